"""The client side of the proxy: one asyncio `Protocol` per client connection, parsed by httptools.

A `ClientConnection` turns bytes into `Request` objects and hands each to the application
(`handler(request, connection)`), one at a time per connection, in order. It owns the
connection's limits and deadlines:

- headers must arrive within `header_timeout`, and the body within `body_timeout` after them
  (a fixed deadline, not an idle timer: a client trickling one byte a second is still cut off);
- header bytes, header count and body bytes are capped (431 / 413);
- an idle keep-alive connection is closed after `keepalive_timeout`.

The request body is buffered (it is needed whole to route and, before the first response byte,
to retry); response bodies are never buffered here: the upstream side writes them straight to
`transport` and uses `pause_writing`/`resume_writing` below to slow the replica down when the
client reads slowly.

What this module must never do: answer a malformed or ambiguous request with anything but 400
and a closed connection (request smuggling), or run two requests of a connection at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol, cast

import httptools

from lora_router.http.errors import REASONS, HTTPError, error_body
from lora_router.http.headers import response_head

log = logging.getLogger(__name__)

_JSON = [(b"content-type", b"application/json")]
_METHODS = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH"})


@dataclass(slots=True)
class Request:
    """One parsed client request; the body is complete."""

    method: bytes
    target: bytes  # origin-form path and query, exactly as sent
    path: bytes  # target without the query
    query: bytes
    headers: list[tuple[bytes, bytes]]  # names lower-cased, values verbatim
    body: bytes
    keep_alive: bool
    http11: bool
    client_ip: bytes

    def header(self, name: bytes) -> bytes | None:
        for key, value in self.headers:
            if key == name:
                return value
        return None


class Limits(Protocol):
    header_timeout: float
    body_timeout: float
    keepalive_timeout: float
    max_body_bytes: int
    max_header_bytes: int
    max_headers: int


class ResponseSink(Protocol):
    """What the upstream side needs of a client connection to stream a response into it."""

    def write(self, data: bytes | memoryview) -> None: ...
    def on_upstream(self, transport: asyncio.Transport | None) -> None: ...


Handler = Callable[[Request, "ClientConnection"], Awaitable[None]]


class ConnectionCount:
    """Open client connections, shared by every connection of one listening socket."""

    __slots__ = ("_drained", "limit", "open")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.open: set[ClientConnection] = set()
        self._drained: asyncio.Event | None = None

    def discard(self, conn: ClientConnection) -> None:
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


class _Phase:
    IDLE, HEADERS, BODY, HANDLING, CLOSED = range(5)


class ClientConnection(asyncio.Protocol):
    """One client connection: parse, limit, dispatch in order, write answers."""

    def __init__(self, handler: Handler, limits: Limits, count: ConnectionCount) -> None:
        self._handler = handler
        self._limits = limits
        self._count = count
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._client_ip = b""
        self._phase = _Phase.IDLE
        self._timer: asyncio.TimerHandle | None = None
        self._queue: deque[Request] = deque()
        self._task: asyncio.Task[None] | None = None
        self._upstream: asyncio.Transport | None = None
        self._writable: asyncio.Event | None = None
        self.response_started = False
        self.keep_alive = True
        # Parser scratch for the request being received.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self._client_ip = str(peer[0]).encode() if peer else b"unknown"
        if len(self._count.open) >= self._count.limit:
            # Past the cap, refuse cleanly: an answer the client can read, then close.
            self._phase = _Phase.CLOSED
            body = error_body(503, "Too many open connections to the router.")
            transport.write(response_head(503, REASONS[503], _JSON, len(body), False) + body)
            transport.close()
            return
        self._count.open.add(self)
        self._arm(self._limits.keepalive_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._phase = _Phase.CLOSED
        self._count.discard(self)
        self._disarm()
        # The client went away: stop the replica's work too (vLLM aborts a generation when its
        # connection closes, which frees the GPU for requests someone still waits for).
        if self._upstream is not None:
            self._upstream.abort()
            self._upstream = None
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self._writable is not None:
            self._writable.set()

    def data_received(self, data: bytes) -> None:
        if self._phase == _Phase.CLOSED:
            return
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # CONNECT and `Upgrade:` would turn this connection into a tunnel; never.
            self._fail(HTTPError(501, "CONNECT and protocol upgrades are not supported."))
        except httptools.HttpParserError as exc:
            # An HTTPError raised by a callback below arrives as the parser error's context.
            cause = exc.__context__
            if isinstance(cause, HTTPError):
                self._fail(cause)
            else:
                self._fail(HTTPError(400, f"Malformed HTTP request: {exc}."))

    def eof_received(self) -> bool | None:
        # A half-closed client still gets the answers to what it sent; then the connection ends.
        self.keep_alive = False
        if self._task is None and not self._queue:
            return None  # nothing pending: let the transport close
        return True

    def pause_writing(self) -> None:
        if self._upstream is not None:
            self._upstream.pause_reading()
        if self._writable is None:
            self._writable = asyncio.Event()
        self._writable.clear()

    def resume_writing(self) -> None:
        if self._upstream is not None:
            self._upstream.resume_reading()
        if self._writable is not None:
            self._writable.set()

    # -- httptools callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._phase = _Phase.HEADERS
        self._arm(self._limits.header_timeout)
        self._url = b""
        self._headers = []
        self._header_bytes = 0
        self._body = []
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._count_header_bytes(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value))
        if len(self._headers) >= self._limits.max_headers:
            raise HTTPError(431, "Too many request headers.")
        for byte in value:
            # NUL and other controls (but tab) in a value are never legitimate; llhttp lets some
            # through, and a replica might read them differently than we do.
            if (byte < 0x20 and byte != 0x09) or byte == 0x7F:
                raise HTTPError(400, "Control characters in a header value.")
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        limits = self._limits
        self._arm(limits.body_timeout)
        self._phase = _Phase.BODY
        lengths = {v.strip() for k, v in self._headers if k == b"content-length"}
        codings = [v for k, v in self._headers if k == b"transfer-encoding"]
        if len(lengths) > 1 or (lengths and codings):
            raise HTTPError(400, "Conflicting Content-Length / Transfer-Encoding headers.")
        if codings and b",".join(codings).strip().lower() != b"chunked":
            raise HTTPError(501, "Only the chunked transfer coding is supported.")
        if lengths:
            length = int(next(iter(lengths)))  # llhttp has already checked it is a number
            if length > limits.max_body_bytes:
                raise HTTPError(413, f"Request body over {limits.max_body_bytes} bytes.")
        expect = [v for k, v in self._headers if k == b"expect"]
        if expect and self.transport is not None:
            if expect != [b"100-continue"] and [e.lower() for e in expect] != [b"100-continue"]:
                raise HTTPError(417, "Only `Expect: 100-continue` is supported.")
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._limits.max_body_bytes:
            raise HTTPError(413, f"Request body over {self._limits.max_body_bytes} bytes.")
        self._body.append(body)

    def on_message_complete(self) -> None:
        url = self._url
        if not url.startswith(b"/"):
            # Absolute-form and authority-form (CONNECT) targets would make a proxy talk to
            # the host they name; this router only ever talks to its replicas.
            raise HTTPError(400, "Only origin-form request targets (`/path`) are accepted.")
        parser = self._parser
        method = parser.get_method()
        if method not in _METHODS:
            raise HTTPError(501, f"Method {method.decode('latin-1')} is not supported.")
        path, _, query = url.partition(b"?")
        request = Request(
            method=method,
            target=url,
            path=path,
            query=query,
            headers=self._headers,
            body=b"".join(self._body),
            keep_alive=parser.should_keep_alive(),
            http11=parser.get_http_version() == "1.1",
            client_ip=self._client_ip,
        )
        self._body = []
        self._queue.append(request)
        self._phase = _Phase.HANDLING
        self._disarm()
        if self._task is None:
            self._start_next()
        elif self.transport is not None:
            # A pipelined request waits for the one in front; stop reading until then.
            self.transport.pause_reading()

    # -- dispatch ---------------------------------------------------------------------------

    def _start_next(self) -> None:
        request = self._queue.popleft()
        self.response_started = False
        self.keep_alive = self.keep_alive and request.keep_alive
        self._task = self._loop.create_task(self._run(request))

    async def _run(self, request: Request) -> None:
        try:
            await self._handler(request, self)
        except asyncio.CancelledError:
            return
        except HTTPError as exc:
            self.send_error(exc)
        except Exception:
            log.exception("unhandled error while handling %s %s", request.method, request.path)
            self.send_error(HTTPError(500, "Internal router error."))
        self._task = None
        self._finish_response()

    def _finish_response(self) -> None:
        if self._phase == _Phase.CLOSED or self.transport is None:
            return
        if not self.keep_alive:
            self._close()
            return
        if self._queue:
            self._start_next()
            return
        self._phase = _Phase.IDLE
        self._arm(self._limits.keepalive_timeout)
        self.transport.resume_reading()

    # -- writing answers ---------------------------------------------------------------------

    def write(self, data: bytes | memoryview) -> None:
        """Raw response bytes (used by the upstream side to stream a replica's answer)."""
        self.response_started = True
        if self.transport is not None:
            self.transport.write(data)

    def on_upstream(self, transport: asyncio.Transport | None) -> None:
        """Register the replica connection now streaming into this client (for flow control)."""
        self._upstream = transport
        if transport is not None and self._writable is not None and not self._writable.is_set():
            transport.pause_reading()

    def send(
        self,
        status: int,
        body: bytes,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """A whole response written by the router itself."""
        if self.response_started or self.transport is None:
            return
        self.response_started = True
        reason = REASONS.get(status, b"Unknown")
        head = response_head(status, reason, headers or _JSON, len(body), self.keep_alive)
        self.transport.write(head + body)

    def send_error(self, error: HTTPError) -> None:
        if self.response_started:
            # Too late for a status line: the only honest signal left is closing the connection.
            self.keep_alive = False
            self._close()
            return
        self.send(error.status, error.body())

    async def drain(self) -> None:
        """Wait until the client has taken what was written (for responses the router writes)."""
        if self._writable is not None:
            await self._writable.wait()

    def close_when_idle(self) -> None:
        """Finish the request in progress, if any, then close (graceful shutdown)."""
        self.keep_alive = False
        if self._phase in (_Phase.IDLE, _Phase.CLOSED):
            self._close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- internals -------------------------------------------------------------------------

    def _count_header_bytes(self, n: int) -> None:
        self._header_bytes += n
        if self._header_bytes > self._limits.max_header_bytes:
            raise HTTPError(431, f"Request headers over {self._limits.max_header_bytes} bytes.")

    def _fail(self, error: HTTPError) -> None:
        """A request the router will not parse further: answer it and close the connection."""
        self._queue.clear()
        self.keep_alive = False
        if self._task is None or self._task.done():
            self.send(error.status, error.body())
            self._close()
        else:
            # The request in front is still running; it is answered first, then we close.
            self._phase = _Phase.HANDLING
            if self.transport is not None:
                self.transport.pause_reading()

    def _close(self) -> None:
        self._phase = _Phase.CLOSED
        self._disarm()
        if self.transport is not None:
            self.transport.close()

    def _arm(self, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(seconds, self._on_timeout)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _on_timeout(self) -> None:
        self._timer = None
        if self._phase in (_Phase.HEADERS, _Phase.BODY):
            self.keep_alive = False
            self.send(408, error_body(408, "The request was not received in time."))
        self._close()


async def serve(
    handler: Handler,
    limits: Limits,
    host: str,
    port: int,
    *,
    max_connections: int,
    backlog: int = 2048,
) -> tuple[asyncio.Server, ConnectionCount]:
    """Listen on host:port; every accepted connection becomes a `ClientConnection`."""
    loop = asyncio.get_running_loop()
    count = ConnectionCount(max_connections)
    server = await loop.create_server(
        lambda: ClientConnection(handler, limits, count), host, port, backlog=backlog
    )
    return server, count
