"""The set of replicas behind the router, and which of them may serve a given model.

This is the data plane's view of the fleet: membership (add, remove, with ids never reused),
the pause the fleet is under (`pause`, a `PauseIntent`), and `routable`, the one function the
routed path asks "who may take a request for this model now?". A replica's service state is
its `Lifecycle` (lifecycle.py), changed only by that object's methods; this module reads it
and does no I/O.

`routable` is the second half of the fence's invariant: a replica is a candidate for adapter A
only when its state is *serving* (which it reaches only through a completed replay), its
circuit breaker lets traffic through, and its acknowledged adapters include A.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from lora_router.config import Config, ReplicaAddress
from lora_router.fleet.breaker import CLOSED, CircuitBreaker
from lora_router.fleet.lifecycle import Lifecycle, State
from lora_router.fleet.replica import Replica
from lora_router.http.upstream import UpstreamPool


@dataclass(frozen=True, slots=True)
class PauseIntent:
    """The pause the trainer last asked the fleet for, replayed onto replicas that come back.

    `known` stays False until the router has broadcast a /pause or a /resume, so a replica
    coming back is not resumed on a guess; `query` is the last /pause's query string (its
    mode), None after a /resume."""

    known: bool = False
    query: str | None = None

    @property
    def paused(self) -> bool:
        return self.query is not None


class Fleet:
    """The replicas, in the order they were given (ids are never reused)."""

    def __init__(self, config: Config, ssl_context: ssl.SSLContext | None = None) -> None:
        self._config = config
        self._ssl = ssl_context
        self._next_rid = 0
        self.replicas: list[Replica] = []
        self.base_models: set[str] = set()  # names that are the base model, not an adapter
        # Set by the broadcaster when a /pause or /resume is asked (before its outcome).
        self.pause = PauseIntent()
        # Called with every member's name after each add or remove (the policy's ring).
        self.on_members: Callable[[Sequence[str]], None] | None = None
        for address in config.replicas:
            self.add(address)

    def add(self, address: ReplicaAddress, *, joining: bool = False) -> Replica:
        """A replica in the fleet: serving (the configured ones, read by discovery before the
        router accepts a request) or, `joining`, out of service until its replay."""
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
        life = Lifecycle(
            f"Replica {rid} ({address.name})",
            config.health_interval,
            State.JOINING if joining else State.SERVING,
        )
        breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown)
        replica = Replica(rid, address, pool, breaker, life)
        self.replicas.append(replica)
        self._members_changed()
        return replica

    def remove(self, replica: Replica) -> None:
        """Take a replica out of the fleet for good (its requests have drained)."""
        if replica in self.replicas:
            self.replicas.remove(replica)
            replica.life.remove()
            replica.pool.close()
            self._members_changed()

    def find(self, rid: int) -> Replica | None:
        return next((r for r in self.replicas if r.rid == rid), None)

    def by_name(self, name: str) -> Replica | None:
        return next((r for r in self.replicas if r.name == name), None)

    def live(self) -> list[Replica]:
        """Replicas that take traffic and broadcasts (see `Replica.live`)."""
        return [r for r in self.replicas if r.live]

    def others_serving(self, replica: Replica) -> bool:
        """Whether a replica other than `replica` serves (the lifecycle's last-replica rules)."""
        return any(r.live for r in self.replicas if r is not replica)

    def routable(self, model: str | None, exclude: Collection[Replica] = ()) -> list[Replica]:
        """Replicas that may receive a request for `model` now.

        For an adapter, only replicas that acknowledged loading it; the fence has already
        made sure every live replica did before the first request was let through.
        """
        adapter = model is not None and model not in self.base_models
        now = 0.0  # read only when a breaker is not closed (rare)
        out = []
        for r in self.replicas:
            if r.life.state is not State.SERVING or r in exclude:
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
