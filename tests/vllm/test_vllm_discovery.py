"""A third real vLLM replica joins through `--replicas-file` while rollouts run: it is given the
live adapter before it serves (its own log: the load comes before any request naming it), and
then it serves rollouts; no rollout is answered other than 200."""

from __future__ import annotations

import asyncio
import os
import random
import threading
from collections.abc import Callable
from pathlib import Path

import aiohttp
import recipe
from trl_client import LORA_NAME
from vllm_harness import REPLICA_START_S, Replica, Router, wait_for

V1 = f"{LORA_NAME}-v1"


def test_a_replica_named_in_the_file_mid_run_is_replayed_then_serves(
    fleet: list[Replica],
    routers: Callable[..., Router],
    publish: Callable[..., str],
    model: Path,
    logs: Path,
    tmp_path: Path,
) -> None:
    members = tmp_path / "replicas"
    members.write_text("# replicas that joined\n")
    router = routers(
        "--replicas-file", str(members), "--replica-hosts", "127.0.0.1", "--discovery-grace", "5"
    )
    path = publish(V1, 0)
    assert router.post("/v1/load_lora_adapter", {"lora_name": V1, "lora_path": path}).status == 200
    third = Replica(model=model / "model", log=logs / "replica-joining.log")
    stop = threading.Event()
    statuses: list[tuple[int, str]] = []  # (status, x-lora-router-replica)

    async def rollouts() -> None:
        rng = random.Random(7)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

            async def worker() -> None:
                while not stop.is_set():
                    body = {
                        "model": V1,
                        "prompt": rng.choices(range(3, 480), k=40),
                        "max_tokens": 2,
                        "seed": rng.getrandbits(63),
                    }
                    async with session.post(router.url + "/v1/completions", json=body) as r:
                        await r.read()
                        statuses.append((r.status, r.headers.get("x-lora-router-replica", "")))

            await asyncio.gather(*(worker() for _ in range(3)))

    traffic = threading.Thread(target=asyncio.run, args=(rollouts(),))
    traffic.start()
    try:
        third.start()
        third.wait_healthy(REPLICA_START_S)
        aside = members.with_suffix(".new")
        aside.write_text(f"# replicas that joined\n{third.url}\n")
        os.replace(aside, members)
        wait_for(
            "the third replica is replayed and admitted",
            lambda: any(r["url"] == third.url and r["admitted"] for r in router.replicas()),
            120,
            [router.log, third.log],
        )
        [joined] = [r for r in router.replicas() if r["url"] == third.url]
        assert joined["origin"] == f"file:{members}"
        assert third.adapters() == {V1: path}
        rid = str(joined["id"])
        wait_for(
            "rollouts reach the third replica",
            lambda: any(h == rid for _, h in statuses),
            120,
            [router.log, third.log],
        )
    finally:
        stop.set()
        traffic.join(timeout=120)
        third.stop()
    assert not traffic.is_alive()
    assert statuses and {s for s, _ in statuses} == {200}, sorted({s for s, _ in statuses})
    run = recipe.record([third], [0])
    assert run.loads[0] and run.late_versions(LORA_NAME) == []  # loaded before it was asked
    completions = [a.status for a in run.accesses[0] if a.path == "/v1/completions"]
    assert completions and set(completions) == {200}, sorted(set(completions))
