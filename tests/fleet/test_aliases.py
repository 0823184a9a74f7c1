"""One server under two names (fleet/aliases.py): the rule, and over real loopback sockets
(`localhost` resolves to 127.0.0.1 here) the places an operator looks: the log line when a
member joins (at start, through discovery or `POST /router/replicas`), `aliases` in
`/router/status` and `lora-router top`'s verdict. Spellings of one URL are one member."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import call, router_status, until

from lora_router.config import ReplicaAddress
from lora_router.emulator import Emulator
from lora_router.fleet.aliases import ALIAS_FIX, aliases, resolve
from lora_router.tools.top import verdict

pytestmark = pytest.mark.timeout(30)


def located(*members: tuple[str, str, set[str]]) -> dict[str, tuple[ReplicaAddress, set[str]]]:
    return {who: (ReplicaAddress.parse(url), found) for who, url, found in members}


def test_two_names_that_resolve_to_one_address_and_port_are_aliases() -> None:
    members = located(
        ("a", "http://gpu-1:8000", {"10.0.0.5"}),
        ("b", "http://gpu-1.cluster.local:8000", {"10.0.0.5", "fd00::5"}),
        ("c", "http://10.0.0.6:8000", {"10.0.0.6"}),
    )
    [what] = aliases(members)
    assert what.startswith("a and b reach the same address, 10.0.0.5:8000: very likely one server")


@pytest.mark.parametrize(
    "other",
    [
        "http://gpu-2:8001",  # another port
        "https://gpu-2:8000",  # another scheme
        "http://gpu-2:8000/other",  # another path prefix: a proxy routing by path
    ],
)
def test_one_address_under_another_port_scheme_or_prefix_is_no_alias(other: str) -> None:
    members = located(("a", "http://gpu-1:8000", {"10.0.0.5"}), ("b", other, {"10.0.0.5"}))
    assert aliases(members) == []


def test_a_host_that_did_not_resolve_is_nobodys_alias() -> None:
    members = located(("a", "http://gpu-1:8000", {"10.0.0.5"}), ("b", "http://gpu-2:8000", set()))
    assert aliases(members) == []


def test_three_names_of_one_server_are_one_group_and_involving_picks_the_groups() -> None:
    members = located(
        ("a", "http://one:8000", {"10.0.0.5"}),
        ("b", "http://two:8000", {"10.0.0.5"}),
        ("c", "http://three:8000", {"10.0.0.5"}),
        ("d", "http://four:8000", {"10.0.0.9"}),
        ("e", "http://five:8000", {"10.0.0.9"}),
    )
    groups = aliases(members)
    assert [g.split(" reach")[0] for g in groups] == ["a, b and c", "d and e"]
    assert [g.split(" reach")[0] for g in aliases(members, involving=["e"])] == ["d and e"]


async def test_an_ip_address_resolves_to_itself_and_localhost_to_loopback() -> None:
    assert await resolve(ReplicaAddress.parse("http://[0:0::1]:8000"), 1.0) == {"::1"}
    assert "127.0.0.1" in await resolve(ReplicaAddress.parse("http://localhost:8000"), 1.0)
    assert await resolve(ReplicaAddress.parse("http://no-such-host.invalid:8000"), 1.0) == set()


def other_name(emu: Emulator) -> str:
    """The same emulated replica under another host name."""
    assert emu.url.startswith("http://127.0.0.1:")
    return emu.url.replace("127.0.0.1", "localhost")


async def test_one_server_under_two_names_is_named_at_start_in_status_and_top(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emu, other = await emulators(2)
    port = emu.url.rsplit(":", 1)[1]
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        rt = await router([emu, other, other_name(emu)])
    assert rt.fleet is not None and len(rt.fleet.replicas) == 3  # not refused
    named = (
        f"replica 0 ({emu.url}) and replica 2 ({other_name(emu)}) reach the same address, "
        f"127.0.0.1:{port}: very likely one server listed twice"
    )
    lines = [r.getMessage() for r in caplog.records if "reach the same address" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(named), lines
    assert lines[0].endswith(f"; fix: {ALIAS_FIX}")
    doc = await router_status(client, rt.url)
    assert doc["aliases"] == lines
    assert doc["disagreements"] == []
    assert verdict(doc) == f"misconfigured: {lines[0]}"


async def test_a_member_discovery_adds_under_a_second_name_is_named_when_it_joins(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    (emu,) = await emulators(1)
    members = tmp_path / "replicas"
    members.write_text("")
    settings = {"replica_hosts": ("127.0.0.1", "localhost"), "discovery_grace": 30.0}
    rt = await router([emu], replicas_files=(str(members),), **settings)
    assert (await router_status(client, rt.url))["aliases"] == []
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        aside = tmp_path / "replicas.new"
        aside.write_text(f"{other_name(emu)}\n")
        os.replace(aside, members)
        await until(lambda: rt.fleet is not None and len(rt.fleet.live()) == 2, timeout=10)
    lines = [r.getMessage() for r in caplog.records if "reach the same address" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(
        f"replica 0 ({emu.url}) and replica 1 ({other_name(emu)}) reach the same address"
    ), lines
    assert (await router_status(client, rt.url))["aliases"] == lines


async def test_a_member_added_under_a_second_name_is_named_and_its_removal_clears_it(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    (emu,) = await emulators(1)
    rt = await router([emu], replica_hosts=("127.0.0.1", "localhost"))
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        code, body, _ = await call(
            client, "POST", rt.url + "/router/replicas", {"url": other_name(emu)}
        )
    assert code == 200, body
    lines = [r.getMessage() for r in caplog.records if "reach the same address" in r.getMessage()]
    assert len(lines) == 1, lines
    assert (await router_status(client, rt.url))["aliases"] == lines
    assert (await call(client, "DELETE", rt.url + "/router/replicas/1"))[0] == 200
    assert (await router_status(client, rt.url))["aliases"] == []


async def test_spellings_of_one_url_in_a_discovery_source_are_one_member(
    emulators: StartEmulators, router: StartRouter, tmp_path: Path
) -> None:
    (emu,) = await emulators(1)
    port = emu.url.rsplit(":", 1)[1]
    spellings = [f"HTTP://127.0.0.1:{port}/", f"http://127.0.0.1:{port}/./", emu.url + "//"]
    members = tmp_path / "replicas"
    members.write_text("".join(f"{s}\n" for s in spellings))
    rt = await router([], replicas_files=(str(members),), replica_hosts=("127.0.0.1",))
    assert rt.discovery is not None
    await until(lambda: rt.fleet is not None and len(rt.fleet.live()) == 1, timeout=10)
    await rt.discovery.step()  # one more read and reconciliation: nothing else joins
    assert rt.fleet is not None and [r.name for r in rt.fleet.replicas] == [emu.url]
