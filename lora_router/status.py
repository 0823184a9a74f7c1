"""What an operator reads first: `/router/status`, the periodic log line, and the live gauges of
`/metrics` — read-only views over the fleet, the fence, the control plane, the health monitor,
the routing policy and the request counters.

Nothing here changes state or sits on the request path: every view is built when it is asked
for, from counters the other modules keep as plain attributes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client.core import Metric

from lora_router.body import CompletionReader
from lora_router.fleet.breaker import CLOSED
from lora_router.fleet.control import ControlPlane
from lora_router.fleet.fence import AdapterFence
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.health import HealthMonitor
from lora_router.fleet.replica import Replica
from lora_router.metrics import RequestStats, Rows, counter, gauge
from lora_router.retry_budget import RetryBudget
from lora_router.routing.policy import Policy


@dataclass
class RouterState:
    """The objects the views read, wired once by the runtime."""

    fleet: Fleet
    fence: AdapterFence
    control: ControlPlane
    health: HealthMonitor
    policy: Policy
    stats: RequestStats
    reader: CompletionReader
    budget: RetryBudget


def replica_json(r: Replica) -> dict[str, object]:
    return {
        "id": r.rid,
        "url": r.name,
        "healthy": r.healthy,
        "admitted": r.admitted,
        "draining": r.draining,
        "in_flight": r.in_flight,
        "breaker": r.breaker.state,
        "breaker_opens": r.breaker.opens,
        "ejections": r.ejections,
        "adapters": sorted(r.adapters),
        "last_error": r.last_error,
    }


def status(state: RouterState) -> dict[str, object]:
    """The JSON of `GET /router/status`."""
    fence, control = state.fence, state.control
    adapters = {
        entry.name: {"state": entry.state.value, "path": entry.path}
        for entry in sorted(fence.entries(), key=lambda e: e.name)
    }
    requests: dict[str, int] = {}
    for (route, status_code, _), count in state.stats.requests.items():
        key = f"{route} {status_code}"
        requests[key] = requests.get(key, 0) + count
    return {
        "replicas": [replica_json(r) for r in state.fleet.replicas],
        "base_models": sorted(state.fleet.base_models),
        "adapters": adapters,
        "fence": {
            "version": fence.version,
            "waiting": fence.waiting,
            "waits": fence.waits,
            "wait_seconds": round(fence.wait_seconds, 6),
            "wait_timeouts": fence.wait_timeouts,
        },
        "paused": control.paused,
        "broadcasts": {
            "received": control.received,
            "pending": control.pending,
            "by_outcome": {f"{op} {outcome}": n for (op, outcome), n in control.counts.items()},
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
            # Replays that did not stick (the listing lacks what was loaded), by replica id.
            "listing_flaps": {str(rid): n for rid, n in sorted(state.health.listing_flaps.items())},
            "last_replica_kept_despite_listing": state.health.listing_kept,
        },
    }


def summary_line(state: RouterState) -> str:
    """The periodic one-line summary in the log."""
    replicas = state.fleet.replicas
    serving = sum(1 for r in replicas if r.healthy and r.admitted)
    live = sorted(state.fence.live())
    counts = state.policy.counts.as_dict()
    decisions = " ".join(f"{k}={v}" for k, v in counts.items() if v)
    total = sum(state.stats.requests.values())
    in_flight = ",".join(str(r.in_flight) for r in replicas)
    return (
        f"status: {serving}/{len(replicas)} replicas serving, in flight [{in_flight}], "
        f"{total} requests, adapters live {live or '-'}, paused={state.control.paused or 'no'}, "
        f"fence waits {state.fence.waits} ({state.fence.waiting} waiting), "
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
        "1 when the replica is healthy and admitted (its adapters replayed), else 0.",
        replica,
        per_replica(lambda r: float(r.healthy and r.admitted)),
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
        per_replica(lambda r: r.ejections),
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
    yield counter(
        "lora_router_body_reuses",
        "Completion bodies identical to one read shortly before (the samples of a GRPO "
        "prompt), routed on that reading instead of a new one.",
        [],
        [([], state.reader.hits)],
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
    control = state.control
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
    live = len(fence.live())
    yield gauge("lora_router_adapters_live", "Adapters that pass the fence.", [], [([], live)])
    yield gauge(
        "lora_router_paused",
        "1 when the fleet was last paused, 0 when resumed.",
        [],
        [([], float(control.paused is not None))],
    )
