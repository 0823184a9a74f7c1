"""One replica as the router sees it: where it is, how busy, whether it may serve, what it holds.

State here is written by the fleet (health, admission, adapters) and by the request path
(`in_flight` and `in_flight_tokens`, the requests and their prompt tokens, added around every
forwarded request in a try/finally so the counts are exact on every path: success, error,
client disconnect, cancellation) and by the telemetry loop (`report`: what the replica's own
`/metrics` said at the last scrape, its queue included, or None when unknown;
fleet/telemetry.py). It is read by the routing policy, which must never write it.

Life cycle: a replica is *healthy* when its last health judgement passed, and *admitted* when,
on top of that, every live adapter and the fleet's pause state were replayed onto it. Only
admitted replicas receive traffic or broadcasts; an ejected one is neither healthy nor
admitted, and goes back through a replay before it serves again. `draining` marks a replica an
operator is removing: it takes nothing new and leaves once its in-flight requests are done.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lora_router.config import ReplicaAddress
from lora_router.fleet.breaker import CircuitBreaker
from lora_router.http.upstream import UpstreamPool

if TYPE_CHECKING:
    from lora_router.fleet.telemetry import Report


class Replica:
    """A vLLM server behind the router. `rid` is stable for the replica's lifetime in the fleet."""

    __slots__ = (
        "adapters",
        "admitted",
        "breaker",
        "draining",
        "ejections",
        "healthy",
        "host_header",
        "in_flight",
        "in_flight_tokens",
        "label",
        "last_error",
        "load_seconds",
        "name",
        "pool",
        "replaying",
        "report",
        "report_error",
        "rid",
        "target_prefix",
    )

    def __init__(
        self, rid: int, address: ReplicaAddress, pool: UpstreamPool, breaker: CircuitBreaker
    ) -> None:
        self.rid = rid
        self.name = address.name  # ring identity: the same URLs give the same placements
        self.label = str(rid).encode()  # what clients see in x-lora-router-replica
        # The request line's path prefix and the Host header, as they go on the wire.
        self.target_prefix = address.path_prefix.encode()
        self.host_header = address.host_header.encode()
        self.pool = pool
        self.breaker = breaker
        self.in_flight = 0
        self.in_flight_tokens = 0  # prompt tokens of the requests in flight (fresh placement)
        self.healthy = True
        # Admitted: the live adapters and the pause state were replayed onto it; until then it
        # serves no request at all.
        self.admitted = True
        self.draining = False
        # Being brought to the fleet's state (fleet/replay.py): load broadcasts that start
        # meanwhile are sent to it too, best effort, so its final pass finds them done.
        self.replaying = False
        self.adapters: dict[str, str] = {}  # adapter name -> lora_path, as acknowledged
        self.ejections = 0
        self.last_error = ""  # why it was last ejected or refused admission
        self.load_seconds = 0.0  # how long its last adapter load took (broadcast order)
        # Its own /metrics at the last scrape (running, waiting, KV, ...); None: unknown, with
        # the reason in report_error. Never a reason to eject it.
        self.report: Report | None = None
        self.report_error = "not scraped yet"

    @property
    def live(self) -> bool:
        """Takes traffic and broadcasts."""
        return self.healthy and self.admitted and not self.draining

    def describe(self) -> str:
        """How errors name a replica: index and URL (the URL never carries a credential)."""
        return f"Replica {self.rid} ({self.name})"

    def __repr__(self) -> str:
        return f"Replica({self.rid}, {self.name}, in_flight={self.in_flight})"
