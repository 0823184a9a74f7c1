"""What a parsed client request is, and what serving it relies on: the `Request` itself, the
`Limits` a connection enforces, the `ResponseSink` an answer streams into, and the
`ConnectionCount` every connection of one listener shares (http/server.py owns the rules).

Rules: a `Request` is complete when built (its whole body read); its `body` becomes b"" once a
response head for it reaches the client, and from then on nothing may send it again.
`ConnectionCount.buffered` counts the request body bytes held over all connections of a
listener, exactly, from a body's head until its answer begins or its connection goes.
Never: parse bytes, hold a transport, or know the application.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

import msgspec


class Connection(Protocol):
    """What a `ConnectionCount` needs of the connections it counts."""

    def close_when_idle(self) -> None: ...

    def abort(self) -> None: ...


# vllm-router's session header, whose values the parser picks out for `Request.session`
# (routing/sessions.py owns its rules).
SESSION_HEADER = b"x-session-id"


class Request(msgspec.Struct):
    """One parsed client request; the body is complete. (A msgspec Struct rather than a
    dataclass: built in C, with no Python `__init__` frame, once per request.)

    `body` becomes b"" once a response head for it reaches the client (`ClientConnection.head`):
    from then on nothing may send the request again (the retry rule, proxy/retry.py).
    """

    method: bytes
    target: bytes  # origin-form path and query, exactly as sent
    path: bytes  # target without the query
    query: bytes
    headers: list[tuple[bytes, bytes]]  # names lower-cased, values verbatim
    body: bytes
    keep_alive: bool
    http11: bool
    client_ip: bytes
    # The values of its SESSION_HEADER headers, in order, picked out as the head is parsed
    # (http/server.py): the routed path reads them here, with no scan of `headers`.
    session: tuple[bytes, ...] = ()

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


class Limits(Protocol):
    """The settings a connection reads (a `Config` is one; read-only, as a frozen Config is)."""

    @property
    def header_timeout(self) -> float: ...
    @property
    def body_timeout(self) -> float: ...
    @property
    def keepalive_timeout(self) -> float: ...
    @property
    def idle_timeout(self) -> float: ...
    @property
    def max_body_bytes(self) -> int: ...
    @property
    def max_buffered_bytes(self) -> int: ...
    @property
    def max_header_bytes(self) -> int: ...
    @property
    def max_headers(self) -> int: ...


class Upstream(Protocol):
    """The replica connection an answer streams from, as its client connection drives it: the
    client's flow control, and an abort when the client goes (http/upstream.py's
    `UpstreamConnection`)."""

    def pause_reading(self) -> None:
        """The client does not read: stop reading the replica (its silence is not counted)."""

    def resume_reading(self) -> None: ...

    def abort(self) -> None: ...


class ResponseSink(Protocol):
    """What the upstream side needs of a client connection to stream a response into it."""

    @property
    def keep_alive(self) -> bool:
        """Whether the client's connection may stay open after this response."""

    def head(self, status: int, data: bytes, body: memoryview | None = None) -> bool:
        """The response head (maybe with the first body bytes), then `body` if given: the
        response's first write. Returns whether the answer goes on to the client; False: the
        sink held it back for another attempt (proxy/routed.py), and nothing more of it is
        wanted (http/upstream.py then ends the exchange at once)."""

    def write(self, data: bytes | memoryview) -> None:
        """Body bytes, as they arrive."""

    def on_upstream(self, upstream: Upstream | None) -> None:
        """The replica connection now streaming into the client (None: it ended)."""


class ConnectionCount:
    """Open client connections and the request body bytes they buffer (module docstring),
    shared by every connection of one listening socket."""

    __slots__ = ("_drained", "buffered", "limit", "max_buffered", "open")

    def __init__(self, limit: int, max_buffered: int) -> None:
        self.limit = limit
        self.open: set[Connection] = set()
        self._drained: asyncio.Event | None = None
        self.buffered = 0
        self.max_buffered = max_buffered

    def discard(self, conn: Connection) -> None:
        self.open.discard(conn)
        if not self.open and self._drained is not None:
            self._drained.set()

    async def drain(self, grace: float) -> None:
        """Close idle connections now, let busy ones finish their request, abort after `grace`."""
        self._drained = asyncio.Event()
        for conn in list(self.open):
            conn.close_when_idle()
        if self.open:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), grace)
        for conn in list(self.open):
            conn.abort()
