"""Over real sockets: a rollout's later turn under the next policy version goes to its
conversation's replica with its siblings, and the replicas' in-flight prompt tokens are exact."""

from __future__ import annotations

import asyncio
import random
from typing import Any

import aiohttp
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, load, until

from lora_router.emulator import Emulator
from lora_router.runtime import RouterRuntime

G = 8


async def turn(
    client: aiohttp.ClientSession, url: str, model: str, prompt: list[int]
) -> tuple[str, list[int]]:
    """One TRL turn (`_generate_one_turn`'s payload): the replica that served it, its ids."""
    body: dict[str, Any] = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": random.getrandbits(63),
    }
    async with client.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        answer = await resp.json()
        return resp.headers["x-lora-router-replica"], answer["choices"][0]["token_ids"]


async def test_a_turn_under_the_next_version_follows_its_conversation(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(3)
    runtime = await router(emus)
    for name in ("trl-policy-v1", "trl-policy-v2"):
        assert (await load(client, runtime.url, name, adapter(name)))[0] == 200
    rnd = random.Random(13)
    problem = [rnd.randrange(1000, 100_000) for _ in range(300)]
    first = await asyncio.gather(
        *(turn(client, runtime.url, "trl-policy-v1", problem) for _ in range(G))
    )
    homes = {replica for replica, _ in first}
    assert len(homes) == 1
    # The weight sync happened mid-rollout: every sample's next turn names v2.
    later = [problem + ids + [rnd.randrange(1000, 100_000) for _ in range(20)] for _, ids in first]
    second = await asyncio.gather(*(turn(client, runtime.url, "trl-policy-v2", p) for p in later))
    assert {replica for replica, _ in second} == homes
    counts = runtime.app.policy.counts if runtime.app else None
    assert counts is not None and counts.continuation == G and counts.fresh == 1


async def test_a_new_lineage_is_placed_apart_from_a_busy_one(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    # Same prompt, other lineage: no affinity, so it goes by the work held (the idle replica).
    emus = await emulators(2, decode_s_per_token=0.05)
    runtime = await router(emus)
    for name in ("trl-policy-v1", "other-v1"):
        assert (await load(client, runtime.url, name, adapter(name)))[0] == 200
    prompt = list(range(1000, 1200))
    busy = asyncio.create_task(turn(client, runtime.url, "trl-policy-v1", prompt))
    assert runtime.fleet is not None
    await until(lambda: any(r.in_flight for r in runtime.fleet.replicas))  # type: ignore[union-attr]
    other, _ = await turn(client, runtime.url, "other-v1", prompt)
    first, _ = await busy
    assert other != first


PROMPT = list(range(500, 740))


async def two_slow_replicas(
    emulators: StartEmulators, router: StartRouter
) -> tuple[list[Emulator], RouterRuntime]:
    """Two replicas decoding at 50 ms a token behind a router that retries once."""
    emus = await emulators(2, decode_s_per_token=0.05)
    return emus, await router(emus, retries=1)


async def test_in_flight_prompt_tokens_are_held_only_while_requests_run(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus, runtime = await two_slow_replicas(emulators, router)
    fleet = runtime.fleet
    assert fleet is not None
    prompt = PROMPT
    slow = asyncio.create_task(turn(client, runtime.url, emus[0].config.model, prompt))
    await until(lambda: sum(r.in_flight_tokens for r in fleet.replicas) == len(prompt))
    # A sibling on the fast path (its wire hash alone) is in flight with nothing to compute:
    # its prompt is its home's already (`Decision.tokens`).
    sibling = asyncio.create_task(turn(client, runtime.url, emus[0].config.model, prompt))
    await until(lambda: sum(r.in_flight for r in fleet.replicas) == 2)
    assert sum(r.in_flight_tokens for r in fleet.replicas) == len(prompt)
    await asyncio.gather(slow, sibling)
    assert [(r.in_flight, r.in_flight_tokens) for r in fleet.replicas] == [(0, 0), (0, 0)]


async def test_a_request_retried_after_a_refused_connection_leaks_no_in_flight_tokens(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus, runtime = await two_slow_replicas(emulators, router)
    fleet = runtime.fleet
    assert fleet is not None
    prompt = PROMPT
    # A replica that refuses the connection: the retry counts on the next one, nothing leaks.
    home = fleet.replicas[int((await turn(client, runtime.url, emus[0].config.model, prompt))[0])]
    await emus[home.rid].stop()
    served, _ = await turn(client, runtime.url, emus[0].config.model, prompt)
    assert int(served) != home.rid
    assert [(r.in_flight, r.in_flight_tokens) for r in fleet.replicas] == [(0, 0), (0, 0)]


async def test_a_new_family_goes_to_a_lighter_replica_dealt_one_more_inside_the_deal_window(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    # 41 families one after another on an idle fleet: 21 and 20, past the 20 a replica from
    # which the window opens. The replica dealt fewer is then kept busy by a slow sibling of one
    # of its own prompts, and the next family goes to the other one, dealt one more but idle
    # (22 families, within floor(1.05 x 42 / 2) = 22). By count alone it would join the queue.
    emus = await emulators(2, decode_s_per_token=0.002)
    runtime = await router(emus)
    model = emus[0].config.model
    rnd = random.Random(17)

    async def send(prompt: list[int], max_tokens: int = 1) -> str:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True}
        async with client.post(runtime.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            await resp.read()
            return resp.headers["x-lora-router-replica"]

    served: dict[str, list[list[int]]] = {}
    for _ in range(41):
        prompt = [rnd.randrange(1000, 100_000) for _ in range(40)]
        served.setdefault(await send(prompt), []).append(prompt)
    fewer, more = sorted(served, key=lambda name: len(served[name]))
    assert (len(served[fewer]), len(served[more])) == (20, 21)
    busy = asyncio.create_task(send(served[fewer][0], max_tokens=500))
    assert runtime.fleet is not None
    await until(lambda: any(r.in_flight for r in runtime.fleet.replicas))  # type: ignore[union-attr]
    assert await send([rnd.randrange(1000, 100_000) for _ in range(40)]) == more
    assert await busy == fewer
    counts = runtime.app.policy.counts if runtime.app else None
    assert counts is not None and counts.fresh == 42 and counts.sibling == 1
