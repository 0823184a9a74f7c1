"""Passive health and the scrape budget, over real sockets: what routed answers spare the
health checks, what they must not, and the bounded `/metrics` rounds of a large fleet.

Traffic windows are bounded by a count of health intervals on the loop's clock (the checks
they are about run on that clock); every wait for a state the router reaches on its own is
`until`, bounded.
"""

from __future__ import annotations

import asyncio
import math

import aiohttp
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, call, complete, load, until

from lora_router.emulator import Emulator

PROMPT = list(range(100, 148))


def count(emu: Emulator, path: str, since: int = 0) -> int:
    return sum(1 for r in emu.requests[since:] if r.path == path)


async def traffic(
    client: aiohttp.ClientSession, url: str, seconds: float, model: str | None = None
) -> None:
    """Completions back to back for `seconds` of loop time, each answered 200."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while loop.time() < end:
        assert (await complete(client, url, model, prompt=PROMPT, max_tokens=1))[0] == 200


async def test_a_replica_serving_routed_traffic_gets_no_health_probe_in_that_interval(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    interval = 0.1
    rt = await router(emus, health_interval=interval)
    assert rt.health is not None
    # One prompt: the prefix policy sends all of it to its home replica; the other stays idle.
    _, _, headers = await call(client, "POST", rt.url + "/v1/completions", {"prompt": PROMPT})
    home = int(headers["x-lora-router-replica"])
    marks = [len(e.requests) for e in emus]
    await traffic(client, rt.url, 6 * interval)
    probes = [count(e, "/health", m) for e, m in zip(emus, marks, strict=True)]
    assert probes[home] == 0
    assert probes[1 - home] >= 2  # an idle replica is probed as before
    assert rt.health.probes_skipped >= 2


async def test_answers_for_a_listed_adapter_stand_in_for_the_listing(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
) -> None:
    emus = await emulators(1)
    interval = 0.1
    rt = await router(emus, health_interval=interval)
    assert rt.health is not None
    await load(client, rt.url, "v1", adapter("v1"))
    mark = len(emus[0].requests)
    await traffic(client, rt.url, 8 * interval, "v1")
    # One listing shows it holds v1; after it, the answers for v1 prove it still does.
    assert count(emus[0], "/v1/models", mark) <= 2
    assert rt.health.listings_skipped >= 3


async def test_answers_for_an_adapter_loaded_after_the_listing_prove_nothing(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
) -> None:
    emus = await emulators(1)
    interval = 0.1
    rt = await router(emus, health_interval=interval)
    assert rt.health is not None
    await load(client, rt.url, "v1", adapter("v1"))
    await traffic(client, rt.url, 4 * interval, "v1")
    await until(lambda: rt.health is not None and rt.health.listings_skipped >= 1)
    # v2 may have gone onto a restarted process that lost v1: its answers do not skip the
    # listing until a listing has shown v2 (and v1) held.
    await load(client, rt.url, "v2", adapter("v2"))
    mark, skipped = len(emus[0].requests), rt.health.listings_skipped
    loop = asyncio.get_running_loop()
    end = loop.time() + 20 * interval
    while count(emus[0], "/v1/models", mark) == 0 and loop.time() < end:
        assert (await complete(client, rt.url, "v2", prompt=PROMPT, max_tokens=1))[0] == 200
    assert count(emus[0], "/v1/models", mark) == 1
    # At most the check whose interval still had an answer for v1 skipped it.
    assert rt.health.listings_skipped <= skipped + 1
    await traffic(client, rt.url, 4 * interval, "v2")
    assert rt.health.listings_skipped > skipped  # shown held: its answers count again


async def test_a_replica_restarted_under_base_model_traffic_only_is_detected_and_replayed(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
) -> None:
    emus = await emulators(2)
    interval = 0.1
    rt = await router(emus, health_interval=interval, policy="round-robin")
    assert rt.health is not None and rt.fleet is not None
    await load(client, rt.url, "v1", adapter("v1"))
    await traffic(client, rt.url, 2 * interval)  # base model: proves liveness, not adapters
    await emus[1].restart()
    loop = asyncio.get_running_loop()
    end = loop.time() + 30 * interval
    while rt.health.readmissions == 0 and loop.time() < end:
        assert (await complete(client, rt.url, prompt=PROMPT, max_tokens=1))[0] == 200
    assert rt.health.restarts_detected == 1 and rt.health.readmissions == 1
    assert emus[1].state.adapters == {"v1": adapter("v1")}
    assert rt.health.probes_skipped > 0  # its /health was spared meanwhile, not its listing
    assert rt.fleet.replicas[1].live


async def test_a_crashed_replica_under_traffic_is_ejected_within_one_round_trip(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(emus, health_interval=30.0, policy="round-robin")
    assert rt.fleet is not None
    down = rt.fleet.replicas[1]
    for i in range(4):  # both replicas have answered routed traffic since their last check
        assert (await complete(client, rt.url, prompt=[i] * 40, max_tokens=1))[0] == 200
    loop = asyncio.get_running_loop()
    crashed_at = loop.time()
    await emus[1].crash()
    for i in range(20):
        if not down.live:
            break
        assert (await complete(client, rt.url, prompt=[i] * 40, max_tokens=1))[0] == 200
    await until(lambda: not down.live, timeout=2.0)
    assert loop.time() - crashed_at < 1.0  # the first failed request, not the 30 s interval


async def test_scrapes_stay_within_the_budget_in_a_large_fleet(
    emulators: StartEmulators, router: StartRouter
) -> None:
    n, budget = 64, 8
    emus = await emulators(n)
    rt = await router(emus, scrape_budget=budget)  # the hour-long interval: rounds by hand
    assert rt.telemetry is not None and rt.fleet is not None
    replicas = rt.fleet.replicas
    rounds = math.ceil(n / budget)
    for i in range(1, rounds + 1):
        if i > 1:  # the first round is the router's start's
            await rt.telemetry.scrape_round()
        assert sum(count(e, "/metrics") for e in emus) == budget * i
        assert sum(r.report is not None for r in replicas) == budget * i
    # Round robin: every replica once in ceil(n / budget) rounds, then the first ones again.
    assert all(count(e, "/metrics") == 1 for e in emus)
    await rt.telemetry.scrape_round()
    again = [r for r in replicas if r.report is not None and r.report.interval > 0]
    assert len(again) == budget
