"""A replica whose listing does not show the adapters it accepted (a load balancer over several
vLLM servers) does not make the fleet flap for ever: its re-admissions back off exponentially,
one warning names it, the flaps are counted, and the last serving replica is never ejected for
its listing alone."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, call, complete, load, until


async def test_re_admissions_of_a_replica_whose_replays_do_not_stick_back_off(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emus = await emulators(2)
    interval = 0.05
    rt = await router(emus, health_interval=interval)
    assert rt.fleet is not None and rt.health is not None
    assert (await load(client, rt.url, "v1", adapter("v1")))[0] == 200
    emus[1].faults.hide_adapters = 2  # every other listing lacks v1
    flappy = rt.fleet.replicas[1]
    health = rt.health
    live_counts: list[int] = []
    statuses: list[int] = []

    async def traffic() -> None:
        # Base-model requests: answers for v1 would prove the replica holds it and spare its
        # listings (passive health, fleet/health.py), so the flapping listing would go unread.
        while True:  # cancelled below
            live_counts.append(sum(r.live for r in rt.fleet.replicas))  # type: ignore[union-attr]
            statuses.append((await complete(client, rt.url))[0])
            await asyncio.sleep(interval / 2)

    caplog.set_level(logging.WARNING, "lora_router")
    task = asyncio.create_task(traffic())
    try:
        await until(lambda: health.listing_flaps[1] >= 4, timeout=30.0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    life = flappy.life
    # Each replay that did not stick doubled the wait before the next re-admission.
    assert life.slips == health.listing_flaps[1] >= 4
    assert life.readmit_at - life.admitted_at >= interval * 2**life.slips
    # The first ejection looked like a restart; every later one, and every replay refused
    # for the same reason, was a flap, and was counted.
    assert flappy.life.ejections <= health.listing_flaps[1] + 1
    assert set(statuses) == {200} and min(live_counts) >= 1
    warnings = [r for r in caplog.records if "but does not show it" in r.getMessage()]
    assert len(warnings) == 1 and "Replica 1" in warnings[0].getMessage()
    assert "v1" in warnings[0].getMessage()
    _, metrics, _ = await call(client, "GET", rt.url + "/metrics")
    assert b'lora_router_replica_listing_flaps_total{replica="1"}' in metrics


async def test_the_last_serving_replica_is_not_ejected_for_its_listing_alone(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    (emu,) = await emulators(1)
    rt = await router([emu], health_interval=0.05)
    assert rt.fleet is not None and rt.health is not None
    assert (await load(client, rt.url, "v1", adapter("v1")))[0] == 200
    emu.faults.hide_adapters = 1  # no listing ever shows v1
    health = rt.health
    checks = health.checks
    await until(lambda: health.checks >= checks + 5 and health.listing_kept >= 3)
    (replica,) = rt.fleet.replicas
    assert replica.live and replica.life.ejections == 0
    assert (await complete(client, rt.url, "v1"))[0] == 200


async def test_a_replica_ejected_while_paused_is_resumed_for_the_streams_it_still_runs(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2, decode_s_per_token=0.005)
    rt = await router(emus, policy="round-robin")
    assert rt.fleet is not None
    # One stream on each replica, its answer begun (a request still waiting for its first byte
    # would be retried elsewhere on the ejection: http/upstream.py's withdrawal rule).
    streams = []
    for i in range(2):
        body = {"prompt": [i + 1] * 20, "max_tokens": 400, "stream": True}
        resp = await client.post(rt.url + "/v1/completions", json=body)
        assert resp.status == 200 and (await resp.content.readline()).startswith(b"data: ")
        streams.append(resp)
    assert all(r.in_flight == 1 for r in rt.fleet.replicas)
    # Paused with "keep": vLLM freezes the running streams until resumed.
    assert (await call(client, "POST", rt.url + "/pause?mode=keep"))[0] == 200
    rt.fleet.replicas[1].life.eject("its listing lacks live adapters")
    assert (await call(client, "POST", rt.url + "/resume"))[0] == 200
    async with asyncio.timeout(5.0):
        ends = [(await resp.read()).rstrip().endswith(b"data: [DONE]") for resp in streams]
    assert ends == [True, True] and not emus[1].state.paused
