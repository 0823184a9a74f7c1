"""The set of replicas behind the router, and which of them may serve a given model.

This is the data plane's view of the fleet: membership (add, remove, with ids never reused),
and `routable`, the one function the routed path asks "who may take a request for this model
now?". Adapter broadcasts and the version fence (control.py, fence.py) and health checks
(health.py) write the replica state that `routable` reads; this module does no I/O.

`routable` is the second half of the fence's invariant: a replica is a candidate for adapter A
only when it is live (healthy, admitted after its replay, not draining), its circuit breaker
lets traffic through, and its acknowledged adapters include A.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Collection, Sequence

from lora_router.config import Config, ReplicaAddress
from lora_router.fleet.breaker import CLOSED, CircuitBreaker
from lora_router.fleet.replica import Replica
from lora_router.http.upstream import UpstreamPool

log = logging.getLogger(__name__)


class Fleet:
    """The replicas, in the order they were given (ids are never reused)."""

    def __init__(self, config: Config, ssl_context: ssl.SSLContext | None = None) -> None:
        self._config = config
        self._ssl = ssl_context
        self._next_rid = 0
        self.replicas: list[Replica] = []
        self.base_models: set[str] = set()  # names that are the base model, not an adapter
        # Called with every member's name after each add or remove (the policy's ring).
        self.on_members: Callable[[Sequence[str]], None] | None = None
        for address in config.replicas:
            self.add(address)

    def add(self, address: ReplicaAddress, *, admitted: bool = True) -> Replica:
        config = self._config
        if address.tls and self._ssl is None:
            self._ssl = config.tls_context()  # a first https replica added at run time
        rid = self._next_rid
        self._next_rid += 1
        pool = UpstreamPool(
            address,
            str(rid).encode(),
            self._ssl,
            connect_timeout=config.connect_timeout,
            first_byte_timeout=config.first_byte_timeout,
            stream_idle_timeout=config.idle_timeout,
            idle_timeout=config.upstream_idle_timeout,
            max_connections=config.max_upstream_connections,
        )
        replica = Replica(
            rid, address, pool, CircuitBreaker(config.breaker_failures, config.breaker_cooldown)
        )
        replica.admitted = admitted
        self.replicas.append(replica)
        self._members_changed()
        return replica

    def remove(self, replica: Replica) -> None:
        """Take a replica out of the fleet for good (its requests have drained)."""
        if replica in self.replicas:
            self.replicas.remove(replica)
            replica.admitted = False
            replica.pool.close()
            self._members_changed()

    def eject(self, replica: Replica, reason: str) -> None:
        """Take a replica out of service until health.py re-admits it with a replay."""
        if replica.healthy or replica.admitted:
            replica.ejections += 1
            log.warning("ejecting %s: %s", replica.describe(), reason)
        replica.healthy = False
        replica.admitted = False
        replica.last_error = reason

    def find(self, rid: int) -> Replica | None:
        return next((r for r in self.replicas if r.rid == rid), None)

    def by_name(self, name: str) -> Replica | None:
        return next((r for r in self.replicas if r.name == name), None)

    def live(self) -> list[Replica]:
        """Replicas that take traffic and broadcasts (see `Replica.live`)."""
        return [r for r in self.replicas if r.live]

    def routable(self, model: str | None, exclude: Collection[Replica] = ()) -> list[Replica]:
        """Replicas that may receive a request for `model` now.

        For an adapter, only replicas that acknowledged loading it; the fence has already
        made sure every live replica did before the first request was let through.
        """
        adapter = model is not None and model not in self.base_models
        now = 0.0  # read only when a breaker is not closed (rare)
        out = []
        for r in self.replicas:
            if not r.healthy or not r.admitted or r.draining or r in exclude:
                continue
            if adapter and model not in r.adapters:
                continue
            if r.breaker.state != CLOSED:
                now = now or asyncio.get_running_loop().time()
                if not r.breaker.allows(now):
                    continue
            out.append(r)
        return out

    def _members_changed(self) -> None:
        if self.on_members is not None:
            self.on_members([r.name for r in self.replicas])

    def close(self) -> None:
        for replica in self.replicas:
            replica.pool.close()
