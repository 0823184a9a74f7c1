"""bench/replay.py and bench/routing.py's report, run as a user runs them (never imported: bench
and tests share code only through lora_router/testbed/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
# A real run's meta (the machine, the timing model, the scale) for the report's header.
META = ROOT / "bench" / "results" / "routing-seeds" / "runs" / "n2" / "routing.json"


def bench(script: str, *args: str) -> None:
    command = [sys.executable, str(ROOT / "bench" / script), *args]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def replayed(tmp: Path, trace: str, n: int, routers: str) -> dict[str, dict[str, Any]]:
    """Each router's figures of one replay of `trace` at `n` replicas, trace seed 0."""
    out = tmp / f"{trace}-{n}.json"
    bench(
        "replay.py",
        "--traces",
        trace,
        "--replicas",
        str(n),
        "--routers",
        routers,
        "--json",
        f"{out}",
    )
    return {o["router"]: o for o in json.loads(out.read_text())}


@pytest.fixture(scope="module")
def multi_turn(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return replayed(tmp_path_factory.mktemp("replay"), "multi-turn", 2, "oracle;prefix")


def test_the_oracle_serves_every_request_once_with_every_later_turn_on_its_parent(multi_turn):
    oracle = multi_turn["oracle"]
    assert sum(oracle["per_replica"]) == oracle["requests"] > 0
    assert oracle["later"] and oracle["followed"] == oracle["later"]
    assert oracle["max_mean_requests"] == 1.0


def test_the_replayed_oracle_reproduces_the_benchs_modelled_makespan(tmp_path):
    # bench/results/archive/routing-spill/: 6.396 s in every wall run of long-tail at 3 replicas.
    oracle = replayed(tmp_path, "long-tail", 3, "oracle")["oracle"]
    assert round(oracle["makespan"], 3) == 6.396


def test_the_policy_reaches_the_oracles_hit_rate_on_the_multi_turn_trace(multi_turn):
    oracle, prefix = multi_turn["oracle"], multi_turn["prefix"]
    assert prefix["hit_rate"] >= 0.995 * oracle["hit_rate"]
    assert prefix["followed"] == prefix["later"] and prefix["spills"] == 0


def report(tmp: Path, runs: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """routing.json's summaries and routing.md, as `routing.py --from-json` writes them."""
    tmp.mkdir(exist_ok=True)
    source = tmp / "runs.json"
    meta = json.loads(META.read_text())["meta"]
    source.write_text(json.dumps({"meta": meta, "runs": runs}))
    out = tmp / "report"
    traces = ("--traces", "single-turn", "--replicas", "2", "--no-plot", "--out", str(out))
    bench("routing.py", "--from-json", str(source), *traces)
    return json.loads((out / "routing.json").read_text()), (out / "routing.md").read_text()


def run(contender: str, seed: int, wall: float, **figures: Any) -> dict[str, Any]:
    mode = "base" if contender.endswith("-base") else "lora"
    common = {"trace": "single-turn", "replicas": 2, "label": contender, "mode": mode}
    return {**common, "contender": contender, "seed": seed, "wall_s": wall, **figures}


def test_a_summary_shows_the_median_makespan_of_its_runs_not_the_middle_walls(tmp_path):
    # The trace seed decides how evenly the work falls, so the run with the median wall time
    # may have any makespan of the group; the summary reports the median of the makespans.
    runs = [
        run("lr-prefix-base", s, w, per_replica_busy_s=b, hit_rate=0.5)
        for s, w, b in [(0, 3.0, [1.0, 1.9]), (1, 2.0, [1.5, 1.4]), (2, 1.0, [1.6, 1.7])]
    ]
    runs += [run("oracle-base", s, 1.0, hit_rate=0.5) for s in range(3)]
    data, _ = report(tmp_path, runs)
    (summary,) = [s for s in data["summaries"] if s["contender"] == "lr-prefix-base"]
    assert summary["wall_s"] == 2.0  # the middle run by wall time: makespan 1.5
    assert summary["median_makespan_s"] == 1.7


def test_in_flight_balance_is_held_to_the_oracles_worst_over_the_same_seeds(tmp_path):
    # Seed 0 spreads the work unevenly for every router: our worst (1.20, on seed 0) is within
    # 10 % of the oracle's worst there (1.12), not of its run with the median wall time (1.04).
    def runs(ours: float) -> list[dict[str, Any]]:
        figures = {"hit_rate": 0.5, "of_oracle": 1.0, "max_mean_requests": 1.0}
        balances = [("oracle-base", [1.12, 1.04, 1.04]), ("lr-prefix-base", [ours, 1.05, 1.05])]
        return [
            run(contender, seed, seed + 1.0, in_flight_balance=balance, **figures)
            for contender, flights in balances
            for seed, balance in enumerate(flights)
        ]

    _, held = report(tmp_path / "held", runs(1.20))
    (row,) = [line for line in held.splitlines() if "1.20 / 1.12" in line]
    assert "✓in-flight" in row
    _, missed = report(tmp_path / "missed", runs(1.24))  # above 1.1 x 1.12
    (row,) = [line for line in missed.splitlines() if "1.24 / 1.12" in line]
    assert "✗in-flight" in row
