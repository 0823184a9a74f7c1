"""bench/rl_replay.py run as a user runs it (never imported: bench and tests share code only
through lora_router/testbed/): deterministic, and its routers place as they should."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def replayed(out: Path, *extra: str) -> list[dict[str, Any]]:
    command = [
        sys.executable,
        str(ROOT / "bench" / "rl_replay.py"),
        "--traces",
        "g8",
        "--fleets",
        "2h",
        "--routers",
        "prefix;round-robin",
        "--out",
        str(out),
        *extra,
    ]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    runs: list[dict[str, Any]] = json.loads((out / "rl-replay.json").read_text())["runs"]
    return runs


def test_rl_replay_is_deterministic_and_weighs_the_slow_replica(tmp_path: Path) -> None:
    first, second = replayed(tmp_path / "a"), replayed(tmp_path / "b")
    assert first == second
    by_router = {run["contender"]: run for run in first}
    prefix, rr = by_router["prefix"], by_router["round-robin"]
    # The pace rule, fed the simulated scrapes, gives the half-speed replica half a weight.
    assert prefix["weights"] == [0.5, 1.0]
    assert rr["per_replica_requests"] == [rr["requests"] // 2] * 2
    assert 0 < rr["hit_rate"] < prefix["hit_rate"] < 1
    assert prefix["group_p90_s"] < rr["group_p90_s"]


def test_a_hedge_copies_requests_off_the_slow_replica_and_keeps_one_answer(tmp_path: Path) -> None:
    plain = replayed(tmp_path / "plain")
    same = replayed(tmp_path / "same", "--hedge-s", "0,1")
    fresh = replayed(tmp_path / "fresh", "--hedge-s", "1", "--hedge-length", "fresh")
    by_router = {run["contender"]: run for run in same}
    # Without a hedge the run is today's, to the figure.
    assert by_router["prefix"] == next(r for r in plain if r["contender"] == "prefix")
    hedged = by_router["prefix hedge 1 s"]
    assert hedged["hedges"] > 0 and 0 < hedged["hedges_won"] <= hedged["hedges"]
    # Every request answered once; the replicas also received the copies.
    assert hedged["groups"] == by_router["prefix"]["groups"]
    assert sum(hedged["per_replica_requests"]) == hedged["requests"] + hedged["hedges"]
    # Round robin gives no replica a lower weight, so nothing is hedged.
    assert by_router["round-robin hedge 1 s"]["hedges"] == 0
    # The same sample keeps the trace's lengths; another one keeps the shorter of two.
    assert hedged["length_ratio"] == 1.0
    fresh_prefix = next(r for r in fresh if r["contender"] == "prefix hedge 1 s")
    assert fresh_prefix["hedges_won"] > 0 and fresh_prefix["length_ratio"] < 1.0
