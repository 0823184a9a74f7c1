"""RL's clock: routers judged by how long a GRPO group waits for its slowest sample, in front
of emulated replicas that batch continuously.

    python bench/rl_clock.py                 # the matrix below, 2 interleaved rounds
    python bench/rl_clock.py --quick         # g8 on 4 and 4h replicas, 1 round (about 8 min)
    python bench/rl_clock.py --traces g8 --fleets 4h --loads saturating --rounds 1
    python bench/rl_clock.py --traces multi-turn --fleets 4 --seeds 0,1,2,3 --rounds 1

Replicas: lora_router.emulator with the capacity model of lora_router/emulator/batching.py:
up to `--max-num-seqs` sequences decode together, a step costs `--decode-ms` plus
`--decode-per-seq-ms` for each further decoding sequence, plus `--prefill-us` per uncached
prompt token computed in it (chunks of at most 8,192 tokens a step); a prefix-cache hit skips
its tokens. The defaults are GPU-shaped (a step that grows slowly with the batch, prefill cheap
next to decode: docs/design/capacity-model.md) and slowed down so the emulated fleet fits one
core. A fleet is N replicas (`2`, `4`, `8`), or N with replica 0 at half speed (`4h`: every
cost of replica 0 doubled). They run in one subprocess on core 1; routers and this load
generator on core 0 (bench/routing.py's arrangement); replicas restart empty before every run.

Traces (lora_router/testbed/grpo_trace.py, TRL 1.16's async GRPO worker): S problems per step
(S = 2 N, so every fleet size gets the same work per replica), each sampled G times, a new
adapter version every 2 steps (TRL's weight sync: pause, load, resume, unload v(N-5));
completion lengths log-normal (median 64 tokens, sigma 1, 8 to 512: RL's long tail).
- `g8`, `g16`: single-turn, a 23-token template, G = 8 or 16;
- `long-prompt`: single-turn, G = 8, a 1,500-token shared system prompt;
- `multi-turn`: 3-turn tool rollouts, G = 8, a turn's prompt is the previous prompt, its
  completion and a tool message; pipelined (a new round starts while older rollouts are in
  later turns; a version every 2 rounds, so syncs land during rollouts).
Every contender gets byte-identical requests naming `trl-policy-vN`. Load: `light` keeps
N x `--max-num-seqs` / 4 requests in flight, `saturating` 2 N x `--max-num-seqs` (a replica's
batch full and as many waiting). A later turn goes once its parent has answered.

Steps: a training run is hundreds of steps with a bounded number of rollouts in flight (TRL's
async worker), so what a router faces is a steady state: every answer lets one more request
in, placed with the fleet busy. A trace shorter than the cap lets every router place
everything in one burst before any answer returns (the run of 9ff65c7: 192 requests, a cap of
256), which is not that state. So a cell runs the fewest steps (at least `--steps`) whose
requests are at least `STEADY` times its in-flight cap: the cap binds for the first
(STEADY - 1) / STEADY of the sends (`steps_for`). The matrix:
g8 and multi-turn on every fleet at saturating load, g16 and long-prompt on the 4-replica
fleets, and g8 at light load on those (not run whole since the steady state; its g8 and
multi-turn cells on 4 replicas took 31 minutes here; `cells` says how to change it).

Contenders, interleaved round by round so a slow spell of the shared machine hits all:
lora-router's default (`--policy prefix`), vllm-router 0.1.17 `consistent_hash`, `cache_aware`
and `sticky_least_loaded` (every request carries `X-Session-ID: group-F`, the group's id, and
the group is released with `POST /finish_session?session_id=group-F` once its last answer is
in, as prime-rl does), and round robin (lora-router `--policy round-robin`). lora-router gets
the syncs through its own fence; the vLLM routers cannot broadcast, so the bench sends each
sync to every replica itself, as a trainer that drives each server does.

Per run (bench/lib/rl_clock_runs.py): each group's time from its first request's send to its
last answer (p50, p90, max), the step time (the gap between two steps' last groups), accepted
samples per second, the hit rate from the replicas' own /metrics, the groups that more than one
replica answered (*split*: from the replicas' own logs of each request's group), on a fleet
with replica 0 at half speed the groups it answered a request of and the group p90 of the
others (the tail the full-speed replicas set on their own: `slow_share`), and for
lora-router each replica's routing weight at the end and how often it changed (/router/status,
fleet/pace.py). Per cell (trace, fleet, load, contender): medians over the rounds and their
ranges. The issue's targets (#43): on a uniform fleet at saturating load, lora-router's group
p90 at most the best contender's at a hit rate at least 0.99 of the best's; with one replica at
half speed, its group p90 at most 0.9 x the best contender's.

Seeds (`--seeds`): each trace seed is another draw of the workload (prompts, completion
lengths). lora-router's placement is a function of the requests and their order, so its runs of
one seed differ by a few percent, while the other routers' move with timing (the figures:
bench/results/rl-clock/README.md): more rounds of one seed sample their noise, not the
workload, and a ratio on one seed is one draw of which families landed together. A cell with
several seeds runs every seed's rounds; its figures are medians over all its runs, and its
target line gives the ratio seed by seed and how many same-seed pairings of runs meet the
bound (bench/lib/rl_clock_report.py).

Outputs: rl-clock.json (every run, the summaries, the targets, the command) and tables.md in
`--out` (default bench/results/rl-clock; with --quick, a temporary directory). Only 127.0.0.1
is used; every child process is stopped on exit; every request has a timeout (120 s) and
every run a deadline (`--deadline`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
SCRIPT = Path(__file__).resolve()
CLIENT_CPUS = "0"

sys.path.insert(0, str(HERE))  # bench/ modules, run as scripts
from lib.procs import git_revision  # noqa: E402
from lib.rl_clock_report import load_runs, summarize, write_json, write_markdown  # noqa: E402
from lib.rl_clock_runs import (  # noqa: E402
    ClockResult,
    Fleet,
    run_one,
    serve_fleet,
    start_fleet,
    write_adapters,
)
from lib.routing_procs import Contender, ReplicaHost, available  # noqa: E402
from lib.routing_traces import build_workload  # noqa: E402

from lora_router.testbed import grpo_trace  # noqa: E402

CONTENDERS = (
    Contender("lr-prefix", "lora-router prefix (default)", "lora-router", "prefix", False),
    Contender("vllm-ch", "vllm-router consistent_hash", "vllm-router", "consistent_hash", False),
    Contender("vllm-ca", "vllm-router cache_aware", "vllm-router", "cache_aware", False),
    Contender(
        "vllm-sll",
        "vllm-router sticky_least_loaded",
        "vllm-router",
        "sticky_least_loaded",
        False,
        sessions=True,
    ),
    Contender("round-robin", "round robin (lora-router)", "lora-router", "round-robin", False),
    # Not in the default matrix (`--routers`): lora-router given the session header as
    # sticky_least_loaded is (docs/sessions.md), beside it on the same trace.
    Contender(
        "lr-session",
        "lora-router prefix + X-Session-ID",
        "lora-router",
        "prefix",
        False,
        sessions=True,
    ),
    # Not in the default matrix: lora-router without its weights (--no-pace, fleet/pace.py).
    Contender(
        "lr-no-pace",
        "lora-router prefix --no-pace",
        "lora-router",
        "prefix",
        False,
        flags=("--no-pace",),
    ),
)
DEFAULT_ROUTERS = ("lr-prefix", "vllm-ch", "vllm-ca", "vllm-sll", "round-robin")


@dataclass(frozen=True, slots=True)
class Trace:
    group_size: int
    template: int
    turns: int

    def spec(self, replicas: int, steps: int, per_replica: int, seed: int) -> grpo_trace.TraceSpec:
        return grpo_trace.TraceSpec(
            steps=steps,
            prompts_per_step=per_replica * replicas,
            group_size=self.group_size,
            template_tokens=self.template,
            turns=self.turns,
            completion_tokens=(8, 512),
            long_tail=True,
            long_tail_median=64,
            version_every=2,
            pipelined=self.turns > 1,
            seed=seed,
        )


TRACES = {
    "g8": Trace(8, 23, 1),
    "g16": Trace(16, 23, 1),
    "long-prompt": Trace(8, 1500, 1),
    "multi-turn": Trace(8, 23, 3),
}
FLEETS = ("4h", "4", "8", "2")  # N replicas; "h": replica 0 at half speed (run order)
LOADS = ("light", "saturating")


def fleet_of(name: str, args: argparse.Namespace) -> Fleet:
    n = int(name.removesuffix("h"))
    speeds = tuple(0.5 if name.endswith("h") and i == 0 else 1.0 for i in range(n))
    return Fleet(
        replicas=n,
        speeds=speeds,
        prefill_s_per_token=args.prefill_us * 1e-6,
        decode_s_per_token=args.decode_ms * 1e-3,
        decode_s_per_seq=args.decode_per_seq_ms * 1e-3,
        max_num_seqs=args.max_num_seqs,
    )


def fleet_label(name: str) -> str:
    n = name.removesuffix("h")
    return f"{n}, replica 0 at half speed" if name.endswith("h") else f"{n} uniform"


def in_flight(load: str, replicas: int, max_num_seqs: int) -> int:
    if load == "light":
        return max(1, replicas * max_num_seqs // 4)
    return 2 * replicas * max_num_seqs


# A cell's requests are at least this many times its in-flight cap (module docstring, Steps).
STEADY = 4


def steps_for(trace: Trace, replicas: int, args: argparse.Namespace, cap: int) -> int:
    """The fewest steps, at least --steps, whose requests are at least STEADY x `cap`."""
    per_step = args.problems_per_replica * replicas * trace.group_size * trace.turns
    return max(args.steps, -(-STEADY * cap // per_step))


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--traces", default=",".join(TRACES), help="of: " + ", ".join(TRACES))
    p.add_argument("--fleets", default=",".join(FLEETS), help="of: " + ", ".join(FLEETS))
    p.add_argument("--loads", default=",".join(LOADS), help="of: " + ", ".join(LOADS))
    p.add_argument(
        "--light-cells",
        default="g8",
        help="the traces run at light load too (light load runs only on the 4 and 4h fleets)",
    )
    p.add_argument(
        "--every-fleet",
        default="g8,multi-turn",
        help="the traces run on every fleet (the others only on the 4 and 4h fleets)",
    )
    p.add_argument(
        "--routers",
        default=",".join(DEFAULT_ROUTERS),
        help="of: " + ", ".join(c.key for c in CONTENDERS),
    )
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds per cell")
    p.add_argument("--quick", action="store_true", help="g8 on 4 and 4h replicas, 1 round")
    p.add_argument(
        "--steps", type=int, default=3, help="the fewest steps a cell runs (`steps_for`)"
    )
    p.add_argument("--problems-per-replica", type=int, default=2, help="S / N per step")
    p.add_argument(
        "--seeds", default="0", help="trace seeds, comma-separated: each cell runs every one"
    )
    p.add_argument("--decode-ms", type=float, default=12.0, help="a step decoding one sequence")
    p.add_argument(
        "--decode-per-seq-ms", type=float, default=0.25, help="each further decoding sequence"
    )
    p.add_argument("--prefill-us", type=float, default=2.0, help="per uncached prompt token")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--deadline", type=float, default=300.0, help="seconds a run may last")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--from-json",
        type=Path,
        default=None,
        help="no runs: summarize this rl-clock.json's runs again, into its own directory",
    )
    args = p.parse_args(argv)
    if args.quick:
        args.traces, args.fleets, args.rounds = "g8", "4h,4", 1
    if args.out is None:
        quick = Path(tempfile.mkdtemp(prefix="rl-clock-quick-"))
        args.out = quick if args.quick else HERE / "results" / "rl-clock"
    args.trace_list = [t for t in args.traces.split(",") if t]
    args.fleet_list = [f for f in args.fleets.split(",") if f]
    args.load_list = [x for x in args.loads.split(",") if x]
    args.light_list = [t for t in args.light_cells.split(",") if t]
    args.every_fleet_list = [t for t in args.every_fleet.split(",") if t]
    args.router_list = [r for r in args.routers.split(",") if r]
    unknown = set(args.trace_list) - set(TRACES)
    unknown |= {f for f in args.fleet_list if f.removesuffix("h") not in {"2", "4", "8"}}
    unknown |= set(args.load_list) - set(LOADS)
    unknown |= set(args.router_list) - {c.key for c in CONTENDERS}
    if unknown:
        p.error(f"unknown trace, fleet, load or router: {', '.join(sorted(unknown))}")
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    try:
        args.seed_list = [int(s) for s in args.seeds.split(",") if s]
    except ValueError:
        p.error(f"--seeds takes integers, comma-separated: {args.seeds!r}")
    if not args.seed_list or len(set(args.seed_list)) != len(args.seed_list):
        p.error("--seeds needs at least one seed, each once")
    return args


def cells(args: argparse.Namespace) -> list[tuple[str, str, str]]:
    """(fleet, trace, load) in run order. On the 2- and 8-replica fleets only the
    --every-fleet traces run, and light load only for the --light-cells traces on the
    4-replica fleets: the matrix stays within an hour."""
    out = []
    for fleet in args.fleet_list:
        four = fleet.removesuffix("h") == "4"
        for trace in args.trace_list:
            if not four and trace not in args.every_fleet_list:
                continue
            for load in args.load_list:
                if load == "light" and (trace not in args.light_list or not four):
                    continue
                out.append((fleet, trace, load))
    return out


def one_line(r: ClockResult) -> str:
    if r.status != "ok":
        return r.status
    return (
        f"group p50 {r.group_p50_s:6.2f} p90 {r.group_p90_s:6.2f} max {r.group_max_s:6.2f} s  "
        f"step {r.step_s:5.2f} s  {r.samples_per_s:6.1f} samples/s  hit {r.hit_rate:.3f}  "
        f"failed {r.failed}"
    )


def write_results(args: argparse.Namespace, results: list[ClockResult], elapsed: float) -> None:
    """rl-clock.json and tables.md in --out, from the runs so far (rewritten after every cell,
    so an interrupted matrix keeps what it measured)."""
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python bench/rl_clock.py " + " ".join(shlex.quote(a) for a in args.argv),
        "elapsed_s": round(elapsed, 1),
        "git": git_revision(),
        "replica_model": {
            "decode_s_per_token": args.decode_ms * 1e-3,
            "decode_s_per_seq": args.decode_per_seq_ms * 1e-3,
            "prefill_s_per_token": args.prefill_us * 1e-6,
            "max_num_seqs": args.max_num_seqs,
        },
        "trace": {
            "min_steps": args.steps,
            "steady": STEADY,
            "problems_per_replica": args.problems_per_replica,
            "seeds": args.seed_list,
            "shapes": {k: asdict(v) for k, v in TRACES.items() if k in args.trace_list},
        },
        "rounds": args.rounds,
    }
    summaries = summarize(results)
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "rl-clock.json", meta, summaries, results)
    write_markdown(args.out / "tables.md", meta, summaries)


@dataclass(frozen=True, slots=True)
class Cell:
    fleet_name: str
    fleet: Fleet
    trace_name: str
    load: str


async def run_cell(
    args: argparse.Namespace,
    host: ReplicaHost,
    cell: Cell,
    contenders: list[Contender],
    workdir: Path,
) -> list[ClockResult]:
    """One cell's runs: for each trace seed its workload, then the rounds, the contenders
    interleaved in each."""
    trace, fleet = TRACES[cell.trace_name], cell.fleet
    cap = in_flight(cell.load, fleet.replicas, args.max_num_seqs)
    steps = steps_for(trace, fleet.replicas, args, cap)
    adapters = workdir / "adapters"
    log_name = f"{cell.fleet_name}-{cell.trace_name}-{cell.load}.log"
    labels = (cell.trace_name, fleet_label(cell.fleet_name), cell.load)
    tag = f"{cell.fleet_name:3} {cell.trace_name:11} {cell.load:10}"
    results = []
    for seed in args.seed_list:
        spec = trace.spec(fleet.replicas, steps, args.problems_per_replica, seed)
        write_adapters(adapters, spec.versions)
        items = build_workload(spec, base=False)
        for round_ in range(args.rounds):
            for c in contenders:
                result = ClockResult(*labels, c.key, c.label, round_, seed)
                await run_one(
                    host,
                    c,
                    items,
                    result,
                    cap,
                    spec.prompts_per_step,
                    adapters,
                    workdir / f"{c.key}-{log_name}",
                    args.deadline,
                    fleet.slow,
                )
                results.append(result)
                print(f"{tag} {c.key:11} seed {seed} #{round_ + 1} {one_line(result)}", flush=True)
    return results


async def bench_main(args: argparse.Namespace) -> int:
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {int(CLIENT_CPUS)})
    started = time.perf_counter()
    contenders = [c for c in CONTENDERS if c.key in args.router_list]
    missing = [c.key for c in contenders if not available(c)]
    if missing:
        print(f"not installed: {', '.join(missing)} (pip install -e '.[bench]')", file=sys.stderr)
        return 2
    workdir = Path(tempfile.mkdtemp(prefix="lora-router-rl-clock-"))
    plan = cells(args)
    results: list[ClockResult] = []
    try:
        by_fleet: dict[str, list[tuple[str, str]]] = {}
        for planned_fleet, planned_trace, planned_load in plan:
            by_fleet.setdefault(planned_fleet, []).append((planned_trace, planned_load))
        for fleet_name, fleet_cells in by_fleet.items():
            fleet = fleet_of(fleet_name, args)
            with open(workdir / f"fleet-{fleet_name}.log", "ab") as log:
                host = await start_fleet(SCRIPT, fleet, log)
            try:
                for trace_name, load in fleet_cells:
                    cell = Cell(fleet_name, fleet, trace_name, load)
                    results += await run_cell(args, host, cell, contenders, workdir)
                    write_results(args, results, time.perf_counter() - started)
            finally:
                await host.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    write_results(args, results, time.perf_counter() - started)
    elapsed = time.perf_counter() - started
    print(f"\n{len(results)} runs in {elapsed / 60:.1f} min; results in {args.out}")
    print((args.out / "tables.md").read_text())
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["serve-fleet"]:
        asyncio.run(serve_fleet(json.loads(raw[1])))
        return 0
    args = parse_args(raw)
    args.argv = raw
    if args.from_json is not None:
        meta, runs = load_runs(args.from_json)
        summaries = summarize(runs)
        write_json(args.from_json, meta, summaries, runs)
        write_markdown(args.from_json.parent / "tables.md", meta, summaries)
        print(f"summaries rewritten in {args.from_json.parent}")
        return 0
    return asyncio.run(bench_main(args))


if __name__ == "__main__":
    sys.exit(main())
