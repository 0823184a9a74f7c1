"""What an operator reads first: `/router/status` and the periodic log line, read-only views
over the fleet, the fence, the broadcaster, the health monitor, the routing policy, the
request counters, the retry budget and what the replicas report (fleet/telemetry.py).

Reads, never writes: every view is built when it is asked for, from counters the other
modules keep as plain attributes; nothing here sits on the request path. `RouterState` names
what the views read (the live `/metrics` families, families.py, read the same).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from lora_router.fleet.broadcast import Broadcaster
from lora_router.fleet.discovery import Discovery
from lora_router.fleet.fence import AdapterFence
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.health import HealthMonitor
from lora_router.fleet.kv_events import KvEvents
from lora_router.fleet.lifecycle import State
from lora_router.fleet.replica import Replica
from lora_router.fleet.telemetry import WINDOW_S, Telemetry, fleet_figures
from lora_router.observe.accuracy import accuracy_json, overpredicting, totals
from lora_router.observe.metrics import RequestStats
from lora_router.routing.policy import WEIGHT_FULL, Policy
from lora_router.routing.sessions import SessionTable


class RetryCounts(Protocol):
    """What the views read of the proxy's retry budget (proxy/retry.py), which they never
    import: the proxy writes, the views read."""

    @property
    def retries(self) -> Mapping[str, int]: ...  # retries made, by reason

    @property
    def denied(self) -> int: ...  # retries the budget refused


@dataclass
class RouterState:
    """The objects the views read, wired once by the runtime."""

    fleet: Fleet
    fence: AdapterFence
    broadcaster: Broadcaster
    health: HealthMonitor
    policy: Policy
    stats: RequestStats
    budget: RetryCounts
    sessions: SessionTable  # X-Session-ID sessions (routing/sessions.py)
    telemetry: Telemetry | None = None  # set by the runtime once its loop runs
    discovery: Discovery | None = None  # set by the runtime
    kv_events: KvEvents | None = None  # set by the runtime with --policy kv


def report_json(r: Replica, busy_share: float | None = None) -> dict[str, object]:
    """What a replica's own `/metrics` said at the last scrape, or why that is unknown."""
    rep = r.report
    if rep is None:
        return {"status": "unknown", "reason": r.report_error}
    adapters_running = list(rep.adapters_running) if rep.adapters_running is not None else None
    adapters_waiting = list(rep.adapters_waiting) if rep.adapters_waiting is not None else None
    return {
        "status": "ok",
        "age_s": round(time.monotonic() - rep.at, 3),
        "interval_s": round(rep.interval, 3),
        # Seconds it has computed nothing while holding requests (`Report.still_since`); 0: not.
        "still_s": round(rep.at - rep.still_since, 3) if rep.still_since is not None else 0.0,
        "running": rep.running,
        "waiting": rep.waiting,
        "kv_cache_usage": round(rep.kv_cache_usage, 4),
        "prefix_cache_hit_rate": _rounded(rep.hit_rate),
        "prefix_cache_hit_rate_total": _rounded(rep.hit_rate_total),
        "generation_tokens_per_s": _rounded(rep.tokens_per_s, 1),
        "decode_step_s": _rounded(rep.decode_step_s, 6),  # over the interval
        "busy_share": _rounded(busy_share),
        "adapters_running": adapters_running,
        "adapters_waiting": adapters_waiting,
        "max_lora": rep.max_lora,
        "prefix_cache_queries": rep.prefix_queries,
        "prefix_cache_hits": rep.prefix_hits,
        "generation_tokens": rep.generation_tokens,
        "prompt_tokens": rep.prompt_tokens,
    }


def replica_json(r: Replica, busy_share: float | None = None) -> dict[str, object]:
    return {
        "id": r.rid,
        "url": r.name,
        "origin": r.origin,
        "state": r.state.value,
        # The three flags of earlier releases, read off the state, for clients that read them.
        "healthy": r.state in (State.SERVING, State.REPLAYING),
        "admitted": r.live,
        "draining": r.state is State.DRAINING,
        "in_flight": r.in_flight,
        # Its routing weight, 1 unless measurably slower than the fleet, the decode step it was
        # judged on (fleet/pace.py; 0: no sample since it last changed), and why it is not
        # measured ("": it is).
        "weight": r.pace.weight / WEIGHT_FULL,
        "seconds_per_decode_step": round(r.pace.step_s, 6),
        "weight_changes": r.pace.changes,
        "pace_unmeasured": r.pace.unmeasured,
        "breaker": r.breaker.state,
        "breaker_opens": r.breaker.opens,
        "ejections": r.life.ejections,
        "cut_streams": r.cut_streams,
        "adapters": sorted(r.adapters),
        "last_error": r.life.last_error,
        # Why it cannot take part in a weight sync (fleet/readiness.py); empty when it can.
        "sync_problems": [str(f) for f in r.unready],
        "reported": report_json(r, busy_share),
    }


def status(state: RouterState) -> dict[str, object]:
    """The JSON of `GET /router/status`."""
    fence, control = state.fence, state.broadcaster
    adapters = {
        entry.name: {"state": entry.state.value, "path": entry.path}
        for entry in sorted(fence.entries(), key=lambda e: e.name)
    }
    requests: dict[str, int] = {}
    for (route, status_code, _), count in state.stats.requests.items():
        key = f"{route} {status_code}"
        requests[key] = requests.get(key, 0) + count
    telemetry = state.telemetry
    replicas = state.fleet.replicas
    busy = {r.rid: telemetry.busy_share(r) if telemetry else None for r in replicas}
    return {
        "replicas": [replica_json(r, busy[r.rid]) for r in replicas],
        "fleet": fleet_json(state),
        "discovery": [s.json() for s in state.discovery.states] if state.discovery else [],
        "syncs": syncs_json(control),
        "base_models": sorted(state.fleet.base_models),
        # What the replicas disagree on that they must share, each with its fix (fleet.py).
        "disagreements": state.fleet.disagreements(),
        # Members that very likely are one server under two names, each with its fix
        # (fleet/aliases.py).
        "aliases": state.fleet.aliases(),
        "adapters": adapters,
        "fence": {
            "version": fence.version,
            "waiting": fence.waiting,
            "waits": fence.waits,
            "wait_seconds": round(fence.wait_seconds, 6),
            "wait_timeouts": fence.wait_timeouts,
        },
        "paused": state.fleet.pause.query,
        "broadcasts": {
            "received": control.received,
            "pending": control.pending,
            # Unloads answered while requests admitted under the name were unanswered, and
            # the names still draining before their broadcast (fleet/broadcast.py, *Unload*).
            "unloads_deferred": control.unloads_deferred,
            "unloads_draining": {name: fence.held(name) for name in control.deferred()},
            "by_outcome": {f"{op} {outcome}": n for (op, outcome), n in control.counts.items()},
            # Loads retried because a replica answers "No adapter found" (mount lag, or a
            # mistyped path): who, for what, and for how long so far.
            "mount_waits": [
                {
                    "replica": w.replica.rid,
                    "adapter": w.name,
                    "path": w.path,
                    "seconds": round(seconds, 3),
                }
                for w, seconds in control.loads.mount_wait_seconds()
            ],
            # The replicas the running broadcast has waited on long (broadcast.py's
            # `waiting_for`): what it asked, for how long.
            "waiting_for": [
                {"replica": r.rid, "call": what, "seconds": round(seconds, 3)}
                for r, what, seconds in control.waiting_for()
            ],
            # A replay's final pass holding the broadcast lock: broadcasts queue behind it.
            "replay_holding_lock": holding_json(state.health.replay.holding),
        },
        "routing": state.policy.counts.as_dict(),
        # The KV block size prompts are keyed by, from --block-size or the replicas; null while
        # no replica has said it (keyed by vLLM's default, 16, meanwhile: fleet/replay.py).
        "block_size": state.health.replay.block_size,
        "sessions": state.sessions.json(),
        "routing_accuracy": accuracy_json(state.stats.cached),
        # Per replica: its KV-event stream's state (live, stale, gap, restarted, mismatch, off).
        "kv_events": state.kv_events.json() if state.kv_events is not None else None,
        "requests": requests,
        "retries": {**state.budget.retries, "refused_by_budget": state.budget.denied},
        "health": {
            "checks": state.health.checks,
            "check_failures": state.health.check_failures,
            "readmissions": state.health.readmissions,
            "readmission_failures": state.health.readmission_failures,
            "restarts_detected": state.health.restarts_detected,
            # Serving replicas ejected for computing nothing while holding requests (health.py).
            "stalls_detected": state.health.stalls.total() + state.health.departed_stalls,
            # Checks of serving replicas that routed 2xx answers stood in for (fleet/health.py).
            "probes_skipped": state.health.probes_skipped,
            "listings_skipped": state.health.listings_skipped,
            # Replays that did not stick (the listing lacks what was loaded), by replica id.
            "listing_flaps": {str(rid): n for rid, n in sorted(state.health.listing_flaps.items())},
            "last_replica_kept_despite_listing": state.health.listing_kept,
        },
    }


def holding_json(holding: tuple[Replica, float] | None) -> dict[str, object] | None:
    """Which replica's final replay pass holds the broadcast lock, and for how long so far."""
    if holding is None:
        return None
    replica, since = holding
    seconds = asyncio.get_running_loop().time() - since
    return {"replica": replica.rid, "seconds": round(seconds, 3)}


def fleet_json(state: RouterState) -> dict[str, object]:
    """The reporting replicas' figures added up."""
    replicas = state.fleet.replicas
    totals = fleet_figures(replicas, state.telemetry) if state.telemetry else None
    if totals is None or totals.reporting == 0:
        return {"replicas": len(replicas), "reporting": 0}
    return {
        "replicas": len(replicas),
        "reporting": totals.reporting,
        "running": totals.running,
        "waiting": totals.waiting,
        "prefix_cache_hit_rate": _rounded(totals.hit_rate),
        "prefix_cache_hit_rate_total": _rounded(totals.hit_rate_total),
        "generation_tokens_per_s": _rounded(totals.tokens_per_s, 1),
        "busy_share": _rounded(totals.busy_share),
        "window_s": WINDOW_S,
    }


def syncs_json(control: Broadcaster) -> dict[str, object]:
    """The fleet's pause -> resume intervals (the trainer's weight syncs)."""
    clock, now = control.syncs, time.monotonic()
    return {
        "count": clock.count,
        "paused_now": clock.paused_at is not None,
        "paused_seconds": round(clock.paused_seconds(now), 3),
        "paused_share": round(clock.share_total(now), 4),
        "paused_share_window": round(clock.share(now), 4),
        "window_s": WINDOW_S,
        "recent": [
            {"ended_s_ago": round(ago, 3), "seconds": round(seconds, 3)}
            for ago, seconds in clock.recent(now)
        ],
    }


def _rounded(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def summary_line(state: RouterState) -> str:
    """The periodic one-line summary in the log."""
    replicas = state.fleet.replicas
    serving = sum(1 for r in replicas if r.live)
    live = sorted(state.fence.live())
    counts = state.policy.counts.as_dict()
    decisions = " ".join(f"{k}={v}" for k, v in counts.items() if v)
    total = sum(state.stats.requests.values())
    in_flight = ",".join(str(r.in_flight) for r in replicas)
    waiting = ",".join(str(r.report.waiting) if r.report else "?" for r in replicas)
    syncs = state.broadcaster.syncs
    warning = (
        "; routing predicts far more cached tokens than the replicas report (routing_accuracy)"
        if overpredicting(totals(state.stats.cached.reported.values()))
        else ""
    )
    return (
        f"status: {serving}/{len(replicas)} replicas serving, in flight [{in_flight}], "
        f"waiting in replicas [{waiting}], "
        f"{total} requests, adapters live {live or '-'}, paused={state.fleet.pause.query or 'no'}, "
        f"{syncs.count} syncs (paused {syncs.share(time.monotonic()):.0%} of the last "
        f"{WINDOW_S:g} s), fence waits {state.fence.waits} ({state.fence.waiting} waiting), "
        f"routing {decisions or '-'}{warning}"
    )
