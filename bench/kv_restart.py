"""A router restart mid-rollout: what `--policy kv` recovers that `--policy prefix` cannot.

    python bench/kv_restart.py [--replicas 3] [--families 24] [--tokens 600] [--out FILE]

N emulated replicas (in process, vLLM 0.32 KV events on, no timing model: only where requests
go is measured) behind a router. Phase 1: a router routes the first turn of each family (G = 8
siblings of one token-id prompt under `trl-policy-v1`, sent together; families a few at a
time). The router is then stopped and a new one started with the same flags: its affinity
table is empty, the replicas' caches are not. Phase 2: each family's second turn (its first
prompt, the first sample's completion, 20 more tokens) through the new router, G siblings
again, the families in a shuffled order (rollouts finish when they finish). Measured over
phase 2: the replicas' own prefix-cache hit rate (tokens hit / tokens
looked up, vLLM's counters), the share of families whose second turn went to the replica of
their first, the requests per replica (max / mean), and the new router's decisions. Run once
with `prefix`, with `kv`, and with two variants of `kv` patched in this process only (an
investigation): `kv-window-only` (no exception for inherited blocks: every holder must be
inside the deal window) and `kv-no-window` (a holder takes a family whatever the families it
holds), on fresh replicas each time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lora_router.config import Config, ReplicaAddress  # noqa: E402
from lora_router.emulator import (  # noqa: E402
    Emulator,
    EmulatorConfig,
    start_emulator,
    write_adapter,
)
from lora_router.emulator.kv_events import KVEventsConfig  # noqa: E402
from lora_router.routing.kv_index import KvIndex  # noqa: E402
from lora_router.routing.policy import PrefixAffinity  # noqa: E402
from lora_router.runtime import RouterRuntime  # noqa: E402

MODEL = "trl-policy-v1"
VARIANTS = ("prefix", "kv", "kv-window-only", "kv-no-window")
G = 8
EVENTS = KVEventsConfig(
    enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"
)


async def start_router(emus: list[Emulator], policy: str) -> RouterRuntime:
    config = Config(
        replicas=tuple(ReplicaAddress.parse(e.url) for e in emus),
        port=0,
        policy=policy,
        health_interval=3600.0,
        status_interval=0.0,
    )
    runtime = RouterRuntime(config)
    await runtime.start()
    return runtime


async def turn(
    session: aiohttp.ClientSession, rt: RouterRuntime, prompt: list[int], seed: int
) -> tuple[str, list[int]]:
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 32,
        "ignore_eos": True,
        "return_token_ids": True,
        "seed": seed,
    }
    async with session.post(rt.url + "/v1/completions", json=body) as resp:
        answer: Any = await resp.json()
        assert resp.status == 200, answer
        replica = rt.fleet.find(int(resp.headers["x-lora-router-replica"]))  # type: ignore[union-attr]
        assert replica is not None
        return replica.name, answer["choices"][0]["token_ids"]


async def group(
    session: aiohttp.ClientSession, rt: RouterRuntime, prompt: list[int], rnd: random.Random
) -> list[tuple[str, list[int]]]:
    return await asyncio.gather(*(turn(session, rt, prompt, rnd.getrandbits(63)) for _ in range(G)))


def counters(emus: list[Emulator]) -> tuple[int, int]:
    return sum(e.state.cache.hits for e in emus), sum(e.state.cache.queries for e in emus)


async def run(variant: str, args: argparse.Namespace, adapter: str) -> dict[str, Any]:
    policy = "prefix" if variant == "prefix" else "kv"
    window, inherited = PrefixAffinity.window, KvIndex.inherited
    if variant == "kv-no-window":
        PrefixAffinity.window = lambda self: 1 << 62  # type: ignore[method-assign]
    if variant == "kv-window-only":
        KvIndex.inherited = lambda self, lora, key, name: False  # type: ignore[method-assign]
    try:
        return await _run(variant, policy, args, adapter)
    finally:
        PrefixAffinity.window = window  # type: ignore[method-assign]
        KvIndex.inherited = inherited  # type: ignore[method-assign]


async def _run(variant: str, policy: str, args: argparse.Namespace, adapter: str) -> dict[str, Any]:
    rnd = random.Random(args.seed)
    emus = [
        await start_emulator(EmulatorConfig(port=0, kv_events_config=EVENTS, record_requests=False))
        for _ in range(args.replicas)
    ]
    try:
        async with aiohttp.ClientSession() as session:
            rt = await start_router(emus, policy)
            try:
                for path in ("/pause?mode=keep",):
                    await session.post(rt.url + path)
                body = {"lora_name": MODEL, "lora_path": adapter, "load_inplace": False}
                async with session.post(rt.url + "/v1/load_lora_adapter", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                await session.post(rt.url + "/resume")
                prompts = [
                    [rnd.randrange(1000, 100_000) for _ in range(args.tokens)]
                    for _ in range(args.families)
                ]
                first: list[list[tuple[str, list[int]]]] = []
                for start in range(0, len(prompts), args.replicas):
                    first += await asyncio.gather(
                        *(
                            group(session, rt, p, rnd)
                            for p in prompts[start : start + args.replicas]
                        )
                    )
            finally:
                await rt.stop()
            rt = await start_router(emus, policy)
            try:
                assert rt.kv_events is not None or policy != "kv"
                if rt.kv_events is not None:  # wait until the replay buffers were read
                    async with asyncio.timeout(30):
                        while sum(rt.kv_events.index.held(e.url) for e in emus) == 0:
                            await asyncio.sleep(0.01)
                later = [
                    [*p, *answers[0][1], *(rnd.randrange(1000, 100_000) for _ in range(20))]
                    for p, answers in zip(prompts, first, strict=True)
                ]
                # Turns come back in another order than they went out (rollouts finish when
                # they finish): the new router meets the families in a shuffled order.
                order = list(range(len(later)))
                rnd.shuffle(order)
                hits0, queries0 = counters(emus)
                second: list[list[tuple[str, list[int]]]] = [[] for _ in later]
                for start in range(0, len(order), args.replicas):
                    batch = order[start : start + args.replicas]
                    done = await asyncio.gather(*(group(session, rt, later[i], rnd) for i in batch))
                    for i, answers in zip(batch, done, strict=True):
                        second[i] = answers
                hits, queries = counters(emus)
                assert rt.app is not None
                decisions = rt.app.policy.counts.as_dict()
            finally:
                await rt.stop()
    finally:
        for emu in emus:
            await emu.stop()
    homes = [answers[0][0] for answers in first]
    followed = sum(
        1 for home, answers in zip(homes, second, strict=True) if all(r == home for r, _ in answers)
    )
    per_replica = [sum(1 for answers in second for r, _ in answers if r == e.url) for e in emus]
    return {
        "policy": variant,
        "second_turn_hit_rate": round((hits - hits0) / (queries - queries0), 4),
        "families_followed": followed,
        "families": args.families,
        "second_turn_requests_per_replica": per_replica,
        "second_turn_max_over_mean": round(max(per_replica) / (sum(per_replica) / len(emus)), 3),
        "new_router_decisions": {k: v for k, v in decisions.items() if v},
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        adapter = str(write_adapter(Path(tmp) / ".vllm_lora" / MODEL, rank=1))
        return {
            "command": "python bench/kv_restart.py " + " ".join(sys.argv[1:]),
            "replicas": args.replicas,
            "families": args.families,
            "group_size": G,
            "prompt_tokens": args.tokens,
            "runs": [await run(policy, args, adapter) for policy in VARIANTS],
        }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--families", type=int, default=24)
    p.add_argument("--tokens", type=int, default=600)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "bench/results/kv-restart.json"))
    args = p.parse_args()
    result = asyncio.run(main_async(args))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
