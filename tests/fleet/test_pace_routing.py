"""Over real sockets: a replica at half speed is measured from its answers (fleet/pace.py), its
weight falls below 1 in /router/status and /metrics, and it is dealt fewer new families; a
fleet at one speed keeps every weight at 1, never telling the policy of a change."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
from emulated_fleet import StartEmulators, StartRouter
from helpers import call, router_status, samples

from lora_router.runtime import RouterRuntime

G = 4  # samples a family
IN_FLIGHT = 16  # requests in flight at most, as TRL's async worker bounds them
# Each step decodes every sequence in it: a 24-token answer takes 24 steps (48 ms, 96 ms at
# half speed), on a fleet far from full.
COSTS: dict[str, Any] = dict(decode_s_per_token=2e-3, prefill_s_per_token=1e-6)


async def families(
    client: aiohttp.ClientSession, url: str, count: int, rnd: random.Random
) -> list[str]:
    """`count` families of G samples each (distinct prompts), at most IN_FLIGHT requests in
    flight: the replica that answered each family's first sample."""
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def sample(prompt: list[int]) -> str:
        body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "seed": rnd.getrandbits(63)}
        async with gate:
            status, data, headers = await call(client, "POST", url + "/v1/completions", body)
        assert status == 200, data
        return headers["x-lora-router-replica"]

    async def family() -> str:
        prompt = [rnd.randrange(1000, 100_000) for _ in range(48)]
        homes = await asyncio.gather(*(sample(prompt) for _ in range(G)))
        return homes[0]

    async with asyncio.timeout(60):
        return list(await asyncio.gather(*(family() for _ in range(count))))


def told(runtime: RouterRuntime) -> list[tuple[str, int]]:
    """Every weight the pace rule tells the policy from now on."""
    route = runtime.route
    assert route is not None and route.pace is not None  # the router runs with --pace
    calls: list[tuple[str, int]] = []
    tell = route.pace.on_weight

    def record(name: str, weight: int) -> None:
        calls.append((name, weight))
        tell(name, weight)

    route.pace.on_weight = record
    return calls


async def test_a_half_speed_replica_loses_weight_and_is_dealt_fewer_families(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = [*await emulators(1, **COSTS, speed=0.5), *await emulators(3, **COSTS)]
    runtime = await router(emus, pace=True)
    changes = told(runtime)
    rnd = random.Random(5)
    slow = "0"  # its x-lora-router-replica label
    # Warm-up: until the weight falls, at most 12 rounds of 16 families.
    for _ in range(12):
        await families(client, runtime.url, 16, rnd)
        weights = {
            str(r["id"]): r["weight"]
            for r in (await router_status(client, runtime.url))["replicas"]
        }
        if weights[slow] < 1:
            break
    assert weights[slow] < 1, weights
    assert all(weights[r] == 1 for r in ("1", "2", "3")), weights
    assert changes and {name for name, _ in changes} == {emus[0].url}
    status, page, _ = await call(client, "GET", runtime.url + "/metrics")
    assert status == 200
    figures = samples(page.decode())
    assert figures[("lora_router_replica_weight", (("replica", slow),))] == weights[slow]
    assert figures[("lora_router_replica_weight", (("replica", "1"),))] == 1
    # Measurably fewer new families from now on: a fair share would be a quarter.
    homes = await families(client, runtime.url, 96, rnd)
    share = homes.count(slow) / len(homes)
    assert share < 0.2, (share, weights)


async def test_a_fleet_at_one_speed_keeps_every_weight_at_1(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(4, **COSTS)
    runtime = await router(emus, pace=True)
    changes = told(runtime)
    rnd = random.Random(6)
    homes = await families(client, runtime.url, 160, rnd)
    assert changes == []  # never told: every decision is the unweighted policy's
    replicas = (await router_status(client, runtime.url))["replicas"]
    assert [r["weight"] for r in replicas] == [1.0] * 4
    assert all(r["seconds_per_output_token"] > 0 for r in replicas)  # it was measured
    assert {homes.count(str(i)) for i in range(4)} == {40}  # the deal, evenly


async def test_without_pace_a_half_speed_replica_is_dealt_its_even_share(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    # The rule is opt-in (--pace): by default the deal is the unweighted policy's.
    emus = [*await emulators(1, **COSTS, speed=0.5), *await emulators(3, **COSTS)]
    runtime = await router(emus)
    homes = await families(client, runtime.url, 160, random.Random(5))
    replicas = (await router_status(client, runtime.url))["replicas"]
    assert [r["weight"] for r in replicas] == [1.0] * 4
    assert [r["seconds_per_output_token"] for r in replicas] == [0.0] * 4  # not measured
    assert homes.count("0") / len(homes) >= 0.2  # with --pace, under 0.2 (above)
