"""The fence's cost: a broadcast load to 8 replicas against the slowest replica's own load time,
and how long eager requests wait at the fence.

Method. Eight emulated replicas run as separate processes (`lora-router-emulator --fast`); one
of them has a slow-load fault (`--load-delay`), so its load time dominates, as the slowest
replica's always does. The router runs as its own process, pinned to core 0; replicas and this
client share core 1. Each round, interleaved:

- *direct*: the client loads a fresh adapter straight on the slow replica (its own load time,
  seen through the same client stack);
- *router*: the client loads another fresh adapter through the router (broadcast to all 8,
  answered when the slowest acknowledged).

The fence's overhead is router - direct, per round; the report gives the median and p90 over
rounds. A second phase sends 8 eager completions naming each new version right after asking
for its load: their wait at the fence is their latency minus a completion's latency on a live
adapter, and "after the answer" is how long after the load's own answer they were served.

    python bench/fence.py                     # 8 replicas, 0.1 s slow load, 40 rounds
    python bench/fence.py --rounds 10 --slow 0.05

Writes bench/results/fence.json (with the command that produced it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib.procs import Procs, free_port, wait_port

from lora_router.emulator import write_adapter

ROUTER_CPU, LOAD_CPU = "0", "1"
TARGET_MS = 2.0


def stats(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {
        "p50": round(statistics.median(ordered), 3),
        "p90": round(ordered[int(0.9 * (len(ordered) - 1))], 3),
        "mean": round(statistics.fmean(ordered), 3),
        "min": round(ordered[0], 3),
        "max": round(ordered[-1], 3),
    }


async def post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, float, float]:
    """POST and read the answer; returns status and start/end (perf_counter, seconds)."""
    start = time.perf_counter()
    async with session.post(url, json=body) as resp:
        await resp.read()
        return resp.status, start, time.perf_counter()


async def measure(args: argparse.Namespace, router: str, slow: str, adapters: Path) -> dict:
    overhead, direct_ms, router_ms = [], [], []
    waits, after_answer = [], []
    async with aiohttp.ClientSession() as s:
        completion = {"prompt": list(range(64)), "max_tokens": 1}

        async def load_via(base: str, name: str) -> float:
            path = str(write_adapter(adapters / name))
            status, start, end = await post(
                s, base + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path}
            )
            assert status == 200, (base, name, status)
            return (end - start) * 1000

        async def unload_via(base: str, name: str) -> None:
            status, _, _ = await post(s, base + "/v1/unload_lora_adapter", {"lora_name": name})
            assert status == 200, (base, name, status)

        # Warm-up: connections in every pool, code paths exercised.
        for i in range(args.warmup):
            await load_via(slow, f"warm-direct-{i}")
            await unload_via(slow, f"warm-direct-{i}")
            await load_via(router, f"warm-{i}")
            await unload_via(router, f"warm-{i}")

        # Phase 1: the load itself, direct and through the router, interleaved.
        for r in tqdm(range(args.rounds), desc="loads, direct and through the router"):
            order = ("direct", "router") if r % 2 == 0 else ("router", "direct")
            took: dict[str, float] = {}
            for kind in order:
                base = slow if kind == "direct" else router
                name = f"{kind}-v{r}"
                took[kind] = await load_via(base, name)
                await unload_via(base, name)
            direct_ms.append(took["direct"])
            router_ms.append(took["router"])
            overhead.append(took["router"] - took["direct"])

        # Phase 2: eager completions at the fence.
        name = "live"
        await load_via(router, name)
        baseline = []
        for _ in range(20):
            status, start, end = await post(
                s, router + "/v1/completions", {**completion, "model": name}
            )
            assert status == 200
            baseline.append((end - start) * 1000)
        base_ms = statistics.median(baseline)
        for r in tqdm(range(args.rounds // 2), desc="eager completions at the fence"):
            name = f"eager-v{r}"
            path = str(write_adapter(adapters / name))
            loading = asyncio.create_task(
                post(s, router + "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})
            )
            await asyncio.sleep(0.002)  # the load request is at the router first
            eager = [
                asyncio.create_task(
                    post(s, router + "/v1/completions", {**completion, "model": name})
                )
                for _ in range(8)
            ]
            status, _, load_end = await loading
            assert status == 200
            for task in eager:
                status, start, end = await task
                assert status == 200
                waits.append((end - start) * 1000 - base_ms)
                after_answer.append((end - load_end) * 1000)
            await unload_via(router, name)

    return {
        "load_direct_ms": stats(direct_ms),
        "load_router_ms": stats(router_ms),
        "overhead_ms": stats(overhead),
        "overhead_of_medians_ms": round(
            statistics.median(router_ms) - statistics.median(direct_ms), 3
        ),
        "eager_completion_baseline_ms": round(base_ms, 3),
        "fence_wait_ms": stats(waits),
        "served_after_load_answer_ms": stats(after_answer),
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--slow", type=float, default=0.1, help="the slow replica's load time (s)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument(
        "--router-cpu",
        default=ROUTER_CPU,
        help="core for the router (replicas and client use core 1); 1 = same core as them, "
        "which leaves out the cross-core wake-ups of this machine",
    )
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()

    procs = Procs()
    adapters = Path(tempfile.mkdtemp(prefix="fence-bench-"))
    try:
        ports = [free_port() for _ in range(args.replicas)]
        for i, port in enumerate(ports):
            argv = [sys.executable, "-m", "lora_router.emulator", "--port", str(port), "--fast"]
            if i == len(ports) - 1:
                argv += ["--load-delay", str(args.slow)]
            procs.start(argv, cpus=LOAD_CPU)
        for port in ports:
            wait_port(port)
        router_port = free_port()
        urls = ",".join(f"http://127.0.0.1:{port}" for port in ports)
        procs.start(
            [
                sys.executable, "-m", "lora_router.cli", "--replicas", urls, "--no-token",
                "--port", str(router_port), "--log-level", "warning",
            ],
            cpus=args.router_cpu,
        )  # fmt: skip
        wait_port(router_port)
        os.sched_setaffinity(0, {int(LOAD_CPU)})
        result = asyncio.run(
            measure(
                args, f"http://127.0.0.1:{router_port}", f"http://127.0.0.1:{ports[-1]}", adapters
            )
        )
    finally:
        procs.close()
    report = {
        "command": "python bench/fence.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "machine": {"cpus": os.cpu_count(), "router_cpu": args.router_cpu, "load_cpu": LOAD_CPU},
        "replicas": args.replicas,
        "slow_load_s": args.slow,
        "rounds": args.rounds,
        "target_overhead_ms": TARGET_MS,
        "met": result["overhead_ms"]["p50"] <= TARGET_MS,
        **result,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fence.json").write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
