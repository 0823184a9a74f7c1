"""bench/rl_replay.py run as a user runs it (never imported: bench and tests share code only
through lora_router/testbed/): deterministic, and its routers place as they should."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def replayed(out: Path) -> list[dict[str, Any]]:
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
