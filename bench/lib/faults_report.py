"""The fault bench's analysis: the router's log, each episode against its targets, and the
report (faults.md, faults.json)."""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import datetime
from typing import Any

from .faults_setup import (
    GENERATION_PATHS,
    LISTING_S,
    Access,
    Cluster,
    Prober,
    ReplicaView,
    Settings,
    read_access_log,
)
from .faults_trainer import EpisodeRun, Rollout, Trainer

_EJECT = re.compile(r"^(\S+ \S+) WARNING \S+: ejecting Replica (\d+) \(([^)]*)\): (.*)$")
_BACK = re.compile(
    r"^(\S+ \S+) INFO \S+: Replica (\d+) \([^)]*\) is back in service "
    r"\((\d+) adapters replayed in ([\d.]+) s\)$"
)

# --- analysis -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LogEvent:
    at: float
    rid: int
    kind: str  # eject | back
    detail: str
    adapters: int = 0
    replay_s: float = 0.0


def parse_router_log(text: str) -> list[LogEvent]:
    events = []
    for line in text.splitlines():
        m = _EJECT.match(line)
        if m:
            events.append(LogEvent(_log_time(m[1]), int(m[2]), "eject", m[4]))
            continue
        m = _BACK.match(line)
        if m:
            events.append(LogEvent(_log_time(m[1]), int(m[2]), "back", "", int(m[3]), float(m[4])))
    return events


def _log_time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def throughput(rollouts: Sequence[Rollout], start: float, end: float) -> dict[str, float]:
    done = [r.attempts[-1] for r in rollouts if r.ok and start <= r.attempts[-1].ended < end]
    seconds = max(end - start, 1e-9)
    latencies = sorted(a.ended - a.started for a in done)
    return {
        "seconds": round(seconds, 3),
        "rollouts": len(done),
        "per_s": round(len(done) / seconds, 1),
        "p50_latency_s": round(statistics.median(latencies), 3) if latencies else 0.0,
    }


def analyse_episode(
    run: EpisodeRun,
    settings: Settings,
    cluster: Cluster,
    trainer: Trainer,
    prober: Prober,
    log_events: Sequence[LogEvent],
    replay_ref_s: float,
    t0: float,
) -> dict[str, Any]:
    rid, interval = run.rid, settings.health_interval
    out: dict[str, Any] = {
        "phase": run.episode.phase,
        "phase_met": run.phase_met,
        "victim": rid,
        "killed_at_s": round(run.killed - t0, 3),
        "down_s": round(run.spawned - run.killed, 3),
        "restart_to_listening_s": round(run.listening - run.spawned, 3),
    }
    ejected = prober.first(rid, False, run.killed)
    eject_log = next(
        (e for e in log_events if e.rid == rid and e.kind == "eject" and e.at >= run.killed - 0.01),
        None,
    )
    out["eject_s"] = round(ejected[1] - run.killed, 4) if ejected else None
    out["eject_s_lower_bound"] = round(ejected[0] - run.killed, 4) if ejected else None
    out["eject_s_router_log"] = round(eject_log.at - run.killed, 4) if eject_log else None
    out["eject_reason"] = eject_log.detail if eject_log else None
    out["eject_target_s"] = 2 * interval
    out["eject_met"] = ejected is not None and ejected[1] - run.killed <= 2 * interval

    back = next(
        (
            e
            for e in log_events
            if e.rid == rid and e.kind == "back" and e.at >= run.listening - 0.01
        ),
        None,
    )
    admitted = run.admitted or None
    out["readmit_s"] = round(admitted - run.listening, 4) if admitted else None
    out["readmit_s_router_log"] = round(back.at - run.listening, 4) if back else None
    out["router_replay_s"] = back.replay_s if back else None
    out["adapters_replayed"] = back.adapters if back else None

    # The new incarnation's own view: health checks, the replay, the first completion.
    log = read_access_log(cluster.access_log(rid, run.incarnation))
    checks = [a for a in log if a.path == "/health" and a.status == 200]
    needed = settings.health_successes
    admitting = checks[needed - 1] if len(checks) >= needed else None
    completions = [a for a in log if a.path in GENERATION_PATHS]
    first_completion = min((a.arrived for a in completions), default=None)
    admitted_at = back.at if back else admitted
    loaded = [
        a
        for a in log
        if a.path == "/v1/load_lora_adapter" and a.status == 200 and a.ended <= (admitted_at or 0)
    ]
    before_admission = [
        a for a in completions if admitted_at is not None and a.arrived < admitted_at
    ]
    held_before_first = {
        a.name for a in loaded if first_completion is None or a.ended <= first_completion
    }
    live_at_admission = _live_adapters(prober, rid, admitted or 0.0)
    out["replica_side"] = {
        "listening_to_admitting_health_check_s": (
            round(admitting.ended - run.listening, 4) if admitting else None
        ),
        "admitting_check_to_admitted_s": (
            round(admitted_at - admitting.ended, 4) if admitting and admitted_at else None
        ),
        "replay_loads": len(loaded),
        "replay_load_rounds": _rounds(loaded),
        "first_completion_after_admission_s": (
            round(first_completion - admitted_at, 4) if first_completion and admitted_at else None
        ),
        "completions_before_admission": len(before_admission),
        "live_adapters_at_admission": sorted(live_at_admission),
        "all_live_adapters_loaded_before_first_completion": live_at_admission <= held_before_first,
        "404s": sum(a.status == 404 for a in completions),
    }
    out["replay_reference_s"] = round(replay_ref_s, 4)
    budget = needed * interval + replay_ref_s
    out["readmit_budget_s"] = round(budget, 4)
    out["readmit_met"] = admitted is not None and admitted - run.listening <= budget
    out["readmit_met_literal"] = admitted is not None and admitted - run.listening <= replay_ref_s

    # A replay's last pass holds the broadcast lock: trainer calls (other than loads, which
    # take a load time anyway) that overlapped the re-admission, against the whole run.
    quick = [c for c in trainer.controls if c.what != "/v1/load_lora_adapter"]
    overlapping = [c for c in quick if c.ended >= run.listening and c.started <= (admitted or 0)]
    slowest = max(overlapping, key=lambda c: c.ended - c.started, default=None)
    out["trainer_calls_during_readmission"] = {
        "median_s_whole_run": round(statistics.median(c.ended - c.started for c in quick), 4)
        if quick
        else None,
        "slowest_s": round(slowest.ended - slowest.started, 4) if slowest else None,
        "slowest": slowest.what if slowest else None,
    }
    w = settings.window
    end_after = admitted + w if admitted else run.killed + w
    out["throughput"] = {
        "before": throughput(trainer.rollouts, run.killed - w, run.killed),
        "during": throughput(trainer.rollouts, run.killed, admitted or run.killed + w),
        "after": throughput(trainer.rollouts, admitted or run.killed, end_after),
    }
    served_after = Counter(
        r.attempts[-1].replica
        for r in trainer.rollouts
        if r.ok and admitted and admitted <= r.attempts[-1].ended < end_after
    )
    out["victim_share_after"] = round(
        served_after.get(str(rid), 0) / max(1, sum(served_after.values())), 3
    )
    return out


def _rounds(loads: Sequence[Access]) -> int:
    """Rounds of loads: a load that arrives after every earlier one ended starts a new one
    (a replay loads what is missing concurrently; a second round is its final pass)."""
    rounds, busy_until = 0, 0.0
    for a in sorted(loads, key=lambda a: a.arrived):
        if a.arrived >= busy_until:
            rounds += 1
        busy_until = max(busy_until, a.ended)
    return rounds


def _live_adapters(prober: Prober, rid: int, at: float) -> set[str]:
    """The adapters a live replica other than `rid` held at the poll that showed `rid` back."""
    views: dict[int, ReplicaView] = {}
    for view in prober.changes:
        if view.seen > at + 1e-6:
            break
        views[view.rid] = view
    others = [v for r, v in views.items() if r != rid and v.live]
    return set(others[0].adapters) if others else set()


def analyse_failures(trainer: Trainer, prober: Prober, replicas: int) -> dict[str, Any]:
    attempts = [a for r in trainer.rollouts for a in r.attempts]
    failed = [a for a in attempts if a.kind != "ok"]
    saveable = []
    for a in failed:
        if a.kind not in ("status", "transport"):
            continue
        named = int(a.replica) if a.replica.isdigit() else None
        others = [rid for rid in range(replicas) if rid != named and prober.live_at(rid, a.started)]
        if others:
            saveable.append(a)
    cut = [a for a in failed if a.kind == "cut"]
    return {
        "rollouts": len(trainer.rollouts),
        "attempts": len(attempts),
        "failed_attempts": dict(Counter(a.kind for a in failed)),
        "failed_non_2xx": sum(a.kind == "status" for a in failed),
        "failed_by_replica": dict(Counter(a.replica or "-" for a in failed)),
        "cut_before_any_data_frame": sum(a.frames == 0 for a in cut),
        "saveable_by_another_replica": len(saveable),
        "client_retries": trainer.client_retries,
        "rollouts_lost_after_retries": sum(not r.ok for r in trainer.rollouts),
        "examples": [asdict(a) for a in failed[:8]],
    }


def analyse_replicas(cluster: Cluster) -> dict[str, Any]:
    by_replica = []
    for i in range(len(cluster.ports)):
        counts: Counter[int] = Counter()
        for inc in range(cluster.incarnations[i] + 1):
            for a in read_access_log(cluster.access_log(i, inc)):
                if a.path in GENERATION_PATHS:
                    counts[a.status] += 1
        by_replica.append({
            "replica": i,
            "completions": sum(counts.values()),
            "404": counts.get(404, 0),
            "5xx": sum(v for k, v in counts.items() if k >= 500),
            "cancelled": counts.get(-1, 0),
        })  # fmt: skip
    return {
        "completion_404s": sum(r["404"] for r in by_replica),
        "completion_5xx": sum(r["5xx"] for r in by_replica),
        "by_replica": by_replica,
    }


def analyse_soft(
    run: EpisodeRun,
    settings: Settings,
    cluster: Cluster,
    trainer: Trainer,
    prober: Prober,
    events: Sequence[LogEvent],
    status: dict[str, Any],
    t0: float,
) -> dict[str, Any]:
    """A 5xx, unload or listing episode, from the trainer's attempts, the router's log and
    status, and the victim's access log."""
    rid, phase = run.rid, run.episode.phase
    attempts = [a for r in trainer.rollouts for a in r.attempts]
    out: dict[str, Any] = {
        "phase": phase,
        "victim": rid,
        "started_at_s": round(run.killed - t0, 3),
        "lasted_s": round(run.ended - run.killed, 3),
    }
    if phase in ("5xx", "5xx-all"):
        window = [a for a in attempts if run.killed <= a.started <= run.ended]
        every = [
            (i, a)
            for i in range(len(cluster.ports))
            for inc in range(cluster.incarnations[i] + 1)
            for a in read_access_log(cluster.access_log(i, inc))
            if a.path in GENERATION_PATHS and run.killed <= a.arrived <= run.ended
        ]
        answered = [a for i, a in every if phase == "5xx-all" or i == rid]
        out |= {
            "attempts_during": len(window),
            # Completions the replicas answered beyond the client's attempts: the router's.
            "router_retries_during": max(0, len(every) - len(window)),
            "victim_answered_5xx": sum(a.status >= 500 for a in answered),
            "client_visible_5xx_during": sum(a.status >= 500 for a in window),
            "failed_attempts_during": sum(a.kind != "ok" for a in window),
        }
    elif phase == "unload":
        call = run.unload_call
        if call is None:
            return out | {"unloaded": "", "missed": "no sync came to carry the unload"}
        named = [a for a in attempts if a.model == run.unloaded]
        in_flight = [a for a in named if a.started < call.started < a.ended]
        out |= {
            "unloaded": run.unloaded,
            "unload_status": call.status,
            "unload_s": round(call.ended - call.started, 4),
            "its_rollouts_in_flight_when_it_arrived": len(in_flight),
            "of_them_answered_200": sum(a.status == 200 for a in in_flight),
            "the_others_answered": dict(Counter(a.status for a in in_flight if a.status != 200)),
            "404s_naming_it": sum(a.status == 404 for a in named),
        }
    else:
        end = run.admitted or run.ended
        ejections = [
            e for e in events if e.rid == rid and e.kind == "eject" and run.killed <= e.at <= end
        ]
        # Without a back-off: one ejection every few health checks for the whole episode.
        # With it: the waits double, so at most log2(episode / interval) + 2.
        bound = 2 + math.ceil(math.log2(max(1.0, LISTING_S / settings.health_interval)))
        live = [
            sum(prober.live_at(r, t) for r in range(settings.replicas))
            for t in _poll_times(prober, run.killed, end)
        ]
        flaps = status.get("health", {}).get("listing_flaps", {})
        out |= {
            "ejections": len(ejections),
            "ejection_bound": bound,
            "listing_flaps_counted": flaps.get(str(rid), 0),
            "fewest_replicas_serving": min(live, default=settings.replicas),
            "back_in_service_after_fault_s": (
                round(run.admitted - run.ended, 3) if run.admitted else None
            ),
            "bounded": len(ejections) <= bound and bool(run.admitted) and min(live, default=1) > 0,
        }
    return out


def _poll_times(prober: Prober, start: float, end: float) -> list[float]:
    return [v.seen for v in prober.changes if start <= v.seen <= end] + [start, end]


def targets(result: dict[str, Any]) -> dict[str, Any]:
    episodes = result["episodes"]
    failures = result["failures"]
    soft = result["soft_episodes"]
    listing = [e for e in soft if e["phase"] == "listing"]
    unloads = [e for e in soft if e["phase"] == "unload"]
    fleet_wide = [e for e in soft if e["phase"] == "5xx-all"]
    return {
        "fleet_wide_5xx_retries_within_budget": {
            # The budget: MIN_RETRIES counted per 10 s window (or 20 % of its requests).
            "met": all(
                e["router_retries_during"]
                <= 10 * (1 + math.ceil(e["lasted_s"] / 10)) + 0.2 * e["attempts_during"]
                for e in fleet_wide
            ),
            "figure": "; ".join(
                f"{e['router_retries_during']} router retries for {e['attempts_during']} "
                f"attempts over {e['lasted_s']} s"
                for e in fleet_wide
            )
            or "no 5xx-all episode",
        },
        "client_visible_5xx": {
            "met": result["client_visible_5xx"] == 0,
            "figure": f"{result['client_visible_5xx']} rollout attempts answered 5xx; the "
            f"replicas answered {result['replicas']['completion_5xx']} completions 5xx; router "
            f"retries {result['router_retries']}",
        },
        "no_404_after_an_unload": {
            "met": result["client_404s"] == 0
            and any(e["unloaded"] for e in unloads)
            and all(
                e["of_them_answered_200"] == e["its_rollouts_in_flight_when_it_arrived"]
                for e in unloads
                if e["unloaded"]
            ),
            "figure": f"{result['client_404s']} rollout attempts answered 404; "
            + "; ".join(
                f"{e['unloaded']} unloaded with {e['its_rollouts_in_flight_when_it_arrived']} of "
                f"its rollouts in flight ({e['of_them_answered_200']} answered 200), in "
                f"{e['unload_s']} s"
                for e in unloads
                if e["unloaded"]
            ),
        },
        "listing_flap_bounded": {
            "met": bool(listing) and all(e["bounded"] for e in listing),
            "figure": "; ".join(
                f"replica {e['victim']}: {e['ejections']} ejections in {e['lasted_s']} s "
                f"(bound {e['ejection_bound']}), {e['listing_flaps_counted']} flaps counted, "
                f"never fewer than {e['fewest_replicas_serving']} replicas serving, back "
                f"{e['back_in_service_after_fault_s']} s after the fault was lifted"
                for e in listing
            ),
        },
        "no_saveable_failures": {
            "met": failures["saveable_by_another_replica"] == 0
            and not result["control_failures"]
            and not result["training_stopped"],
            "figure": f"{failures['saveable_by_another_replica']} saveable of "
            f"{sum(failures['failed_attempts'].values())} failed rollout attempts; trainer "
            f"calls not answered 200: {len(result['control_failures'])}",
        },
        "eject_within_2_intervals": {
            "met": all(e["eject_met"] for e in episodes) and bool(episodes),
            "figure": ", ".join(f"{e['eject_s']} s" for e in episodes)
            + f" (target {episodes[0]['eject_target_s'] if episodes else '?'} s)",
        },
        "readmit_within_one_replay": {
            "met": all(e["readmit_met"] for e in episodes) and bool(episodes),
            "met_literal": all(e["readmit_met_literal"] for e in episodes) and bool(episodes),
            "figure": ", ".join(
                f"{e['readmit_s']} s (budget {e['readmit_budget_s']} s, one replay "
                f"{e['replay_reference_s']} s)"
                for e in episodes
            ),
        },
        "no_request_for_an_adapter_reached_a_replica_without_it": {
            "met": result["replicas"]["completion_404s"] == 0
            and all(
                e["replica_side"]["completions_before_admission"] == 0
                and e["replica_side"]["all_live_adapters_loaded_before_first_completion"]
                for e in episodes
            ),
            "figure": f"{result['replicas']['completion_404s']} completion 404s at the replicas",
        },
    }


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        "# Fault tolerance under a GRPO-shaped run (bench/faults.py)",
        "",
        f"Made {report['date']} by `{report['command']}`: {report['wall_s']} s of run "
        f"({report['steps']} steps), {report['total_s']} s in all, on "
        f"{report['machine']['cpus']} cores (git {report['git']}).",
        "",
        f"3 emulated replicas, each a process (8 seqs, 4 ms/token, {s['load_delay']} s per "
        f"adapter load); router `{' '.join(report['router_flags'])}`; S={s['prompts']} x "
        f"G={s['group']} rollouts per step (each request with its own seed, naming the version "
        "current when it is sent), pause(keep) -> load vN -> resume -> unload v(N-3) without "
        "waiting for its rollouts, as TRL; the client retries a failed rollout after 1, 2, "
        f"4 s. Kill episodes SIGKILL one replica and restart it empty {s['down']} s later on "
        f"the same port; `5xx`: a replica answers 500 to every completion for {s['down']} s, "
        "its /health 200; `unload`: a sync also unloads the version it supersedes while that "
        f"version's rollouts are in flight; `listing`: for {LISTING_S:g} s every other "
        "/v1/models answer of a replica lists no adapter (a balancer over two servers). "
        "Method: the module docstring.",
        "",
        "## Targets",
        "",
        "| target | met | figures |",
        "|---|---|---|",
    ]
    for name, t in report["targets"].items():
        met = "yes" if t["met"] else "**no**"
        if "met_literal" in t:
            met += f" (literal reading: {'yes' if t['met_literal'] else 'no'})"
        lines.append(f"| {name.replace('_', ' ')} | {met} | {t['figure']} |")
    lines += [
        "",
        "## Episodes",
        "",
        "Eject: kill -> first poll of `/router/replicas` showing the victim out (10 ms polls) "
        "/ the router's log line. Re-admit: the new process listening -> first poll showing it "
        "admitted / log line; split into the health wait (-> the /health answer that completed "
        "`--health-successes`) and the replay (-> admitted), with the replay's rounds of loads. "
        "One replay by hand: the same calls on an empty spare replica.",
        "",
        "| kill | victim | eject s (poll / log) | restart -> listening s | re-admit s (poll / "
        "log) | health wait s | replay s: router (load rounds) / by hand | slowest trainer "
        "call during it s | rollouts/s before / during / after | victim share after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in report["episodes"]:
        t = e["throughput"]
        rs = e["replica_side"]
        calls = e["trainer_calls_during_readmission"]
        lines.append(
            f"| {e['phase']} at {e['killed_at_s']} s{'' if e['phase_met'] else ' (phase missed)'}"
            f" | {e['victim']} | {e['eject_s']} / {e['eject_s_router_log']} | "
            f"{e['restart_to_listening_s']} | {e['readmit_s']} / {e['readmit_s_router_log']} | "
            f"{rs['listening_to_admitting_health_check_s']} | {e['router_replay_s']} "
            f"({rs['replay_load_rounds']}) / {e['replay_reference_s']} | "
            f"{calls['slowest_s']} ({calls['slowest']}; median {calls['median_s_whole_run']}) | "
            f"{t['before']['per_s']} / {t['during']['per_s']} / {t['after']['per_s']} | "
            f"{e['victim_share_after']} |"
        )
    f = report["failures"]
    r = report["replicas"]
    lines += [
        "",
        "## Requests",
        "",
        f"- rollouts {f['rollouts']}, attempts {f['attempts']}, failed attempts "
        f"{f['failed_attempts'] or 0}, by replica {f['failed_by_replica'] or 0} (status: "
        "answered non-2xx; cut: a 200 whose body broke off after bytes had reached the client, "
        "which the router must not retry; transport: no answer from the router)",
        f"- of the cut streams, {f['cut_before_any_data_frame']} had received no SSE data frame "
        "(only the 200 head, which vLLM sends before generating)",
        f"- failed before any response byte while another replica was live (saveable): "
        f"{f['saveable_by_another_replica']}",
        f"- client retries {f['client_retries']}; rollouts lost after all retries "
        f"{f['rollouts_lost_after_retries']}",
        f"- completions answered 404 by a replica (its access log): {r['completion_404s']}; "
        f"5xx: {r['completion_5xx']}; completions reaching a restarted replica before its "
        "admission: "
        + str(sum(e["replica_side"]["completions_before_admission"] for e in report["episodes"])),
        f"- trainer control calls not answered 200: {len(report['control_failures'])}; "
        f"ejections of replicas that were not killed: {len(report['unexpected_ejections'])}",
        "",
    ]
    doubled = [e for e in report["episodes"] if (e["replica_side"]["replay_load_rounds"] or 0) > 1]
    soft = report["soft_episodes"]
    if soft:
        lines += ["## Soft faults", ""]
    for e in soft:
        shown = {k: v for k, v in e.items() if k not in ("phase", "victim")}
        fields_text = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in shown.items())
        lines.append(f"- `{e['phase']}` on replica {e['victim']}: {fields_text}")
    if soft:
        lines.append("")
    if doubled:
        lines += [
            "## Note",
            "",
            f"In {len(doubled)} of {len(report['episodes'])} episodes the replica loaded in two "
            "rounds: the trainer's load of a new version started while it replayed, and load "
            "broadcasts ride along to a replaying replica, so it had one more adapter to load "
            "before it could serve. The trainer's calls do not wait for it (the slowest trainer "
            "call during each re-admission is in the table above).",
            "",
        ]
    return "\n".join(lines)
