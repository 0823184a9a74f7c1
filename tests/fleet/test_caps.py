"""Amplification and sizes (issue 44): an unauthenticated `/health` storm makes one probe of
each replica at a time, the control session opens at most `--control-connections` to one
replica, the fleet has a size cap, for the API and for discovery, a dead member's checks
space out, and what a member listed as its own when it joined leaves with it.

The replica here is a small aiohttp server on loopback that answers like vLLM and holds each
`/health` until a second one arrives alongside it (or 0.5 s pass), so concurrent probes are
seen for sure when they happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import orjson
import pytest
from aiohttp import web
from emulated_fleet import StartEmulators, StartRouter
from helpers import call, listing_replica, router_config, until

from lora_router.fleet.client import ReplicaClient
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.health import DOWN_SPACING_MAX

BASE = "Qwen/Qwen2.5-Math-1.5B"


@dataclass
class Probed:
    url: str
    health: int = 0  # /health requests received
    active: int = 0
    peak: int = 0
    crowd: asyncio.Event | None = None


@pytest.fixture
async def probed() -> AsyncIterator[Probed]:
    state = Probed("")
    state.crowd = asyncio.Event()

    async def health(request: web.Request) -> web.Response:
        assert state.crowd is not None
        state.health += 1
        state.active += 1
        state.peak = max(state.peak, state.active)
        if state.active > 1:
            state.crowd.set()
        try:
            async with asyncio.timeout(0.5):
                await state.crowd.wait()
        except TimeoutError:
            pass
        finally:
            state.active -= 1
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        card = {"id": BASE, "object": "model", "root": BASE, "parent": None}
        return web.json_response({"object": "list", "data": [card]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield state
    await runner.cleanup()


async def test_a_health_storm_makes_one_probe_of_each_replica_at_a_time(
    router: StartRouter, client: aiohttp.ClientSession, probed: Probed
) -> None:
    rt = await router([probed.url])
    async with asyncio.timeout(20):
        codes = await asyncio.gather(*(call(client, "GET", rt.url + "/health") for _ in range(200)))
    assert [c for c, _, _ in codes] == [200] * 200
    assert probed.peak == 1  # never two probes of the replica at once
    assert probed.health <= 5  # shared: 200 callers, a wave of probes per 100 connections


async def test_the_fleet_size_is_capped_for_the_api_and_for_discovery(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="lora_router")
    first, second, third, fourth = await emulators(4)
    rt = await router([first], max_replicas=2, replica_hosts=("127.0.0.0/8",))
    assert (await call(client, "POST", rt.url + "/router/replicas", {"url": second.url}))[0] == 200
    code, body, _ = await call(client, "POST", rt.url + "/router/replicas", {"url": third.url})
    assert code == 409 and "--max-replicas" in orjson.loads(body)["error"]["message"]
    assert third.requests == []  # never contacted
    with pytest.raises(ValueError, match="over --max-replicas"):
        router_config([first.url, second.url], max_replicas=1)

    members = tmp_path / "replicas"
    members.write_text(f"{third.url}\n{fourth.url}\n")
    found = await router(
        [first], max_replicas=2, replica_hosts=("127.0.0.0/8",), replicas_files=(str(members),)
    )
    assert found.discovery is not None and found.fleet is not None
    await until(lambda: found.discovery.waiting == 1, timeout=10)
    assert len(found.fleet.replicas) == 2
    assert len([r for r in caplog.records if "wait for room" in r.getMessage()]) == 1


def test_max_connections_defaults_under_the_open_file_limit() -> None:
    def limited() -> None:
        resource.setrlimit(
            resource.RLIMIT_NOFILE, (1024, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        )

    shown = subprocess.run(
        [sys.executable, "-m", "lora_router.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        preexec_fn=limited,
        env={**os.environ, "COLUMNS": "1000"},
        check=True,
    ).stdout
    assert "half of the open-file limit less 256" in shown and "here 384)" in shown


async def test_the_control_session_opens_at_most_its_cap_of_connections_to_a_replica() -> None:
    """Ten control calls at once to a replica that holds each until three are open (or
    0.3 s pass): with a cap of 2, never three."""
    state = {"active": 0, "peak": 0}
    crowd = asyncio.Event()

    async def held(request: web.Request) -> web.Response:
        state["active"] += 1
        state["peak"] = max(state["peak"], state["active"])
        if state["active"] >= 3:
            crowd.set()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.3):
                await crowd.wait()
        state["active"] -= 1
        return web.Response()

    app = web.Application()
    app.router.add_get("/health", held)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    config = router_config([f"http://127.0.0.1:{runner.addresses[0][1]}"], control_connections=2)
    fleet = Fleet(config)
    try:
        async with ReplicaClient(config) as control, asyncio.timeout(10):
            replica = fleet.replicas[0]
            answers = await asyncio.gather(
                *(control.call(replica, "GET", "/health", timeout=5) for _ in range(10))
            )
        assert [a.status for a in answers] == [200] * 10
        assert state["peak"] == 2
    finally:
        fleet.close()
        await runner.cleanup()


async def test_a_dead_member_is_checked_less_and_less_often_and_still_seen_when_back(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    """Over 40 health intervals a member whose /health answers 503 is asked far fewer than
    40 times (its checks space out to DOWN_SPACING_MAX intervals); once it answers again it is
    back within that spacing and its replay."""
    first, dead = await emulators(2)
    dead.faults.dead = True
    interval = 0.05
    rt = await router(
        [first], replica_hosts=("127.0.0.0/8",), health_interval=interval, health_timeout=1.0
    )
    assert rt.fleet is not None
    code, _, _ = await call(client, "POST", rt.url + "/router/replicas", {"url": dead.url})
    assert code == 202
    checks = len([r for r in dead.requests if r.path == "/health"])
    await asyncio.sleep(40 * interval)  # a rate is measured over a time window
    checks = len([r for r in dead.requests if r.path == "/health"]) - checks
    assert 2 <= checks <= 12, checks
    dead.faults.dead = False
    await until(
        lambda: all(r.live for r in rt.fleet.replicas), timeout=DOWN_SPACING_MAX * 4 * interval + 5
    )


async def test_what_members_list_as_their_own_leaves_with_them(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    # A replica added, listing adapters of its own that no earlier member had, then removed,
    # again and again (an operator's churn, or discovery's): what the router keeps of those
    # listings must not grow with each visit.
    (emu,) = await emulators(1)
    visits = 0

    def cards() -> list[dict[str, object]]:
        own = [
            {"id": f"own-{visits}-{i}", "object": "model", "root": f"/o/{i}", "parent": "base"}
            for i in range(50)
        ]
        return [{"id": "base"}, *own]

    async with listing_replica(cards) as lister:
        rt = await router([emu], replica_hosts=("127.0.0.0/8",))
        assert rt.health is not None
        kept = len(rt.health._own)
        async with asyncio.timeout(20):
            for _ in range(5):
                visits += 1  # a new listing
                code, body, _ = await call(
                    client, "POST", rt.url + "/router/replicas", {"url": lister}
                )
                assert code in (200, 202), body
                assert len(rt.health._own) == kept + 50  # its own, while it is a member
                rid = orjson.loads(body)["id"]
                code, _, _ = await call(client, "DELETE", rt.url + f"/router/replicas/{rid}")
                assert code == 200
                assert len(rt.health._own) == kept  # gone with it
