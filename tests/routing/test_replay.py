"""bench/replay.py: the noise-free replay that evaluates placement rules before wall runs."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

_BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(_BENCH))
_spec = importlib.util.spec_from_file_location("bench_replay", _BENCH / "replay.py")
assert _spec is not None and _spec.loader is not None
replay = importlib.util.module_from_spec(_spec)
sys.modules["bench_replay"] = replay  # dataclasses look their module up by name
_spec.loader.exec_module(replay)
from lib import routing_report, routing_runs  # noqa: E402

ARGS = argparse.Namespace(timing=replay.traces.Timing(), overhead_ms=3.0, decode_scale=1.3)


def run(trace: str, n: int, make):
    reqs = replay.requests_of(trace, n, 0, ARGS.timing)
    return reqs, replay.measure("x", trace, n, 0, reqs, make, ARGS)


def test_the_oracle_serves_every_request_once_with_every_later_turn_on_its_parent():
    reqs, out = run("multi-turn", 2, replay.OracleRouter)
    assert sum(out.per_replica) == len(reqs)
    assert out.later and out.followed == out.later
    assert out.max_mean_requests == 1.0


def test_the_replayed_oracle_reproduces_the_benchs_modelled_makespan():
    # bench/results/archive/routing-spill/: 6.396 s in every wall run of long-tail at 3 replicas.
    _, out = run("long-tail", 3, replay.OracleRouter)
    assert round(out.makespan, 3) == 6.396


def test_the_policy_reaches_the_oracles_hit_rate_on_the_multi_turn_trace():
    _, oracle = run("multi-turn", 2, replay.OracleRouter)
    _, prefix = run("multi-turn", 2, replay.PrefixRouter)
    assert prefix.hit_rate >= 0.995 * oracle.hit_rate
    assert prefix.followed == prefix.later and prefix.spills == 0


def test_a_summary_shows_the_median_makespan_of_its_runs_not_the_middle_walls():
    # The trace seed decides how evenly the work falls, so the run with the median wall time
    # may have any makespan of the group; the summary reports the median of the makespans.
    runs = [
        routing_runs.RunResult("t", 2, "c", "c", "base", seed=s, wall_s=w, per_replica_busy_s=b)
        for s, w, b in [(0, 3.0, [1.0, 1.9]), (1, 2.0, [1.5, 1.4]), (2, 1.0, [1.6, 1.7])]
    ]
    (summary,) = routing_report.aggregate(runs)
    assert summary.wall_s == 2.0  # the middle run by wall time: makespan 1.5
    assert summary.makespan_s == 1.7


def test_in_flight_balance_is_held_to_the_oracles_worst_over_the_same_seeds():
    # Seed 0 spreads the work unevenly for every router: our worst (1.20, on seed 0) is within
    # 10 % of the oracle's worst there (1.12), not of its run with the median wall time (1.04).
    def result(contender: str, seed: int, wall: float, flight: float):
        return routing_runs.RunResult(
            "t",
            2,
            contender,
            contender,
            "base",
            seed=seed,
            wall_s=wall,
            hit_rate=0.5,
            in_flight_balance=flight,
            max_mean_requests=1.0,
        )

    runs = [
        result("oracle-base", 0, 1.0, 1.12),
        result("oracle-base", 1, 2.0, 1.04),
        result("oracle-base", 2, 3.0, 1.04),
        result("lr-prefix-base", 0, 1.0, 1.20),
        result("lr-prefix-base", 1, 2.0, 1.05),
        result("lr-prefix-base", 2, 3.0, 1.05),
    ]
    routing_report.fill_oracle_fractions(runs)
    (row,) = routing_report.targets(routing_report.aggregate(runs), ["t"], [2])
    assert "1.20 / 1.12" in row and "✓in-flight" in row[-1]
    runs[3].in_flight_balance = 1.24  # above 1.1 x 1.12
    (row,) = routing_report.targets(routing_report.aggregate(runs), ["t"], [2])
    assert "✗in-flight" in row[-1]
