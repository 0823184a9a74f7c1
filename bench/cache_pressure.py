"""Routing under cache pressure: today's prediction (`--policy prefix`), KV-event routing
(`--policy kv`) and vllm-router's cache_aware, side by side, on long multi-turn GRPO rollouts
whose working set does not fit the replicas' prefix caches, with one replica restarted mid-run.

    python bench/cache_pressure.py --traces tools-6 --pressure 3,1.5,0.25   # bench/README.md
    python bench/cache_pressure.py --quick               # a smoke run, results in /tmp
    python bench/cache_pressure.py --traces tools-6 --pressure 3 --rounds 1 \\
        --routers lr-prefix,lr-kv --out /tmp/cp         # an investigation run

Workload: lora_router/testbed/grpo_trace.py's multi-turn rollouts, driven as TRL 1.16's async worker
drives them: `AsyncRolloutWorker._generate_loop` keeps `max_inflight_tasks` rollouts going (one
sample's whole conversation each) and starts the next one, in dataset order, only when one ends; a
rollout's next turn goes out as soon as its turn before answers. Here the slots are `--slot-steps`
(1) steps' worth of samples (S x G), so new families arrive all through the run, onto caches already
full (the tool-use setting TRL's docs suggest sizing by hand; its default, 4 steps' worth, would
start every rollout of a short trace at once). TRL's tool loop (`_generate_one`) has no turn limit
by default (`max_tool_calling_iterations` None): a rollout goes on while the model calls tools, so
turns are more than bench/routing.py's three, and the chat template renders the tools' schemas into
the system prompt (`apply_chat_template(..., tools=tools)`), a long prefix every rollout shares:
- `tools-6`: a 1,000-token system prompt, 6 turns re-rendered through the Qwen3-shaped chat
  template (a turn's prompt is not a prefix of the next: the generation-prompt stub goes, the
  completion is re-tokenized), completions 32-128 tokens;
- `tools-long-tail-4`: the same with 4 turns and completions log-normal (median 100) up to
  3,000 tokens;
- `mt-6` (not in the default run): a 23-token template, 6 turns appended.
S = `--problems` (2) x N problems a step, G = 8, `--steps` (4) steps, N = 3 replicas. Each
rollout names the adapter version of its step (`trl-policy-v{step + 1}`, a sync before a step's
first request, while the previous step's rollouts are still running): with rollouts started by
slots, naming the version current at each turn would need the trace re-rendered as it runs
(the completion a replica generates depends on the name), so this is the simplification.

Cache pressure: the *working set* is the distinct 16-token blocks of every prompt and completion
of one step's rollouts (what the slots hold at once; base-model naming), the shared template's on
every replica and the rest split over N; `--pressure 3,1.5,0.25` gives each emulator
`--cache-blocks` = working set / p: three times the cache, one and a half, and a quarter (the
cache holds everything: the control, where the contenders should tie). Eviction is LRU.

The restart: when `--restart-at` (0.4) of the requests have answered, replica `--restart-replica`
crashes (its connections cut, as a killed process), stays down `--down` seconds and comes back on
its port empty: no cache, no counters, no adapters (the router replays them in LoRA mode). The
counters it had are added back to the run's totals.

Contenders (base-model naming, like for like): `lr-prefix-base` (lora-router `--policy prefix`,
today's prediction), `lr-kv-base` (`--policy kv`: new families where the replicas' KV events say
their prefix is, the prediction for a replica whose stream is not live), `vllm-ca` (vllm-router
cache_aware); in LoRA naming (adapters synced as TRL does: pause, load, resume, unload v(N-5)),
`lr-prefix` and `lr-kv` (the peers cannot broadcast adapter loads). Every emulator publishes KV
events (`--kv-events-config`, ephemeral ports) for every contender, so all pay the same; only
`--policy kv` subscribes, and a kv run starts once every stream is subscribed. Contenders run
interleaved, in an order rotated each round, on the same requests and the same emulators
(restarted between runs).

Measured per run: hit rate from the replicas' own counters (`vllm:prefix_cache_hits` /
`vllm:prefix_cache_queries` of each emulator's /metrics), also in `--windows` windows of answered
requests (before and after the restart: the recovery); the restarted replica's share of each
window's requests and its own hit rate (from the answers' usage); makespan (the busiest replica's
modeled service time, as bench/routing.py computes it: noise-free) and wall time (not:
the machine is shared); failed requests; lora-router's decisions by kind and, where the router
publishes it, `routing_accuracy` (predicted against reported cached tokens) from /router/status.
Figures are medians over `--rounds` with their ranges; ratios to the prediction
(lr-prefix-base, or lr-prefix in LoRA mode) are taken within a round, then their median.

Timing model (bench/lib/routing_traces.py's Timing): one sequence at a time per replica, 100 us
per uncached prompt token, 50 us per generated token. Replicas in one subprocess on core 1; the
router and this load generator on core 0. Outputs: `--out` (bench/results/cache-pressure):
cache_pressure.json (every run) and README.md (tables, command, revision, date).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import math
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench/ modules, run as scripts
from lib.cache_pressure_report import write_json, write_markdown  # noqa: E402
from lib.cache_pressure_run import CacheRun, Plan, run_one  # noqa: E402
from lib.procs import git_revision  # noqa: E402
from lib.routing_procs import CONTENDERS, Contender, ReplicaHost, RouterOptions, available  # noqa: E402
from lib.routing_runs import Bench  # noqa: E402
from lib.routing_traces import Scale, Shape, Timing, build_workload, shape_spec  # noqa: E402

from lora_router.testbed import grpo_trace  # noqa: E402

SHAPES: dict[str, Shape] = {
    "tools-6": Shape(1000, 6, render="chat"),
    "tools-long-tail-4": Shape(1000, 4, render="chat", long_tail=True),
    "mt-6": Shape(23, 6),
}
DEFAULT_TRACES = "tools-6,tools-long-tail-4"
_BY_KEY = {c.key: c for c in CONTENDERS}
KV_CONTENDERS = (
    _BY_KEY["lr-prefix-base"],
    Contender("lr-kv-base", "lora-router kv", "lora-router", "kv", True),
    _BY_KEY["vllm-ca"],
    _BY_KEY["lr-prefix"],
    Contender("lr-kv", "lora-router kv", "lora-router", "kv", False),
    _BY_KEY["oracle-base"],
)
REFERENCE = {True: "lr-prefix-base", False: "lr-prefix"}  # ratios are to these, per mode


def working_set(spec: object, block_size: int, replicas: int) -> int:
    """The live working set a replica: the distinct full blocks of every prompt + completion
    of one step's rollouts (what the rollout slots hold at once), base naming, the shared
    template's on every replica and the rest split evenly."""
    blocks: set[int] = set()
    for r in grpo_trace.generate(spec):  # type: ignore[arg-type]
        if r.step:
            continue
        tokens = r.tokens + r.completion
        chain = 0
        for end in range(block_size, len(tokens) + 1, block_size):
            chain = hash((chain, *tokens[end - block_size : end]))  # a block and all before it
            blocks.add(chain)
    shared = spec.template_tokens // block_size  # type: ignore[attr-defined]
    return shared + math.ceil((len(blocks) - shared) / replicas)


def kv_policy_available() -> bool:
    """Whether this lora-router accepts `--policy kv`."""
    from lora_router.routing.policy import POLICIES

    return "kv" in POLICIES


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--traces", default=DEFAULT_TRACES, help="of: " + ", ".join(SHAPES))
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument(
        "--routers",
        default="lr-prefix-base,lr-kv-base,vllm-ca,lr-prefix,lr-kv",
        help="of: " + ", ".join(c.key for c in KV_CONTENDERS),
    )
    p.add_argument(
        "--pressure",
        default="3,1.5,0.25",
        help="working set per replica over --cache-blocks, one cell each (0.25: no pressure)",
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument(
        "--slot-steps",
        type=float,
        default=1.0,
        help="rollout slots (TRL's max_inflight_tasks) in steps' worth of samples (S x G)",
    )
    p.add_argument("--problems", type=int, default=2, help="problems a step, per replica")
    p.add_argument("--seed", type=int, default=0, help="trace seed")
    p.add_argument("--restart-at", type=float, default=0.4, help="fraction answered; 0: no restart")
    p.add_argument("--restart-replica", type=int, default=1)
    p.add_argument("--down", type=float, default=0.5, help="seconds the restarted replica is down")
    p.add_argument("--windows", type=int, default=10)
    p.add_argument("--deadline", type=float, default=600.0, help="seconds a run may last")
    p.add_argument("--quick", action="store_true", help="2 steps, 1 problem per replica a step")
    p.add_argument("--keep-logs", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="no runs: rewrite the report from this cache_pressure.json (into --out)",
    )
    args = p.parse_args(argv)
    if args.out is None:
        args.out = (
            Path(tempfile.mkdtemp(prefix="cache-pressure-quick-"))
            if args.quick
            else HERE / "results" / "cache-pressure"
        )
    keys = {c.key for c in KV_CONTENDERS}
    args.trace_list = [t for t in args.traces.split(",") if t]
    args.router_list = [r for r in args.routers.split(",") if r]
    args.pressure_list = [float(x) for x in args.pressure.split(",") if x]
    unknown = (set(args.trace_list) - set(SHAPES)) | (set(args.router_list) - keys)
    if unknown:
        p.error(f"unknown trace or router: {', '.join(sorted(unknown))}")
    scale = Scale(steps=args.steps, multi_prompts_per_replica=args.problems, seed=args.seed)
    if args.quick:
        scale = replace(scale, steps=2, multi_prompts_per_replica=1)
    args.scale = scale
    return args


def metadata(
    args: argparse.Namespace,
    started: float,
    cells: list[dict[str, object]],
    skipped: dict[str, str],
) -> dict[str, object]:
    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python bench/cache_pressure.py " + " ".join(shlex.quote(a) for a in args.argv),
        "git": git_revision(),
        "elapsed_s": round(time.perf_counter() - started, 1),
        "replicas": args.replicas,
        "scale": asdict(args.scale),
        "timing": asdict(replace(Timing(), kv_events=True)),
        "plan": {
            "restart_at": args.restart_at or None,
            "restart_replica": args.restart_replica,
            "down_s": args.down,
            "windows": args.windows,
        },
        "rounds": args.rounds,
        "cells": cells,
        "skipped": skipped,
        "load_average": os.getloadavg(),
    }


async def bench_main(args: argparse.Namespace) -> int:
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {0})
    started = time.perf_counter()
    wanted = [c for c in KV_CONTENDERS if c.key in args.router_list]
    skipped: dict[str, str] = {}
    kv_ok = kv_policy_available()
    contenders: list[Contender] = []
    for c in wanted:
        if c.policy == "kv" and not kv_ok:
            skipped[c.key] = "this lora-router has no --policy kv"
        elif not available(c):
            skipped[c.key] = "not installed (pip install -e '.[bench]'; PATH=.venv/bin:$PATH)"
        else:
            contenders.append(c)
    for key, why in skipped.items():
        print(f"skipped {key}: {why}")
    workdir = Path(tempfile.mkdtemp(prefix="lora-router-cache-pressure-"))
    bench = Bench(
        argparse.Namespace(
            timing=Timing(),
            scale=args.scale,
            load_factor=None,
            load_slack=None,
            lr_source=None,
            alt_source=None,
            deadline=args.deadline,
        ),
        workdir,
    )
    n = args.replicas
    results: list[CacheRun] = []
    cells: list[dict[str, object]] = []
    try:
        for trace in args.trace_list:
            spec = shape_spec(SHAPES[trace], n, args.scale)
            bench.write_adapters(spec.versions)
            workloads = {base: build_workload(spec, base) for base in {c.base for c in contenders}}
            per_replica = working_set(spec, Timing().block_size, n)
            slots = max(1, round(args.slot_steps * spec.prompts_per_step * spec.group_size))
            for pressure in args.pressure_list:
                blocks = max(1, math.ceil(per_replica / pressure))
                timing = Timing(cache_blocks=blocks, kv_events=True)
                items = next(iter(workloads.values()))
                cells.append(
                    {
                        "trace": trace,
                        "pressure": pressure,
                        "cache_blocks": blocks,
                        "working_set_per_replica": per_replica,
                        "requests": len(items),
                        "prompt_tokens": sum(i.prompt_len for i in items),
                        "rollout_slots": slots,
                    }
                )
                print(
                    f"{trace}: {len(items)} requests, working set {per_replica} blocks a "
                    f"replica, cache {blocks} (pressure {pressure:g})"
                )
                plan = Plan(
                    restart_at=args.restart_at or None,
                    restart_replica=args.restart_replica,
                    down_s=args.down,
                    windows=args.windows,
                    slots=slots,
                    deadline_s=args.deadline,
                )
                with open(workdir / f"replicas-{trace}-{blocks}.log", "ab") as log:
                    host = await ReplicaHost.start(n, timing, log)
                try:
                    for round_ in range(args.rounds):
                        k = round_ % len(contenders)
                        for c in contenders[k:] + contenders[:k]:
                            result = CacheRun(
                                trace,
                                blocks,
                                pressure,
                                c.key,
                                c.label,
                                "base" if c.base else "lora",
                                round_,
                            )
                            await run_one(
                                host,
                                c,
                                workloads[c.base],
                                timing,
                                plan,
                                None if c.base else bench.adapters,
                                workdir,
                                result,
                                RouterOptions(),
                            )
                            results.append(result)
                            # Written as it goes: a run cut short still has a report
                            # (--from-json).
                            args.out.mkdir(parents=True, exist_ok=True)
                            partial = metadata(args, started, cells, skipped)
                            write_json(args.out / "cache_pressure.json", partial, results)
                            print(f"  #{round_ + 1} {c.key:15} {one_line(result)}", flush=True)
                finally:
                    await host.close()
    finally:
        if args.keep_logs:
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    meta = metadata(args, started, cells, skipped)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "cache_pressure.json", meta, results)
    write_markdown(args.out / "README.md", meta, results, REFERENCE)
    print(f"\n{len(results)} runs in {meta['elapsed_s']} s; results in {args.out}")
    return 0


def _window(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def one_line(r: CacheRun) -> str:
    if r.status != "ok":
        return r.status
    return (
        f"hit {r.hit_rate:.3f} makespan {r.makespan_s:.2f}s wall {r.wall_s:.2f}s "
        f"failed {r.failed} windows {' '.join(_window(w) for w in r.window_hit_rate)}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    args.argv = raw
    if args.from_json is not None:
        doc = json.loads(args.from_json.read_text())
        results = [CacheRun.from_json(r) for r in doc["runs"]]
        doc["meta"]["report_git"] = git_revision()
        args.out.mkdir(parents=True, exist_ok=True)
        write_json(args.out / "cache_pressure.json", doc["meta"], results)
        write_markdown(args.out / "README.md", doc["meta"], results, REFERENCE)
        print(f"report rewritten in {args.out} from {args.from_json}")
        return 0
    return asyncio.run(bench_main(args))


if __name__ == "__main__":
    sys.exit(main())
