"""The set of replicas behind the router, and which of them may serve a given model.

This is the data plane's view of the fleet; adapter broadcasts, the version fence and health
checks build on it (see the other modules of this package).
"""

from __future__ import annotations

import ssl
from collections.abc import Collection

from lora_router.config import Config, ReplicaAddress
from lora_router.fleet.replica import Replica
from lora_router.http.upstream import UpstreamPool


class Fleet:
    """The replicas, in the order they were given (ids are never reused)."""

    def __init__(self, config: Config, ssl_context: ssl.SSLContext | None) -> None:
        self._config = config
        self._ssl = ssl_context
        self._next_rid = 0
        self.replicas: list[Replica] = []
        for address in config.replicas:
            self.add(address)

    def add(self, address: ReplicaAddress) -> Replica:
        config = self._config
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
        replica = Replica(rid, address, pool)
        self.replicas.append(replica)
        return replica

    def routable(self, model: str | None, exclude: Collection[Replica] = ()) -> list[Replica]:
        """Replicas that may receive a request for `model` now."""
        return [
            r
            for r in self.replicas
            if r.healthy and r.admitted and r not in exclude and (True)
        ]

    def close(self) -> None:
        for replica in self.replicas:
            replica.pool.close()
