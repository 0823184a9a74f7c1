"""A replica SIGKILLed and restarted empty is replayed before it serves: no client sees a 404."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable

import aiohttp
from trl_client import LORA_NAME
from vllm_harness import REPLICA_START_S, Replica, Router, wait_for

V1 = f"{LORA_NAME}-v1"


def test_restarted_replica_gets_its_adapters_back_before_it_serves(
    fleet: list[Replica], routers: Callable[..., Router], publish: Callable[..., str], base: str
) -> None:
    """TRL-shaped rollouts for trl-policy-v1 keep flowing while replica 1 is SIGKILLed and
    started again on its port with no adapter. Every rollout answers 200 (none 404, none
    refused), replica 1 holds v1 again, and it serves rollouts after its return."""
    router = routers("--health-failures", "1", "--health-successes", "1")
    path = publish(V1, 0)
    assert router.post("/v1/load_lora_adapter", {"lora_name": V1, "lora_path": path}).status == 200
    victim = fleet[1]
    stop = threading.Event()
    statuses: list[tuple[int, str]] = []  # (status, replica header)

    async def rollouts() -> None:
        rng = random.Random(5)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

            async def worker() -> None:
                while not stop.is_set():
                    body = {
                        "model": V1,
                        "prompt": rng.choices(range(3, 480), k=40),
                        "max_tokens": 2,
                        "n": 1,
                        "return_token_ids": True,
                        "logprobs": 0,
                        "seed": rng.getrandbits(63),
                    }
                    async with session.post(router.url + "/v1/completions", json=body) as r:
                        await r.read()
                        statuses.append((r.status, r.headers.get("x-lora-router-replica", "")))

            await asyncio.gather(*(worker() for _ in range(3)))

    traffic = threading.Thread(target=asyncio.run, args=(rollouts(),))
    traffic.start()
    try:
        wait_for("rollouts on both replicas", lambda: {h for _, h in statuses} >= {"0", "1"}, 120)
        victim.kill()
        wait_for(
            "the router ejects the killed replica",
            lambda: not router.replicas()[1]["healthy"],
            30,
            [router.log],
        )
        served_while_down = len(statuses)
        victim.start()
        victim.wait_healthy(REPLICA_START_S)
        wait_for(
            "the restarted replica is replayed and admitted",
            lambda: router.replicas()[1]["admitted"] and router.replicas()[1]["healthy"],
            120,
            [router.log, victim.log],
        )
        assert victim.adapters() == {V1: path}
        wait_for(
            "rollouts reach the restarted replica",
            lambda: any(h == "1" for _, h in statuses[served_while_down:]),
            120,
            [router.log, victim.log],
        )
    finally:
        stop.set()
        traffic.join(timeout=120)
    assert not traffic.is_alive()
    assert statuses and {s for s, _ in statuses} == {200}, sorted({s for s, _ in statuses})
