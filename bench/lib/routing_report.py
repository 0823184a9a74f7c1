"""The routing bench's reports: summaries over repeats and trace seeds, the targets of issue
13, routing.md, routing.png and routing.json (and reading routing.json back, `--from-json`)."""

from __future__ import annotations

import json
import os
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from .routing_procs import CONTENDERS
from .routing_runs import RunResult, follow_rate
from .routing_traces import LONG_TAIL_MAX, TRACES

TARGET_FRACTION = 0.995
TARGET_BALANCE = 1.05  # max/mean requests per replica
TARGET_FOLLOW = 0.99  # later turns on their previous turn's replica (spills excepted)
TARGET_IN_FLIGHT = 1.10  # time-weighted in-flight max/mean, relative to the oracle's


# --- reporting -----------------------------------------------------------------------------


def fill_oracle_fractions(results: list[RunResult]) -> None:
    """Each run's hit rate over the oracle's (median over its repeats) on the same trace, trace
    seed, replica count and naming mode."""
    oracle: dict[tuple[str, int, str, int], list[float]] = {}
    for r in results:
        if r.contender.startswith("oracle") and r.status == "ok":
            oracle.setdefault((r.trace, r.replicas, r.mode, r.seed), []).append(r.hit_rate)
    for r in results:
        rates = oracle.get((r.trace, r.replicas, r.mode, r.seed))
        if r.status == "ok" and rates:
            r.of_oracle = r.hit_rate / statistics.median(rates)


def aggregate(results: list[RunResult]) -> list[RunResult]:
    """One summary per (trace, replicas, contender), over its repeats and trace seeds: the run
    with the median wall time, with the median hit rate and fraction of the oracle, and the
    worst of each."""
    groups: dict[tuple[str, int, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.trace, r.replicas, r.contender), []).append(r)
    summaries = []
    for runs in groups.values():
        ok = [r for r in runs if r.status == "ok"]
        if not ok:
            summaries.append(replace(runs[0], repeats=len(runs)))
            continue
        middle = sorted(ok, key=lambda r: r.wall_s)[(len(ok) - 1) // 2]
        fractions = [r.of_oracle for r in ok if r.of_oracle is not None]
        summaries.append(
            replace(
                middle,
                hit_rate=statistics.median(r.hit_rate for r in ok),
                of_oracle=statistics.median(fractions) if fractions else None,
                failed=sum(r.failed for r in runs),
                requests=sum(r.requests for r in runs),
                repeats=len(runs),
                wall_range_s=[min(r.wall_s for r in ok), max(r.wall_s for r in ok)],
                worst_of_oracle=min(fractions) if fractions else None,
                worst_max_mean_requests=max(r.max_mean_requests for r in ok),
                worst_in_flight_balance=max(r.in_flight_balance for r in ok),
                worst_follow=min(follows) if (follows := _follows(ok)) else None,
                wall_by_run={f"{r.seed}:{r.round}": r.wall_s for r in ok},
                median_makespan_s=statistics.median(r.makespan_s for r in ok),
            )
        )
    return summaries


def _follows(runs: list[RunResult]) -> list[float]:
    return [f for r in runs if (f := follow_rate(r)) is not None]


def _f(value: float | None, digits: int = 3) -> str:
    if value is None or value != value:  # None or NaN
        return "—"
    return f"{value:.{digits}f}"


def _by(results: list[RunResult]) -> dict[tuple[str, int, str], RunResult]:
    return {(r.trace, r.replicas, r.contender): r for r in results}


TARGET_HEADER = [
    "trace",
    "N",
    "of oracle, LoRA",
    "of oracle, base",
    "turns followed (spills)",
    "max/mean req",
    "in flight: ours / oracle's",
    "wall s, base",
    "best peer wall s",
    "wall: ours / peer's, paired",
    "makespan s: ours / peer's",
    "met",
]


def _wall(r: RunResult) -> str:
    if r.repeats > 1 and r.wall_range_s:
        return f"{r.wall_s:.2f} [{r.wall_range_s[0]:.2f}-{r.wall_range_s[1]:.2f}]"
    return f"{r.wall_s:.2f}"


def paired_wall(ours: RunResult, peer: RunResult) -> list[float]:
    """Our wall time over the peer's, run by run: the same trace seed, the same interleaved
    round (so the same spell of the machine), which the medians of `_wall` do not pair."""
    both = ours.wall_by_run.keys() & peer.wall_by_run.keys()
    return sorted(ours.wall_by_run[k] / peer.wall_by_run[k] for k in both if peer.wall_by_run[k])


def _ratios(ratios: list[float]) -> str:
    if not ratios:
        return "—"
    if len(ratios) == 1:
        return f"{ratios[0]:.3f}"
    return f"{statistics.median(ratios):.3f} [{ratios[0]:.3f}-{ratios[-1]:.3f}]"


def _ok(r: RunResult | None) -> RunResult | None:
    return r if r is not None and r.status == "ok" else None


def targets(summaries: list[RunResult], traces: list[str], counts: list[int]) -> list[list[str]]:
    """One row per (trace, replicas): lora-router prefix against the issue's targets, both
    naming modes. Hit fractions, follow rates and balance are the worst over repeats, wall times
    medians [range] over repeats and trace seeds; a wall time above the best peer's median but
    inside its range is a tie within the noise (≈). Beside them, the paired ratios (`paired_wall`):
    median [range]. In-flight balance: the worst over repeats and trace seeds against the
    oracle's worst of the same mode (the oracle runs every seed, and the seed decides how
    evenly the work falls, so the oracle's run with the median wall time is no yardstick)."""
    by = _by(summaries)
    rows = []
    for trace in traces:
        for n in counts:
            if not any(r.trace == trace and r.replicas == n for r in summaries):
                continue  # a pooled or partial run that has no such cell
            lora, base = (
                _ok(by.get((trace, n, "lr-prefix"))),
                _ok(by.get((trace, n, "lr-prefix-base"))),
            )
            oracles = {
                "lr-prefix": _ok(by.get((trace, n, "oracle"))),
                "lr-prefix-base": _ok(by.get((trace, n, "oracle-base"))),
            }
            ours = [r for r in (lora, base) if r is not None]
            peers = [
                r
                for key in ("vllm-ch", "vllm-ca", "sglang-ca")
                if (r := _ok(by.get((trace, n, key)))) is not None and not r.failed
            ]
            best = min(peers, key=lambda r: r.wall_s) if peers else None
            fracs = [r.worst_of_oracle for r in ours if r.worst_of_oracle is not None]
            balance = [r.worst_max_mean_requests for r in ours]
            follows = [r.worst_follow for r in ours if r.worst_follow is not None]
            spills = sum(r.spills or 0 for r in ours)
            flights = []
            for r in ours:
                oracle = oracles[r.contender]
                if oracle is not None:
                    flights.append((r.worst_in_flight_balance, oracle.worst_in_flight_balance))
            hit = "✓" if fracs and min(fracs) >= TARGET_FRACTION else "✗"
            bal = "✓" if balance and max(balance) <= TARGET_BALANCE else "✗"
            fol = "✓" if not follows or min(follows) >= TARGET_FOLLOW else "✗"
            fly = "✓" if flights and all(o <= TARGET_IN_FLIGHT * b for o, b in flights) else "✗"
            if best is None or base is None:
                wall = "✓" if best is None else "✗"
            elif base.wall_s <= best.wall_s:
                wall = "✓"
            else:
                low = base.wall_range_s[0] if base.wall_range_s else base.wall_s
                high = best.wall_range_s[1] if best.wall_range_s else best.wall_s
                wall = "≈" if low <= high else "✗"
            makespan = f"{base.makespan_s:.2f} / {best.makespan_s:.2f}" if base and best else "—"
            rows.append(
                [
                    trace,
                    str(n),
                    _f(lora.worst_of_oracle if lora else None),
                    _f(base.worst_of_oracle if base else None),
                    f"{_f(min(follows) if follows else None)} ({spills})",
                    _f(max(balance) if balance else None, 2),
                    " · ".join(f"{o:.2f} / {b:.2f}" for o, b in flights) or "—",
                    _wall(base) if base else "—",
                    f"{_wall(best)} ({best.label})" if best else "—",
                    _ratios(paired_wall(base, best)) if base and best else "—",
                    makespan,
                    f"{hit}hits {fol}turns {bal}balance {fly}in-flight {wall}wall",
                ]
            )
    return rows


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def compact(results: list[RunResult], traces: list[str], counts: list[int]) -> list[list[str]]:
    """The anchors' shape: fraction of the oracle per trace (2/3/8 replicas), worst balance."""
    by = _by(results)
    rows = []
    for c in CONTENDERS:
        runs = [r for r in results if r.contender == c.key]
        if not runs:
            continue
        if all(r.status != "ok" for r in runs):
            label = f"{c.label} ({'base' if c.base else 'LoRA'})"
            rows.append([label, runs[0].status, *[""] * len(traces)])
            continue
        cells = []
        for trace in traces:
            found = [by.get((trace, n, c.key)) for n in counts]
            cells.append(" / ".join(_f(r.of_oracle if r else None, 3) for r in found))
        balance = [r.worst_max_mean_requests for r in runs if r.status == "ok"]
        rows.append(
            [
                f"{c.label} ({'base' if c.base else 'LoRA'})",
                *cells,
                _f(max(balance) if balance else None, 2),
            ]
        )
    return rows


DETAIL_HEADER = [
    "N",
    "router (mode)",
    "runs",
    "hit rate",
    "of oracle",
    "siblings on majority",
    "turns on parent",
    "spills",
    "max/mean req",
    "in flight max/mean",
    "max/mean busy",
    "makespan s",
    "wall s",
    "router CPU s",
    "failed",
]


def detail_rows(summaries: list[RunResult], trace: str) -> list[list[str]]:
    order = [c.key for c in CONTENDERS]
    rows = []
    for r in sorted(
        (r for r in summaries if r.trace == trace),
        key=lambda r: (r.replicas, order.index(r.contender)),
    ):
        head = [str(r.replicas), f"{r.label} ({r.mode})", str(r.repeats)]
        if r.status != "ok":
            rows.append([*head, r.status, *[""] * (len(DETAIL_HEADER) - 4)])
            continue
        rows.append(
            [
                *head,
                _f(r.hit_rate),
                _f(r.of_oracle),
                _f(r.siblings_on_majority),
                _f(r.continuations_on_parent),
                "—" if r.spills is None else str(r.spills),
                _f(r.worst_max_mean_requests, 2),
                _f(r.worst_in_flight_balance, 2),
                _f(r.max_mean_busy, 2),
                _f(r.makespan_s, 2),
                _wall(r),
                _f(r.router_cpu_s, 1),
                f"{r.failed}/{r.requests}",
            ]
        )
    return rows


def write_markdown(
    path: Path,
    summaries: list[RunResult],
    meta: dict[str, Any],
    traces: list[str],
    counts: list[int],
) -> None:
    t = meta["timing"]
    s = meta["scale"]
    parts = [
        "# Routing quality (bench/routing.py)",
        "",
        f"Made {meta['date']} by `{meta['command']}` in {meta['elapsed_s'] / 60:.1f} min "
        f"on {os.cpu_count()} cores (git {meta['git']}).",
        "",
        "Method (details in the docstring of bench/routing.py): GRPO-shaped traces from "
        f"lora_router/testbed/grpo_trace.py (G = {s['group_size']}, "
        f"S = {s['prompts_per_replica']} N problems "
        "per "
        f"step single-turn, {s['multi_prompts_per_replica']} N multi-turn, "
        f"{s['pipelined_prompts_per_replica']} N on the pipelined traces, {s['steps']} steps, "
        "a new adapter version every step (every round of turns on the pipelined traces, whose "
        "rollouts span versions), a random 63-bit seed per request as TRL draws it, at most "
        f"{s['in_flight_per_replica']} N requests in flight, completions of "
        f"{s['completion_tokens'][0]}-{s['completion_tokens'][1]} tokens, long-tail: "
        f"log-normal, median {s['long_tail_median']}, up to {LONG_TAIL_MAX}) replayed through "
        "each router to N emulated replicas (max_num_seqs "
        f"{t['max_num_seqs']}, {t['prefill_s_per_token'] * 1e6:.0f} µs per uncached prompt "
        f"token, {t['decode_s_per_token'] * 1e6:.0f} µs per generated token, a "
        f"{t['cache_blocks']}-block LRU prefix cache of {t['block_size']}-token blocks). The "
        "replicas run in one subprocess pinned to core 1; the router under test and the load "
        "generator share core 0. *Of oracle* is the prefix-cache hit rate (tokens, from the "
        "replicas' /metrics) divided by the oracle's on the same trace, replica count and naming "
        "mode. The oracle is a proxy that pins every prompt family (a problem's samples and all "
        "their later turns) to one replica, families dealt out round robin in arrival order, "
        "replaying the same requests through the same emulators. *LoRA*: requests name "
        "`trl-policy-vN`, synced through the router as TRL does (pause keep, load, resume, "
        "unload v(N-5)); *base*: requests name the base model (the peers cannot load adapters). "
        f"Runs repeated {meta['repeat']} times (interleaved): "
        f"{', '.join(meta['repeated']) or 'none'}; others once"
        + (
            f"; every contender on each of the trace seeds {meta['seeds'][0]}-{meta['seeds'][-1]}, "
            "the figures pooled over them (the oracle's fraction taken per seed)."
            if len(meta.get("seeds", [0])) > 1
            else "."
        ),
        "",
        "## lora-router (prefix) against the targets",
        "",
        f"Targets: ≥ {TARGET_FRACTION:.1%} of the oracle's hit rate (worst over repeats, both "
        f"modes); ≥ {TARGET_FOLLOW:.0%} of later turns on their previous turn's replica, spills "
        "under the load cap excepted (worst, both modes; in brackets the spills of both modes); "
        f"max/mean requests per replica ≤ {TARGET_BALANCE:.2f} (worst); time-weighted in-flight "
        f"max/mean ≤ {TARGET_IN_FLIGHT:.2f} times the oracle's of the same mode (worst over "
        "repeats and seeds; LoRA · base); "
        "wall time ≤ the best peer's (base-model runs, like for like; median [min-max] over "
        "repeats, ≈: above the peer's median but inside its range; *paired*: ours over the "
        "peer's run by run, same seed and round, median [min-max]). *Makespan* is the busiest "
        "replica's modeled service time, the part of the wall time that routing decides, free "
        "of the machine's noise.",
        "",
        md_table(TARGET_HEADER, targets(summaries, traces, counts)),
        "",
        "## Fraction of the oracle's hit rate, 2 / 3 / 8 replicas (medians)",
        "",
        md_table(["router", *traces, "worst max/mean req"], compact(summaries, traces, counts)),
        "",
        "![hit rate as a fraction of the oracle's](routing.png)",
        "",
    ]
    for trace in traces:
        parts += [
            f"## {trace} ({TRACES[trace].describe()})",
            "",
            md_table(DETAIL_HEADER, detail_rows(summaries, trace)),
            "",
        ]
    parts += [
        "Columns: *siblings on majority* — share of first-turn samples on their group's most "
        "used replica; *turns on parent* — share of later turns sent where their previous turn "
        "ran (all of them; spills not excepted); *spills* — lora-router's spill decisions (a "
        "home over the load cap), from its /metrics; *max/mean req* — worst over repeats; "
        "*in flight max/mean* — ∫ max over replicas of requests in flight dt / ∫ their mean dt "
        "over the run, from each request's send and answer times here, worst over repeats; "
        "*busy* — a replica's modeled service time "
        "(uncached prompt tokens x prefill cost + generated tokens x decode cost, from each "
        "answer's usage); *makespan* — the largest busy time (of several runs: the median); "
        "*wall s* — first request to last "
        "answer, median [min-max] when repeated; *router CPU s* — user + system CPU of the "
        "router process over the run. Every run's raw figures are in routing.json.",
        "",
    ]
    path.write_text("\n".join(parts))


def write_plot(path: Path, results: list[RunResult], traces: list[str], counts: list[int]) -> None:
    """One column per trace: hit rate over the oracle's by router and replica count, on the
    full scale (top) and zoomed on the target (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = _by(results)
    shown = [c for c in CONTENDERS if any(r.contender == c.key for r in results)]
    fig, axes = plt.subplots(
        2,
        len(traces),
        figsize=(4.2 * len(traces), 7.0),
        sharey="row",
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 2]},
    )
    width = 0.8 / max(1, len(counts))
    labels = [f"{c.label} ({'base' if c.base else 'LoRA'})" for c in shown]
    for col, trace in enumerate(traces):
        for row, (low, high) in enumerate(((0.0, 1.05), (0.98, 1.002))):
            ax = axes[row][col]
            for j, n in enumerate(counts):
                xs, values = [], []
                for i, c in enumerate(shown):
                    r = by.get((trace, n, c.key))
                    if r is not None and r.of_oracle is not None:
                        xs.append(i + (j - (len(counts) - 1) / 2) * width)
                        values.append(r.of_oracle)
                ax.bar(xs, values, width, label=f"{n} replicas", color=f"C{j}")
            for i, c in enumerate(shown):
                refused = [
                    r for n in counts if (r := by.get((trace, n, c.key))) and r.status != "ok"
                ]
                if refused and row == 0:
                    ax.text(i, 0.05, refused[0].status, rotation=90, ha="center", fontsize=6)
            ax.axhline(TARGET_FRACTION, color="k", linewidth=0.8, linestyle="--")
            ax.set_ylim(low, high)
            ax.set_xticks(range(len(shown)))
            if row == 0:
                ax.set_title(trace)
                ax.set_xticklabels([])
            else:
                ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    axes[0][0].set_ylabel("hit rate / oracle's (tokens)")
    axes[1][0].set_ylabel("zoom: 0.98-1.0")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper right", fontsize=8, ncol=len(counts))
    fig.suptitle(
        "Prefix-cache hit rate as a fraction of the oracle's (medians; dashed: the 0.995 target)"
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(
    path: Path, meta: dict[str, Any], summaries: list[RunResult], runs: list[RunResult]
) -> None:
    """routing.json: the meta, the summaries and every run (what `load_json` reads back)."""
    payload = {
        "meta": meta,
        "summaries": [asdict(r) for r in summaries],
        "runs": [asdict(r) for r in runs],
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")


def load_json(
    paths: Sequence[Path], traces: Sequence[str], counts: Sequence[int], command: str
) -> tuple[dict[str, Any], list[RunResult]]:
    """The meta and runs of earlier runs' routing.json files (for --from-json, which `command`
    is), those of `traces` at `counts` replicas: pooled, as if one run had made them all. Runs
    of one trace, replica count, contender, trace seed and round in two files would be the same
    run twice: refused."""
    metas, runs = [], []
    for path in paths:
        data = json.loads(path.read_text())
        metas.append(data["meta"])
        runs += [
            RunResult(**r) for r in data["runs"] if r["trace"] in traces and r["replicas"] in counts
        ]
    seen = Counter((r.trace, r.replicas, r.contender, r.seed, r.round) for r in runs)
    if twice := [key for key, count in seen.items() if count > 1]:
        raise SystemExit(f"runs in more than one file: {twice[:3]} (run them on other --seeds)")
    meta = metas[0]
    if len(metas) > 1:
        meta = {
            **meta,
            "date": max(m["date"] for m in metas),
            "command": "; ".join(m["command"] for m in metas) + f"` pooled by `{command}",
            "elapsed_s": sum(m["elapsed_s"] for m in metas),
            "git": ", ".join(dict.fromkeys(m["git"] for m in metas)),
            "repeat": max(m["repeat"] for m in metas),
            "repeated": list(dict.fromkeys(c for m in metas for c in m["repeated"])),
            "seeds": sorted({s for m in metas for s in m.get("seeds", [0])}),
        }
    fill_oracle_fractions(runs)
    return meta, runs
