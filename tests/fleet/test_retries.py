"""A replica's 5xx is retried on another replica while nothing has reached the client, within
`--retries` and the retry budget; a 4xx never counts against a replica; a stream that has begun
is never retried."""

from __future__ import annotations

import aiohttp
import orjson
import pytest

from lora_router.emulator import Emulator
from lora_router.retry_budget import MIN_RETRIES, WINDOW_S, RetryBudget
from lora_router.runtime import RouterRuntime

from .conftest import StartEmulators, StartRouter, call, complete


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
    _, raw, _ = await call(client, "GET", rt.url + "/router/status")
    retries = orjson.loads(raw)["retries"]
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
    assert completions(emus[0]) + completions(emus[1]) == n + MIN_RETRIES
    assert rt.app.budget.denied == 5


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


def test_the_budget_keeps_a_minimum_then_a_share_of_the_window() -> None:
    budget = RetryBudget(0.2)
    for _ in range(100):
        budget.request(0.0)
    assert [budget.allow(0.0) for _ in range(21)] == [True] * 20 + [False]
    assert budget.denied == 1 and budget.retries["5xx"] == 20
    # A lone request on an idle router may still retry, up to the minimum.
    lone = RetryBudget(0.2)
    lone.request(0.0)
    assert [lone.allow(0.0) for _ in range(MIN_RETRIES + 1)] == [True] * MIN_RETRIES + [False]


def test_the_budget_window_slides() -> None:
    budget = RetryBudget(0.0)
    budget.request(0.0)
    assert all(budget.allow(0.0) for _ in range(MIN_RETRIES))
    assert not budget.allow(WINDOW_S / 2)  # still in the window
    assert budget.allow(WINDOW_S + 0.01)  # the first bucket has left it
    assert budget.allow(10 * WINDOW_S)  # idle for long: a fresh window


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
