"""The live Prometheus families of `/metrics`: per replica, per discovery source, the retries,
the routing decisions and their accuracy (accuracy.py), the fence, the broadcasts, what the
replicas report and the weight syncs, built at scrape time from the state `RouterState` names
(the request counters are `metrics.py`'s).

Reads, never writes: every family is built when `/metrics` is scraped, from counters the
other modules keep as plain attributes; nothing here sits on the request path.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client.core import HistogramMetricFamily, Metric

from lora_router.fleet.breaker import CLOSED
from lora_router.fleet.replica import Replica
from lora_router.fleet.report import Report
from lora_router.fleet.telemetry import WINDOW_S, fleet_figures
from lora_router.observe.accuracy import accuracy_families
from lora_router.observe.metrics import Rows, counter, gauge
from lora_router.observe.status import RouterState
from lora_router.routing.policy import WEIGHT_FULL


def metric_families(state: RouterState) -> Iterator[Metric]:
    """The live gauges and counters of `/metrics` (request counters come from metrics.py)."""
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
    yield gauge(
        "lora_router_replica_weight",
        "Each replica's routing weight, its relative speed as measured from its decode step "
        "(vllm:inter_token_latency_seconds, fleet/pace.py): 1 unless measurably slower than "
        "the fleet.",
        replica,
        per_replica(lambda r: r.pace.weight / WEIGHT_FULL),
    )
    yield counter(
        "lora_router_ejections",
        "Times each replica was taken out of service.",
        replica,
        per_replica(lambda r: r.life.ejections),
    )
    yield counter(
        "lora_router_cut_streams",
        "Answers each replica broke off after their head had reached the client (a crash "
        "mid-stream): the client saw a truncated answer; never retried.",
        replica,
        per_replica(lambda r: r.cut_streams),
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
    stalls = state.health.stalls
    yield counter(
        "lora_router_replica_stalls",
        "Times each replica was ejected as stalled: no token computed for --stall-timeout while "
        "the router held requests on it, though its /health answered (an engine that hangs).",
        replica,
        per_replica(lambda r: stalls.get(r.rid, 0)),
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
        "Routing decisions by kind (sibling, continuation, spill, fresh, kv, nokey, balanced).",
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
    for w, seconds in control.loads.mount_wait_seconds():
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
    yield from accuracy_families(state.stats.cached)
    yield from kv_families(state)


def kv_families(state: RouterState) -> Iterator[Metric]:
    """With `--policy kv`: what each replica's KV-event stream skipped (fleet/kv_wire.py's caps)
    and the bytes its blocks cost in the KV index."""
    kv = state.kv_events
    if kv is None:
        return
    streams = [(r, s) for r in state.fleet.replicas if (s := kv.streams.get(r.name)) is not None]
    for field, doc in _KV_SKIPPED:
        rows: Rows = [([str(r.rid)], getattr(s, field)) for r, s in streams]
        yield counter(f"lora_router_kv_events_{field}", doc, ["replica"], rows)
    yield gauge(
        "lora_router_kv_index_bytes",
        "What each replica's blocks cost in the KV index, in bytes (bounded in all by its "
        "max_bytes).",
        ["replica"],
        [([str(r.rid)], kv.index.held_bytes(r.name)) for r, _ in streams],
    )


_KV_SKIPPED = (
    ("malformed", "KV-event messages skipped: not (topic, sequence number, payload)."),
    ("undecodable", "KV-event payloads skipped: not a batch of vLLM's events (each a gap)."),
    ("refused", "KV stored events skipped: a block hash or adapter name over its cap."),
)


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
