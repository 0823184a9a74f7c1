"""A noise-free replay of bench/routing.py's traces: the routing policy object itself in front
of N modelled replicas, in simulated time, so that placement rules are compared free of the
machine's noise and across trace seeds before any wall-clock run.

    python bench/replay.py --traces long-tail --replicas 3,8 --seeds 0-9
    python bench/replay.py --routers 'oracle;prefix;prefix:load_slack=8' --seeds 0-5 \\
        --overhead-ms 3 --decode-scale 1.3 --out /tmp/replay.md

What is modelled, and from where:
- the workload: bench/routing.py's own (`build_workload` of `trace_spec(trace, n, Scale(seed))`,
  base-model names), the same token ids, completions and parent links;
- the client: bench/lib/routing_runs.py's `Run.replay` — at most 64 N requests in flight, the
  lowest-indexed eligible request first, a later turn eligible once its parent answered;
- a replica: lora_router.emulator's engine with `max_num_seqs` 1 — a FIFO server; at the start
  of service the prompt is looked up in and inserted into the emulator's own `PrefixCache`
  (same block hashes, same LRU capacity), service takes uncached prompt tokens x prefill cost
  + generated tokens x decode cost x `--decode-scale` + `--overhead-ms` (what the emulator's
  2 ms sleep steps and the HTTP round trip add on the real bench), and the output's blocks are
  cached at the end, as `Engine._cache_output` does;
- the routers: `prefix` is `lora_router.routing.policy.PrefixAffinity` with its defaults, fed
  the keys the router builds (`keys.completion_key` under base-model seeds) and the in-flight
  counts and prompt tokens the fleet keeps (`Fleet.started` / `finished`, with each decision's
  `Decision.tokens`), given any of
  `PrefixAffinity`'s keyword arguments (`prefix:load_slack=8`; a candidate rule under test adds
  its own, e.g. `queue_tokens` of bench/results/archive/routing-spill/'s patch, kept by git:
  `git show 515a94e:bench/results/archive/routing-spill/queue-spill.patch`);
  `oracle` is bench/routing.py's oracle (families dealt round robin in arrival order, pinned).
  The peers are not modelled: an approximation of vllm-router's
  cache_aware (its balance thresholds, a block set per replica for its tree) reached 0.959 of
  the oracle's hit rate where the real one reaches 0.995-0.997, so its figures would mislead;
  compare with peers on the wall-clock bench.

Figures per run (the same definitions as bench/routing.py): hit rate (tokens) and its fraction
of the oracle's; later turns on their previous turn's replica; spills (the policy's counts);
max/mean requests; time-weighted in-flight max/mean; makespan (the busiest replica's modelled
service time without the overhead); end (the simulated wall time, with it). Pure computation,
no sockets; a 3-replica long-tail trace replays in about a second.
"""

from __future__ import annotations

import argparse
import heapq
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import orjson

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from lib import routing_traces as traces  # noqa: E402
from lib.rl_sim import Prompt  # noqa: E402
from lib.routing_runs import in_flight_balance, max_mean  # noqa: E402

from lora_router.emulator.prefix_cache import PrefixCache, block_hashes  # noqa: E402
from lora_router.routing.keys import Lineages, completion_key  # noqa: E402
from lora_router.routing.policy import Candidates, PrefixAffinity  # noqa: E402


class SimReplica:
    """A modelled replica as a policy reads it (`Replica`): counts kept by the replay."""

    __slots__ = ("busy", "cache", "free_at", "in_flight", "in_flight_tokens", "name", "served")

    def __init__(self, name: str, timing: traces.Timing) -> None:
        self.name = name
        self.in_flight = 0
        self.in_flight_tokens = 0
        self.cache = PrefixCache(timing.block_size, timing.cache_blocks)
        self.free_at = 0.0  # when the FIFO server finishes what it holds
        self.busy = 0.0  # modelled service time, without the overhead
        self.served = 0


@dataclass(slots=True)
class Request:
    index: int
    family: int
    turn: int
    parent: int | None
    prompt: list[int]
    hashes: list[int]
    generated: list[int]  # what the replica generates (the next turn's history holds it)
    length: int  # completion tokens


@dataclass(slots=True)
class Outcome:
    router: str
    trace: str
    replicas: int
    seed: int
    requests: int = 0
    hit_rate: float = 0.0
    of_oracle: float = 0.0
    later: int = 0
    followed: int = 0
    spills: int = 0
    max_mean_requests: float = 0.0
    in_flight: float = 0.0
    makespan: float = 0.0
    end: float = 0.0
    per_replica: list[int] = field(default_factory=list)

    @property
    def follow(self) -> float | None:
        """Later turns on their parent's replica, spills excepted (bench/routing.py's rule)."""
        if not self.later:
            return None
        elsewhere = self.later - self.followed
        return (self.later - elsewhere + min(self.spills, elsewhere)) / self.later


def requests_of(trace: str, n: int, seed: int, timing: traces.Timing) -> list[Request]:
    spec = traces.trace_spec(trace, n, traces.Scale(seed=seed))
    out = []
    for item in traces.build_workload(spec, base=True):
        body = orjson.loads(item.body)
        prompt = body["prompt"]
        out.append(
            Request(
                item.index,
                item.family,
                item.turn,
                item.parent,
                prompt,
                block_hashes(prompt, timing.block_size),
                item.expected or [],
                body["max_tokens"],
            )
        )
    return out


class Router:
    """What the replay asks of a router: a replica for each request, told of load changes."""

    def route(self, req: Request, routable: Candidates[SimReplica]) -> tuple[SimReplica, int]:
        """The replica and the prompt tokens to count in its `in_flight_tokens`."""
        raise NotImplementedError

    def changed(self, replica: SimReplica) -> None:
        pass

    def spills(self) -> int:
        return 0


class PrefixRouter(Router):
    """lora-router's policy, fed what the router feeds it (module docstring)."""

    def __init__(self, **options: Any) -> None:
        self.policy = PrefixAffinity(**options)
        self.seeds = Lineages().seeds(traces.MODEL, False)
        self.block = traces.Timing().block_size
        self.started = False

    def route(self, req: Request, routable: Candidates[SimReplica]) -> tuple[SimReplica, int]:
        if not self.started:
            self.policy.set_members(routable)
            self.started = True
        key = completion_key(Prompt(orjson.dumps(req.prompt), req.prompt), self.seeds, self.block)
        decision = self.policy.choose(key, routable)
        return decision.replica, decision.tokens  # as the fleet counts it (`Fleet.started`)

    def changed(self, replica: SimReplica) -> None:
        self.policy.load_changed(replica)

    def spills(self) -> int:
        return self.policy.counts.spill


class OracleRouter(Router):
    """bench/routing.py's oracle: families dealt round robin in arrival order, pinned."""

    def __init__(self) -> None:
        self.homes: dict[int, int] = {}

    def route(self, req: Request, routable: Candidates[SimReplica]) -> tuple[SimReplica, int]:
        home = self.homes.setdefault(req.family, len(self.homes) % len(routable))
        return routable[home], len(req.prompt)


def replay(
    reqs: list[Request],
    n: int,
    router: Router,
    timing: traces.Timing,
    overhead_s: float,
    decode_scale: float,
) -> tuple[list[int], list[SimReplica], list[tuple[float, float, int]], float]:
    """Replay `reqs` through `router` to n modelled replicas; returns each request's replica,
    the replicas, the (sent, answered, replica) intervals and the end time."""
    replicas = [SimReplica(f"replica-{i}", timing) for i in range(n)]
    routable: Candidates[SimReplica] = Candidates(replicas)
    cap = traces.Scale().in_flight_per_replica * n
    children: dict[int, list[int]] = {}
    ready: list[int] = []
    for r in reqs:
        if r.parent is None:
            ready.append(r.index)
        else:
            children.setdefault(r.parent, []).append(r.index)
    heapq.heapify(ready)
    placed = [-1] * len(reqs)
    charged = [0] * len(reqs)  # the prompt tokens counted in its replica's in_flight_tokens
    intervals: list[tuple[float, float, int]] = []
    done: list[tuple[float, int]] = []  # (answer time, request) of requests in flight
    now = 0.0
    while ready or done:
        while ready and routable.in_flight < cap:
            req = reqs[heapq.heappop(ready)]
            rep, charged[req.index] = router.route(req, routable)
            placed[req.index] = int(rep.name.rsplit("-", 1)[1])
            rep.in_flight += 1
            rep.in_flight_tokens += charged[req.index]
            routable.in_flight += 1
            router.changed(rep)
            # FIFO, one sequence at a time: the prompt is looked up when its service starts,
            # which in a FIFO is determined now (the cache changes only at service starts and
            # ends; looking it up here, in service order, is the same as at the start).
            start = max(now, rep.free_at)
            cached = rep.cache.lookup(req.hashes, len(req.prompt))
            rep.cache.insert(req.hashes)
            service = (len(req.prompt) - cached) * timing.prefill_s_per_token
            service += req.length * timing.decode_s_per_token * decode_scale
            rep.busy += (len(req.prompt) - cached) * timing.prefill_s_per_token
            rep.busy += req.length * timing.decode_s_per_token
            rep.free_at = start + service + overhead_s
            rep.served += 1
            if len(req.generated) > timing.block_size:
                computed = req.prompt + req.generated[:-1]
                rep.cache.insert(block_hashes(computed, timing.block_size))
            intervals.append((now, rep.free_at, placed[req.index]))
            heapq.heappush(done, (rep.free_at, req.index))
        if not done:
            break
        now, index = heapq.heappop(done)
        rep = replicas[placed[index]]
        rep.in_flight -= 1
        rep.in_flight_tokens -= charged[index]
        routable.in_flight -= 1
        router.changed(rep)
        for child in children.get(index, ()):
            heapq.heappush(ready, child)
    return placed, replicas, intervals, now


def measure(
    name: str,
    trace: str,
    n: int,
    seed: int,
    reqs: list[Request],
    make: Callable[[], Router],
    args: argparse.Namespace,
) -> Outcome:
    router = make()
    placed, replicas, intervals, end = replay(
        reqs, n, router, args.timing, args.overhead_ms / 1e3, args.decode_scale
    )
    out = Outcome(name, trace, n, seed, requests=len(reqs))
    queries = sum(r.cache.queries for r in replicas)
    out.hit_rate = sum(r.cache.hits for r in replicas) / queries if queries else 0.0
    for r in reqs:
        if r.parent is not None:
            out.later += 1
            out.followed += placed[r.index] == placed[r.parent]
    out.spills = router.spills()
    out.per_replica = [r.served for r in replicas]
    out.max_mean_requests = max_mean(out.per_replica)
    out.in_flight = in_flight_balance(intervals, n)
    out.makespan = max(r.busy for r in replicas)
    out.end = end
    return out


def routers(spec: str) -> dict[str, Callable[[], Router]]:
    """`name` or `name:key=value,...` (PrefixAffinity options for `prefix`)."""
    out: dict[str, Callable[[], Router]] = {}
    for part in spec.split(";"):
        name, _, opts = part.partition(":")
        options = {
            k: int(v) if v.isdigit() else float(v)
            for k, v in (o.split("=") for o in opts.split(",") if o)
        }
        if name == "oracle":
            out[part] = OracleRouter
        elif name == "prefix":
            out[part] = partial(PrefixRouter, **options)
        else:
            raise SystemExit(f"unknown router {name!r}")
    return out


def table(outcomes: list[Outcome], names: Sequence[str]) -> list[str]:
    """One row per (trace, N, router): medians and worsts over the seeds."""
    rows = [
        "| trace | N | router | of oracle, worst [median] | turns followed, worst "
        "| spills (sum) | max/mean req, worst | in flight / oracle's, median (worst) "
        "| makespan / oracle's, median [min-max] | end / oracle's, median [min-max] |",
        "|" + "---|" * 10,
    ]
    keyed = {(o.trace, o.replicas, o.seed, o.router): o for o in outcomes}
    cells = sorted({(o.trace, o.replicas) for o in outcomes}, key=lambda c: (c[0], c[1]))
    for trace, n in cells:
        for name in names:
            mine = [o for o in outcomes if (o.trace, o.replicas, o.router) == (trace, n, name)]
            if not mine:
                continue

            def ratio(o: Outcome, other: str, attr: str) -> float | None:
                ref = keyed.get((o.trace, o.replicas, o.seed, other))
                return getattr(o, attr) / getattr(ref, attr) if ref else None

            def span(values: list[float | None]) -> str:
                vs = [v for v in values if v is not None]
                if not vs:
                    return "—"
                return f"{statistics.median(vs):.4f} [{min(vs):.3f}-{max(vs):.3f}]"

            follows = [f for o in mine if (f := o.follow) is not None]
            inflight = [v for o in mine if (v := ratio(o, "oracle", "in_flight")) is not None]
            # A single-turn trace has no later turns to follow.
            follow = f"| {min(follows):.4f} " if follows else "| — "
            rows.append(
                f"| {trace} | {n} | {name} "
                f"| {min(o.of_oracle for o in mine):.4f} "
                f"[{statistics.median(o.of_oracle for o in mine):.4f}] "
                + follow
                + f"| {sum(o.spills for o in mine)} "
                f"| {max(o.max_mean_requests for o in mine):.3f} "
                + (
                    f"| {statistics.median(inflight):.3f} ({max(inflight):.3f}) "
                    if inflight
                    else "| — "
                )
                + f"| {span([ratio(o, 'oracle', 'makespan') for o in mine])} "
                f"| {span([ratio(o, 'oracle', 'end') for o in mine])} |"
            )
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--traces", default=",".join(traces.TRACES))
    p.add_argument("--replicas", default="2,3,8")
    p.add_argument(
        "--routers",
        default="oracle;prefix",
        help="';'-separated: oracle, prefix[:option=value,...] (PrefixAffinity's keyword "
        "arguments, e.g. prefix:load_slack=8)",
    )
    p.add_argument("--seeds", default="0", help="trace seeds, e.g. 0-9")
    p.add_argument("--overhead-ms", type=float, default=3.0, help="per request, modelled")
    p.add_argument("--decode-scale", type=float, default=1.3, help="decode time x the model")
    p.add_argument("--out", type=Path, default=None, help="write the table here (markdown)")
    p.add_argument(
        "--json", type=Path, default=None, help="write every run's figures here (Outcome's fields)"
    )
    args = p.parse_args(argv)
    args.timing = traces.Timing()
    names = list(routers(args.routers))
    makers = routers(args.routers)
    if "oracle" not in makers:
        makers = {"oracle": OracleRouter, **makers}
    outcomes: list[Outcome] = []
    for trace in [t for t in args.traces.split(",") if t]:
        for n in [int(x) for x in args.replicas.split(",") if x]:
            for seed in traces.seeds_of(args.seeds):
                reqs = requests_of(trace, n, seed, args.timing)
                got = {
                    name: measure(name, trace, n, seed, reqs, make, args)
                    for name, make in makers.items()
                }
                for o in got.values():
                    o.of_oracle = o.hit_rate / got["oracle"].hit_rate
                outcomes += got.values()
                print(
                    f"{trace} N={n} seed={seed}: "
                    + "; ".join(
                        f"{k} of={o.of_oracle:.4f} sp={o.spills} mk={o.makespan:.3f} "
                        f"end={o.end:.3f} if={o.in_flight:.3f} mm={o.max_mean_requests:.3f}"
                        for k, o in got.items()
                    ),
                    flush=True,
                )
    rows = table(outcomes, ["oracle", *[k for k in names if k != "oracle"]])
    text = "\n".join(rows)
    print(text)
    if args.out is not None:
        command = "python bench/replay.py " + " ".join(sys.argv[1:] if argv is None else argv)
        args.out.write_text(f"`{command}`\n\n{text}\n")
    if args.json is not None:
        args.json.write_bytes(
            orjson.dumps([asdict(o) for o in outcomes], option=orjson.OPT_INDENT_2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
