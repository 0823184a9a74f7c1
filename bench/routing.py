"""Routing quality: prefix-cache hit rate, sibling affinity, balance and wall time of routers
in front of N emulated vLLM replicas, on GRPO-shaped traces, against an oracle.

    python bench/routing.py                  # every trace, router and replica count, once
    python bench/routing.py --repeat 3       # the wall-time contenders 3 times, medians
    python bench/routing.py --quick          # a smaller trace, for a smoke test
    python bench/routing.py --traces multi-turn --replicas 8 --routers lr-prefix \\
        --load-factor 0.5 --out /tmp/routing  # an investigation run, results elsewhere

Workload. `lora_router/testbed/grpo_trace.py` generates what TRL 1.16's async GRPO rollout worker
sends: S problems per step, each sent G = 8 times (siblings), token-id prompts that start with a
shared template, a random 63-bit `seed` per request (TRL's `random.getrandbits(63)`), a new adapter
version `trl-policy-vN` every step. Seven traces, each with 2, 3 and 8 replicas: `single-turn` (a
23-token chat template), `system-300` and `system-1000` (a shared system prompt of 300 / 1,000
tokens), `multi-turn` (3 turns: a sample's next prompt is its previous prompt + its completion + a
tool message, sent only once the previous turn has answered, every turn of a rollout under one
version), and three *pipelined* 3-turn traces, where new rollouts start while older ones are in
later turns and every request names the version current when it is sent (a new version every round,
so each rollout spans three versions and the syncs land during rollouts, as TRL's `_request_model`
does): `multi-turn-sync` (turns appended), `chat-rerender` (every turn re-rendered through a
Qwen3-shaped chat template, as `_generate_one` and the OpenEnv harness's `_sample_turn` do: the
previous prompt's generation-prompt stub is dropped and the completion re-tokenized) and `long-tail`
(re-rendered, completions log-normal up to 3,000 tokens). A trace grows with the fleet (S = 8 N
problems per step single-turn, 4 N multi-turn, 2 N pipelined; 3 steps), so every replica count gets
the same work and the same number of families per replica. Requests go out in trace order with at
most 64 N in flight: a later turn becomes eligible when its parent has answered, and the
lowest-indexed eligible request goes first. Each request carries `max_tokens` = the trace's
completion length and `ignore_eos`, so every replica generates the same completion for it; a later
turn's prompt carries that very completion (predicted with the emulator's own deterministic
generator, checked against the answer's `token_ids`, which only multi-turn requests ask for), so its
KV is what the next turn reuses, as on vLLM. Every router in a naming mode receives byte-identical
requests.

Two naming modes. *LoRA* (as TRL): requests name `trl-policy-vN`; before the first request of
version N the bench syncs through the router exactly as TRL does: `POST /pause?mode=keep`,
`/v1/load_lora_adapter`, `/resume`, unload `v(N-5)` (v1 is loaded before the clock starts).
Only lora-router and the oracle can do this. *Base*: requests name the base model and there are
no syncs; the peers run only this way (they cannot broadcast adapter loads), and so does a
second lora-router prefix run, for a like-for-like comparison. Hit rates are compared only
within a mode (base mode shares the template across steps; LoRA mode never across versions).

Replicas: N `lora_router.emulator` replicas in one subprocess pinned to core 1, alone; the
router under test and this load generator on core 0 (the load generator costs the same for
every router; pinning it with the replicas made 8-replica runs CPU-bound on core 1). Timing
model: a replica runs one sequence at a time (`max_num_seqs` 1: a replica is a server with a
queue, so its busy time is the sum of its service times and the busiest replica finishes
last), 100 us per *uncached* prompt token, 50 us per generated token, a prefix cache of 4,096
blocks of 16 tokens with LRU eviction. A request whose prefix is cached costs ~4-10 ms; missing
a 1,000-token system prompt adds 100 ms, so cache hits and balance decide the wall time. The
emulator sleeps in steps of at least 2 ms and asyncio timers overshoot by up to 1 ms, which
adds a few ms per request to the measured times (the same for every router). Emulators are
restarted (fresh caches, counters and adapters) before every run. The machine is shared: wall
times vary by about 10 % from run to run, hence `--repeat` (interleaved rounds, medians) and
the noise-free *makespan* (the busiest replica's modeled service time) next to wall time.

The oracle, the theoretical maximum. A tiny proxy in this file (`serve-oracle`, aiohttp, also
on core 0) pins every prompt family — a problem's first-turn prompt, all G samples of it, and
all their later turns — to one replica, the families dealt out evenly: the first request of a
new family (read from the `x-bench-family` header, which the bench sends with every request)
goes to the next replica in round-robin order, and the family stays there. Control routes
(pause, resume, load, unload) are broadcast to every replica. The oracle replays the very same
requests through the same emulators and timing, so every sibling after the first and every
later turn finds its whole prefix cached, and each replica computes each template once per
version: no router does better without loading some replica with more families than others.
(A router could edge past it only through LRU evictions, rare with 4,096 blocks, or by keeping
a template on fewer replicas.) Figures are ratios to the oracle of the same trace, replica
count and mode (its median over repeats).

Measured per run (trace, replicas, router; the oracle's figures are reported beside each):
- hit rate: prefix-cache hits / queries in tokens, summed over the replicas' `/metrics`
  (`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`), and its fraction of the oracle's;
- siblings on majority: the share of first-turn samples that ran on their group's most used
  replica; turns on parent: the share of later turns that ran where their previous turn ran
  (the targets except one later turn per spill lora-router counted in its /metrics);
- max/mean requests per replica; time-weighted in-flight max/mean (∫ max over replicas of the
  requests in flight / ∫ their mean, from each request's send and answer times here); max/mean
  busy time and makespan (busy time: the replica's modeled service time, uncached prompt
  tokens x prefill cost + generated tokens x decode cost, from each answer's `usage`);
- wall time from the first request to the last answer (LoRA syncs included), failed requests,
  CPU seconds of the router, the replicas and the load generator.
Which replica served a request is read on the replicas: the replica host keeps the `seed` of
every completion each emulator receives (it replaces the emulator's request log,
`Emulator.requests`), so routers that add no header are measured like the others; lora-router's
`x-lora-router-replica` header is checked against it (`header_mismatches`).

Trace seeds: a trace is one draw of problems, samples and completion lengths, and with a
router that places deterministically one draw decides how evenly the work falls (bench/replay.py
moves the makespan by up to ±5 % between seeds). `--seeds 0-4` runs every contender on each
seed (each repeated `--repeat` times), pools the figures and pairs the wall times run by run.
Read wall times at 8 replicas with care: there both cores are 65-80 % busy (the replica host on
core 1; the router and this load generator on core 0), the wall time is about 2.5 times the
makespan, and single runs of one router spread by ±10 %.

Investigation aids: `--load-factor` and `--load-slack` are passed to lora-router; `--lr-source`
runs lora-router from another source tree (the base commit's, to show a trace can fail);
`--alt-source` runs the `lr-prefix-alt` and `lr-prefix-base-alt` contenders from another tree
next to lora-router itself, interleaved in one run (an A/B of two revisions);
`--prefill-us`, `--decode-us`, `--max-num-seqs`, `--cache-blocks` change the timing model.

Outputs: bench/results/routing.json (every run and the summaries), routing.md (tables, the
command, the date), routing.png (hit rate as a fraction of the oracle's, one panel per trace).
Only 127.0.0.1 is used; every child process is stopped on exit; every request has a timeout
(120 s) and every run a deadline (`--deadline`, 600 s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import itertools
import json
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
CLIENT_CPUS = "0"

sys.path.insert(0, str(HERE))  # bench/ modules, run as scripts
from lib.procs import git_revision  # noqa: E402
from lib.routing_procs import (  # noqa: E402
    CONTENDERS,
    OPT_IN,
    ReplicaHost,
    RouterOptions,
    available,
    serve_oracle,
    serve_replicas,
)
from lib.routing_report import (  # noqa: E402
    TARGET_BALANCE,
    TARGET_FOLLOW,
    TARGET_FRACTION,
    TARGET_HEADER,
    TARGET_IN_FLIGHT,
    aggregate,
    compact,
    fill_oracle_fractions,
    load_json,
    md_table,
    targets,
    write_json,
    write_markdown,
    write_plot,
)
from lib.routing_runs import Bench, RunResult  # noqa: E402
from lib.routing_traces import TRACES, Scale, Timing, build_workload, seeds_of, trace_spec  # noqa: E402

# --- main ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--traces", default=",".join(TRACES), help="comma-separated, of: " + ", ".join(TRACES)
    )
    p.add_argument("--replicas", default="2,3,8", help="comma-separated replica counts")
    p.add_argument(
        "--routers",
        default=",".join(c.key for c in CONTENDERS if c.key not in OPT_IN),
        help="comma-separated, of: " + ", ".join(c.key for c in CONTENDERS),
    )
    p.add_argument("--quick", action="store_true", help="2 steps, half the problems per step")
    p.add_argument("--repeat", type=int, default=1, help="run the --repeat-routers K times")
    p.add_argument(
        "--repeat-routers",
        default="lr-prefix-base,vllm-ch,vllm-ca",
        help="the routers --repeat applies to (default: those the wall-time target compares)",
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument(
        "--seeds",
        default="0",
        help="trace seeds, e.g. 0-4: every contender runs every seed (--repeat times for the "
        "--repeat-routers), and the figures pool them",
    )
    p.add_argument("--load-factor", type=float, default=None, help="lora-router --load-factor")
    p.add_argument(
        "--load-slack",
        type=int,
        default=None,
        help="investigation: override the prefix policy's load_slack",
    )
    timing = Timing()
    p.add_argument(
        "--prefill-us",
        type=float,
        default=timing.prefill_s_per_token * 1e6,
        help="replica time per uncached prompt token, microseconds",
    )
    p.add_argument(
        "--decode-us",
        type=float,
        default=timing.decode_s_per_token * 1e6,
        help="replica time per generated token, microseconds",
    )
    p.add_argument("--max-num-seqs", type=int, default=timing.max_num_seqs)
    p.add_argument("--cache-blocks", type=int, default=timing.cache_blocks)
    p.add_argument("--deadline", type=float, default=600.0, help="seconds a run may last")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: bench/results; with --quick, a temporary directory, so "
        "a smoke run never overwrites the committed results)",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep router and replica logs")
    p.add_argument(
        "--lr-source",
        type=Path,
        default=None,
        help="run lora-router from this source tree (e.g. `git archive` of another revision), "
        "to show how that revision does on these traces",
    )
    p.add_argument(
        "--alt-source",
        type=Path,
        default=None,
        help="the source tree the lr-prefix-alt and lr-prefix-base-alt contenders run from, so "
        "two revisions run interleaved in one run (e.g. `git archive` of the base commit)",
    )
    p.add_argument(
        "--no-plot",
        action="store_true",
        help="write no routing.png (it needs matplotlib, of the bench extra)",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        help="only rewrite routing.md and routing.png from the runs of these routing.json files, "
        "those of --traces and --replicas (no runs; several: pooled, e.g. runs on different "
        "--seeds, and written to --out's routing.json too)",
    )
    args = p.parse_args(argv)
    if args.out is None:
        args.out = (
            Path(tempfile.mkdtemp(prefix="routing-quick-")) if args.quick else HERE / "results"
        )
    scale = Scale()
    if args.quick:
        scale = Scale(
            steps=2,
            prompts_per_replica=4,
            multi_prompts_per_replica=2,
            pipelined_prompts_per_replica=1,
        )
    if args.steps is not None:
        scale = Scale(**{**asdict(scale), "steps": args.steps})
    args.scale = scale
    args.timing = Timing(
        prefill_s_per_token=args.prefill_us * 1e-6,
        decode_s_per_token=args.decode_us * 1e-6,
        max_num_seqs=args.max_num_seqs,
        cache_blocks=args.cache_blocks,
        kv_events="lr-kv" in args.routers.split(","),
    )
    args.trace_list = [t for t in args.traces.split(",") if t]
    args.replica_list = [int(n) for n in args.replicas.split(",") if n]
    args.router_list = [r for r in args.routers.split(",") if r]
    args.repeat_list = [r for r in args.repeat_routers.split(",") if r]
    args.seed_list = seeds_of(args.seeds)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    unknown = set(args.trace_list) - set(TRACES)
    unknown |= set(args.router_list) - {c.key for c in CONTENDERS}
    if unknown:
        p.error(f"unknown trace or router: {', '.join(sorted(unknown))}")
    alt = any(r.endswith("-alt") for r in args.router_list)
    if alt and args.alt_source is None and args.from_json is None:
        p.error("the -alt contenders need --alt-source")
    # Fractions of the oracle need the oracle of the same mode.
    wanted = {c.key: c for c in CONTENDERS if c.key in args.router_list}
    for c in list(wanted.values()):
        oracle = "oracle-base" if c.base else "oracle"
        if oracle not in wanted:
            args.router_list.append(oracle)
    args.router_list = [c.key for c in CONTENDERS if c.key in args.router_list]
    return args


def one_line(r: RunResult) -> str:
    if r.status != "ok":
        return r.status
    return (
        f"hit {r.hit_rate:.3f} max/mean {r.max_mean_requests:.2f} "
        f"wall {r.wall_s:.2f}s failed {r.failed}"
    )


async def bench_main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {int(CLIENT_CPUS)})
    started = time.perf_counter()
    contenders = [c for c in CONTENDERS if c.key in args.router_list]
    skipped = [c.key for c in contenders if not available(c)]
    contenders = [c for c in contenders if available(c)]
    if skipped:
        print(f"not installed, skipped: {', '.join(skipped)}")
    workdir = Path(tempfile.mkdtemp(prefix="lora-router-routing-"))
    bench = Bench(args, workdir)
    bench.write_adapters(
        max(
            trace_spec(t, n, args.scale).versions
            for t in args.trace_list
            for n in args.replica_list
        )
    )
    results: list[RunResult] = []
    repeated = [c.key for c in contenders if c.key in args.repeat_list and args.repeat > 1]
    per_block = len(contenders) + (args.repeat - 1) * len(repeated)
    total = len(args.replica_list) * len(args.trace_list) * len(args.seed_list) * per_block
    progress = tqdm(total=total, unit="run", dynamic_ncols=True)
    try:
        for n in args.replica_list:
            with open(workdir / f"replicas-{n}.log", "ab") as log:
                host = await ReplicaHost.start(n, args.timing, log)
            try:
                for trace, seed in itertools.product(args.trace_list, args.seed_list):
                    spec = trace_spec(trace, n, replace(args.scale, seed=seed))
                    workloads = {
                        base: build_workload(spec, base) for base in {c.base for c in contenders}
                    }
                    # Repeats are interleaved, so a slow spell of the machine hits every
                    # contender rather than one.
                    for round_ in range(args.repeat):
                        for c in contenders:
                            if round_ and c.key not in repeated:
                                continue
                            tag = f"{c.key} #{round_ + 1}"
                            if len(args.seed_list) > 1:
                                tag += f" seed {seed}"
                            progress.set_description(f"{trace} N={n} {tag}")
                            result = await bench.run(host, c, trace, n, workloads[c.base])
                            result.round, result.seed = round_, seed
                            results.append(result)
                            progress.write(f"{trace:12} N={n} {tag:26} {one_line(result)}")
                            progress.update()
            finally:
                await host.close()
    finally:
        progress.close()
        if args.keep_logs:
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    fill_oracle_fractions(results)
    summaries = aggregate(results)
    elapsed = time.perf_counter() - started
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python bench/routing.py " + " ".join(shlex.quote(a) for a in args.argv),
        "elapsed_s": elapsed,
        "git": git_revision(),
        "timing": asdict(args.timing),
        "scale": asdict(args.scale),
        "router_options": {
            **asdict(RouterOptions(args.load_factor, args.load_slack)),
            "source": str(args.lr_source) if args.lr_source else None,
            "alt_source": str(args.alt_source) if args.alt_source else None,
        },
        "targets": {
            "of_oracle": TARGET_FRACTION,
            "follow": TARGET_FOLLOW,
            "max_mean_requests": TARGET_BALANCE,
            "in_flight_vs_oracle": TARGET_IN_FLIGHT,
        },
        "repeat": args.repeat,
        "repeated": repeated,
        "seeds": args.seed_list,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "routing.json", meta, summaries, results)
    write_markdown(args.out / "routing.md", summaries, meta, args.trace_list, args.replica_list)
    if not args.no_plot:
        write_plot(args.out / "routing.png", summaries, args.trace_list, args.replica_list)

    print()
    print(
        md_table(
            ["router", *args.trace_list, "worst max/mean req"],
            compact(summaries, args.trace_list, args.replica_list),
        )
    )
    print()
    print(md_table(TARGET_HEADER, targets(summaries, args.trace_list, args.replica_list)))
    print(f"\n{len(results)} runs in {elapsed / 60:.1f} min; results in {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["serve-replicas"]:
        asyncio.run(serve_replicas(int(raw[1]), Timing(**json.loads(raw[2]))))
        return 0
    if raw[:1] == ["serve-oracle"]:
        asyncio.run(serve_oracle(int(raw[1]), raw[2:]))
        return 0
    args = parse_args(raw)
    args.argv = raw
    if args.from_json is not None:
        command = "python bench/routing.py " + " ".join(shlex.quote(a) for a in raw)
        meta, runs = load_json(args.from_json, args.trace_list, args.replica_list, command)
        summaries = aggregate(runs)
        traces = [t for t in TRACES if any(r.trace == t for r in summaries)]
        counts = sorted({r.replicas for r in summaries})
        args.out.mkdir(parents=True, exist_ok=True)
        out_json = args.out / "routing.json"
        if out_json.resolve() not in {p.resolve() for p in args.from_json}:
            write_json(out_json, meta, summaries, runs)
        write_markdown(args.out / "routing.md", summaries, meta, traces, counts)
        written = "routing.md"
        if not args.no_plot:
            write_plot(args.out / "routing.png", summaries, traces, counts)
            written += " and routing.png"
        sources = ", ".join(map(str, args.from_json))
        print(f"{written} rewritten in {args.out} from {sources}")
        return 0
    return asyncio.run(bench_main(args))


if __name__ == "__main__":
    sys.exit(main())
