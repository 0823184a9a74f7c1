"""The overhead bench's report: the run's figures, the issue-16 targets, and overhead.md /
table_memory.md with their JSON."""

from __future__ import annotations

import json
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .overhead_memory import (
    StreamSample,
    TableSample,
    streams_markdown,
    table_markdown,
)
from .overhead_setup import (
    ADDED_P50_SLACK_US,
    BASE,
    CPU_VS_NGINX,
    FLEET_CPU_TOLERANCE,
    PROMPT_TOKENS,
    RPS_VS_VLLM_ROUTER,
    STREAM_COUNTS,
    STREAM_TOKENS,
    STREAMS_RSS_MIB,
    TRACES,
    WINDOW_CONTENDERS,
    fmt,
    spread,
)
from .overhead_windows import (
    Idle,
    Sample,
)

# --- the report ---------------------------------------------------------------------------------


@dataclass
class Report:
    command: str
    revision: str
    date: str
    seconds: float = 0.0
    load_before_rounds: list[float] = field(default_factory=list)
    load_end: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    idle: list[Idle] = field(default_factory=list)
    streams: list[StreamSample] = field(default_factory=list)
    table: list[TableSample] = field(default_factory=list)
    contenders: list[str] = field(default_factory=lambda: list(WINDOW_CONTENDERS))
    base_tree: str | None = None

    @property
    def proxies(self) -> list[str]:
        return self.contenders[1:]

    def versus(self, scenario: str, a: str, b: str, attr: str) -> dict[str, float] | None:
        """Per round, `attr` of contender a over contender b in one scenario."""
        mine = {
            (s.contender, s.round): getattr(s, attr) for s in self.samples if s.scenario == scenario
        }
        ratios = [
            mine[a, r] / mine[b, r]
            for r in {s.round for s in self.samples}
            if mine.get((a, r)) and mine.get((b, r))
        ]
        return spread(ratios) if ratios else None

    def values(self, scenario: str, name: str, attr: str) -> list[float]:
        got = [
            getattr(s, attr) for s in self.samples if s.scenario == scenario and s.contender == name
        ]
        return [float(v) for v in got if v is not None]

    def stat(self, scenario: str, name: str, attr: str) -> dict[str, float] | None:
        values = self.values(scenario, name, attr)
        return spread(values) if values else None

    def paired(self, name: str, a: str, b: str, attr: str) -> dict[str, float] | None:
        """Per round, `attr` in scenario a over scenario b."""
        mine = {
            (s.scenario, s.round): getattr(s, attr) for s in self.samples if s.contender == name
        }
        ratios = [
            mine[a, r] / mine[b, r]
            for r in {s.round for s in self.samples}
            if (a, r) in mine and (b, r) in mine
        ]
        return spread(ratios) if ratios else None


def targets(report: Report, fleets: Sequence[int]) -> list[dict[str, object]]:
    c1, c64 = "2 replicas, siblings, c=1", "2 replicas, siblings, c=64"
    out: list[dict[str, object]] = []
    small, large = min(fleets), max(fleets)
    for trace in TRACES if large > small else ():  # one fleet size (--fleets 2): no sweep
        ratio = report.paired(
            "lora-router",
            f"{large} replicas, {trace}, c=64",
            f"{small} replicas, {trace}, c=64",
            "cpu_us_per_req",
        )
        net = report.paired(
            "lora-router",
            f"{large} replicas, {trace}, c=64",
            f"{small} replicas, {trace}, c=64",
            "net_cpu_us_per_req",
        )
        assert ratio is not None and net is not None
        out.append(
            {
                "target": f"CPU/request at {large} replicas within 10 % of {small} ({trace})",
                "figure": f"{fmt(ratio, '.3f')} x, per-round ratio ({fmt(net, '.3f')} x less "
                "idle CPU)",
                "met": ratio["median"] <= FLEET_CPU_TOLERANCE,
            }
        )
    mine = report.stat(c1, "lora-router", "added_p50_us")
    nginx = report.stat(c1, "nginx", "added_p50_us")
    assert mine and nginx
    out.append(
        {
            "target": "added p50 at c=1 within nginx's + 40 µs",
            "figure": f"{mine['median']:.0f} µs against nginx's {nginx['median']:.0f} + 40",
            "met": mine["median"] <= nginx["median"] + ADDED_P50_SLACK_US,
        }
    )
    mine = report.stat(c64, "lora-router", "cpu_us_per_req")
    nginx = report.stat(c64, "nginx", "cpu_us_per_req")
    assert mine and nginx
    out.append(
        {
            "target": "CPU/request at c=64 ≤ 2x nginx's",
            "figure": f"{mine['median']:.1f} µs against 2 x {nginx['median']:.1f}",
            "met": mine["median"] <= CPU_VS_NGINX * nginx["median"],
        }
    )
    scenarios_64 = sorted({s.scenario for s in report.samples if s.scenario.endswith("c=64")})
    worst = min(
        statistics.median(report.values(sc, "lora-router", "rps"))
        / statistics.median(report.values(sc, "vllm-router", "rps"))
        for sc in scenarios_64
    )
    here = statistics.median(report.values(c64, "lora-router", "rps")) / statistics.median(
        report.values(c64, "vllm-router", "rps")
    )
    out.append(
        {
            "target": "≥ 2x vllm-router's req/s",
            "figure": f"{here:.2f}x at 2 replicas, siblings, c=64; {worst:.2f}x in the worst "
            "scenario at c=64",
            "met": worst >= RPS_VS_VLLM_ROUTER,
        }
    )
    most = max(STREAM_COUNTS)
    rss = [
        s.with_open_kib[most] / 1024
        for s in report.streams
        if s.contender == "lora-router" and most in s.with_open_kib
    ]
    if rss:
        out.append(
            {
                "target": f"{most:,} open streams of {STREAM_TOKENS:,}-token prompts < 150 MiB RSS",
                "figure": f"{statistics.median(rss):.0f} MiB",
                "met": statistics.median(rss) < STREAMS_RSS_MIB,
            }
        )
    return out


def floor_markdown(report: Report) -> list[str]:
    """How the targets read against the floor (bench/floor.py): the runtime's own cost per
    request, and lora-router's above it, per round in the same scenario."""
    out = [
        "## The floor: what the runtime costs before lora-router's work",
        "",
        "Per round, in the same scenario (2 replicas, siblings): CPU per request and added p50 "
        "of one contender over another's. Added p50 only at c=1: at c=64 wrk and the replicas "
        "share a core, and direct's own p50 there is no baseline.",
        "",
        "| figure | c=1 | c=64 |",
        "| --- | ---: | ---: |",
    ]
    pairs = [("floor", "nginx"), ("lora-router", "floor"), ("lora-router", "nginx")]
    for attr, label, levels in (
        ("cpu_us_per_req", "CPU µs/req", (1, 64)),
        ("added_p50_us", "added p50", (1,)),
    ):
        for a, b in pairs:
            cells = [
                fmt(report.versus(f"2 replicas, siblings, c={c}", a, b, attr), ".2f")
                if c in levels
                else "—"
                for c in (1, 64)
            ]
            out.append(f"| {label}, {a} / {b} | " + " | ".join(cells) + " |")
    return out


def split_markdown(report: Report) -> list[str]:
    """The A/B's CPU split: user and system time and minor page faults per request, each
    tree's median and the per-round ratio (the kernel splits CPU time by sampled ticks)."""
    out = [
        "Where the CPU went (the kernel's user/system split of each window, by sampled ticks), "
        f"lora-router and {BASE}, and per round the ratio of the two:",
        "",
        "| scenario | figure | lora-router | lora-router@base | ratio |",
        "| --- | --- | ---: | ---: | ---: |",
    ]
    figures = (
        ("user_us_per_req", "user µs/req", ".1f"),
        ("sys_us_per_req", "system µs/req", ".1f"),
        ("minflt_per_req", "minor faults/req", ".3f"),
    )
    for sc in dict.fromkeys(s.scenario for s in report.samples):
        for attr, label, spec in figures:
            mine, base = report.stat(sc, "lora-router", attr), report.stat(sc, BASE, attr)
            if mine is None or base is None:
                continue
            ratio = fmt(report.versus(sc, "lora-router", BASE, attr), ".3f")
            out.append(f"| {sc} | {label} | {fmt(mine, spec)} | {fmt(base, spec)} | {ratio} |")
    return out


def markdown(report: Report, fleets: Sequence[int], goals: list[dict[str, object]]) -> str:
    loads = ", ".join(f"{x:.2f}" for x in report.load_before_rounds)
    out = [
        "# Proxy overhead (issue 16)",
        "",
        f"- command: `{report.command}`",
        f"- revision: `{report.revision}`; {report.date}; "
        f"the run took {report.seconds / 60:.1f} min",
        f"- machine: {os.cpu_count()} cores shared with other work; 1-minute load average before "
        f"each round: {loads}; at the end: {report.load_end:.2f}",
        "- proxies pinned to core 0; nginx replicas, wrk (one thread) and the bench on core 1",
        f"- requests: TRL 1.16's rollout payload, {PROMPT_TOKENS}-token token-id prompts, a "
        "seed per request; figures are medians over rounds with [min .. max]",
        "",
        "## Targets",
        "",
        "| target | figure | met |",
        "| --- | --- | --- |",
    ]
    out += [f"| {g['target']} | {g['figure']} | {'yes' if g['met'] else '**no**'} |" for g in goals]
    out += ["", *floor_markdown(report)]
    if BASE in report.contenders:
        out += ["", f"## A/B: lora-router over {BASE} (`{report.base_tree}`)", ""]
        out += [
            f"Per round, lora-router's figure over {BASE}'s in the same scenario (below 1: "
            "lora-router uses less CPU, or waits less; above 1: it serves more req/s).",
            "",
            "| scenario | CPU µs/req | req/s | p50 µs | added p50 µs |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for sc in dict.fromkeys(s.scenario for s in report.samples):
            attrs = ("cpu_us_per_req", "rps", "p50_us", "added_p50_us")
            cells = [fmt(report.versus(sc, "lora-router", BASE, a), ".3f") for a in attrs]
            out.append(f"| {sc} | " + " | ".join(cells) + " |")
        out += ["", *split_markdown(report)]
    out += ["", "## Latency and CPU, 2 replicas, siblings trace", ""]
    out += [
        "| concurrency | contender | req/s | p50 µs | added p50 µs | p99 µs | CPU µs/req |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in (1, 64):
        sc = f"2 replicas, siblings, c={c}"
        for name in report.contenders:
            attrs = ("rps", "p50_us", "added_p50_us", "p99_us")
            cells = [fmt(report.stat(sc, name, a)) for a in attrs]
            cells.append(fmt(report.stat(sc, name, "cpu_us_per_req"), ".1f"))
            out.append(f"| {c} | {name} | " + " | ".join(cells) + " |")
    out += ["", "## Fleet sweep, concurrency 64", ""]
    out += [
        "CPU µs per request (req/s below); the last rows are the per-round ratio to 2 replicas.",
        "",
    ]
    for trace in TRACES:
        out += [f"### {trace} ({TRACES[trace]} request(s) per prompt)", ""]
        proxies = report.proxies
        out += ["| replicas | " + " | ".join(proxies) + " |", "| ---: |" + " ---: |" * len(proxies)]
        for n in fleets:
            sc = f"{n} replicas, {trace}, c=64"
            cells = [
                fmt(report.stat(sc, name, "cpu_us_per_req"), ".1f")
                + f"<br>{fmt(report.stat(sc, name, 'rps'))} req/s"
                for name in proxies
            ]
            out.append(f"| {n} | " + " | ".join(cells) + " |")
        for figure, label in (("cpu_us_per_req", ""), ("net_cpu_us_per_req", ", less idle CPU")):
            for n in fleets[1:]:
                pair = (f"{n} replicas, {trace}, c=64", f"{fleets[0]} replicas, {trace}, c=64")
                cells = [fmt(report.paired(name, *pair, figure), ".3f") for name in proxies]
                out.append(f"| CPU {n} / {fleets[0]}{label} | " + " | ".join(cells) + " |")
        out.append("")
    out += [
        "Idle CPU (µs per second) of each proxy while the others of its fleet size were measured: "
        "health checks "
        'and replica scrapes, included in the figures above (the "less idle CPU" rows take '
        "each proxy's idle rate of that round out of its windows).",
        "",
        "| replicas | " + " | ".join(report.proxies) + " |",
        "| ---: |" + " ---: |" * len(report.proxies),
    ]
    for n in fleets:
        cells = []
        for name in report.proxies:
            rates = [i.cpu_us_per_s for i in report.idle if i.contender == name and i.replicas == n]
            cells.append(fmt(spread(rates), ",.0f") if rates else "—")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    out.append("")
    out += ["### lora-router's routing decisions (the trace check), summed over rounds", ""]
    out += ["| scenario | decisions |", "| --- | --- |"]
    mix: dict[str, dict[str, int]] = {}
    for s in report.samples:
        if s.decisions:
            tally = mix.setdefault(s.scenario, {})
            for k, n in s.decisions.items():
                tally[k] = tally.get(k, 0) + n
    out += [
        f"| {sc} | " + ", ".join(f"{k} {n:,}" for k, n in sorted(t.items())) + " |"
        for sc, t in mix.items()
    ]
    # --windows-only measures neither of these: no empty tables.
    if report.streams:
        out += ["", *streams_markdown(report.streams)]
    if report.table:
        out += ["", *table_markdown(report.table)]
    out += [
        "",
        "## Not measured here",
        "",
        "- sglang-router: it rejects token-id prompts on /v1/completions, which is all TRL sends.",
        "- the routing figures of bench/routing.py (the issue's last target): run that bench.",
        "",
    ]
    return "\n".join(out)


def write_table(report: Report, began: float, out: Path, quick: bool) -> None:
    """The report of `--table-only`: bench/results/table_memory.md (and .json)."""
    report.seconds = time.monotonic() - began
    report.load_end = os.getloadavg()[0]
    text = "\n".join(
        [
            "# Memory after many distinct prompts (issue 16)",
            "",
            f"- command: `{report.command}`",
            f"- revision: `{report.revision}`; {report.date}; the run took "
            f"{report.seconds / 60:.1f} min; 1-minute load average at the end: "
            f"{report.load_end:.2f}",
            "- proxies pinned to core 0; nginx replicas (2), wrk (one thread, 64 connections) and "
            "the bench on core 1",
            "",
            *table_markdown(report.table),
            "",
        ]
    )
    out.mkdir(parents=True, exist_ok=True)
    name = "table_memory-quick" if quick else "table_memory"
    (out / f"{name}.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    (out / f"{name}.md").write_text(text)
    print(text)
