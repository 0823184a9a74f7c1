"""One replica as the router sees it: where it is, how busy, whether it may serve, what it holds.

State here is written by the fleet (health, admission, adapters) and by the request path
(`in_flight`, incremented around every forwarded request in a try/finally so the count is exact
on every path: success, error, client disconnect, cancellation). It is read by the routing
policy, which must never write it.
"""

from __future__ import annotations

from lora_router.config import ReplicaAddress
from lora_router.http.upstream import UpstreamPool


class Replica:
    """A vLLM server behind the router. `rid` is stable for the replica's lifetime in the fleet."""

    __slots__ = (
        "adapters",
        "address",
        "admitted",
        "healthy",
        "in_flight",
        "label",
        "name",
        "pool",
        "rid",
    )

    def __init__(self, rid: int, address: ReplicaAddress, pool: UpstreamPool) -> None:
        self.rid = rid
        self.address = address
        self.name = address.name  # ring identity: the same URLs give the same placements
        self.label = str(rid).encode()  # what clients see in x-lora-router-replica
        self.pool = pool
        self.in_flight = 0
        self.healthy = True
        # Admitted: the live adapters and the pause state were replayed onto it; until then it
        # serves no request at all.
        self.admitted = True
        self.adapters: dict[str, str] = {}  # adapter name -> lora_path, as acknowledged

    def __repr__(self) -> str:
        return f"Replica({self.rid}, {self.name}, in_flight={self.in_flight})"
