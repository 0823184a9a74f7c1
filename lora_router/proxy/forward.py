"""Forwarding one client request to one replica: the request head it goes with, and the count
of the replica's work around the exchange.

`Forwarder.exchange` builds the exchange (the head by http/headers.py's rules, with the
router's token and a request id when the client sent none); `Forwarder.send` carries it on the
replica's pool (http/upstream.py), counted by `Fleet.started`/`finished` while it runs, and
names the replica in the client's metrics (`ClientConnection.replica`). Used by the routed
completion (proxy/routed.py) and by the routes forwarded to one replica (proxy/dispatch.py).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable

from lora_router.config import Config
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.replica import Replica
from lora_router.http.exchange import Exchange
from lora_router.http.headers import upstream_request_head
from lora_router.http.request import Request, ResponseSink
from lora_router.http.server import ClientConnection


class Forwarder:
    """Sends requests to replicas (module docstring)."""

    __slots__ = ("_authorization", "_new_request_id", "fleet")

    def __init__(self, config: Config, fleet: Fleet) -> None:
        self.fleet = fleet
        token = config.token.reveal()
        self._authorization = f"Bearer {token}".encode() if token else None
        # Request ids for requests that come without one: unique per process and cheap (a
        # counter behind a random prefix, not a uuid4 and its getrandom call per request).
        # 32 hex digits like a uuid4's: 16 random, then a 64-bit counter. A C-level callable:
        # no Python frame per id.
        ids = map((os.urandom(8).hex().encode() + b"%016x").__mod__, itertools.count(1))
        self._new_request_id: Callable[[], bytes] = ids.__next__

    def exchange(self, request: Request, replica: Replica, sink: ResponseSink) -> Exchange:
        """`request`'s exchange with `replica`, its answer written into `sink`. Head and body
        are joined here and held by the exchange alone, until the first response byte
        (http/exchange.py)."""
        head = upstream_request_head(
            request.method,
            replica.target_prefix + request.target,
            request.headers,
            host=replica.host_header,
            client_ip=request.client_ip,
            body_length=len(request.body),
            authorization=self._authorization,
            new_request_id=self._new_request_id,
        )
        return Exchange(sink, head + request.body, request.method == b"HEAD", request.http11)

    async def send(
        self, ex: Exchange, conn: ClientConnection, replica: Replica, tokens: int = 0
    ) -> None:
        """Carry `ex` on `replica` (its work counted as `tokens` prompt tokens meanwhile);
        raises UpstreamError. The client may keep its connection only if the answer allows."""
        fleet = self.fleet
        fleet.started(replica, tokens)
        conn.replica = replica.label
        try:
            keep_alive = await replica.pool.forward(ex)
        finally:
            fleet.finished(replica, tokens)
        conn.keep_alive = conn.keep_alive and keep_alive
