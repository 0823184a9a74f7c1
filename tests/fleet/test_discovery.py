"""Discovery end to end: members named by a real file and by a real DNS server on loopback.

Each test starts emulated replicas and a router whose `--replicas-file` is a real file (written
in place, replaced atomically, half written) or whose `--replicas-dns`/`--replicas-srv` names
records that a dnslib server on 127.0.0.1 answers (the router resolves through dnspython, as in
production, pointed at it with `--dns-server`). `FenceMonitor` checks that no request for an
adapter reaches a replica that lacks it, joining members included.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import aiohttp
import pytest
from dnslib import QTYPE, RCODE, RR, SRV, A, DNSRecord
from dnslib.server import BaseResolver, DNSServer
from emulated_fleet import FenceMonitor, StartEmulators, StartRouter
from helpers import Adapter, call, complete, load, router_status, until

from lora_router.config import Config
from lora_router.emulator import Emulator, Faults
from lora_router.fleet.discovery import Discovery, FileSource, SourceError, make_sources
from lora_router.fleet.fleet import Fleet
from lora_router.runtime import RouterRuntime

ALLOWED = ("127.0.0.0/8",)


def write_members(path: Path, *emus: Emulator, extra: str = "") -> None:
    """Replace the file atomically, as a launcher should (write aside, then rename)."""
    os.replace(_aside(path, "# the fleet\n" + "".join(f"{e.url}\n" for e in emus) + extra), path)


def urls(rt: RouterRuntime, *, serving: bool = False) -> set[str]:
    assert rt.fleet is not None
    return {r.name for r in rt.fleet.replicas if r.live or not serving}


def completions(emu: Emulator) -> int:
    return sum(1 for r in emu.requests if r.path == "/v1/completions")


async def file_router(
    router: StartRouter, emus: list[Emulator], path: Path, **more: Any
) -> RouterRuntime:
    settings: dict[str, Any] = {"replica_hosts": ALLOWED, "discovery_grace": 30.0, **more}
    return await router(emus, replicas_files=(str(path),), **settings)


async def srv_router(router: StartRouter, first: Emulator, dns_port: int) -> RouterRuntime:
    """A router in front of `first` that follows _vllm._tcp.fleet.test's SRV records, asked of
    the test's DNS server on `dns_port`."""
    return await router(
        [first],
        replicas_srv=("_vllm._tcp.fleet.test",),
        dns_server=f"127.0.0.1:{dns_port}",
        dns_interval=0.2,
        replica_hosts=ALLOWED,
    )


async def test_a_member_named_in_the_file_joins_replayed_then_takes_work(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monitor: FenceMonitor,
    tmp_path: Path,
) -> None:
    first, second, third = await emulators(3)
    members = tmp_path / "replicas"
    write_members(members)
    rt = await file_router(router, [first], members)
    assert (await load(client, rt.url, "trl-policy-v1", adapter("trl-policy-v1")))[0] == 200
    await call(client, "POST", rt.url + "/pause?mode=keep")
    write_members(members, second, third)
    await until(lambda: len(urls(rt, serving=True)) == 3, timeout=10)
    for emu in (second, third):
        assert emu.state.adapters == {"trl-policy-v1": adapter("trl-policy-v1")}
        assert emu.state.paused  # the fleet's pause state, replayed before it serves
    await call(client, "POST", rt.url + "/resume")
    answers = [await complete(client, rt.url, "trl-policy-v1", prompt=[i] * 40) for i in range(30)]
    assert [code for code, _ in answers] == [200] * 30
    assert completions(second) > 0 and completions(third) > 0  # new families go there too
    assert monitor.violations == []
    doc = await router_status(client, rt.url)
    origins = {r["url"]: r["origin"] for r in doc["replicas"]}
    assert origins == {
        first.url: "replicas",
        second.url: f"file:{members}",
        third.url: f"file:{members}",
    }
    [source] = doc["discovery"]
    assert source["source"] == f"file:{members}" and source["members"] == 2
    assert source["error"] is None and source["last_ok"] is not None
    code, metrics, _ = await call(client, "GET", rt.url + "/metrics")
    assert code == 200
    assert f'lora_router_discovery_members{{source="file:{members}"}} 2.0' in metrics.decode()


async def test_a_member_that_leaves_drains_after_the_grace_and_gets_nothing_new(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    first, stays, leaving = await emulators(3, decode_s_per_token=0.01)
    members = tmp_path / "replicas"
    write_members(members, stays, leaving)
    rt = await file_router(router, [first], members, discovery_grace=1.0, policy="round-robin")
    await until(lambda: len(urls(rt, serving=True)) == 3, timeout=10)
    slow = [
        asyncio.create_task(complete(client, rt.url, prompt=[i] * 40, max_tokens=150))
        for i in range(3)
    ]
    await until(lambda: leaving.state.num_running == 1)
    write_members(members, stays)
    await until(lambda: leaving.url not in urls(rt), timeout=10)
    assert [(await t)[0] for t in slow] == [200] * 3  # in flight while it drained: finished
    mark = completions(leaving)
    assert [(await complete(client, rt.url, prompt=[i] * 40))[0] for i in range(6)] == [200] * 6
    assert completions(leaving) == mark


async def test_a_member_missing_for_less_than_the_grace_is_left_alone(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    first, flapping, other = await emulators(3)
    members = tmp_path / "replicas"
    write_members(members, flapping, other)
    rt = await file_router(router, [first], members, discovery_grace=30.0)
    await until(lambda: len(urls(rt, serving=True)) == 3, timeout=10)
    assert rt.fleet is not None
    before = {r.name: r.rid for r in rt.fleet.replicas}
    write_members(members, other)  # gone from the answer...
    await until(lambda: _source(rt)["members"] == 1, timeout=10)
    write_members(members, flapping, other)  # ...and back, within the grace
    await until(lambda: _source(rt)["members"] == 2, timeout=10)
    assert {r.name: r.rid for r in rt.fleet.replicas} == before  # no churn: same ids, serving
    assert all(r.live for r in rt.fleet.replicas)


def _source(rt: RouterRuntime, i: int = 0) -> dict[str, Any]:
    assert rt.discovery is not None
    return rt.discovery.states[i].json()


async def test_a_source_that_fails_keeps_its_last_good_set(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    first, member = await emulators(2)
    members = tmp_path / "replicas"
    write_members(members, member)
    rt = await file_router(router, [first], members, discovery_grace=0.5)
    await until(lambda: len(urls(rt, serving=True)) == 2, timeout=10)
    members.unlink()  # unreadable
    await until(lambda: _source(rt)["error"] is not None, timeout=10)
    assert "cannot read it" in _source(rt)["error"]
    members.write_text("# nothing here\n")  # empty: a failed read too, never an empty fleet
    await until(lambda: _source(rt)["error"] == "it names no replica", timeout=10)
    # Two more discovery steps (one a second), past the grace (0.5 s): either would have
    # drained the member; the kept set is still the fleet.
    assert rt.discovery is not None
    discovery, steps = rt.discovery, []
    step = discovery.step

    async def counted_step() -> None:
        await step()
        steps.append(1)

    discovery.step = counted_step  # type: ignore[method-assign]
    await until(lambda: len(steps) >= 2, timeout=10)
    assert urls(rt, serving=True) == {first.url, member.url}
    doc = await router_status(client, rt.url)
    assert doc["discovery"][0]["errors"] >= 2 and doc["discovery"][0]["members"] == 1
    code, metrics, _ = await call(client, "GET", rt.url + "/metrics")
    assert code == 200
    assert f'lora_router_discovery_source_ok{{source="file:{members}"}} 0.0' in metrics.decode()


async def test_entries_that_are_not_replicas_or_outside_the_allow_list_are_skipped(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    first, member = await emulators(2)
    outside = await _listener("127.0.0.2")
    members = tmp_path / "replicas"
    garbage = f"not a url\nftp://127.0.0.1:21\nhttp://127.0.0.2:{outside.port}\n\x00\x01\n"
    write_members(members, member, extra=garbage)
    try:
        rt = await file_router(router, [first], members, replica_hosts=("127.0.0.1",))
        await until(lambda: len(urls(rt, serving=True)) == 2, timeout=10)
        skipped = _source(rt)["skipped"]
        assert len(skipped) == 4, skipped
        assert any("outside --replica-hosts" in s and "127.0.0.2" in s for s in skipped)
        assert (await complete(client, rt.url))[0] == 200  # it keeps serving
        assert outside.connections == 0  # the token never went there
    finally:
        outside.close()


class _Listener:
    """A TCP listener that counts connections (a host the token must not reach)."""

    def __init__(self) -> None:
        self.connections = 0
        self.port = 0
        self.server: asyncio.Server | None = None

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def _listener(host: str) -> _Listener:
    listener = _Listener()

    def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        listener.connections += 1
        writer.close()

    listener.server = await asyncio.start_server(accepted, host, 0)
    listener.port = listener.server.sockets[0].getsockname()[1]
    return listener


async def test_a_half_written_file_is_used_only_once_it_is_complete(tmp_path: Path) -> None:
    """A read whose last line has no newline waits for the next poll: a writer that finishes
    the line by then is read whole; a file that stays the same (written without a final
    newline) is then taken as it is."""
    path = tmp_path / "replicas"
    source = FileSource(str(path))
    path.write_text("http://127.0.0.1:8001\nhttp://127.0.0.1:80")  # cut inside the port
    assert await source.read() is None
    with path.open("a") as f:
        f.write("02\n")
    assert await source.read() == ["http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    assert await source.read() is None  # unchanged since: nothing new
    path.write_text("http://127.0.0.1:8003  # no newline at the end")
    assert await source.read() is None
    assert await source.read() == ["http://127.0.0.1:8003"]
    os.replace(_aside(path, "http://127.0.0.1:8004\n"), path)  # an atomic replace
    assert await source.read() == ["http://127.0.0.1:8004"]
    path.unlink()
    with pytest.raises(SourceError, match="cannot read it"):
        await source.read()


def _aside(path: Path, text: str) -> Path:
    aside = path.with_suffix(".new")
    aside.write_text(text)
    return aside


async def test_a_member_that_joins_during_a_load_never_serves_before_it_has_it(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monitor: FenceMonitor,
    tmp_path: Path,
) -> None:
    first, joining = await emulators(2, faults=Faults(load_delay_s=0.5))
    members = tmp_path / "replicas"
    members.write_text("# starting\n")
    rt = await file_router(router, [first], members)
    loading = asyncio.create_task(load(client, rt.url, "trl-policy-v2", adapter("trl-policy-v2")))
    await until(lambda: any(r.path == "/v1/load_lora_adapter" for r in first.requests))
    write_members(members, joining)  # joins while the broadcast runs
    traffic = [
        asyncio.create_task(complete(client, rt.url, "trl-policy-v2", prompt=[i] * 40))
        for i in range(20)
    ]
    assert (await loading)[0] == 200
    assert [(await t)[0] for t in traffic] == [200] * 20
    await until(lambda: joining.url in urls(rt, serving=True), timeout=10)
    assert "trl-policy-v2" in joining.state.adapters
    assert monitor.violations == [] and monitor.checked >= 20


# -- DNS ------------------------------------------------------------------------------------


class Zone(BaseResolver):  # type: ignore[misc]
    """Records a test can change while the server runs; `fail` answers SERVFAIL."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], list[Any]] = {}
        self.fail = False
        self.lock = threading.Lock()

    def resolve(self, request: DNSRecord, handler: object) -> DNSRecord:
        reply = request.reply()
        name, kind = str(request.q.qname), QTYPE[request.q.qtype]
        with self.lock:
            if self.fail:
                reply.header.rcode = RCODE.SERVFAIL
                return reply
            for rdata in self.records.get((name, kind), []):
                reply.add_answer(RR(name, request.q.qtype, rdata=rdata, ttl=1))
        return reply

    def set(self, name: str, kind: str, *rdata: Any) -> None:
        with self.lock:
            self.records[(name, kind)] = list(rdata)


@pytest.fixture
def zone() -> Iterator[tuple[Zone, int]]:
    resolver = Zone()
    server = DNSServer(resolver, port=0, address="127.0.0.1")
    server.start_thread()
    try:
        yield resolver, server.server.server_address[1]
    finally:
        server.stop()


async def test_a_records_name_the_members_and_a_servfail_keeps_them(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    zone: tuple[Zone, int],
) -> None:
    records, dns_port = zone
    [first] = await emulators(1)
    a = (await emulators(1, host="127.0.0.2"))[0]
    b = (await emulators(1, host="127.0.0.3", port=a.port))[0]
    records.set("vllm.fleet.test.", "A", A("127.0.0.2"))
    rt = await router(
        [first],
        replicas_dns=(f"vllm.fleet.test:{a.port}",),
        dns_server=f"127.0.0.1:{dns_port}",
        dns_interval=0.2,
        replica_hosts=ALLOWED,
        discovery_grace=30.0,
    )
    await until(lambda: urls(rt, serving=True) == {first.url, a.url}, timeout=10)
    records.set("vllm.fleet.test.", "A", A("127.0.0.2"), A("127.0.0.3"))
    await until(lambda: urls(rt, serving=True) == {first.url, a.url, b.url}, timeout=10)
    records.fail = True
    await until(lambda: _source(rt)["error"] is not None, timeout=10)
    assert "failed" in _source(rt)["error"] or "timed out" in _source(rt)["error"]
    assert urls(rt, serving=True) == {first.url, a.url, b.url}
    doc = await router_status(client, rt.url)
    assert doc["discovery"][0]["source"] == f"dns:vllm.fleet.test:{a.port}"
    assert doc["discovery"][0]["members"] == 2


async def test_srv_records_give_hosts_and_ports(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    zone: tuple[Zone, int],
) -> None:
    records, dns_port = zone
    first, one, two = await emulators(3)
    records.set("r.fleet.test.", "A", A("127.0.0.1"))
    records.set(
        "_vllm._tcp.fleet.test.",
        "SRV",
        SRV(0, 1, one.port, "r.fleet.test."),
        SRV(0, 1, two.port, "r.fleet.test."),
    )
    rt = await srv_router(router, first, dns_port)
    await until(lambda: urls(rt, serving=True) == {first.url, one.url, two.url}, timeout=10)
    assert _source(rt)["source"] == "srv:_vllm._tcp.fleet.test"


async def test_an_srv_record_with_port_0_is_skipped_never_taken_as_port_80(
    emulators: StartEmulators, router: StartRouter, zone: tuple[Zone, int]
) -> None:
    records, dns_port = zone
    first, one = await emulators(2)
    records.set("r.fleet.test.", "A", A("127.0.0.1"))
    records.set(
        "_vllm._tcp.fleet.test.",
        "SRV",
        SRV(0, 1, one.port, "r.fleet.test."),
        SRV(0, 1, 0, "r.fleet.test."),
    )
    rt = await srv_router(router, first, dns_port)
    await until(lambda: urls(rt, serving=True) == {first.url, one.url}, timeout=10)
    [skipped] = _source(rt)["skipped"]
    assert "port 0" in skipped and _source(rt)["skipped_count"] == 1
    assert urls(rt) == {first.url, one.url}  # no http://127.0.0.1:80


async def test_a_member_leaving_while_the_fleet_is_paused_is_resumed_with_the_fleet(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """Its requests were frozen by the pause: the fleet's /resume must reach it while it drains,
    or they never finish (it would be removed at the shutdown grace with them cut)."""
    first, leaving = await emulators(2, decode_s_per_token=0.01)
    members = tmp_path / "replicas"
    write_members(members, leaving)
    rt = await file_router(
        router, [first], members, discovery_grace=0.0, policy="round-robin", shutdown_grace=30.0
    )
    await until(lambda: len(urls(rt, serving=True)) == 2, timeout=10)
    slow = [
        asyncio.create_task(complete(client, rt.url, prompt=[i] * 40, max_tokens=20))
        for i in range(2)
    ]
    await until(lambda: leaving.state.num_running == 1)
    assert (await call(client, "POST", rt.url + "/pause?mode=keep"))[0] == 200
    write_members(members, first)  # the static member only: the leaver is absent
    assert rt.fleet is not None
    await until(lambda: any(r.name == leaving.url and not r.live for r in rt.fleet.replicas))
    assert (await call(client, "POST", rt.url + "/resume"))[0] == 200
    assert not leaving.state.paused
    assert [(await t)[0] for t in slow] == [200] * 2
    await until(lambda: leaving.url not in urls(rt), timeout=10)


async def test_a_rewritten_file_is_judged_entry_by_entry_as_before(tmp_path: Path) -> None:
    """Entries a previous read held keep their verdict (member or skipped, with why); new
    ones are judged, and the ones gone are forgotten."""
    path = tmp_path / "replicas"
    config = Config(replicas=(), replicas_files=(str(path),), replica_hosts=("127.0.0.1",))
    fleet = Fleet(config)
    discovery = Discovery(config, fleet, cast(Any, None), make_sources(config))
    write_lines(path, "http://127.0.0.1:8001", "not a url", "http://127.0.0.2:8002")
    await discovery._read(0, discovery.sources[0])
    state = discovery.states[0]
    assert state.members == ("http://127.0.0.1:8001",) and len(state.skipped) == 2
    write_lines(path, "not a url", "http://127.0.0.1:8003", "http://127.0.0.1:8001")
    await discovery._read(0, discovery.sources[0])
    assert state.members == ("http://127.0.0.1:8003", "http://127.0.0.1:8001")
    assert len(state.skipped) == 1 and "not a url" in state.skipped[0]
    assert set(discovery._verdicts[0]) == {
        "not a url",
        "http://127.0.0.1:8003",
        "http://127.0.0.1:8001",
    }
    fleet.close()


def write_lines(path: Path, *lines: str) -> None:
    os.replace(_aside(path, "".join(f"{line}\n" for line in lines)), path)
