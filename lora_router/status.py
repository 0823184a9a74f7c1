"""What an operator reads first: `/router/status`, the periodic log line, and the live gauges of
`/metrics` — read-only views over the fleet, the fence, the broadcaster, the health monitor,
the routing policy, the request counters and what the replicas report (fleet/telemetry.py).

Nothing here changes state or sits on the request path: every view is built when it is asked
for, from counters the other modules keep as plain attributes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import HistogramMetricFamily, Metric

from lora_router.fleet.breaker import CLOSED
from lora_router.fleet.broadcast import Broadcaster
from lora_router.fleet.discovery import Discovery
from lora_router.fleet.fence import AdapterFence
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.health import HealthMonitor
from lora_router.fleet.lifecycle import State
from lora_router.fleet.replica import Replica
from lora_router.fleet.report import Report
from lora_router.fleet.telemetry import WINDOW_S, Telemetry, fleet_figures
from lora_router.metrics import RequestStats, Rows, counter, gauge
from lora_router.proxy.retry import RetryBudget
from lora_router.routing.policy import Policy


@dataclass
class RouterState:
    """The objects the views read, wired once by the runtime."""

    fleet: Fleet
    fence: AdapterFence
    broadcaster: Broadcaster
    health: HealthMonitor
    policy: Policy
    stats: RequestStats
    budget: RetryBudget
    telemetry: Telemetry | None = None  # set by the runtime once its loop runs
    discovery: Discovery | None = None  # set by the runtime


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
        "running": rep.running,
        "waiting": rep.waiting,
        "kv_cache_usage": round(rep.kv_cache_usage, 4),
        "prefix_cache_hit_rate": _rounded(rep.hit_rate),
        "prefix_cache_hit_rate_total": _rounded(rep.hit_rate_total),
        "generation_tokens_per_s": _rounded(rep.tokens_per_s, 1),
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
        "breaker": r.breaker.state,
        "breaker_opens": r.breaker.opens,
        "ejections": r.life.ejections,
        "adapters": sorted(r.adapters),
        "last_error": r.life.last_error,
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
                for w, seconds in control.mount_wait_seconds()
            ],
        },
        "routing": state.policy.counts.as_dict(),
        "requests": requests,
        "retries": {**state.budget.retries, "refused_by_budget": state.budget.denied},
        "health": {
            "checks": state.health.checks,
            "check_failures": state.health.check_failures,
            "readmissions": state.health.readmissions,
            "readmission_failures": state.health.readmission_failures,
            "restarts_detected": state.health.restarts_detected,
            # Checks of serving replicas that routed 2xx answers stood in for (fleet/health.py).
            "probes_skipped": state.health.probes_skipped,
            "listings_skipped": state.health.listings_skipped,
            # Replays that did not stick (the listing lacks what was loaded), by replica id.
            "listing_flaps": {str(rid): n for rid, n in sorted(state.health.listing_flaps.items())},
            "last_replica_kept_despite_listing": state.health.listing_kept,
        },
    }


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
    return (
        f"status: {serving}/{len(replicas)} replicas serving, in flight [{in_flight}], "
        f"waiting in replicas [{waiting}], "
        f"{total} requests, adapters live {live or '-'}, paused={state.fleet.pause.query or 'no'}, "
        f"{syncs.count} syncs (paused {syncs.share(time.monotonic()):.0%} of the last "
        f"{WINDOW_S:g} s), fence waits {state.fence.waits} ({state.fence.waiting} waiting), "
        f"routing {decisions or '-'}"
    )


def metric_families(state: RouterState) -> Iterator[Metric]:
    """The live gauges and counters of `/metrics` (request counters come from `metrics.py`)."""
    replicas = state.fleet.replicas

    def per_replica(value: Callable[[Replica], float]) -> Rows:
        return [([str(r.rid)], value(r)) for r in replicas]

    replica = ["replica"]
    yield gauge(
        "lora_router_in_flight",
        "Requests in flight to each replica.",
        replica,
        per_replica(lambda r: r.in_flight),
    )
    yield gauge(
        "lora_router_replica_up",
        "1 when the replica is serving (its adapters replayed), else 0.",
        replica,
        per_replica(lambda r: float(r.live)),
    )
    yield gauge(
        "lora_router_breaker_open",
        "1 when the replica's circuit breaker is open or half-open, else 0.",
        replica,
        per_replica(lambda r: float(r.breaker.state != CLOSED)),
    )
    yield counter(
        "lora_router_ejections",
        "Times each replica was taken out of service.",
        replica,
        per_replica(lambda r: r.life.ejections),
    )
    yield counter(
        "lora_router_breaker_opens",
        "Times each replica's circuit breaker opened.",
        replica,
        per_replica(lambda r: r.breaker.opens),
    )
    flaps = state.health.listing_flaps
    yield counter(
        "lora_router_replica_listing_flaps",
        "Re-admissions of each replica that did not stick: it lacked a replayed adapter again "
        "soon after (a URL that is a load balancer over several vLLM servers?); each one "
        "doubles the wait before the next re-admission.",
        replica,
        per_replica(lambda r: flaps.get(r.rid, 0)),
    )
    sources = state.discovery.states if state.discovery else []
    yield gauge(
        "lora_router_discovery_members",
        "Members in each discovery source's last good answer.",
        ["source"],
        [([s.label], len(s.members)) for s in sources],
    )
    yield gauge(
        "lora_router_discovery_source_ok",
        "1 when the discovery source's last read succeeded, 0 when its last good set is kept.",
        ["source"],
        [([s.label], float(not s.error)) for s in sources],
    )
    yield counter(
        "lora_router_discovery_read_errors",
        "Failed reads of each discovery source.",
        ["source"],
        [([s.label], s.errors) for s in sources],
    )
    budget = state.budget
    yield counter(
        "lora_router_retries",
        "Routed requests tried again on another replica, by reason (transport: failed before "
        "any response byte; 5xx: answered 5xx; missing_adapter: answered 404 for a live "
        "adapter).",
        ["reason"],
        [([reason], n) for reason, n in sorted(budget.retries.items())],
    )
    yield counter(
        "lora_router_retries_refused",
        "Retries the retry budget (--retry-budget) refused.",
        [],
        [([], budget.denied)],
    )
    yield counter(
        "lora_router_routing_decisions",
        "Routing decisions by kind (sibling, continuation, spill, fresh, nokey, balanced).",
        ["kind"],
        [([kind], n) for kind, n in state.policy.counts.as_dict().items()],
    )
    fence = state.fence
    yield counter(
        "lora_router_fence_waits", "Requests that waited at the fence.", [], [([], fence.waits)]
    )
    yield counter(
        "lora_router_fence_wait_seconds",
        "Total time requests waited at the fence.",
        [],
        [([], fence.wait_seconds)],
    )
    yield counter(
        "lora_router_fence_timeouts",
        "Requests that gave up waiting at the fence.",
        [],
        [([], fence.wait_timeouts)],
    )
    yield gauge(
        "lora_router_fence_waiting", "Requests waiting at the fence now.", [], [([], fence.waiting)]
    )
    control = state.broadcaster
    yield counter(
        "lora_router_broadcasts",
        "Control operations broadcast to the fleet, by operation and outcome.",
        ["op", "outcome"],
        [([op, outcome], n) for (op, outcome), n in sorted(control.counts.items())],
    )
    yield counter(
        "lora_router_broadcast_seconds",
        "Total time of the broadcasts, by operation and outcome.",
        ["op", "outcome"],
        [([op, outcome], s) for (op, outcome), s in sorted(control.seconds.items())],
    )
    waiting: dict[int, float] = {}
    for w, seconds in control.mount_wait_seconds():
        waiting[w.replica.rid] = max(waiting.get(w.replica.rid, 0.0), seconds)
    yield gauge(
        "lora_router_load_mount_wait_seconds",
        "How long each replica has answered 'No adapter found' to the load being retried "
        "(0: none); a value near --load-deadline is a path the replica cannot see.",
        replica,
        per_replica(lambda r: waiting.get(r.rid, 0.0)),
    )
    live = len(fence.live())
    yield gauge("lora_router_adapters_live", "Adapters that pass the fence.", [], [([], live)])
    yield gauge(
        "lora_router_paused",
        "1 when the fleet was last paused, 0 when resumed.",
        [],
        [([], float(state.fleet.pause.paused))],
    )

    yield from telemetry_families(state)


def telemetry_families(state: RouterState) -> Iterator[Metric]:
    """What the replicas report, per replica and for the fleet, and the weight syncs."""
    replica = ["replica"]
    reports = [(r, r.report) for r in state.fleet.replicas]
    known = [(r, rep) for r, rep in reports if rep is not None]
    yield gauge(
        "lora_router_replica_reporting",
        "1 when the replica's last /metrics answer was read, 0 when its figures are unknown.",
        replica,
        [([str(r.rid)], float(rep is not None)) for r, rep in reports],
    )

    for kind, name, doc, value in _REPORTED:
        rows = [([str(r.rid)], v) for r, rep in known if (v := value(rep)) is not None]
        yield kind(name, doc, replica, rows)
    telemetry = state.telemetry
    if telemetry is not None:
        yield gauge(
            "lora_router_replica_busy_share",
            f"Share of the last {WINDOW_S:g} s of unpaused scrapes in which the replica ran or "
            "queued requests.",
            replica,
            [([str(r.rid)], s) for r, _ in known if (s := telemetry.busy_share(r)) is not None],
        )
        totals = fleet_figures(state.fleet.replicas, telemetry)
        yield gauge(
            "lora_router_fleet_prefix_cache_hit_ratio",
            "Prefix-cache hits / queries over the reporting replicas' last intervals.",
            [],
            [([], totals.hit_rate)] if totals.hit_rate is not None else [],
        )
        yield gauge(
            "lora_router_fleet_generation_tokens_per_second",
            "Tokens generated per second, summed over the reporting replicas.",
            [],
            [([], totals.tokens_per_s)] if totals.tokens_per_s is not None else [],
        )
    clock, now = state.broadcaster.syncs, time.monotonic()
    yield counter(
        "lora_router_syncs",
        "Weight syncs: a /pause followed by a /resume.",
        [],
        [([], clock.count)],
    )
    yield counter(
        "lora_router_sync_paused_seconds",
        "Time the fleet spent paused for syncs (pause -> resume, the one in progress included); "
        "its rate is the share of time paused.",
        [],
        [([], clock.paused_seconds(now))],
    )
    durations = HistogramMetricFamily(
        "lora_router_sync_duration_seconds", "Duration of each finished sync (pause -> resume)."
    )
    durations.add_metric([], clock.durations.cumulative(), sum_value=clock.durations.total)
    yield durations


def _count(names: tuple[str, ...] | None) -> int | None:
    return None if names is None else len(names)


# What each replica reported, one family per figure: (kind, name, help, the figure or None).
_REPORTED: tuple[tuple[Callable[..., Metric], str, str, Callable[[Report], float | None]], ...] = (
    (
        gauge,
        "lora_router_replica_requests_running",
        "vllm:num_requests_running as the replica last reported it.",
        lambda rep: rep.running,
    ),
    (
        gauge,
        "lora_router_replica_requests_waiting",
        "vllm:num_requests_waiting as the replica last reported it.",
        lambda rep: rep.waiting,
    ),
    (
        gauge,
        "lora_router_replica_kv_cache_usage",
        "vllm:kv_cache_usage_perc as the replica last reported it (1 means full).",
        lambda rep: rep.kv_cache_usage,
    ),
    (
        gauge,
        "lora_router_replica_prefix_cache_hit_ratio",
        "Prefix-cache hits / queries (tokens) between the replica's last two reports.",
        lambda rep: rep.hit_rate,
    ),
    (
        gauge,
        "lora_router_replica_generation_tokens_per_second",
        "Tokens generated per second between the replica's last two reports.",
        lambda rep: rep.tokens_per_s,
    ),
    (
        gauge,
        "lora_router_replica_adapters_running",
        "Adapters with requests running, from vllm:lora_requests_info.",
        lambda rep: _count(rep.adapters_running),
    ),
    (
        gauge,
        "lora_router_replica_adapters_waiting",
        "Adapters with requests waiting, from vllm:lora_requests_info.",
        lambda rep: _count(rep.adapters_waiting),
    ),
    (
        counter,
        "lora_router_replica_prefix_cache_queries",
        "vllm:prefix_cache_queries_total (tokens) as last reported; resets with the replica.",
        lambda rep: rep.prefix_queries,
    ),
    (
        counter,
        "lora_router_replica_prefix_cache_hits",
        "vllm:prefix_cache_hits_total (tokens) as last reported; resets with the replica.",
        lambda rep: rep.prefix_hits,
    ),
    (
        counter,
        "lora_router_replica_generation_tokens",
        "vllm:generation_tokens_total as last reported; resets with the replica.",
        lambda rep: rep.generation_tokens,
    ),
    (
        counter,
        "lora_router_replica_prompt_tokens",
        "vllm:prompt_tokens_total as last reported; resets with the replica.",
        lambda rep: rep.prompt_tokens,
    ),
)
