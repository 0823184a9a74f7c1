"""A replica's 5xx is retried on another replica while nothing has reached the client, within
`--retries`; the budget counts only what amplifies load (lora_router/proxy/retry.py); a 4xx never
counts against a replica; a stream that has begun is never retried."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import call, complete, router_status

from lora_router.emulator import Emulator
from lora_router.proxy.retry import MIN_RETRIES, WINDOW_S, RetryBudget
from lora_router.runtime import RouterRuntime


def completions(emu: object) -> int:
    return sum(1 for r in emu.requests if r.path == "/v1/completions")  # type: ignore[attr-defined]


async def test_a_replica_answering_500_with_a_healthy_health_costs_the_client_nothing(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    emus[0].faults.error_rate = 1.0  # every completion 500, /health stays 200
    rt = await router(emus, policy="round-robin", breaker_failures=100)
    assert rt.fleet is not None
    statuses = [(await complete(client, rt.url, prompt=[i] * 20))[0] for i in range(8)]
    assert statuses == [200] * 8
    sick = completions(emus[0])
    assert sick >= 4  # round-robin kept trying it: each 500 was retried on replica 1
    assert completions(emus[1]) == 8
    assert rt.fleet.replicas[0].breaker.failures == sick  # the breaker counted every 500
    retries = (await router_status(client, rt.url))["retries"]
    assert retries["5xx"] == sick and retries["refused_by_budget"] == 0
    _, metrics, _ = await call(client, "GET", rt.url + "/metrics")
    assert f'lora_router_retries_total{{reason="5xx"}} {float(sick)}'.encode() in metrics


async def four_4xx(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> tuple[list[Emulator], RouterRuntime, list[int]]:
    """Four completions through two replicas that answer every one 400 (round-robin, a
    breaker that opens on the first failure): the replicas, the router and the statuses."""
    emus = await emulators(2)
    for emu in emus:
        emu.faults.error_rate, emu.faults.error_status = 1.0, 400
    rt = await router(emus, policy="round-robin", breaker_failures=1)
    statuses = [(await complete(client, rt.url, prompt=[i] * 20))[0] for i in range(4)]
    return emus, rt, statuses


async def test_a_4xx_is_passed_on_without_a_retry(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus, _, statuses = await four_4xx(emulators, router, client)
    assert statuses == [400] * 4
    assert completions(emus[0]) + completions(emus[1]) == 4  # no retry


async def test_a_4xx_never_counts_against_the_replica(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    _, rt, _ = await four_4xx(emulators, router, client)
    assert rt.fleet is not None
    assert all(r.breaker.failures == 0 and r.breaker.state == "closed" for r in rt.fleet.replicas)


async def test_a_5xx_with_no_other_replica_left_reaches_the_client_as_the_replica_sent_it(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    for emu in emus:
        emu.faults.error_rate = 1.0
    rt = await router(emus, policy="round-robin", breaker_failures=100)
    status, body = await complete(client, rt.url)
    assert status == 500 and "Injected fault" in body["error"]["message"]
    assert completions(emus[0]) + completions(emus[1]) == 2  # tried once on each


async def test_retries_of_5xx_stop_at_the_budget(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    for emu in emus:
        emu.faults.error_rate = 1.0
    # A share of 0: only the minimum per window is left.
    rt = await router(emus, policy="round-robin", breaker_failures=100, retry_budget=0.0)
    assert rt.app is not None
    n = MIN_RETRIES + 5
    statuses = [(await complete(client, rt.url, prompt=[i] * 20))[0] for i in range(n)]
    assert statuses == [500] * n  # the replica's own 500 when no retry is left
    # The first retry is free: it moved off the replica that failed onto one not failing yet.
    # From then on both are failing, and each retry is counted until the budget refuses.
    assert completions(emus[0]) + completions(emus[1]) == n + 1 + MIN_RETRIES
    assert rt.app.budget.denied == n - 1 - MIN_RETRIES


async def burst(client: aiohttp.ClientSession, url: str, step: int) -> list[int]:
    """One TRL step's burst: 16 concurrent completions (distinct prompts)."""
    sent = [complete(client, url, prompt=[step * 16 + i + 1] * 20) for i in range(16)]
    return [status for status, _ in await asyncio.gather(*sent)]


async def test_one_replica_answering_500_among_healthy_ones_costs_no_burst_anything(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(3)
    emus[0].faults.error_rate = 1.0  # every completion 500
    rt = await router(emus, policy="round-robin", breaker_failures=100)
    assert rt.app is not None
    statuses = [s for step in range(3) for s in await burst(client, rt.url, step)]
    assert statuses == [200] * 48
    sick = completions(emus[0])
    assert sick > MIN_RETRIES  # more 5xx than the budget's minimum: every one retried, free
    assert rt.app.budget.retries["5xx"] == sick and rt.app.budget.denied == 0


async def test_a_fleet_answering_500_everywhere_gets_retries_only_within_the_budget(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(3)
    for emu in emus:
        emu.faults.error_rate = 1.0
    rt = await router(emus, policy="round-robin", breaker_failures=100, retry_budget=0.0)
    assert rt.app is not None
    statuses = [s for step in range(3) for s in await burst(client, rt.url, step)]
    assert statuses == [500] * 48
    retries = sum(completions(e) for e in emus) - 48
    assert retries == rt.app.budget.retries["5xx"]
    # The retries free of the budget are those made before most of the fleet had failed once:
    # at most one burst's; every later one is counted, and the budget refused the rest.
    assert MIN_RETRIES <= retries <= MIN_RETRIES + 16
    assert rt.app.budget.denied >= 48 - 16 - MIN_RETRIES


async def test_a_stream_that_began_is_never_retried(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    for emu in emus:
        emu.faults.crash_after_frames = 0  # a 200 head, then the connection is cut
    rt = await router(emus, policy="round-robin")
    body = {"prompt": [1] * 20, "max_tokens": 8, "stream": True}
    with pytest.raises(aiohttp.ClientPayloadError):
        async with client.post(rt.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            await resp.read()
    assert completions(emus[0]) + completions(emus[1]) == 1


def spend_all(budget: RetryBudget, now: float, at_most: int) -> int:
    """Counted retries spent at `now` while the budget has room, up to `at_most`."""
    n = 0
    while n < at_most and budget.room(now):
        budget.spend(now)
        n += 1
    return n


def test_the_budget_keeps_a_minimum_then_a_share_of_the_window() -> None:
    budget = RetryBudget(0.2)
    for _ in range(100):
        budget.request(0.0)
    assert spend_all(budget, 0.0, 100) == 20
    # A lone request on an idle router may still retry, up to the minimum.
    lone = RetryBudget(0.2)
    lone.request(0.0)
    assert spend_all(lone, 0.0, 100) == MIN_RETRIES


def test_the_budget_window_slides() -> None:
    budget = RetryBudget(0.0)
    budget.request(0.0)
    assert spend_all(budget, 0.0, 100) == MIN_RETRIES
    assert not budget.room(WINDOW_S / 2)  # still in the window
    assert budget.room(WINDOW_S + 0.01)  # the first bucket has left it
    assert spend_all(budget, 10 * WINDOW_S, 100) == MIN_RETRIES  # idle for long: a fresh window


async def test_a_503_while_the_fleet_is_paused_is_not_retried_nor_counted(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    for emu in emus:
        emu.faults.error_rate, emu.faults.error_status = 1.0, 503
    rt = await router(emus, policy="round-robin", breaker_failures=1)
    assert rt.fleet is not None
    assert (await call(client, "POST", rt.url + "/pause?mode=keep"))[0] == 200
    status, _ = await complete(client, rt.url)
    assert status == 503  # vLLM refusing work on purpose: every replica would say the same
    assert completions(emus[0]) + completions(emus[1]) == 1
    assert all(r.breaker.state == "closed" for r in rt.fleet.replicas)
