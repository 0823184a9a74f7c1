"""The client side of the proxy: one asyncio `Protocol` per client connection, parsed by httptools.

A `ClientConnection` turns bytes into `Request` objects and hands each to the application
(`handler(request, connection)`), one at a time per connection, in order. It owns the
connection's limits and deadlines:

- headers must arrive within `header_timeout`, and the body within `body_timeout` after them
  (a fixed deadline, not an idle timer: a client trickling one byte a second is still cut off);
- header bytes, header count and body bytes are capped (431 / 413);
- an idle keep-alive connection is closed after `keepalive_timeout`.
While a request is being answered the client's deadlines are off (the replica's apply); a
pipelined request that arrives meanwhile gets its full deadlines once the answer in front of it
is complete.

The request body is buffered (it is needed whole to route and, before the first response byte,
to retry) and released when the response head is passed on (`head`): a stream that has begun
does not keep its request. The body bytes buffered at once over all connections of a listener
are bounded (`ConnectionCount.buffered`, `max_buffered_bytes`): a body is counted from its head
(its Content-Length, reserved at once; a chunked body chunk by chunk) until its answer begins
(`head`, or the router's own `send`), its input is refused (`_fail`) or its connection is lost
(whatever is still counted then), so the count is exact on every path; past the bound a
request is answered 503 with `Retry-After` and its connection closed. Response bodies are never
buffered here: the upstream side writes them straight to `transport` and uses
`pause_writing`/`resume_writing` below to slow the replica down when the client reads slowly.

End of input from the client while its request is in flight means the client is gone (as in
nginx): the connection closes and the replica's connection with it, which makes vLLM abort the
generation. Half-closing clients are not supported.

What this module must never do: answer a malformed or ambiguous request with anything but an
error and a closed connection (request smuggling), let trailers or anything after the headers
add request headers, or run two requests of a connection at once.

Two ways a request is answered. THE FAST PATH: `fast(request, connection)`, called from the
parser callback that completed the request (`on_message_complete`) or from the end of the
answer in front of it, may take the request and answer it from protocol callbacks alone, with
no Task (the app's `handle_now`: a routed completion written upstream at once on an idle pooled
connection). It then ends with `answered()`, or passes the request on to the general path with
`hand_over(work)`; `on_lost` tells it the client went away. When `fast` declines (returns
False), the general path runs: a Task awaiting `handler(request, connection)`.

A connection's objects die with it, by reference counting: its parser and timer refer back to
it, and are dropped when it is lost (a cycle would wait for the cycle collector).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol, cast

import httptools
import msgspec

from lora_router.http.errors import REASONS, HTTPError, error_body
from lora_router.http.headers import response_head
from lora_router.http.timer import LazyTimer

log = logging.getLogger(__name__)

_JSON = [(b"content-type", b"application/json")]
_LINGER = 2.0  # seconds a closing connection keeps draining the client's input
_METHODS = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH"})
# NUL and other controls (but tab) are never legitimate in a header value. llhttp already
# refuses them in strict mode; this is the second lock, in C speed.
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
# Request headers that frame the body, checked together once the head is complete.
_FRAMING = frozenset({b"content-length", b"transfer-encoding", b"expect"})


class Request(msgspec.Struct):
    """One parsed client request; the body is complete. (A msgspec Struct rather than a
    dataclass: built in C, with no Python `__init__` frame, once per request.)

    `body` becomes b"" once a response head for it reaches the client (`ClientConnection.head`):
    from then on nothing may send the request again (the retry rule, proxy/routed.py).
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
    def max_body_bytes(self) -> int: ...
    @property
    def max_buffered_bytes(self) -> int: ...
    @property
    def max_header_bytes(self) -> int: ...
    @property
    def max_headers(self) -> int: ...


class ResponseSink(Protocol):
    """What the upstream side needs of a client connection to stream a response into it."""

    @property
    def keep_alive(self) -> bool:
        """Whether the client's connection may stay open after this response."""

    def head(self, status: int, data: bytes, body: memoryview | None = None) -> None:
        """The response head (maybe with the first body bytes), then `body` if given: the
        response's first write."""

    def write(self, data: bytes | memoryview) -> None:
        """Body bytes, as they arrive."""

    def on_upstream(self, transport: asyncio.Transport | None) -> None: ...


Handler = Callable[[Request, "ClientConnection"], Awaitable[None]]
# The fast path (module docstring): True when it took the request.
FastHandler = Callable[[Request, "ClientConnection"], bool]


class ConnectionCount:
    """Open client connections and the request body bytes they buffer (module docstring),
    shared by every connection of one listening socket."""

    __slots__ = ("_drained", "buffered", "limit", "max_buffered", "open")

    def __init__(self, limit: int, max_buffered: int) -> None:
        self.limit = limit
        self.open: set[ClientConnection] = set()
        self._drained: asyncio.Event | None = None
        self.buffered = 0
        self.max_buffered = max_buffered

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
    """Where the parser is in the client's byte stream (independent of answering); NONE only
    as `_armed`: no deadline is set."""

    IDLE, HEADERS, BODY, NONE = range(4)


class ClientConnection(asyncio.Protocol):
    """One client connection: parse, limit, dispatch in order, write answers."""

    __slots__ = (
        "__weakref__",
        "_armed",
        "_body",
        "_body_bytes",
        "_broken",
        "_busy",
        "_chunked",
        "_client_ip",
        "_closed",
        "_continue",
        "_count",
        "_deadline",
        "_error",
        "_fast",
        "_framing",
        "_handler",
        "_header_bytes",
        "_header_timeout",
        "_headers",
        "_http11",
        "_limits",
        "_loop",
        "_max_body_bytes",
        "_max_header_bytes",
        "_max_headers",
        "_parser",
        "_paused",
        "_phase",
        "_queue",
        "_receiving",
        "_request",
        "_task",
        "_timer",
        "_upstream",
        "_url",
        "first_byte_at",
        "keep_alive",
        "on_lost",
        "replica",
        "response_started",
        "status",
        "transport",
    )

    def __init__(
        self,
        handler: Handler,
        limits: Limits,
        count: ConnectionCount,
        fast: FastHandler | None = None,
    ) -> None:
        self._handler = handler
        self._fast = fast
        self._limits = limits
        # Read on every request: copied out of `limits` once.
        self._max_header_bytes = limits.max_header_bytes
        self._max_headers = limits.max_headers
        self._max_body_bytes = limits.max_body_bytes
        self._header_timeout = limits.header_timeout
        self._count = count
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self._client_ip = b""
        self._phase = _Phase.IDLE
        self._closed = False
        self._broken = False  # the input can no longer be parsed; answer what is queued, close
        self._error: HTTPError | None = None  # raised by a parser callback, read after it
        self._continue = False  # a `100 Continue` owed once the answer in front is complete
        self._timer = LazyTimer(self._loop, self._on_timer, self._header_timeout)
        self._deadline = math.inf
        self._armed = _Phase.NONE  # the phase `_deadline` was set for (see `data_received`)
        self._queue: deque[Request] = deque()
        self._request: Request | None = None  # the one being answered
        self._busy = False  # a request is being answered (by a Task or the fast path)
        self._task: asyncio.Task[None] | None = None
        # Set by the fast path while it answers: called if the client goes away meanwhile.
        self.on_lost: Callable[[], None] | None = None
        self._upstream: asyncio.Transport | None = None
        self._paused = False  # the client's socket buffer is full (pause_writing)
        self.response_started = False
        self.keep_alive = True
        # The answer to the current request, as far as it went (read by metrics).
        self.status = 0
        self.first_byte_at = 0.0
        self.replica = b"-"  # the label of the replica that answered, set by the app
        # Parser scratch for the request being received.
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._framing: list[tuple[bytes, bytes]] = []  # the headers in _FRAMING, in order
        self._http11 = True
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        # In `count.buffered`: the body being received (`_receiving`, chunk by chunk when
        # `_chunked`), then each request's `body` until released.
        self._receiving = 0
        self._chunked = False

    # -- asyncio.Protocol ------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        peer = transport.get_extra_info("peername")
        self._client_ip = str(peer[0]).encode() if peer else b"unknown"
        if len(self._count.open) >= self._count.limit:
            # Past the cap, refuse cleanly: an answer the client can read, then close.
            body = error_body(503, "Too many open connections to the router.")
            self.transport.write(response_head(503, REASONS[503], _JSON, len(body), False) + body)
            self._close()
            return
        self._count.open.add(self)
        self._rearm()  # idle: the keep-alive deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._closed = True
        self._drop_buffered()
        request = self._request
        if request is not None:  # released here, once: a later `head` finds nothing
            self._count.buffered -= len(request.body)
            request.body = b""
        self._count.discard(self)
        self._timer.close()
        del self._parser  # it refers back to this connection (and takes no more input)
        self._queue.clear()
        # The client went away: stop the replica's work too (vLLM aborts a generation when its
        # connection closes, which frees the GPU for requests someone still waits for).
        if self._upstream is not None:
            self._upstream.abort()
            self._upstream = None
        if self._task is not None and not self._task.done():
            self._task.cancel()
        elif self.on_lost is not None:
            on_lost, self.on_lost = self.on_lost, None
            on_lost()

    def data_received(self, data: bytes) -> None:
        if self._closed or self._broken:
            return
        try:
            self._parser.feed_data(data)
            # A request still arriving gets the deadline of its phase here, once per read, not
            # in the parser callbacks that enter each phase: a request read whole (the usual
            # case) sets none, where it used to set two. The deadline starts microseconds
            # later than from the callback, once this read is parsed. Only on a change of
            # phase: more bytes of the same phase never move it (a fixed deadline).
            if self._phase != self._armed and not (self._busy or self._closed):
                self._rearm()
        except httptools.HttpParserUpgrade:
            # `Upgrade:` (or CONNECT) would turn this connection into a tunnel: never. A request
            # that was complete is answered without the upgrade, then the connection closes.
            self._fail(HTTPError(501, "CONNECT and protocol upgrades are not supported."))
        except httptools.HttpParserError as exc:
            error, self._error = self._error, None
            self._fail(error or HTTPError(400, f"Malformed HTTP request: {exc}."))

    def eof_received(self) -> bool | None:
        # The client is gone, or half-closed: either way nothing it sent after this is coming,
        # and a request in flight is abandoned (see the module docstring).
        return None

    def pause_writing(self) -> None:
        self._paused = True
        if self._upstream is not None:
            self._upstream.pause_reading()

    def resume_writing(self) -> None:
        self._paused = False
        if self._upstream is not None:
            self._upstream.resume_reading()

    # -- httptools callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._phase = _Phase.HEADERS  # its deadline: `data_received`
        self._url = b""
        self._headers = []
        self._framing = []
        self._header_bytes = 0
        self._body = []
        self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url += url
        self._header_bytes += len(url)
        if self._header_bytes > self._max_header_bytes:
            self._headers_too_big()

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_bytes += len(name) + len(value)
        if self._header_bytes > self._max_header_bytes:
            self._headers_too_big()
        if self._phase != _Phase.HEADERS:
            return  # a trailer of a chunked body: counted against the limit, never forwarded
        if len(self._headers) >= self._max_headers:
            self._raise(HTTPError(431, "Too many request headers."))
        if _CONTROL.search(value) is not None:
            self._raise(HTTPError(400, "Control characters in a header value."))
        name = name.lower()
        self._headers.append((name, value))
        if name in _FRAMING:
            self._framing.append((name, value))

    def on_headers_complete(self) -> None:
        self._phase = _Phase.BODY  # its deadline: `data_received`
        version = self._parser.get_http_version()
        if version not in ("1.1", "1.0"):
            self._raise(HTTPError(505, f"HTTP/{version} is not supported."))
        self._http11 = version == "1.1"
        framing = self._framing
        if len(framing) == 1 and framing[0][0] == b"content-length":
            # The usual case, `_check_length` written out (it runs on every request with a body).
            length = int(framing[0][1])  # llhttp checked the digits
            if length > self._max_body_bytes:
                self._body_too_big()
            count = self._count  # `_reserve`, written out too
            buffered = count.buffered + length
            if buffered > count.max_buffered:
                self._over_budget()
            count.buffered = buffered
            self._receiving = length
            self._chunked = False
        elif framing:
            self._check_framing(version)

    def _check_length(self, value: bytes) -> None:
        length = int(value)  # llhttp checked the digits
        if length > self._max_body_bytes:
            self._body_too_big()
        self._reserve(length)

    def _reserve(self, length: int) -> None:
        """Count a body of `length` bytes in the buffer budget, before it is read."""
        count = self._count
        buffered = count.buffered + length
        if buffered > count.max_buffered:
            self._over_budget()  # refused before the body is sent, not after
        count.buffered = buffered
        self._receiving = length

    def _over_budget(self) -> None:
        self._raise(
            HTTPError(
                503,
                "The router holds as many request bodies as --max-buffered-bytes allows; retry.",
                headers=[*_JSON, (b"retry-after", b"1")],
            )
        )

    def _body_too_big(self) -> None:
        self._raise(HTTPError(413, f"Request body over {self._max_body_bytes} bytes."))

    def _check_framing(self, version: str) -> None:
        """Content-Length, Transfer-Encoding and Expect, the headers that frame the body."""
        framing = self._framing
        lengths = [v for k, v in framing if k == b"content-length"]
        codings = [v for k, v in framing if k == b"transfer-encoding"]
        if len(lengths) > 1 or (lengths and codings):
            self._raise(HTTPError(400, "Conflicting Content-Length / Transfer-Encoding headers."))
        if codings and (
            version == "1.0" or len(codings) > 1 or codings[0].strip().lower() != b"chunked"
        ):
            # Only a plain `chunked` means the same to every parser on the way (RFC 9112 §6.1).
            self._raise(HTTPError(400, "Only `Transfer-Encoding: chunked` (HTTP/1.1) is accepted."))
        self._chunked = bool(codings)
        if lengths:
            self._check_length(lengths[0])
        expect = [v.lower() for k, v in framing if k == b"expect"]
        if expect:
            if expect != [b"100-continue"]:
                self._raise(HTTPError(417, "Only `Expect: 100-continue` is supported."))
            if version == "1.1" and (lengths or codings):
                if not self._busy:
                    self._write_continue()
                else:
                    self._continue = True  # after the answer in front of it

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._max_body_bytes:
            self._body_too_big()
        if self._chunked:  # no length to reserve ahead: counted as it arrives
            self._reserve_chunk(len(body))
        self._body.append(body)

    def _reserve_chunk(self, size: int) -> None:
        count = self._count
        if count.buffered + size > count.max_buffered:
            self._over_budget()
        count.buffered += size
        self._receiving += size

    def on_message_complete(self) -> None:
        parser = self._parser
        method = parser.get_method()
        if method not in _METHODS:
            self._raise(HTTPError(501, f"Method {method.decode('latin-1')} is not supported."))
        url = self._url
        if not url.startswith(b"/"):
            # Absolute-form and authority-form targets would make a proxy talk to the host
            # they name; this router only ever talks to its replicas.
            self._raise(HTTPError(400, "Only origin-form request targets (`/path`) are accepted."))
        if b"#" in url:
            # A fragment is never part of a request target (RFC 9112 §3.2); servers on the way
            # would drop it or read it (the path rule: http/target.py).
            self._raise(HTTPError(400, "A request target must not contain `#`."))
        path, _, query = url.partition(b"?")
        request = Request(
            method=method,
            target=url,
            path=path,
            query=query,
            headers=self._headers,
            body=b"".join(self._body),
            keep_alive=parser.should_keep_alive(),
            http11=self._http11,
            client_ip=self._client_ip,
        )
        self._body = []
        self._receiving = 0  # counted as the request's `body` from now on
        self._phase = _Phase.IDLE
        self._continue = False
        if not self._busy:
            # Answering: no client deadline (the replica's apply); the timer, if any, wakes
            # up to find nothing due.
            self._deadline = math.inf
            self._armed = _Phase.NONE
            self._start(request)  # nothing queued: only a request behind a busy one waits
        else:
            self._queue.append(request)
            if self.transport is not None:
                # A pipelined request waits for the one in front; stop reading until then.
                self.transport.pause_reading()

    # -- dispatch ---------------------------------------------------------------------------

    def _start(self, request: Request) -> None:
        self._request = request
        self.response_started = False
        self.status = 0
        self.first_byte_at = 0.0
        self.keep_alive = self.keep_alive and request.keep_alive
        self._busy = True
        if self._fast is not None:
            try:
                if self._fast(request, self):
                    return  # the fast path took it: it ends with `answered` or `hand_over`
            except Exception:
                # Never into the parser (it would read as malformed input): answered as the
                # general path answers an unhandled error.
                log.exception("unhandled error while handling %s %s", request.method, request.path)
                self.send_error(HTTPError(500, "Internal router error."))
                self.answered()
                return
        self._task = self._loop.create_task(self._run(request, self._handler(request, self)))

    async def _run(self, request: Request, work: Awaitable[None]) -> None:
        try:
            await work
        except asyncio.CancelledError:
            return
        except HTTPError as exc:
            self.send_error(exc)
        except Exception:
            log.exception("unhandled error while handling %s %s", request.method, request.path)
            self.send_error(HTTPError(500, "Internal router error."))
        self._task = None
        self.answered()

    def answered(self) -> None:
        """The current request is answered (or its error sent): on to the next one."""
        self._request = self.on_lost = None
        self._busy = False
        if self._closed or self.transport is None:
            return
        if not self.keep_alive:
            self._close()
            return
        if self._queue:
            self._start(self._queue.popleft())
            if not self._queue:
                self.transport.resume_reading()
            return
        self._rearm()
        if self._continue and self._phase == _Phase.BODY:
            self._write_continue()
        self._continue = False
        self.transport.resume_reading()

    def hand_over(self, work: Awaitable[None]) -> None:
        """The fast path passes the current request on to the general path: `work` runs in a
        Task, as a handler would (its HTTPError is the answer; a client going away cancels it).
        Only before `on_lost` was called: a fast path told the client is gone ends there."""
        assert self._request is not None and not self._closed
        self.on_lost = None
        self._task = self._loop.create_task(self._run(self._request, work))

    # -- writing answers ---------------------------------------------------------------------

    def head(self, status: int, data: bytes, body: memoryview | None = None) -> None:
        """A replica's response head, rewritten, and the first body bytes (one writev)."""
        request = self._request
        if request is not None:  # the answer has begun: nothing will re-send the request
            self._count.buffered -= len(request.body)
            request.body = b""
        self.response_started = True
        self.status = status
        self.first_byte_at = self._loop.time()
        if self.transport is not None:
            if body is None:
                self.transport.write(data)
            else:
                self.transport.writelines((data, body))

    def write(self, data: bytes | memoryview) -> None:
        """Response body bytes, as the replica sends them."""
        if self.transport is not None:
            self.transport.write(data)

    def on_upstream(self, transport: asyncio.Transport | None) -> None:
        """Register the replica connection now streaming into this client (for flow control)."""
        self._upstream = transport
        if transport is not None and self._paused:
            transport.pause_reading()

    def send(
        self,
        status: int,
        body: bytes,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        """A whole response written by the router itself."""
        request = self._request
        if request is not None:  # the router's own answer: the body is no longer needed
            self._count.buffered -= len(request.body)
            request.body = b""
        if self.response_started or self.transport is None or self._closed:
            return
        self.response_started = True
        self.status = status
        reason = REASONS.get(status, b"Unknown")
        head = response_head(status, reason, headers or _JSON, len(body), self.keep_alive)
        if request is not None and request.method == b"HEAD":
            self.transport.write(head)  # no body, and the Content-Length a GET would have
        else:
            self.transport.write(head + body)

    def send_error(self, error: HTTPError) -> None:
        if self.response_started:
            # Too late for a status line: the only honest signal left is closing the connection.
            self.keep_alive = False
            self._close()
            return
        self.send(error.status, error.body(), error.headers)

    def close_when_idle(self) -> None:
        """Finish the request in progress, if any, then close (graceful shutdown)."""
        self.keep_alive = False
        if not self._busy and self._phase == _Phase.IDLE:
            self._close()

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- internals -------------------------------------------------------------------------

    def _drop_buffered(self) -> None:
        """Input that will never be answered leaves the buffer budget: the body being received
        and the requests queued (the current request's body goes with its answer)."""
        queued = sum(len(r.body) for r in self._queue)
        self._count.buffered -= self._receiving + queued
        self._receiving = 0
        self._body = []
        self._queue.clear()

    def _raise(self, error: HTTPError) -> None:
        # httptools replaces an exception raised in a callback by its own error; keep ours.
        self._error = error
        raise error

    def _headers_too_big(self) -> None:
        self._raise(HTTPError(431, f"Request headers over {self._max_header_bytes} bytes."))

    def _write_continue(self) -> None:
        if self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def _fail(self, error: HTTPError) -> None:
        """Input the router will not parse further: answer it and close the connection.

        A request already being answered is finished first (the error then goes unsaid);
        requests queued behind it are dropped.
        """
        self._broken = True
        self.keep_alive = False
        self._drop_buffered()  # now, not when the connection goes (it may linger)
        if not self._busy:
            self.send(error.status, error.body(), error.headers)
            self._close()
        elif self.transport is not None:
            self.transport.pause_reading()

    def _close(self) -> None:
        """Close after what was written, lingering like nginx: the answer and a FIN go out,
        and what the client still sends is read and dropped for a moment. Closing with unread
        input would make the kernel reset the connection and destroy the answer unread."""
        if self._closed:
            return
        self._closed = True
        self._timer.cancel()
        transport = self.transport
        if transport is None:
            return
        if not transport.can_write_eof():
            transport.close()
            return
        transport.resume_reading()
        transport.write_eof()
        self._loop.call_later(_LINGER, transport.abort)

    # `_deadline` says when the current phase times out (http/timer.py). The timer never
    # sleeps past `header_timeout`, so the next request's header deadline never needs it moved;
    # an idle connection wakes up to re-check itself every `header_timeout` seconds.

    def _rearm(self) -> None:
        """Start the client's deadline for whatever the parser is in the middle of."""
        limits = self._limits
        phase = self._armed = self._phase
        if phase == _Phase.HEADERS:
            seconds = limits.header_timeout
        elif phase == _Phase.BODY:
            seconds = limits.body_timeout
        else:
            seconds = limits.keepalive_timeout
        now = self._loop.time()
        self._deadline = now + seconds
        self._timer.arm(now, seconds)

    def _on_timer(self) -> None:
        if self._closed or self._deadline == math.inf:
            return
        if self._timer.due(self._loop.time(), self._deadline):
            self._on_timeout()

    def _on_timeout(self) -> None:
        if self._busy:
            return  # answering: the replica's timeouts apply
        if self._phase != _Phase.IDLE:
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
    start_serving: bool = True,
    fast: FastHandler | None = None,
) -> tuple[asyncio.Server, ConnectionCount]:
    """Listen on host:port; every accepted connection becomes a `ClientConnection` (`fast`:
    the fast path, see the module docstring). With `start_serving` False the socket is bound
    but accepts only after `start_serving()`."""
    loop = asyncio.get_running_loop()
    count = ConnectionCount(max_connections, limits.max_buffered_bytes)
    server = await loop.create_server(
        lambda: ClientConnection(handler, limits, count, fast),
        host,
        port,
        backlog=backlog,
        start_serving=start_serving,
    )
    return server, count
