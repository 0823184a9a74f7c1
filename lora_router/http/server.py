"""The client side of the proxy: one asyncio `Protocol` per client connection, parsed by httptools.

A `ClientConnection` turns bytes into `Request`s (http/request.py) and hands each to the
application, one at a time per connection, in order. It owns the connection's limits:
- headers within `header_timeout`, the body within `body_timeout` after them (fixed deadlines,
  not idle timers: a client trickling a byte a second is still cut off); an idle keep-alive
  connection closes after `keepalive_timeout`; while a request is answered the replica's
  timeouts apply instead, and a pipelined request gets its deadlines once the one in front ends;
- the write deadline: while an answer streams from a replica into a client that does not read
  it (its transport paused for writing), the replica is not read and its silence is not counted
  (http/upstream.py); the client instead has `idle_timeout` from the pause to read again, or it
  is dropped as gone (its replica's connection closed, counted 499 like any client that leaves:
  never a failure or a cut stream of the replica, which did nothing wrong);
- header bytes and count (431) and the head rules of http/framing.py; the head's bytes count
  as they arrive (`_head_arrived`), not only once it is complete;
- body bytes (413): `max_body_bytes`, or the lower cap of the request's path (`body_cap`:
  the control routes, routes.py), known once the head is complete and applied as the body
  arrives: a Content-Length over it is refused before a byte of the body is read, a chunked
  body as soon as it passes it. No body is ever held past its path's limit;
- no protocol upgrade: a request asking for one (`Connection: upgrade`, or CONNECT) is 501,
  before its body is read (llhttp would hand it over with an empty body) or it is dispatched;
- the bodies buffered over all connections (`ConnectionCount.buffered`): a body is reserved
  from its head (chunked: chunk by chunk) until its answer begins (`head`, `send`), its input
  is refused (`_fail`) or its connection goes; past `max_buffered_bytes`, 503 + Retry-After.
A body is buffered whole (to route, and to retry before the first response byte) and released
when the response head passes; response bodies are never buffered here (the upstream side writes
them through the loop's cork, http/cork.py, slowed by `pause_writing`/`resume_writing`). End of
input while a request is in flight means the client is gone: the replica's connection closes
too, and vLLM aborts.

One way a request is answered: the connection's Task (`_serve`, made for its first request)
awaits `handler(request, connection)` for each request in turn, as HTTP/1.1 answers them in
order; its HTTPError is the answer, any other error a 500, and `answered()` then starts the next
pipelined request, or the Task waits for one. A client that goes away cancels the Task.

Back-pressure: while the client's transport is paused for writing (`pause_writing`: the client
does not read), no next request starts and no more input is read, whoever wrote the answer (a
replica, or the router itself: an error, a 401, /router/status), and a replica streaming the
answer is not read (the write deadline above); `resume_writing` goes on.
So a client that pipelines requests and never reads holds one answer's bytes, one read of
input and the requests parsed from it; the keep-alive deadline then closes its connection.

Never: answer a malformed or ambiguous request but with an error and a closed connection
(request smuggling), let trailers add request headers, run two requests of a connection at once,
or keep a reference cycle (a connection's parser and timer are dropped when it is lost).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Awaitable, Callable
from typing import NoReturn, cast

import httptools

from lora_router.http.cork import cork_for
from lora_router.http.errors import REASONS, HTTPError, error_body
from lora_router.http.framing import (
    CONTROL,
    FRAMING,
    METHODS,
    body_framing,
    body_too_big,
    headers_too_big,
    over_budget,
)
from lora_router.http.headers import response_head
from lora_router.http.request import SESSION_HEADER, ConnectionCount, Limits, Request, Upstream
from lora_router.http.timer import LazyTimer

log = logging.getLogger(__name__)

_JSON = [(b"content-type", b"application/json")]
_LINGER = 2.0  # seconds a closing connection keeps draining the client's input
# Headers picked out as they are parsed: the framing (judged once the head is complete) and
# the session id (`Request.session`).
_PICKED = FRAMING | {SESSION_HEADER}


Handler = Callable[[Request, "ClientConnection"], Awaitable[None]]
# A request path (as the client wrote it) -> the cap on its body, None: `max_body_bytes`.
BodyCap = Callable[[bytes], int | None]


class _Phase:
    """Where the parser is in the client's byte stream (independent of answering); NONE only
    as `_armed`: no deadline is set."""

    IDLE, HEADERS, BODY, NONE = range(4)


class ClientConnection(asyncio.Protocol):
    """One client connection: parse, limit, dispatch in order, write answers."""

    __slots__ = (
        "__weakref__",
        "_armed",
        "_begun",
        "_body",
        "_body_bytes",
        "_body_cap",
        "_body_limit",
        "_broken",
        "_busy",
        "_chunked",
        "_client_ip",
        "_closed",
        "_continue",
        "_cork",
        "_count",
        "_deadline",
        "_error",
        "_framing",
        "_handler",
        "_head_bytes",
        "_header_bytes",
        "_header_timeout",
        "_headers",
        "_held",
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
        "_session",
        "_task",
        "_timer",
        "_upstream",
        "_url",
        "_waiting",
        "first_byte_at",
        "keep_alive",
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
        body_cap: BodyCap,
    ) -> None:
        self._handler = handler
        self._body_cap = body_cap
        self._limits = limits
        # Read on every request: copied out of `limits` once.
        self._max_header_bytes = limits.max_header_bytes
        self._max_headers = limits.max_headers
        self._max_body_bytes = limits.max_body_bytes
        self._header_timeout = limits.header_timeout
        self._count = count
        self._loop = asyncio.get_running_loop()
        self._cork = cork_for(self._loop)  # every write of this connection (http/cork.py)
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
        self._busy = False  # a request is being answered (by the Task)
        self._held = False  # the next request waits for the client to read (back-pressure)
        self._task: asyncio.Task[None] | None = None  # `_serve`, from the first request on
        # While the Task waits for the next request: what `_start` hands it over with.
        self._waiting: asyncio.Future[Request] | None = None
        self._upstream: Upstream | None = None
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
        self._framing: list[tuple[bytes, bytes]] = []  # the headers in FRAMING, in order
        self._session: tuple[bytes, ...] = ()  # the SESSION_HEADER values, in order
        self._http11 = True
        self._header_bytes = 0
        # The head being received, as it arrives (`_head_arrived`): its bytes so far, and the
        # number of requests begun on this connection (to tell where a head began).
        self._head_bytes = 0
        self._begun = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self._body_limit = self._max_body_bytes  # of the body being received (`_limit_body`)
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
            self.keep_alive = False
            self.send(503, error_body(503, "Too many open connections to the router."))
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

    def data_received(self, data: bytes) -> None:
        if self._closed or self._broken:
            return
        phase, begun = self._phase, self._begun
        try:
            self._parser.feed_data(data)
            if self._phase == _Phase.HEADERS:  # this read ends inside a head
                self._head_arrived(len(data), phase == _Phase.IDLE, self._begun - begun)
            # A request still arriving gets the deadline of its phase here, once per read, not
            # in the parser callbacks that enter each phase: a request read whole (the usual
            # case) sets none, where it used to set two. The deadline starts microseconds
            # later than from the callback, once this read is parsed. Only on a change of
            # phase: more bytes of the same phase never move it (a fixed deadline).
            if self._phase != self._armed and not (self._busy or self._closed):
                self._rearm()
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
            self._await_reader()

    def resume_writing(self) -> None:
        self._paused = False
        if self._upstream is not None:
            self._deadline = math.inf  # answering: no client deadline (the replica's apply)
            self._upstream.resume_reading()
        if self._held and not self._closed:
            self._held = False
            self._next()

    # -- httptools callbacks --------------------------------------------------------------

    def on_message_begin(self) -> None:
        self._phase = _Phase.HEADERS  # its deadline: `data_received`
        self._begun += 1
        self._head_bytes = 0
        self._url = b""
        self._headers = []
        self._framing = []
        self._session = ()
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
        if CONTROL.search(value) is not None:
            self._raise(HTTPError(400, "Control characters in a header value."))
        name = name.lower()
        self._headers.append((name, value))
        if name in _PICKED:
            if name == SESSION_HEADER:
                self._session += (value,)
            else:
                self._framing.append((name, value))

    def on_headers_complete(self) -> None:
        self._phase = _Phase.BODY  # its deadline: `data_received`
        version = self._parser.get_http_version()
        if version not in ("1.1", "1.0"):
            self._raise(HTTPError(505, f"HTTP/{version} is not supported."))
        self._http11 = version == "1.1"
        if self._parser.should_upgrade():
            # A tunnel, never: and llhttp would skip the body (the new protocol's bytes) and
            # complete the request empty. Refused before anything reads or dispatches it.
            self._raise(HTTPError(501, "CONNECT and protocol upgrades are not supported."))
        framing = self._framing
        if not framing:
            return  # no body
        self._limit_body()
        if len(framing) == 1 and framing[0][0] == b"content-length":  # the usual case
            self._chunked = False
            self._reserve_length(framing[0][1])
        else:
            self._check_framing(version)

    def _limit_body(self) -> None:
        """The limit on the body to come: `max_body_bytes`, or its path's lower cap."""
        limit = self._max_body_bytes
        cap = self._body_cap(self._url.partition(b"?")[0])
        self._body_limit = limit if cap is None or cap > limit else cap

    def _reserve_length(self, value: bytes) -> None:
        """A body of Content-Length `value` (digits, checked by llhttp), refused past the body
        limit or the buffer budget before it is sent, else counted in the budget."""
        length = int(value)
        if length > self._body_limit:
            self._body_too_big()
        count = self._count
        buffered = count.buffered + length
        if buffered > count.max_buffered:
            self._over_budget()
        count.buffered = buffered
        self._receiving = length

    def _over_budget(self) -> None:
        self._raise(over_budget())

    def _body_too_big(self) -> None:
        self._raise(body_too_big(self._body_limit))

    def _check_framing(self, version: str) -> None:
        """http/framing.py's rules applied; a `100 Continue` now, or after the answer in front."""
        try:
            framing = body_framing(self._framing, version)
        except HTTPError as error:
            self._raise(error)
        self._chunked = framing.chunked
        if framing.length is not None:
            self._reserve_length(framing.length)
        if framing.expect_continue:
            if not self._busy:
                self._write_continue()
            else:
                self._continue = True

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._body_limit:
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
        if method not in METHODS:
            self._raise(HTTPError(501, f"Method {method.decode('latin-1')} is not supported."))
        url = self._url
        if not url.startswith(b"/"):
            # Other forms name a host to talk to: this router only ever talks to its replicas.
            self._raise(HTTPError(400, "Only origin-form request targets (`/path`) are accepted."))
        if b"#" in url:
            # Never part of a target (RFC 9112 §3.2): servers would drop or read it (target.py).
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
            session=self._session,
        )
        self._body = []
        self._receiving = 0  # counted as the request's `body` from now on
        self._phase = _Phase.IDLE
        self._continue = False
        if not (self._busy or self._held):
            # Answering: no client deadline (the replica's apply); the timer, if any, wakes
            # up to find nothing due.
            self._deadline = math.inf
            self._armed = _Phase.NONE
            self._start(request)  # nothing queued: only a request behind a busy one waits
        else:
            self._queue.append(request)
            if self.transport is not None:
                # A pipelined request waits for the one in front (or for the client to read
                # its answer); stop reading until then.
                self.transport.pause_reading()

    # -- dispatch ---------------------------------------------------------------------------

    def _start(self, request: Request) -> None:
        self._request = request
        self.response_started = False
        self.status = 0
        self.first_byte_at = 0.0
        self.keep_alive = self.keep_alive and request.keep_alive
        self._busy = True
        waiting = self._waiting
        if waiting is not None:
            self._waiting = None
            waiting.set_result(request)
        elif self._task is None:
            self._task = self._loop.create_task(self._serve(request))
        # Otherwise the Task is running: it started `request` in `answered()`, and answers it
        # next.

    async def _serve(self, request: Request) -> None:
        """The connection's Task: answer `request`, then each next one in turn, one at a time.
        It ends when the connection closes (cancelled, if it is lost)."""
        while True:
            try:
                await self._handler(request, self)
            except asyncio.CancelledError:
                return
            except HTTPError as exc:
                self.send_error(exc)
            except Exception:
                log.exception("unhandled error while handling %s %s", request.method, request.path)
                self.send_error(HTTPError(500, "Internal router error."))
            self.answered()
            if self._closed:
                return
            if self._busy:  # a pipelined request, started by `answered()`
                assert self._request is not None
                request = self._request
                continue
            waiting = self._waiting = self._loop.create_future()
            try:
                request = await waiting
            except asyncio.CancelledError:
                return

    def answered(self) -> None:
        """The current request is answered (or its error sent): on to the next one, once the
        client reads (back-pressure, module docstring)."""
        self._request = None
        self._busy = False
        if self._closed or self.transport is None:
            return
        if not self.keep_alive:
            self._close()
            return
        if self._paused:
            self._held = True
            self.transport.pause_reading()
            self._rearm()  # bounded: a client that never reads meets its deadline
            return
        self._next()

    def _next(self) -> None:
        """Start the next pipelined request, or wait for one."""
        assert self.transport is not None
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

    # -- writing answers ---------------------------------------------------------------------

    def head(self, status: int, data: bytes, body: memoryview | None = None) -> bool:
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
                self._cork.write(self.transport, data)
            else:
                self._cork.writelines(self.transport, (data, body))
        return True

    def write(self, data: bytes | memoryview) -> None:
        """Response body bytes, as the replica sends them (at once: flow control)."""
        if self.transport is not None:
            self._cork.write_through(self.transport, data)

    def on_upstream(self, upstream: Upstream | None) -> None:
        """Register the replica connection now streaming into this client (for flow control)."""
        self._upstream = upstream
        if upstream is not None and self._paused:
            upstream.pause_reading()
            self._await_reader()

    def send(
        self, status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None = None
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
            self._cork.write(self.transport, head)  # no body; the Content-Length a GET would have
        else:
            self._cork.write(self.transport, head + body)

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

    def _raise(self, error: HTTPError) -> NoReturn:
        # httptools replaces an exception raised in a callback by its own error; keep ours.
        self._error = error
        raise error

    def _headers_too_big(self) -> None:
        self._raise(headers_too_big(self._max_header_bytes))

    def _head_arrived(self, size: int, idle: bool, begun: int) -> None:
        """A read of `size` bytes ended inside a head: past `max_header_bytes` of it (raw bytes,
        separators and whitespace included), 431 now.

        httptools keeps a header line until it ends (then `on_header` counts it), so a line
        that never ends would be held, and copied again on each read, until the deadline. The
        read's bytes are the head's when the head began before it (`begun` 0) or with it (the
        connection was `idle` and one request began); a head begun behind another request in
        the same read is counted from the next read on (its share of this one is unknown),
        so a connection holds at most one read more than the limit.
        """
        if begun == 0 or (idle and begun == 1):
            self._head_bytes += size
            if self._head_bytes > self._max_header_bytes:
                self._fail(headers_too_big(self._max_header_bytes))

    def _write_continue(self) -> None:
        if self.transport is not None:
            self._cork.write(self.transport, b"HTTP/1.1 100 Continue\r\n\r\n")

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
        self._cork.flush()  # what was written leaves before the end
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

    def _await_reader(self) -> None:
        """The write deadline (module docstring), from now: the client reads again by then."""
        seconds = self._limits.idle_timeout
        now = self._loop.time()
        self._deadline = now + seconds
        self._timer.arm(now, seconds)

    def _on_timeout(self) -> None:
        if self._busy:
            if self._paused and self._upstream is not None:  # the write deadline
                log.warning(
                    "dropping a client that read nothing of its answer for %g s "
                    "(--idle-timeout); its replica's connection is closed",
                    self._limits.idle_timeout,
                )
                self.abort()  # connection_lost: the client is gone
            return  # otherwise answering: the replica's timeouts apply
        if self._phase != _Phase.IDLE:
            self.keep_alive = False
            self.send(408, error_body(408, "The request was not received in time."))
        self._close()
