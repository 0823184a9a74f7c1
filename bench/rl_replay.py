"""RL's clock in simulated time: bench/rl_clock.py's cells replayed through the routing policy
object itself in front of modelled batching replicas, noise-free, so that placement rules can be
compared on each GRPO group's wait for its slowest sample where the shared machine's wall clock
moves by several percent.

    python bench/rl_replay.py --traces g8 --fleets 4h --seeds 0-3
    python bench/rl_replay.py --traces g8,g16,long-prompt,multi-turn --fleets 4h,4 --seeds 0-3 \\
        --routers 'prefix;prefix:load_slack=8;round-robin;least-loaded' --out /tmp/rl-replay
    python bench/rl_replay.py --fleets 4h --policy-module cand=/tmp/cand.py \\
        --routers 'prefix;cand;cand:slack=4'
    python bench/rl_replay.py --traces g8,multi-turn --fleets 4h --seeds 0-3 \\
        --wall bench/results/rl-clock/standing/half-4h/rl-clock.json   # sim / wall per cell

What is modelled, and from where (bench/lib/rl_sim.py holds the loop):
- the workload: rl_clock's own. Its `TRACES` (g8, g16, long-prompt, multi-turn), `fleet_of`
  (`2`, `4`, `8`; `h`: replica 0 at speed 0.5), `in_flight` (light: N x max_num_seqs / 4,
  saturating: 2 N x max_num_seqs), `steps_for` and the same flags and defaults (--steps,
  --problems-per-replica, --decode-ms, --decode-per-seq-ms, --prefill-us, --max-num-seqs),
  built by bench/lib/routing_traces.py's `build_workload` (adapter names `trl-policy-vN`);
- the client: rl_clock_runs.py's `Rollouts` over routing_runs.py's `drive`: the lowest-indexed
  eligible item first, at most the cap in flight, a later turn eligible once its parent
  answered, v1 live before the clock starts, and before the first item naming a new version
  its sync: every replica paused (keep mode) for `--sync-ms`, the sends held as long, then the
  unload of v(N-5), which lora-router's fence holds until every request naming it is answered
  (fleet/fence.py `drain`): the client sends nothing more until then, as TRL awaits the sync;
- a replica: lora_router/emulator/engine.py's scheduling in simulated time over its own pure
  parts: admission by `scheduler.Scheduler` (max_num_seqs; max_loras = MAX_STALENESS + 2 as
  rl_clock sets it, adapter = version), at admission the prompt looked up in and registered
  with the emulator's `PrefixCache` (4,096 blocks, rl_clock's `Fleet.cache_blocks`; block hashes
  under the adapter's extra keys, name and path, as vLLM 0.32 and the emulator do, so versions
  share no block), steps planned by `batching.plan_step` (8,192-token budget, chunked prefill)
  and timed by `batching.StepCosts` (with the replica's speed), planned back to back up to
  engine.py's 2 ms and "slept" as one; a step's outputs are seen at its chunk's end, the next
  chunk is planned before the finished sequences leave the batch and the waiting ones are
  admitted (the order of `Engine._step_loop` and the woken sequences), so a freed slot is used
  one step later, as on the emulator; a finished sample's output blocks are cached
  (`Engine._cache_output`, with the emulator's own generated tokens, `tokens.generate`);
  paused, no step runs and a sample that finished answers only at resume (`_freeze`);
  the inter-token latency each step observes is `batching.InterTokenLatency`'s;
- the router: the policy object (`prefix`: `PrefixAffinity` with its defaults, or given any of
  its keyword arguments, `prefix:load_slack=8`; `round-robin`, `least-loaded`:
  `make_policy`'s `KeyBlind` ones), keyed as proxy/routed.py keys a completion
  (`keys.completion_key` under the adapter lineage's seeds: the prompt's JSON text and ids,
  16-token blocks), with the in-flight counts and `Decision.tokens` that fleet/fleet.py's
  `started` / `finished` keep, from the send to the answer. Weights (`--weights`): `pace`
  (the default) runs fleet/pace.py's `PaceRule` itself on simulated scrapes, every
  `--health-interval` from the router's start, `--router-lead-s` before the first send (the
  router starts, is ready, v1 is synced; telemetry's first round is a baseline, so the first
  sample and judgement come one interval after start: 1.8 s into the run by default), each
  replica's sample the change of its inter-token-latency sum and count, the seconds paused in
  the interval as telemetry counts them; `fixed` sets each replica's speed in sixteenths
  (8 for half speed) through `set_weight` at that first judgement; `none` never sets one.
- late binding, a router design screened (`--late home|any`, bench/lib/rl_sim.py's
  `SimSettings.late`): the router holds each request until a replica has room for its
  weight's share of max_num_seqs, instead of sending it at once;
- hedging, a router design screened (`--hedge-s 0,3`: every router without and with it, as
  `NAME hedge 3 s`; bench/lib/rl_sim.py's `SimSettings.hedge_s`): a request still unanswered on
  a replica below full weight that long after its send gets one copy on a full-weight
  replica, the first answer kept; the copy is the same sample (`--hedge-length same`, a seeded
  request reproduced) or another one (`fresh`, single-turn traces only), and the run's
  `length_ratio` (its answers' completion tokens over the trace's) shows which samples it kept;
  a replica's requests then count the copies;
- a candidate rule without editing lora_router: `--policy-module NAME=path.py` imports the
  file (once, before any run: it may also monkeypatch lora_router.routing.policy) and a router
  `NAME` or `NAME:key=value,...` calls its `make_policy(**options)`, which returns an object with
  the policy contract (routing/contract.py `Policy`: `choose`, `set_members`, `load_changed`,
  `set_weight`, `counts`), e.g. a `PrefixAffinity` subclass.

Not modelled: the HTTP and event-loop time of a request beyond `--overhead-ms` (a fixed time
per request, half before the replica has it, half after its answer), the emulator's late
wake-ups (on one core for the fleet; engine.py keeps its steps' clock, so only a wake-up later
than 2 ms loses time), the sync's own HTTP calls (in `--sync-ms`), adapter loads (free on
rl_clock's emulated replicas), the vLLM routers (compare them on the wall clock), retries and
failures (every request answers), the pace rule's `busy_share` and stale rule inputs beyond
what scrapes give it.

Figures per run (rl_clock_runs.py's definitions and functions): group p50 / p90 / max (first
send to last answer), step time, hit rate (the replicas' prefix-cache hits over queries, in
tokens), requests per replica, split groups, on a fleet with a slow replica the groups it
answered a request of and the p90 of the others (`slow_share`), each replica's weight at the
end and its changes. `--out DIR` writes rl-replay.json (every run) and tables.md. `--wall
FILE` (rl_clock's rl-clock.json, repeatable) adds sim / wall per cell and seed for the routers
both have (lr-prefix: prefix; round-robin). Deterministic: a run's figures depend only on its
inputs (even across PYTHONHASHSEED). A 4-replica cell (about 1,000 requests, 25 simulated
seconds) replays in about 0.15 s per router, an 8-replica one in about 0.5 s.

Validation (bench/results/rl-replay/validation*/tables.md, `--wall` against rl_clock's committed
runs, seeds 0-3 on 4h and 4, 4-7 on 4, 0-3 on 2h and 8h): per cell, the median over seeds of
sim / wall is within 0.96-1.03 for the group p90 and p50 and within 0.996-1.003 for the hit
rate, lora-router and round robin alike; single runs within 0.87-1.12 for the p90, 0.90-1.05
for the p50 (the wall clock's own spread), with no `--overhead-ms` (4 ms moves no cell by more
than 1.7 %: groups last seconds).
`--sync-ms` 5: a sync without an unload took 7 ms on the wall clock (g16's `sync_max_s`).
The weight: the pace rule sets replica 0 of an `h` fleet to 8 at its first judgement and
never moves it in the sim (the wall clock moved it back in one multi-turn run in 16).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import rl_clock  # noqa: E402
from lib.rl_clock_runs import (  # noqa: E402
    ClockResult,
    clock_figures,
    group_spans,
    slow_share,
    split_groups,
)
from lib.rl_sim import (  # noqa: E402
    SimRequest,
    SimSettings,
    policy_weights,
    sim_requests,
    simulate,
)
from lib.routing_traces import build_workload  # noqa: E402

from lora_router.routing.policy import PolicyParams, PrefixAffinity, make_policy  # noqa: E402
from lora_router.testbed import grpo_trace  # noqa: E402

WALL_NAMES = {"lr-prefix": "prefix", "round-robin": "round-robin"}  # rl_clock -> sim router


@dataclass(slots=True)
class ReplayResult(ClockResult):
    """A replayed run: rl_clock's figures and the hedge's (`--hedge-s`)."""

    hedges: int = 0  # copies the hedge sent
    hedges_won: int = 0  # requests whose copy answered first
    # The answers' completion tokens over the trace's own: below 1, the hedge kept the shorter
    # of two samples, a length bias in what the trainer learns from.
    length_ratio: float = 1.0


def options_of(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in (o for o in text.split(",") if o):
        k, _, v = part.partition("=")
        try:
            out[k] = int(v)
        except ValueError:
            out[k] = float(v)
    return out


def load_module(name: str, path: str) -> Any:
    spec = importlib.util.spec_from_file_location(f"rl_replay_policy_{name}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not hasattr(module, "make_policy"):
        raise SystemExit(f"{path} has no make_policy(**options)")
    return module


def routers(spec: str, modules: dict[str, Any]) -> dict[str, Callable[[], Any]]:
    """`name` or `name:key=value,...`, ';'-separated (module docstring)."""
    out: dict[str, Callable[[], Any]] = {}
    for part in (p for p in spec.split(";") if p):
        name, _, opts = part.partition(":")
        options = options_of(opts)
        if name == "prefix":
            out[part] = partial(PrefixAffinity, **options)
        elif name in ("round-robin", "least-loaded"):
            out[part] = partial(make_policy, name, PolicyParams())
        elif name in modules:
            out[part] = partial(modules[name].make_policy, **options)
        else:
            raise SystemExit(f"unknown router {name!r}")
    return out


def seeds_of(text: str) -> list[int]:
    out: list[int] = []
    for part in (p for p in text.split(",") if p):
        low, _, high = part.partition("-")
        out += range(int(low), int(high or low) + 1)
    return out


def run_cell(
    args: argparse.Namespace,
    fleet_name: str,
    trace_name: str,
    load: str,
    seed: int,
    makers: dict[str, tuple[Callable[[], Any], float]],
) -> list[ReplayResult]:
    trace = rl_clock.TRACES[trace_name]
    fleet = rl_clock.fleet_of(fleet_name, args)
    cap = rl_clock.in_flight(load, fleet.replicas, args.max_num_seqs)
    steps = rl_clock.steps_for(trace, fleet.replicas, args, cap)
    spec = trace.spec(fleet.replicas, steps, args.problems_per_replica, seed)
    items = build_workload(spec, base=False)
    reqs = sim_requests(items)
    settings = SimSettings(
        cap=cap,
        overhead_s=args.overhead_ms / 1e3,
        sync_s=args.sync_ms / 1e3,
        weights=args.weights,
        health_interval=args.health_interval,
        router_lead_s=args.router_lead_s,
        late=args.late,
    )
    redraw = None
    if args.hedge_length == "fresh":

        def redraw(req: SimRequest) -> int:
            return grpo_trace.completion_length(random.Random(f"{seed}:hedge:{req.index}"), spec)

    out = []
    for name, (make, hedge_s) in makers.items():
        started = time.perf_counter()
        sim = simulate(reqs, fleet, make(), replace(settings, hedge_s=hedge_s), redraw)
        result = ReplayResult(
            trace_name, rl_clock.fleet_label(fleet_name), load, name, "sim", 0, seed
        )
        result.requests = len(items)
        result.wall_s = round(sim.end, 3)
        spans = group_spans(items, sim.outcomes)  # type: ignore[arg-type]
        families = [r.families for r in sim.replicas]
        result.per_replica_requests = [len(f) for f in families]
        result.split_groups = split_groups(families)
        if fleet.slow:
            result.slow_groups, result.rest_p90_s = slow_share(spans, families, fleet.slow)
        queries = sum(r.cache.queries for r in sim.replicas)
        hits = sum(r.cache.hits for r in sim.replicas)
        result.hit_rate = round(hits / queries, 4) if queries else 0.0
        result.syncs = sim.syncs
        result.sync_max_s = round(max((b - a for a, b in sim.sync_log), default=0.0), 3)
        result.weights, result.weight_changes = policy_weights(sim)
        clock_figures(result, spans, items, sim.outcomes, spec.prompts_per_step)  # type: ignore[arg-type]
        result.hedges, result.hedges_won = sim.hedges, sim.hedges_won
        result.length_ratio = round(
            sum(sim.accepted_lengths.values()) / sum(r.length for r in reqs), 4
        )
        out.append(result)
        print(
            f"{fleet_name:3} {trace_name:11} {load:10} seed {seed} {name:24} "
            f"p50 {result.group_p50_s:6.3f} p90 {result.group_p90_s:6.3f} "
            f"max {result.group_max_s:6.3f} hit {result.hit_rate:.4f} "
            f"req {result.per_replica_requests} slow {result.slow_groups} "
            f"rest-p90 {result.rest_p90_s} split {result.split_groups} "
            f"w {result.weights} set {[(round(t, 2), n, w) for t, n, w in sim.weight_log]} "
            f"sync-max {result.sync_max_s} end {result.wall_s} "
            f"hedged {result.hedges} won {result.hedges_won} length {result.length_ratio} "
            f"({time.perf_counter() - started:.1f} s)",
            flush=True,
        )
        if args.slowest:
            print(slowest(spans, sim.replicas, args.slowest), flush=True)
    return out


def slowest(spans: dict[int, tuple[float, float]], replicas: Sequence[Any], k: int) -> str:
    """The `k` slowest groups of a run, slowest first: span, first send, replicas."""
    where: dict[int, set[int]] = {}
    for replica in replicas:
        for family in replica.families:
            where.setdefault(family, set()).add(replica.index)
    ranked = sorted(spans.items(), key=lambda kv: kv[1][0] - kv[1][1])[:k]
    return "\n".join(
        f"    group {g:4}: {end - start:7.3f} s from {start:7.3f} s on {sorted(where.get(g, ()))}"
        for g, (start, end) in ranked
    )


def _med(values: Sequence[float | None]) -> str:
    vs = [v for v in values if v is not None]
    return f"{statistics.median(vs):.3f}" if vs else "—"


def _span(values: Sequence[float]) -> str:
    if not values:
        return "—"
    return f"{statistics.median(values):.4f} [{min(values):.4f}-{max(values):.4f}]"


def table(results: list[ReplayResult], names: Sequence[str]) -> list[str]:
    """One row per (trace, fleet, load, router): medians over the seeds, and the group p90
    as a ratio to the first router's, seed by seed; with hedging, its medians too."""
    hedging = any(r.hedges for r in results)
    rows = [
        "| trace | fleet | load | router | seeds | group p50 | p90 | max | p90 / "
        f"{names[0]}'s, median [min-max] | hit | requests per replica | slow groups "
        "| rest p90 | split |" + (" hedges | won | length ratio |" if hedging else ""),
        "|" + "---|" * (17 if hedging else 14),
    ]
    keyed = {(r.trace, r.fleet, r.load, r.seed, r.contender): r for r in results}
    cells = list(dict.fromkeys((r.trace, r.fleet, r.load) for r in results))
    for cell in cells:
        for name in names:
            mine = [
                r for r in results if (r.trace, r.fleet, r.load) == cell and r.contender == name
            ]
            if not mine:
                continue
            ratios = [
                r.group_p90_s / ref.group_p90_s
                for r in mine
                if (ref := keyed.get((*cell, r.seed, names[0]))) is not None
            ]
            per_replica = [
                round(statistics.median(col))
                for col in zip(*(r.per_replica_requests for r in mine), strict=True)
            ]
            rows.append(
                f"| {cell[0]} | {cell[1]} | {cell[2]} | {name} | {len(mine)} "
                f"| {_med([r.group_p50_s for r in mine])} | {_med([r.group_p90_s for r in mine])} "
                f"| {_med([r.group_max_s for r in mine])} | {_span(ratios)} "
                f"| {statistics.median(r.hit_rate for r in mine):.4f} | {per_replica} "
                f"| {_med([r.slow_groups for r in mine])} | {_med([r.rest_p90_s for r in mine])} "
                f"| {_med([r.split_groups for r in mine])} |"
                + (
                    f" {_med([r.hedges for r in mine])} | {_med([r.hedges_won for r in mine])} "
                    f"| {statistics.median(r.length_ratio for r in mine):.4f} |"
                    if hedging
                    else ""
                )
            )
    return rows


def wall_table(results: list[ReplayResult], walls: list[Path]) -> list[str]:
    """sim / wall per cell and seed: group p50, p90, hit rate, for the routers both have."""
    wall_runs: dict[tuple[str, str, str, int, str], dict[str, Any]] = {}
    for path in walls:
        for run in json.loads(path.read_text())["runs"]:
            name = WALL_NAMES.get(run["contender"])
            if name is not None and run["status"] == "ok":
                key = (run["trace"], run["fleet"], run["load"], run["seed"], name)
                wall_runs.setdefault(key, run)  # the first file's run of a cell and seed
    rows = [
        "| trace | fleet | router | seed | group p90 sim | wall | sim / wall "
        "| group p50 sim / wall | hit sim | wall | sim / wall | slow groups sim / wall "
        "| req/replica sim | wall |",
        "|" + "---|" * 14,
    ]
    cells: dict[tuple[str, str, str], list[tuple[float, float, float]]] = {}
    for r in results:
        wall = wall_runs.get((r.trace, r.fleet, r.load, r.seed, r.contender))
        if wall is None:
            continue
        p90 = r.group_p90_s / wall["group_p90_s"]
        p50 = r.group_p50_s / wall["group_p50_s"]
        hit = r.hit_rate / wall["hit_rate"]
        cells.setdefault((r.trace, r.fleet, r.contender), []).append((p90, p50, hit))
        rows.append(
            f"| {r.trace} | {r.fleet} | {r.contender} | {r.seed} | {r.group_p90_s:.3f} "
            f"| {wall['group_p90_s']:.3f} | {p90:.3f} | {p50:.3f} | {r.hit_rate:.4f} "
            f"| {wall['hit_rate']:.4f} | {hit:.3f} | {r.slow_groups} / {wall.get('slow_groups')} "
            f"| {r.per_replica_requests} | {wall['per_replica_requests']} |"
        )
    rows += [
        "",
        "| trace | fleet | router | seeds | p90 sim / wall, median [min-max] | p50 sim / wall "
        "| hit sim / wall |",
        "|" + "---|" * 7,
    ]
    for (trace, fleet, name), got in cells.items():
        rows.append(
            f"| {trace} | {fleet} | {name} | {len(got)} | {_span([g[0] for g in got])} "
            f"| {_span([g[1] for g in got])} | {_span([g[2] for g in got])} |"
        )
    return rows


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--traces", default="g8", help="of: " + ", ".join(rl_clock.TRACES))
    p.add_argument("--fleets", default="4h", help="of: 2, 4, 8, 2h, 4h, 8h")
    p.add_argument("--loads", default="saturating", help="of: light, saturating")
    p.add_argument("--seeds", default="0", help="trace seeds: 0-3, or 0,2,5")
    p.add_argument(
        "--routers",
        default="prefix;round-robin;least-loaded",
        help="';'-separated: prefix[:option=value,...] (PrefixAffinity's keyword arguments), "
        "round-robin, least-loaded, or a --policy-module NAME[:option=value,...]",
    )
    p.add_argument(
        "--policy-module",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a file whose make_policy(**options) builds router NAME (repeatable)",
    )
    # rl_clock's knobs, with its defaults (rl_clock.parse_args).
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--problems-per-replica", type=int, default=2)
    p.add_argument("--decode-ms", type=float, default=12.0)
    p.add_argument("--decode-per-seq-ms", type=float, default=0.25)
    p.add_argument("--prefill-us", type=float, default=2.0)
    p.add_argument("--max-num-seqs", type=int, default=32)
    # The sim's own.
    p.add_argument(
        "--overhead-ms", type=float, default=0.0, help="per request: HTTP and event loop"
    )
    p.add_argument("--sync-ms", type=float, default=5.0, help="a weight sync's pause")
    p.add_argument("--weights", choices=("pace", "fixed", "none"), default="pace")
    p.add_argument("--health-interval", type=float, default=2.0)
    p.add_argument(
        "--router-lead-s", type=float, default=0.2, help="router start before the first send"
    )
    p.add_argument(
        "--late",
        choices=("", "any", "home"),
        default="",
        help="late binding, a design screened (bench/lib/rl_sim.py's SimSettings.late)",
    )
    p.add_argument(
        "--hedge-s",
        default="0",
        help="hedging, a design screened: a request on a slow replica still unanswered this long "
        "after its send gets a copy on a full-weight replica (bench/lib/rl_sim.py SimSettings); "
        "'0,3': every router without and with it",
    )
    p.add_argument(
        "--hedge-length",
        choices=("same", "fresh"),
        default="same",
        help="a hedge copy's completion: the same sample (seeded) or a fresh draw (unseeded)",
    )
    p.add_argument(
        "--slowest",
        type=int,
        default=0,
        help="print each run's K slowest groups: their span, first send and replicas",
    )
    p.add_argument("--wall", type=Path, action="append", default=[], help="an rl-clock.json")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    args.trace_list = [t for t in args.traces.split(",") if t]
    args.fleet_list = [f for f in args.fleets.split(",") if f]
    args.load_list = [x for x in args.loads.split(",") if x]
    bad = set(args.trace_list) - set(rl_clock.TRACES)
    bad |= {f for f in args.fleet_list if f.removesuffix("h") not in {"2", "4", "8"}}
    bad |= set(args.load_list) - set(rl_clock.LOADS)
    if bad:
        p.error(f"unknown trace, fleet or load: {', '.join(sorted(bad))}")
    args.seed_list = seeds_of(args.seeds)
    args.hedge_list = [float(h) for h in args.hedge_s.split(",") if h]
    if args.hedge_length == "fresh" and any(rl_clock.TRACES[t].turns > 1 for t in args.trace_list):
        p.error("--hedge-length fresh: a later turn's prompt holds its parent's completion")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    modules = {}
    for entry in args.policy_module:
        name, _, path = entry.partition("=")
        modules[name] = load_module(name, path)
    makers = {
        name if hedge_s == 0 else f"{name} hedge {hedge_s:g} s": (make, hedge_s)
        for name, make in routers(args.routers, modules).items()
        for hedge_s in args.hedge_list
    }
    results: list[ReplayResult] = []
    timings = []
    for fleet_name in args.fleet_list:
        for trace_name in args.trace_list:
            for load in args.load_list:
                for seed in args.seed_list:
                    started = time.perf_counter()
                    results += run_cell(args, fleet_name, trace_name, load, seed, makers)
                    timings.append(time.perf_counter() - started)
    command = "python bench/rl_replay.py " + " ".join(shlex.quote(a) for a in raw)
    text = "\n".join(table(results, list(makers)))
    if args.wall:
        text += "\n\nsim / wall (" + ", ".join(str(w) for w in args.wall) + "):\n\n"
        text += "\n".join(wall_table(results, args.wall))
    print(text)
    print(
        f"\n{len(timings)} cells x {len(makers)} routers in {sum(timings):.1f} s "
        f"(a cell with every router: median {statistics.median(timings):.1f} s)"
    )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        settings = {
            k: getattr(args, k)
            for k in (
                "overhead_ms",
                "sync_ms",
                "weights",
                "health_interval",
                "router_lead_s",
                "late",
                "hedge_list",
                "hedge_length",
                "decode_ms",
                "decode_per_seq_ms",
                "prefill_us",
                "max_num_seqs",
                "steps",
                "problems_per_replica",
            )
        }
        payload = {
            "command": command,
            "settings": settings,
            "runs": [asdict(r) for r in results],
        }
        (args.out / "rl-replay.json").write_text(json.dumps(payload, indent=1) + "\n")
        (args.out / "tables.md").write_text(f"`{command}`\n\n{text}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
