"""RL's clock (bench/rl_clock.py): per-cell summaries over the rounds, the issue's targets
(#43), and the JSON and markdown they are written to."""

from __future__ import annotations

import json
import statistics
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .rl_clock_runs import ClockResult

DEFAULT = "lr-prefix"  # lora-router's default policy: the contender the targets judge
# lora-router's own other runs (not contenders the targets compare it with).
OURS = {DEFAULT, "lr-session", "lr-no-pace"}
HIT_FRACTION = 0.99  # uniform fleet, saturating load: hit rate >= this x the best contender's
SLOW_FLEET_P90 = 0.9  # one replica at half speed: group p90 <= this x the best contender's


@dataclass(slots=True)
class Summary:
    """One contender in one cell (trace, fleet, load): medians over its rounds."""

    trace: str
    fleet: str
    load: str
    contender: str
    label: str
    rounds: int  # complete runs: every request answered (the figures are theirs)
    failed: int  # requests, over every round
    incomplete: int  # runs with a failed request, left out of the figures
    group_p50_s: float
    group_p90_s: float
    group_max_s: float
    step_s: float
    samples_per_s: float
    hit_rate: float
    # Each complete run's group p90 by its trace seed (a JSON key: the seed as text).
    group_p90_by_seed: dict[str, list[float]] = field(default_factory=dict)
    per_replica_requests: list[int] = field(default_factory=list)  # the median round's
    # lora-router's routing weights at the median round's end, and how often each changed.
    weights: list[float] = field(default_factory=list)
    weight_changes: list[int] = field(default_factory=list)
    sync_max_s: float = 0.0  # the longest weight sync of a run (ClockResult.sync_max_s)
    split_groups: float | None = None  # ClockResult.split_groups; None: not counted
    # ClockResult.slow_groups and rest_p90_s (rl_clock_runs.slow_share); None: a uniform fleet,
    # or runs recorded before they were counted.
    slow_groups: float | None = None
    rest_p90_s: float | None = None


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 4)


def summarize(results: list[ClockResult]) -> list[Summary]:
    """Medians over each contender's complete runs in each cell (a run where a request failed
    measured another workload, so it only counts as `incomplete`)."""
    cells: dict[tuple[str, str, str, str], list[ClockResult]] = {}
    for r in results:
        cells.setdefault((r.trace, r.fleet, r.load, r.contender), []).append(r)
    out = []
    for (trace, fleet, load, contender), every in cells.items():
        runs = [r for r in every if r.status == "ok" and r.failed == 0]
        if not runs:
            continue
        p90s = [r.group_p90_s for r in runs]
        by_seed: dict[str, list[float]] = {}
        for r in runs:
            by_seed.setdefault(str(r.seed), []).append(r.group_p90_s)
        middle = sorted(runs, key=lambda r: r.group_p90_s)[len(runs) // 2]
        split = [r.split_groups for r in runs if r.split_groups is not None]
        slow = [r.slow_groups for r in runs if r.slow_groups is not None]
        rest = [r.rest_p90_s for r in runs if r.rest_p90_s is not None]
        out.append(
            Summary(
                trace,
                fleet,
                load,
                contender,
                runs[0].label,
                len(runs),
                sum(r.failed for r in every),
                len(every) - len(runs),
                _median([r.group_p50_s for r in runs]),
                _median(p90s),
                _median([r.group_max_s for r in runs]),
                _median([r.step_s for r in runs]),
                _median([r.samples_per_s for r in runs]),
                _median([r.hit_rate for r in runs]),
                by_seed,
                middle.per_replica_requests,
                middle.weights,
                middle.weight_changes,
                _median([r.sync_max_s for r in runs]),
                _median(split) if split else None,
                _median(slow) if slow else None,
                _median(rest) if rest else None,
            )
        )
    return out


def by_cell(summaries: list[Summary]) -> dict[tuple[str, str, str], list[Summary]]:
    cells: dict[tuple[str, str, str], list[Summary]] = {}
    for s in summaries:
        cells.setdefault((s.trace, s.fleet, s.load), []).append(s)
    return cells


def _pairs(ours: Summary, best: Summary, factor: float) -> list[int]:
    """Of every pairing of one of our runs with one of the best other's on the same seed, how
    many meet the p90 bound (ours <= factor x theirs), and how many there are: how far the
    medians' verdict holds against the runs' spread on a shared, noisy machine."""
    theirs = best.group_p90_by_seed
    runs = [
        (o, b)
        for seed, mine in ours.group_p90_by_seed.items()
        for o in mine
        for b in theirs.get(seed, [])
    ]
    return [sum(o <= factor * b for o, b in runs), len(runs)]


def _seed_ratios(ours: Summary, best: Summary) -> dict[str, float]:
    """Seed by seed, our median p90 over the best other's (seeds both ran)."""
    theirs = best.group_p90_by_seed
    return {
        seed: round(statistics.median(mine) / statistics.median(theirs[seed]), 3)
        for seed, mine in ours.group_p90_by_seed.items()
        if theirs.get(seed)
    }


def target(cell: tuple[str, str, str], rows: list[Summary]) -> dict[str, Any] | None:
    """The issue's target for a cell where one applies: saturating load on a uniform fleet
    (p90 and hit rate), or any load with a replica at half speed (p90 against 0.9 x best).
    Judged on the medians; `run_pairs` says in how many run pairings the p90 bound holds."""
    _, fleet, load = cell
    ours = next((s for s in rows if s.contender == DEFAULT), None)
    others = [s for s in rows if s.contender not in OURS]
    if ours is None or not others:
        return None
    best = min(others, key=lambda s: s.group_p90_s)
    best_hit = max(s.hit_rate for s in others)
    if "half speed" in fleet:
        bound = SLOW_FLEET_P90 * best.group_p90_s
        return {
            "kind": "half speed",
            "ours_p90_s": ours.group_p90_s,
            "best": best.contender,
            "best_p90_s": best.group_p90_s,
            "ratio": round(ours.group_p90_s / best.group_p90_s, 3),
            "met": ours.group_p90_s <= bound,
            "run_pairs": _pairs(ours, best, SLOW_FLEET_P90),
            "seed_ratios": _seed_ratios(ours, best),
            # lora-router's group p90 over the groups no slower replica answered, over the best
            # other's p90 (rl_clock_runs.slow_share): above the bound, placing the slow
            # replica's groups better cannot meet it alone.
            "rest_ratio": (
                round(ours.rest_p90_s / best.group_p90_s, 3)
                if ours.rest_p90_s is not None
                else None
            ),
        }
    if load != "saturating":
        return None
    return {
        "kind": "uniform, saturating",
        "ours_p90_s": ours.group_p90_s,
        "best": best.contender,
        "best_p90_s": best.group_p90_s,
        "ratio": round(ours.group_p90_s / best.group_p90_s, 3),
        "hit_fraction": round(ours.hit_rate / best_hit, 4) if best_hit else None,
        "met": ours.group_p90_s <= best.group_p90_s and ours.hit_rate >= HIT_FRACTION * best_hit,
        "run_pairs": _pairs(ours, best, 1.0),
        "seed_ratios": _seed_ratios(ours, best),
    }


def load_runs(path: Path) -> tuple[dict[str, Any], list[ClockResult]]:
    """The meta and the runs of an rl-clock.json (to summarize them again)."""
    doc = json.loads(path.read_text())
    return doc["meta"], [ClockResult(**run) for run in doc["runs"]]


def write_json(
    path: Path, meta: dict[str, Any], summaries: list[Summary], results: list[ClockResult]
) -> None:
    targets = [
        {"trace": c[0], "fleet": c[1], "load": c[2], **t}
        for c, rows in by_cell(summaries).items()
        if (t := target(c, rows)) is not None
    ]
    doc = {
        "meta": meta,
        "targets": targets,
        "summaries": [asdict(s) for s in summaries],
        "runs": [asdict(r) for r in results],
    }
    path.write_text(json.dumps(doc, indent=1) + "\n")


def write_markdown(path: Path, meta: dict[str, Any], summaries: list[Summary]) -> None:
    listed = meta.get("trace", {}).get("seeds")  # runs before `--seeds` name one seed
    seeds = f" per trace seed, seeds {', '.join(map(str, listed))}" if listed else ""
    lines = [
        f"Command: `{meta['command']}` ({meta['date']}, git {meta['git']}, "
        f"{meta['rounds']} rounds{seeds}, {meta['elapsed_s'] / 60:.0f} min).",
        "",
        "Per cell: medians over each router's complete runs (every request answered); group p90 "
        "range = its min and max over them (over every seed's runs). A target is judged on the "
        "medians; the pairings count each of lora-router's runs against each of the best "
        "other's on the same trace seed.",
        "",
    ]
    for cell, rows in by_cell(summaries).items():
        trace, fleet, load = cell
        lines += [
            f"### {trace}, {fleet}, {load} load",
            "",
            "| router | group p50 s | group p90 s (range) | group max s | step s | samples/s "
            "| hit rate | split groups | longest sync s | requests per replica | complete runs "
            "| failed requests |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        for s in sorted(rows, key=lambda s: s.group_p90_s):
            every = [p for runs in s.group_p90_by_seed.values() for p in runs]
            low, high = min(every), max(every)
            split = "-" if s.split_groups is None else f"{s.split_groups:g}"
            lines.append(
                f"| {s.label} | {s.group_p50_s:.2f} | {s.group_p90_s:.2f} ({low:.2f}-{high:.2f}) "
                f"| {s.group_max_s:.2f} | {s.step_s:.2f} | {s.samples_per_s:.1f} "
                f"| {s.hit_rate:.3f} | {split} | {s.sync_max_s:.2f} "
                f"| {' '.join(map(str, s.per_replica_requests))} "
                f"| {s.rounds} of {s.rounds + s.incomplete} | {s.failed} |"
            )
        ours = next((s for s in rows if s.contender == DEFAULT and s.weights), None)
        if ours is not None:
            weights = " ".join(f"{w:g}" for w in ours.weights)
            changes = " ".join(map(str, ours.weight_changes))
            lines += ["", f"{ours.label}: weights at the end {weights}, changed {changes} times."]
        shares = [s for s in sorted(rows, key=lambda s: s.group_p90_s) if s.rest_p90_s is not None]
        if shares:
            each = "; ".join(
                f"{s.label} {s.slow_groups:g} groups, the rest's p90 {s.rest_p90_s:.2f} s"
                for s in shares
            )
            lines += ["", f"Groups the slower replica answered a request of: {each}."]
        t = target(cell, rows)
        if t is not None:
            verdict = "met" if t["met"] else "NOT met"
            extra = f", hit rate {t['hit_fraction']} of the best" if "hit_fraction" in t else ""
            met, pairs = t["run_pairs"]
            seeds = t["seed_ratios"]
            per_seed = (
                "; seed by seed: " + ", ".join(f"{k} {v:.2f}x" for k, v in seeds.items())
                if len(seeds) > 1
                else ""
            )
            rest = (
                f" The groups no slower replica answered had a p90 {t['rest_ratio']:.2f}x the "
                "best other's."
                if t.get("rest_ratio") is not None
                else ""
            )
            lines.append("")
            lines.append(
                f"Target ({t['kind']}): {verdict}: lora-router's p90 {t['ours_p90_s']:.2f} s is "
                f"{t['ratio']:.2f}x the best other ({t['best']}, {t['best_p90_s']:.2f} s){extra}; "
                f"its p90 bound holds in {met} of {pairs} pairings of their runs "
                f"(same seed){per_seed}.{rest}"
            )
        lines.append("")
    path.write_text("\n".join(lines))
