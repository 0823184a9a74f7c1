"""The soak bench's analysis and report (bench/soak.py): figures at each phase's end, slopes
over the hostile phase, the good traffic per phase, the attacks, the router's log."""

from __future__ import annotations

import re
import statistics
from collections import Counter
from typing import Any

from .soak_good import GoodClient
from .soak_hostile import Attacks

PHASES = ("start", "warm-up", "hostile", "cool-down", "idle")
FIGURES = ("rss_mib", "hwm_mib", "fds", "sockets", "threads", "tasks", "gc_objects")


def slope_per_minute(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, value) points, per minute."""
    if len(points) < 3:
        return None
    mx = statistics.fmean(t for t, _ in points)
    my = statistics.fmean(v for _, v in points)
    den = sum((t - mx) ** 2 for t, _ in points)
    if den == 0:
        return None
    return sum((t - mx) * (v - my) for t, v in points) / den * 60.0


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _figures(sample: dict[str, Any]) -> dict[str, Any]:
    out = {k: sample.get(k) for k in FIGURES}
    out["rss_mib"] = round(out["rss_mib"], 1)
    out["hwm_mib"] = round(out["hwm_mib"], 1)
    out["connections"] = sum(sample["accepted"].values())
    out["upstream"] = sample.get("upstream")
    out["t"] = sample["t"]
    return out


def summarise(
    samples: list[dict[str, Any]],
    marks: dict[str, float],
    good: GoodClient,
    attacks: Attacks,
    bursts: list[dict[str, Any]],
    episodes: list[dict[str, Any]],
    log: str,
    exit_code: int | None,
    end_warm: dict[str, Any],
    end_idle: dict[str, Any],
    hostile_s: float,
    router_status: dict[str, Any],
) -> dict[str, Any]:
    t0 = min(marks.values())
    at_end: dict[str, Any] = {"start": _figures(samples[0])}
    for name in PHASES[1:]:
        of = [s for s in samples if s["phase"] == name]
        if of:
            at_end[name] = _figures(of[-1])
    at_end["warm-up"] = _figures(end_warm)
    at_end["idle"] = _figures(end_idle)
    # Slopes over the hostile phase, after its first minute (a third of a short one).
    hostile = [s for s in samples if s["phase"] == "hostile"]
    skip = 60.0 if hostile_s >= 180 else hostile_s / 3
    h0 = hostile[0]["t"] if hostile else 0.0
    late = [s for s in hostile if s["t"] - h0 >= skip]
    slopes = {
        k: slope_per_minute([(s["t"], s[k]) for s in late if s.get(k) is not None])
        for k in ("rss_mib", "fds", "tasks", "gc_objects")
    }
    slopes = {k: None if v is None else round(v, 3) for k, v in slopes.items()}
    # Good traffic per phase, by when each request started.
    bounds = [(name, marks[name]) for name in PHASES[1:] if name in marks]
    per_phase: dict[str, Any] = {}
    for i, (name, begin) in enumerate(bounds):
        end = bounds[i + 1][1] if i + 1 < len(bounds) else float("inf")
        done = [d for d in good.done if begin <= d.started < end]
        if name == "idle" and not done:
            continue
        lat = [(d.ended - d.started) * 1e3 for d in done if d.ok]
        p50, p99 = pct(lat, 0.5), pct(lat, 0.99)
        per_phase[name] = {
            "sent": len(done),
            "ok": sum(d.ok for d in done),
            "lost": sum(not d.ok for d in done),
            "retried_ok": sum(d.ok and d.attempts > 1 for d in done),
            "p50_ms": None if p50 is None else round(p50, 1),
            "p99_ms": None if p99 is None else round(p99, 1),
            "max_ms": round(max(lat), 1) if lat else None,
        }
    unended = good.sent - len(good.done)
    kinds = Counter(k for d in good.done for k in d.kinds)
    bad = Counter(
        (b.kind, b.status, b.replica or "-", "stream" if b.stream else "whole", _shape(b.detail))
        for b in good.bad
    )
    lost = [d for d in good.done if not d.ok]
    bad_by_phase = Counter(_phase_of(b.at, bounds) + " " + b.kind for b in good.bad)
    controls_failed = [c for c in good.controls if c["status"] != 200]
    attack_rows = {
        name: {
            "runs": st.runs,
            "outcomes": dict(st.outcomes.most_common()),
            "close_s_median": round(statistics.median(st.close_s), 2) if st.close_s else None,
            "close_s_max": round(max(st.close_s), 2) if st.close_s else None,
        }
        for name, st in attacks.stats.items()
    }
    hostile_samples = [s for s in samples if s["phase"] == "hostile"]
    health = [s["health_ms"] for s in samples if s.get("health_ms") is not None]
    status = [s["status_ms"] for s in samples if s.get("status_ms") is not None]
    return {
        "phase_ends": at_end,
        "hostile_slopes_per_min": slopes,
        "slope_window": {"skip_s": round(skip, 1), "samples": len(late)},
        "hwm_max_mib": round(max(s["hwm_mib"] for s in samples), 1),
        "rss_max_mib": round(max(s["rss_mib"] for s in samples), 1),
        "fds_max": max(s["fds"] for s in samples),
        "connections_max": max(sum(s["accepted"].values()) for s in samples),
        "tasks_max": max((s["tasks"] for s in samples if s["tasks"] is not None), default=None),
        "fds_idle_minus_start": at_end["idle"]["fds"] - at_end["start"]["fds"],
        "fds_cooldown_minus_warmup": (
            at_end["cool-down"]["fds"] - at_end["warm-up"]["fds"] if "cool-down" in at_end else None
        ),
        "health_ms_max": max(health) if health else None,
        "status_ms_max": max(status) if status else None,
        "status_ms_p99": pct(status, 0.99),
        "probe_failures": sum(1 for s in samples if s.get("health_ms") is None),
        "health_503": sum(1 for s in samples if s.get("health_status") == 503),
        "hostile_status_ms_p99": pct(
            [s["status_ms"] for s in hostile_samples if s.get("status_ms") is not None], 0.99
        ),
        "good": {
            "sent": good.sent,
            "ended": len(good.done),
            "ok": sum(d.ok for d in good.done),
            "lost": len(lost) + unended,
            "unended": unended,
            "attempts_by_kind": dict(kinds),
            "non_ok_attempts_by_phase": dict(bad_by_phase),
            "non_ok_attempts": [
                {"kind": k, "status": s, "replica": r, "body": w, "detail": d, "count": n}
                for (k, s, r, w, d), n in bad.most_common(30)
            ],
            "lost_requests": [
                {"started": round(d.started - t0, 2), "kinds": d.kinds, "stream": d.stream}
                for d in lost[:30]
            ],
            "syncs": sum(c["path"] == "/v1/load_lora_adapter" for c in good.controls),
            "control_calls": len(good.controls),
            "control_failures": controls_failed[:30],
        },
        "per_phase": per_phase,
        "attacks": attack_rows,
        "attack_errors": dict(attacks.errors),
        "bursts": [{**b, "at": round(b["at"] - t0, 1)} for b in bursts],
        "fault_episodes": [{**e, "at": round(e["at"] - t0, 1)} for e in episodes],
        "router_log": read_log(log),
        "router_counts": router_status,
        "router_exit_code": exit_code,
        "samples": samples,
        "phase_starts_s": {k: round(v - t0, 1) for k, v in marks.items()},
    }


def _phase_of(at: float, bounds: list[tuple[str, float]]) -> str:
    name = "?"
    for n, begin in bounds:
        if at >= begin:
            name = n
    return name


def _shape(detail: str) -> str:
    """A failure's detail with its numbers dropped, to count alike ones together."""
    return re.sub(r"\d+", "N", detail)[:160]


def read_log(log: str) -> dict[str, Any]:
    lines = log.splitlines()
    levels = Counter()
    shapes: Counter[str] = Counter()
    for line in lines:
        m = re.search(r"\b(WARNING|ERROR|CRITICAL)\b", line)
        if m:
            levels[m.group(1)] += 1
            rest = line[m.end() :]
            shapes[f"{m.group(1)} {_shape(rest.strip())[:140]}"] += 1
    tracebacks = [i for i, line in enumerate(lines) if line.startswith("Traceback")]
    return {
        "lines": len(lines),
        "by_level": dict(levels),
        "tracebacks": len(tracebacks),
        "traceback_text": ["\n".join(lines[i : i + 30]) for i in tracebacks[:3]],
        "messages": [{"message": k, "count": n} for k, n in shapes.most_common(25)],
        "last_lines": lines[-8:],
    }


def _cell(v: Any, spec: str = "") -> str:
    """A figure as the docs quote it: whole numbers with thousands separators."""
    if v is None:
        return "—"
    if spec:
        return f"{v:{spec}}"
    return f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else str(v)


def _unit(v: Any, unit: str) -> str:
    return "—" if v is None else f"{_cell(v)} {unit}"


def markdown(r: dict[str, Any]) -> str:
    s = r["settings"]
    ends, slopes, good = r["phase_ends"], r["hostile_slopes_per_min"], r["good"]
    lb, le = r["load_before"], r["load_end"]
    lines = [
        "# Soak: hostile clients and a misbehaving replica, for minutes (bench/soak.py)",
        "",
        f"Made {r['date']} by `{r['command']}` (git {r['revision']}), {r['seconds']} s in all, "
        f"on 2 cores shared with other work: load average {lb[0]}, {lb[1]}, {lb[2]} before, "
        f"{le[0]}, {le[1]}, {le[2]} at the end. Method: the module docstring.",
        "",
        f"Phases: warm-up {s['warmup']:g} s (good traffic), hostile {s['minutes'] * 60:g} s "
        f"(good + {s['hostile_workers']} hostile loops + a burst of "
        "--max-connections + 16 connections every "
        f"{s['burst_every']:g} s"
        + (f" + replica 2 faulty: {', '.join(r['fault_cycle'])}" if r["fault_cycle"] else "")
        + f"), cool-down {s['cooldown']:g} s (good), idle {s['idle']:g} s (nothing). Good "
        f"traffic: {s['concurrency']} requests in flight, G = 8, a sync every 10 s. Router "
        f"`{' '.join(r['router_flags'])}`; samples every {s['sample']:g} s.",
        "",
        "## Verdict",
        "",
        f"- RSS slope over the hostile phase (after its first {r['slope_window']['skip_s']:g} s, "
        f"{r['slope_window']['samples']} samples): **{_cell(slopes['rss_mib'], '+.3f')} MiB/min**;"
        f" fds {_cell(slopes['fds'], '+.2f')}/min, tasks {_cell(slopes['tasks'], '+.2f')}/min, "
        f"gc objects {_cell(slopes['gc_objects'], '+.0f')}/min.",
        f"- fds: {ends['start']['fds']} before the first request, {ends['idle']['fds']} after "
        f"the idle phase ({r['fds_idle_minus_start']:+d}); {ends['warm-up']['fds']} at the end "
        f"of warm-up, {ends.get('cool-down', {}).get('fds')} at the end of cool-down "
        f"({_cell(r['fds_cooldown_minus_warmup'], '+d')}); at most {_cell(r['fds_max'])}.",
        f"- RSS at most {r['rss_max_mib']} MiB, VmHWM {r['hwm_max_mib']} MiB; accepted "
        f"connections at most {r['connections_max']}; asyncio tasks at most {r['tasks_max']}.",
        f"- Good requests: **{_cell(good['sent'])} sent, {_cell(good['ok'])} ok, "
        f"{good['lost']} lost** "
        f"({good['unended']} never ended); {good['syncs']} syncs, "
        f"{len(good['control_failures'])} control calls not answered 200.",
        f"- The router's /router/status answered in at most {_cell(r['status_ms_max'])} ms "
        f"(p99 {_cell(r['status_ms_p99'])} ms; /health, which asks the replicas, at most "
        f"{_cell(r['health_ms_max'])} ms), {r['probe_failures']} probes unanswered, /health "
        f"503 (a replica out of service) in {r['health_503']} samples; its log: "
        f"{r['router_log']['tracebacks']} "
        f"tracebacks, levels {r['router_log']['by_level']}; exit code on SIGTERM "
        f"{r['router_exit_code']}.",
        "",
        "## At the end of each phase",
        "",
        "| phase | t (s) | RSS | VmHWM | fds | sockets | threads | tasks | gc objects "
        "| accepted connections (any TCP state) | to replicas |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, f in ends.items():
        lines.append(
            f"| {name} | {f['t']} | {_unit(f['rss_mib'], 'MiB')} | {_unit(f['hwm_mib'], 'MiB')} "
            f"| {_cell(f['fds'])} | {_cell(f['sockets'])} | {f['threads']} | {_cell(f['tasks'])} "
            f"| {_cell(f['gc_objects'])} | {_cell(f['connections'])} | {_cell(f['upstream'])} |"
        )
    lines += [
        "",
        "## Good traffic per phase (by when a request started; latency of the ok ones, retries "
        "included)",
        "",
        "| phase | sent | ok | lost | ok after a retry | p50 ms | p99 ms | max ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, p in r["per_phase"].items():
        lines.append(
            f"| {name} | {_cell(p['sent'])} | {_cell(p['ok'])} | {p['lost']} | {p['retried_ok']} | "
            f"{_cell(p['p50_ms'])} | {_cell(p['p99_ms'])} | {_cell(p['max_ms'])} |"
        )
    lines += [
        "",
        f"Attempts by kind: {good['attempts_by_kind']}; non-ok attempts by phase: "
        f"{good['non_ok_attempts_by_phase'] or 'none'}.",
        "",
    ]
    if good["non_ok_attempts"]:
        lines += [
            "Non-ok attempts (kind, status, replica, body, detail: count):",
            "",
            *(
                f"- {b['kind']} {b['status']} replica {b['replica']} {b['body']}: "
                f"`{b['detail']}` x {b['count']}"
                for b in good["non_ok_attempts"]
            ),
            "",
        ]
    if good["control_failures"]:
        lines += ["Control calls not answered 200:", ""]
        lines += [f"- `{c}`" for c in good["control_failures"]]
        lines.append("")
    lines += [
        "## Attacks (hostile phase)",
        "",
        "| attack | runs | outcomes (status, how the connection ended) | router ended it after "
        "(median / max) |",
        "|---|---:|---|---|",
    ]
    for name, a in r["attacks"].items():
        outs = ", ".join(f"{k}: {n}" for k, n in a["outcomes"].items())
        lines.append(
            f"| {name} | {a['runs']} | {outs} | {_unit(a['close_s_median'], 's')} / "
            f"{_unit(a['close_s_max'], 's')} |"
        )
    lines += ["", f"Attack errors on the client's side: {r['attack_errors'] or 'none'}.", ""]
    lines += ["Bursts of connections:", ""]
    lines += [
        f"- at {b['at']} s: {_cell(b['asked'])} asked, {_cell(b['opened'])} opened in "
        f"{b['open_s']} s, "
        f"{b['answered_503']} answered 503 past the cap, {b['connect_failed']} failed to connect"
        for b in r["bursts"]
    ] or ["- none"]
    lines += ["", "Replica 2's fault episodes (s from the start of warm-up):", ""]
    lines.append(
        "; ".join(f"{e['at']} {e['fault']} ({e['s']} s)" for e in r["fault_episodes"]) or "none"
    )
    counts = r["router_counts"]
    lines += [
        "",
        f"The router's own counts at the end (/router/status): requests {counts.get('requests')}"
        f"; retries {counts.get('retries')}.",
    ]
    log = r["router_log"]
    lines += [
        "",
        f"## The router's log ({log['lines']} lines)",
        "",
        *(f"- {m['message']} x {m['count']}" for m in log["messages"]),
        "",
    ]
    for tb in log["traceback_text"]:
        lines += ["```", tb, "```", ""]
    return "\n".join(lines) + "\n"
