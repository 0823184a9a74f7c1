"""The cache-pressure bench's report (bench/cache_pressure.py): medians over rounds with their
ranges, ratios to the prediction taken within a round, the hit rate in windows around the
restart, and a verdict per cell by a stated rule."""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .cache_pressure_run import CacheRun

# The verdict rule for kv against the prediction, per cell (medians of per-round ratios), with
# `band` the run's own noise: the largest distance from 1 of an A/A pair's median makespan
# ratio (a kv contender that made no kv decision applies prefix's rules exactly, so what
# separates it from prefix is timing alone), and at least MARGIN. wins: makespan <= 1 - band and
# hit rate >= 1 - band / 4; loses: makespan >= 1 + band or hit rate <= 1 - band; else ties.
MARGIN = 0.02


def write_json(path: Path, meta: dict[str, Any], results: list[CacheRun]) -> None:
    doc = {"meta": meta, "runs": [r.as_json() for r in results]}
    path.write_text(json.dumps(doc, indent=1) + "\n")


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def _fmt(value: float | None, digits: int = 3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _with_range(values: Sequence[float], digits: int = 3) -> str:
    if not values:
        return "n/a"
    mid = _fmt(_median(values), digits)
    if len(values) == 1:
        return mid
    return f"{mid} [{min(values):.{digits}f} .. {max(values):.{digits}f}]"


def _ok(runs: list[CacheRun]) -> list[CacheRun]:
    return [r for r in runs if r.status == "ok"]


def ratios(
    runs: list[CacheRun], ref_runs: list[CacheRun], value: Callable[[CacheRun], float]
) -> list[float]:
    """value(run) / value(the reference's run of the same round), per round."""
    ref = {r.round: value(r) for r in _ok(ref_runs)}
    return [round(value(r) / ref[r.round], 4) for r in _ok(runs) if ref.get(r.round)]


def accuracy_ratio(r: CacheRun) -> float | None:
    acc = r.accuracy or {}
    predicted, reported = acc.get("predicted_cached_tokens"), acc.get("reported_cached_tokens")
    if not predicted or reported is None:
        return None
    return float(reported) / float(predicted)


def _stream(r: CacheRun, i: int) -> str:
    """Replica i's KV-event stream at the end of a kv run (streams in --replicas order):
    state, gaps, restarts."""
    streams = list(((r.kv_events or {}).get("replicas") or {}).values())
    if i >= len(streams):
        return "?"
    s = streams[i]
    return f"{s.get('state')}, {s.get('gaps')} gap(s), {s.get('restarts')} restart(s)"


def verdict(hit: list[float], makespan: list[float], band: float) -> str:
    h, m = _median(hit), _median(makespan)
    if h is None or m is None:
        return "n/a"
    if m >= 1 + band or h <= 1 - band:
        return "loses"
    if m <= 1 - band and h >= 1 - band / 4:
        return "wins"
    return "ties"


def is_aa(summary: dict[str, Any]) -> bool:
    """A kv contender whose every round made no kv decision: prefix's rules, exactly."""
    return (
        "kv" in summary["contender"]
        and bool(summary["kv_decisions"])
        and not any(summary["kv_decisions"])
    )


def noise_band(summaries: list[dict[str, Any]]) -> float:
    """The run's noise: the largest |1 - median makespan ratio| of its A/A pairs, >= MARGIN."""
    spread = [
        abs(1 - m)
        for s in summaries
        if is_aa(s) and (m := _median(s["makespan_vs_prediction"])) is not None
    ]
    return max([MARGIN, *spread])


def _window_row(runs: list[CacheRun], attr: str) -> list[str]:
    columns: list[list[float]] = []
    for r in _ok(runs):
        for i, v in enumerate(getattr(r, attr)):
            while len(columns) <= i:
                columns.append([])
            if v is not None:
                columns[i].append(v)
    return [_fmt(_median(c), 2) for c in columns]


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    out += ["| " + " | ".join(row) + " |" for row in rows]
    return out


def cell_summary(
    cell_runs: list[CacheRun], reference: dict[bool, str], restarted: int
) -> tuple[list[list[str]], list[dict[str, Any]]]:
    """The cell's table rows and its per-contender summary (for the JSON and the verdicts)."""
    by_key: dict[str, list[CacheRun]] = {}
    for r in cell_runs:
        by_key.setdefault(r.contender, []).append(r)
    rows, summaries = [], []
    for key, runs in by_key.items():
        ok = _ok(runs)
        base = runs[0].mode == "base"
        ref = by_key.get(reference[base], [])
        hit_ratio = ratios(runs, ref, lambda r: r.hit_rate)
        span_ratio = ratios(runs, ref, lambda r: r.makespan_s)
        acc = [a for a in map(accuracy_ratio, ok) if a is not None]
        kinds = [r.routing or {} for r in ok]
        kv = [k.get("kv", 0) for k in kinds]
        fresh = [k.get("fresh", 0) for k in kinds]
        summary = {
            "contender": key,
            "mode": runs[0].mode,
            "runs": len(runs),
            "ok": len(ok),
            "status": sorted({r.status for r in runs if r.status != "ok"}),
            "hit_rate": [r.hit_rate for r in ok],
            "hit_rate_vs_prediction": hit_ratio,
            "makespan_s": [r.makespan_s for r in ok],
            "makespan_vs_prediction": span_ratio,
            "wall_s": [r.wall_s for r in ok],
            "failed": [r.failed for r in ok],
            "reported_over_predicted": acc,
            "kv_decisions": kv,
            "restarted_stream": [_stream(r, restarted) for r in ok if r.kv_events],
            "fresh_decisions": fresh,
        }
        summaries.append(summary)
        rows.append(
            [
                key,
                runs[0].mode,
                _with_range(summary["hit_rate"]),
                _with_range(hit_ratio) if key != reference[base] else "1",
                _with_range(summary["makespan_s"], 2),
                _with_range(span_ratio) if key != reference[base] else "1",
                _with_range(summary["wall_s"], 2),
                "/".join(str(f) for f in summary["failed"]) or "n/a",
                _with_range(acc) if acc else "n/a",
                f"{_median(kv):g} / {_median(fresh):g}" if any(r.routing for r in ok) else "",
                "",  # the verdict, once the run's noise band is known
            ]
        )
        if not ok:
            rows[-1][2] = "; ".join(summary["status"])[:120]
    return rows, summaries


def write_markdown(
    path: Path, meta: dict[str, Any], results: list[CacheRun], reference: dict[bool, str]
) -> None:
    lines = [
        "# Routing under cache pressure",
        "",
        f"Command (from the root of a clone at `{meta['git']}`): `{meta['command']}`"
        + (
            f" (this report rewritten from its JSON at `{meta['report_git']}`: "
            f"`python bench/cache_pressure.py --from-json {path.parent}/cache_pressure.json "
            f"--out {path.parent}`)"
            if meta.get("report_git")
            else ""
        ),
        "",
        f"Date: {meta['date']}; {meta['rounds']} rounds, contenders interleaved (order rotated "
        f"each round); {meta['elapsed_s']} s in all. A shared 2-core machine (load average at "
        f"the end: {', '.join(f'{x:.2f}' for x in meta['load_average'])}): makespan, the "
        "busiest replica's modeled service time, is noise-free; wall time is not.",
        "",
        f"{meta['replicas']} emulated replicas, TRL's rollout slots "
        f"({', '.join(str(c.get('rollout_slots')) for c in meta['cells'][:1])} rollouts at "
        "once); "
        + (
            f"the restart: replica {meta['plan']['restart_replica']} crashes when "
            f"{meta['plan']['restart_at']} of the requests have answered, down "
            f"{meta['plan']['down_s']} s, back empty on its port."
            if meta["plan"]["restart_at"]
            else "no restart (the control)."
        )
        + f" Hit rate in {meta['plan']['windows']} windows of answered requests.",
        "",
    ]
    if meta.get("skipped"):
        lines += [
            "Skipped: " + "; ".join(f"`{k}`: {v}" for k, v in meta["skipped"].items()),
            "",
        ]
    lines += _table(
        [
            "trace",
            "pressure (working set / cache)",
            "cache blocks",
            "working set a replica",
            "requests",
            "prompt tokens",
        ],
        [
            [
                c["trace"],
                f"{c['pressure']:g}",
                str(c["cache_blocks"]),
                str(c["working_set_per_replica"]),
                str(c["requests"]),
                str(c["prompt_tokens"]),
            ]
            for c in meta["cells"]
        ],
    )
    lines += [
        "",
        "Columns: hit rate from the replicas' own counters (median [range] over rounds); "
        "`/ pred.`: the ratio to the prediction (lr-prefix-base, or lr-prefix in LoRA "
        "naming) in the same round, median [range]; makespan in modeled seconds; failed "
        "requests per round; `reported / predicted`: the router's routing_accuracy (cached "
        "tokens vLLM reported over those routing predicted; n/a where the router does not "
        "publish it); `kv / fresh`: lora-router's new-family decisions by the KV index and by "
        "the deal. Verdict (kv against the prediction, medians of the per-round ratios):",
        "BAND_TEXT",
        "",
    ]
    header = [
        "contender",
        "naming",
        "hit rate",
        "hit / pred.",
        "makespan s",
        "makespan / pred.",
        "wall s",
        "failed",
        "reported / predicted",
        "kv / fresh",
        "verdict",
    ]
    summaries: list[dict[str, Any]] = []
    verdicts: list[list[str]] = []
    tables: dict[int, tuple[list[list[str]], list[dict[str, Any]]]] = {}
    for i, cell in enumerate(meta["cells"]):
        cell_runs = [
            r
            for r in results
            if r.trace == cell["trace"] and r.cache_blocks == cell["cache_blocks"]
        ]
        if cell_runs:
            tables[i] = cell_summary(cell_runs, reference, meta["plan"]["restart_replica"])
    band = noise_band([s for _, cs in tables.values() for s in cs])
    for rows, cell_summaries in tables.values():
        for row, s in zip(rows, cell_summaries, strict=True):
            if "kv" not in s["contender"]:
                continue
            s["verdict"] = (
                "A/A: no kv decision"
                if is_aa(s)
                else verdict(s["hit_rate_vs_prediction"], s["makespan_vs_prediction"], band)
            )
            row[-1] = s["verdict"]
    band_text = (
        f"the run's noise band is {band:.3f}: the largest distance from 1 of an A/A pair's "
        "median makespan ratio (a kv contender that made no kv decision applies prefix's "
        f"rules exactly; timing alone separates it from prefix), at least {MARGIN:g}. kv wins "
        f"when the makespan ratio is at most {1 - band:.3f} with the hit-rate ratio at least "
        f"{1 - band / 4:.3f}, loses when the makespan ratio is at least {1 + band:.3f} or the "
        f"hit-rate ratio at most {1 - band:.3f}, else ties."
    )
    lines = [band_text if line == "BAND_TEXT" else line for line in lines]
    for i, cell in enumerate(meta["cells"]):
        cell_runs = [
            r
            for r in results
            if r.trace == cell["trace"] and r.cache_blocks == cell["cache_blocks"]
        ]
        if not cell_runs:
            continue
        title = f"## {cell['trace']}, pressure {cell['pressure']:g} ({cell['cache_blocks']} blocks)"
        rows, cell_summaries = tables[i]
        for s in cell_summaries:
            s.update(trace=cell["trace"], pressure=cell["pressure"])
            if "verdict" in s:
                verdicts.append(
                    [
                        cell["trace"],
                        f"{cell['pressure']:g}",
                        s["contender"],
                        s["verdict"],
                        _fmt(_median(s["hit_rate_vs_prediction"])),
                        _fmt(_median(s["makespan_vs_prediction"])),
                    ]
                )
        summaries += cell_summaries
        lines += [title, "", *_table(header, rows), ""]
        streams = [
            f"`{c['contender']}`: " + "; ".join(c["restarted_stream"])
            for c in cell_summaries
            if c["restarted_stream"]
        ]
        if streams:
            lines += [
                "The restarted replica's KV-event stream at the end of each round: "
                + " / ".join(streams),
                "",
            ]
        windows = max((len(r.window_hit_rate) for r in cell_runs), default=0)
        if windows:
            by_key: dict[str, list[CacheRun]] = {}
            for r in cell_runs:
                by_key.setdefault(r.contender, []).append(r)
            restart = meta["plan"]["restart_at"]
            when = (
                f"the restart after window {round(restart * windows)}"
                if restart
                else "no restart in this run: the control"
            )
            lines += [
                f"Hit rate by window of answered requests (median over rounds; {when}), then "
                f"replica {meta['plan']['restart_replica']}'s (the restarted one's) share of "
                "each window's requests and its own hit rate (from usage):",
                "",
            ]
            wh = ["contender", "figure", *(str(i + 1) for i in range(windows))]
            wrows = []
            for key, runs in by_key.items():
                wrows.append([key, "hit rate", *_window_row(runs, "window_hit_rate")])
                wrows.append(
                    ["", "restarted's share", *_window_row(runs, "window_restarted_share")]
                )
                wrows.append(
                    ["", "restarted's hit rate", *_window_row(runs, "window_restarted_hit_rate")]
                )
            lines += [*_table(wh, wrows), ""]
    notes = path.with_name("notes.md")
    if notes.exists():  # what the figures say, written by hand (kept across --from-json)
        lines = [*lines[:8], notes.read_text().strip(), "", *lines[8:]]
    if verdicts:
        lines = [
            *lines[:8],
            "## Verdicts",
            "",
            *_table(
                ["trace", "pressure", "contender", "verdict", "hit / pred.", "makespan / pred."],
                verdicts,
            ),
            "",
            *lines[8:],
        ]
    path.write_text("\n".join(lines) + "\n")
    doc = json.loads(path.with_name("cache_pressure.json").read_text())
    doc["summaries"] = summaries
    path.with_name("cache_pressure.json").write_text(json.dumps(doc, indent=1) + "\n")
