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

ARGS = argparse.Namespace(timing=replay.bench.Timing(), overhead_ms=3.0, decode_scale=1.3)


def run(trace: str, n: int, make):
    reqs = replay.requests_of(trace, n, 0, ARGS.timing)
    return reqs, replay.measure("x", trace, n, 0, reqs, make, ARGS)


def test_the_oracle_serves_every_request_once_with_every_later_turn_on_its_parent():
    reqs, out = run("multi-turn", 2, replay.OracleRouter)
    assert sum(out.per_replica) == len(reqs)
    assert out.later and out.followed == out.later
    assert out.max_mean_requests == 1.0


def test_the_replayed_oracle_reproduces_the_benchs_modelled_makespan():
    # bench/results/routing-spill/: 6.396 s in every wall run of long-tail at 3 replicas.
    _, out = run("long-tail", 3, replay.OracleRouter)
    assert round(out.makespan, 3) == 6.396


def test_the_policy_reaches_the_oracles_hit_rate_on_the_multi_turn_trace():
    _, oracle = run("multi-turn", 2, replay.OracleRouter)
    _, prefix = run("multi-turn", 2, replay.PrefixRouter)
    assert prefix.hit_rate >= 0.995 * oracle.hit_rate
    assert prefix.followed == prefix.later and prefix.spills == 0
