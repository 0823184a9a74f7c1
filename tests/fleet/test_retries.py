"""A replica's 5xx is retried on another replica while nothing has reached the client, within
`--retries` and the retry budget; a 4xx never counts against a replica; a stream that has begun
is never retried."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest

from lora_router.retry_budget import MIN_RETRIES, RetryBudget

from .conftest import StartEmulators, StartRouter, call, complete, until


def completions(emu: object) -> int:
    return sum(1 for r in emu.requests if r.path == "/v1/completions")  # type: ignore[attr-defined]


async def test_a_replica_answering_500_with_a_healthy_health_costs_the_client_nothing(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    emus[0].faults.error_rate = 1.0  # every completion 500, /health stays 200
    rt = await router(emus, policy="round-robin", breaker_failures=100)
    assert rt.fleet is not None
    statuses = [(await complete(client, rt.url, prompt=[i] * 20))[0] for i in range(12)]
    assert statuses == [200] * 12
    sick = completions(emus[0])
    assert sick >= 5  # round-robin kept trying it: each 500 was retried on replica 1
    assert completions(emus[1]) == 12
    assert rt.fleet.replicas[0].breaker.failures == sick  # the breaker counted every 500
    _, raw, _ = await call(client, "GET", rt.url + "/router/status")
    retries = orjson.loads(raw)["retries"]
    assert retries["5xx"] == sick and retries["refused_by_budget"] == 0
    _, metrics, _ = await call(client, "GET", rt.url + "/metrics")
    assert f'lora_router_retries_total{{reason="5xx"}} {float(sick)}'.encode() in metrics


async def test_a_4xx_is_passed_on_and_never_counts_against_the_replica(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    for emu in emus:
        emu.faults.error_rate, emu.faults.error_status = 1.0, 400
    rt = await router(emus, policy="round-robin", breaker_failures=1)
    assert rt.fleet is not None
    statuses = [(await complete(client, rt.url, prompt=[i] * 20))[0] for i in range(4)]
    assert statuses == [400] * 4
    assert completions(emus[0]) + completions(emus[1]) == 4  # no retry
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


async def test_retries_in_flight_stop_at_the_budget(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    emus[0].faults.error_rate = 1.0  # answers 500 at once
    emus[1].faults.stall = True  # holds every request (retries included) until released
    # A share of 0: only the minimum of retries in flight is allowed.
    rt = await router(emus, policy="round-robin", breaker_failures=100, retry_budget=0.0)
    assert rt.app is not None
    budget = rt.app.budget
    requests = [
        asyncio.create_task(complete(client, rt.url, prompt=[i] * 20)) for i in range(2 * 4)
    ]
    try:
        # 4 requests met replica 0's 500: MIN_RETRIES of them wait on replica 1, one was refused.
        await until(lambda: budget.denied == 4 - MIN_RETRIES and budget.retrying == MIN_RETRIES)
    finally:
        emus[1].faults.stall = False
    statuses = sorted(s for s, _ in await asyncio.gather(*requests))
    assert statuses == [200] * 7 + [500]
    assert budget.retrying == 0 and budget.active == 0


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


def test_the_budget_keeps_a_minimum_then_a_share_of_the_requests_in_flight() -> None:
    budget = RetryBudget(0.2)
    budget.active = 20  # 20 % of 20: 4 retries in flight
    assert [budget.allow(False) for _ in range(5)] == [True] * 4 + [False]
    assert budget.denied == 1 and budget.retries["5xx"] == 4
    # A request already holding a slot keeps it for its next retry.
    assert budget.allow(True) and budget.retrying == 4
    budget.release()
    assert budget.allow(False)
    # A lone request may still retry, up to the minimum.
    lone = RetryBudget(0.2)
    lone.active = 1
    assert [lone.allow(False) for _ in range(MIN_RETRIES + 1)] == [True] * 3 + [False]
