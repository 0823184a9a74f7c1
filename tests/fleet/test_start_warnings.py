"""What the router says about a fleet that is half right: adapters left on a reused replica
that the trainer's loads would collide with, named at start with the replica and the fix; a
member that never answers, named once, not on every check; fewer replicas than
`--min-replicas`; a replica file that is not there yet."""

from __future__ import annotations

import logging
from pathlib import Path

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, free_port, load, until


async def test_a_leftover_trainer_version_is_named_at_start_with_its_fix(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emus = await emulators(2)
    # An earlier run's version, on one replica only, and a name no trainer gives.
    assert (await load(client, emus[1].url, "trl-policy-v3", adapter("trl-policy-v3")))[0] == 200
    assert (await load(client, emus[1].url, "sql-expert", adapter("sql-expert")))[0] == 200
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        await router(emus)
    lines = [r.getMessage() for r in caplog.records if "leftover" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"Replica 1 ({emus[1].url}) holds 1 leftover adapter(s)")
    assert "trl-policy-v3" in lines[0] and "sql-expert" not in lines[0]
    assert "--unload-stale trl-policy-v3" in lines[0]
    held = [r.getMessage() for r in caplog.records if "held by" in r.getMessage()]
    assert any(f"held by Replica 1 ({emus[1].url})" in m for m in held), held


async def test_a_leftover_the_given_pattern_clears_is_not_warned_of(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emus = await emulators(1)
    assert (await load(client, emus[0].url, "trl-policy-v3", adapter("trl-policy-v3")))[0] == 200
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        await router(emus, unload_stale="trl-policy-*")
    assert not [r for r in caplog.records if "leftover" in r.getMessage()]
    assert "trl-policy-v3" not in emus[0].state.adapters


async def test_a_member_that_never_answers_is_warned_of_once_not_every_check(
    emulators: StartEmulators,
    router: StartRouter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    (emu,) = await emulators(1)
    dead = f"http://127.0.0.1:{free_port()}"  # a port nothing listens on
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        rt = await router([emu, dead], health_interval=0.02)
        assert rt.health is not None
        await until(lambda: rt.health is not None and rt.health.check_failures >= 10)
    lines = [r.getMessage() for r in caplog.records if "stays out of service" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"Replica 1 ({dead}) stays out of service: cannot connect")


async def test_health_answers_503_below_min_replicas_naming_the_one_out(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (emu,) = await emulators(1)
    dead = f"http://127.0.0.1:{free_port()}"
    rt = await router([emu, dead], min_replicas=2)
    async with client.get(rt.url + "/health") as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"]
        message = (await resp.json())["error"]["message"]
    assert message.startswith("1 replica(s) in service, fewer than --min-replicas 2")
    assert f"Replica 1 ({dead}) out of service: at start: cannot connect" in message
    relaxed = await router([emu, dead])  # the default: 200 while one serves
    async with client.get(relaxed.url + "/health") as resp:
        assert resp.status == 200


async def test_a_router_whose_replica_file_is_missing_starts_and_says_so(
    router: StartRouter,
    client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:
    missing = tmp_path / "replicas.txt"  # a scheduler writes it later
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        rt = await router(
            [], replicas_files=(str(missing),), replica_hosts=("127.0.0.1",), dns_interval=1.0
        )
    assert any(
        r.getMessage()
        == f"no replica yet: the router serves nothing, and /health answers 503, until "
        f"file:{missing} names one"
        for r in caplog.records
    )
    async with client.get(rt.url + "/health") as resp:
        assert resp.status == 503
