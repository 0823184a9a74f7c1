"""The replica side of the proxy: keep-alive connection pools and zero-copy response streaming.

An `UpstreamPool` holds a bounded set of HTTP/1.1 connections to one replica. `forward()` sends
one request and streams the answer into the client connection: the replica's head is rewritten
(hop-by-hop headers out, the replica's index in), and every body byte after it goes to the client
as it arrives — chunked framing and SSE frames included, never decoded or re-chunked. httptools
parses the response only to learn where it ends, so the connection can go back to the pool.

Flow control is done by the transports themselves: when the client's socket buffer fills, the
client connection pauses reading from the replica (`ResponseSink.on_upstream`, then
`pause_reading`), so a slow reader costs bounded memory however long the stream.

The timeouts, each a deadline on the replica alone:
- the response head, whole, within `first_byte_timeout` of the request's send (a long prefill,
  `/pause?mode=wait`): a replica dripping its head a byte at a time does not restart it (the
  head is at most 64 KiB, but a byte a second would take it 18 hours); once its first bytes
  came, each gap in it is also bounded as a body's is (below);
- then each gap between two reads of the body within `stream_idle_timeout` (`--idle-timeout`;
  `withdrawn_gap` once the replica left service: the withdrawal rule below), counted only
  while the client reads: while it does not, the replica is not read and its silence says
  nothing of it, so the timer stands still until `resume_reading`; the client connection has
  its own write deadline meanwhile (http/server.py). A body as a whole has no deadline: a
  stream may rightly last hours (long generations), and a client that wants a bound on a whole
  answer sets its own (TRL's request timeout);
- a pooled connection unused for `idle_timeout` (`--upstream-idle-timeout`) is closed;
- a request waits for a slot (one of `max_connections`) at most `first_byte_timeout`: queued in
  the router it waits for the replica as it would in vLLM's own queue, and gets the same bound;
  past it, it fails unsent (kind `busy`, which the routed retry rule tries on another replica and
  answers 503 when none is left), never counted against the replica's health: the cap is the
  router's own.

The re-send rule (stated once, here; trying *another* replica is proxy/retry.py's retry rule):
a request is sent again to the same replica only when it went out on a *reused* pooled
connection and that connection failed in a way `UpstreamError.retryable` allows (nothing
received, not a timeout): the replica most likely closed it while idle, and the request cannot
have been processed. A fresh connection is tried once. So the request's bytes are held (by its
`Exchange`) only until the first response byte: a long stream does not keep them. Never a
request the pool withdrew (below): its replica is out of service.

The withdrawal rule: when the replica leaves service (ejected: fleet/lifecycle.py calls
`withdraw`), every exchange on it that has received no response byte ends at once, its
connection closed (vLLM aborts the work), as a failure `UpstreamError.retryable` allows (kind
`withdrawn`), and so do the requests still waiting for a slot and those whose connection is
still opening (a connect or a TLS handshake in progress, abandoned and its socket closed): the
routed path's retry rule sends them to another replica at once, where they would otherwise wait
out `--first-byte-timeout` or `--connect-timeout` on a replica known to be out (hung, dead,
restarted). Nothing had reached the client, whose connection is unaffected. An exchange whose
answer has begun is left to finish: part of it may have reached the client, which a second
answer cannot be spliced onto, and a replica ejected for its health checks may still be
streaming. From then on a gap in it is bounded by the pool's `withdrawn_gap`
(`--stall-timeout`, what the stall rule calls an engine that computes nothing) instead of
`--idle-timeout` (30 minutes by default), counted from its last byte: a replica out of service
that has sent nothing of an answer that long (a host frozen or cut off, which also fails its
health checks) sends no more of it, while one that goes on streaming is never cut. But when the
replica left service because its engine stalled (fleet/health.py: it has computed no token for
`--stall-timeout`), a begun answer will not go on either: it ends too, at once, as a failure no
retry may take (the routed path closes the client's connection, a cut stream). It costs a
request on a pooled connection nothing (a new connection, a future to be told by): the pool
walks its connections only then.

A connection's objects die with it, by reference counting: its parser and timer refer back to
it, and are dropped when it is lost (a cycle would wait for the cycle collector).
"""

from __future__ import annotations

import asyncio
import re
import ssl
from asyncio import FIRST_COMPLETED
from collections import deque
from typing import Final, cast

import httptools

from lora_router.config import ReplicaAddress
from lora_router.http.cork import cork_for
from lora_router.http.exchange import Exchange, UpstreamError
from lora_router.http.headers import client_response_head
from lora_router.http.timer import LazyTimer

_MAX_HEAD: Final = 64 * 1024
_COALESCE: Final = 4 * 1024  # body bytes copied behind the head rather than written beside it
_FRAMED: Final = re.compile(rb"\r\n(?:content-length|transfer-encoding):", re.IGNORECASE)


class UpstreamConnection(asyncio.Protocol):
    """One HTTP/1.1 connection to a replica, carrying one request at a time."""

    __slots__ = (
        "__weakref__",
        "_dechunking",
        "_ex",
        "_gap",
        "_last",
        "_limit",
        "_loop",
        "_parser",
        "_paused",
        "_pool",
        "_timer",
        "closed",
        "transport",
    )

    def __init__(self, pool: UpstreamPool) -> None:
        self._pool = pool
        self._loop = pool.loop
        self.transport: asyncio.Transport | None = None
        # No `on_body` here: httptools would copy every body chunk into a new bytes object to
        # call it, and the body is forwarded as it was read. Only an HTTP/1.0 client's answer
        # is decoded, by a parser with `_Dechunking` callbacks.
        self._parser = httptools.HttpResponseParser(self)
        self._dechunking = False
        self._ex: Exchange | None = None
        self._timer = LazyTimer(self._loop, self._on_timer, pool.idle_timeout)
        self._last = 0.0
        self._limit = 0.0
        self._gap = pool.stream_idle_timeout  # the bound on a gap in an answer's body
        self._paused = False  # by the client, which does not read (`pause_reading`)
        self.closed = False

    @property
    def usable(self) -> bool:
        """Open, and not closing: a transport closed under it (the replica reset it) is told to
        the protocol a loop turn later, and writing on it by then raises."""
        return not self.closed and self.transport is not None and not self.transport.is_closing()

    # -- asyncio.Protocol ---------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._timer.close()
        del self._parser  # it refers back to this connection (and takes no more input)
        self._pool.forget(self)
        ex = self._ex
        if ex is None or ex.ended:
            return
        if ex.head_sent and ex.close_delimited:
            ex.complete = True  # EOF is how this response ends
            self._finish(keep=False)
            return
        received = ex.head_sent or bool(ex.head_buf)
        self._fail(
            "reset",
            "the replica closed the connection mid-response"
            if received
            else "the replica closed the connection",
            received,
        )

    def data_received(self, data: bytes) -> None:
        ex = self._ex
        if ex is None:
            # Bytes nobody asked for: the connection is no longer in a known state.
            self.abort()
            return
        ex.received += len(data)
        if ex.head_sent:
            ex.earlier, ex.prior, ex.tail = ex.prior, ex.tail, data
            # Parse before forwarding: bytes past the end of this response never reach the
            # client (the parser fails the exchange on them instead).
            self._feed(data)
            if self._ex is not ex:
                return
            if not ex.dechunk:
                ex.sink.write(data)
        elif not self._head(ex, data):
            return  # no whole head yet: its deadline runs from the send (module docstring)
        self._last = self._loop.time()
        if ex.complete:
            self._finish(keep=ex.reusable)
        elif self._limit != self._gap:
            self._arm(self._gap)  # streaming now: its first bytes came

    def _head(self, ex: Exchange, data: bytes) -> bool:
        """Collect the response head; once whole, send it on with what followed it."""
        if not ex.head_buf:
            # The first response byte: the request will not be sent again (the re-send rule
            # above, and proxy/retry.py's). Once the head is whole the replica is streaming,
            # not thinking: `data_received` arms the stream-idle timeout unless this read ends
            # the answer (the usual case: the pool's idle one follows).
            ex.request = b""
        buf = ex.tail = ex.head_buf + data if ex.head_buf else data
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    self._fail("protocol", "the replica sent an oversized response head", True)
                    return False
                ex.head_buf = buf
                # Both bounds (module docstring): the whole head by the first-byte deadline,
                # from the send (`_last` until the head is whole), and this gap's end.
                gap = self._loop.time() - self._last + self._gap
                self._arm(min(self._pool.first_byte_timeout, gap))
                return False
            body_at = end + 4
            if buf[9:10] != b"1" and not ex.dechunk and not ex.head_only:
                break
            # A slower, careful path: an interim head, a HEAD answer, or an HTTP/1.0 client.
            self._feed(memoryview(buf)[:body_at])  # on_headers_complete, maybe complete
            if self._ex is not ex:
                return False  # the parser rejected the head
            if ex.status >= 200:
                return self._send_head(ex, buf[:end], memoryview(buf)[body_at:])
            if ex.status == 101:
                self._fail("protocol", "the replica switched protocols unasked", True)
                return False
            # An interim answer (103 Early Hints): not forwarded; the final head follows.
            ex.complete = False
            buf = buf[body_at:]
        # The usual case: one parse of everything received, then one write. Parsed before
        # anything is forwarded, so bytes past the end of the response (a second response,
        # response splitting) fail the exchange before a byte reaches the client.
        self._feed(buf)
        if self._ex is not ex:
            return False  # the parser failed the exchange
        ex.head_buf = b""
        ex.head_sent = True
        head = buf[:end]
        if ex.complete:
            # A whole answer in one read (the usual case) is framed, and `dechunk` is off here:
            # `_client_keep_alive` comes down to the client's own (`close_delimited` stays off).
            keep_alive = ex.client_keep_alive = ex.sink.keep_alive
        else:
            keep_alive = self._client_keep_alive(ex, head)
        if len(buf) - body_at <= _COALESCE:
            # A whole small answer (vLLM's non-streamed completions are a few KB): its body is
            # copied behind the rewritten head in the same join, and goes in one write.
            body = buf[body_at:] if len(buf) > body_at else b""
            out = client_response_head(head, self._pool.label, keep_alive, False, body)
            passed = ex.sink.head(ex.status, out)
        else:
            out = client_response_head(head, self._pool.label, keep_alive, False)
            passed = ex.sink.head(ex.status, out, memoryview(buf)[body_at:])  # one writev
        return passed or self._diverted(ex, ex.complete)

    def _send_head(self, ex: Exchange, head: bytes, rest: memoryview) -> bool:
        """The final head on the careful path, then what followed it (parsed first)."""
        ex.head_buf = b""
        ex.head_sent = True
        out = client_response_head(
            head, self._pool.label, self._client_keep_alive(ex, head), ex.dechunk
        )
        if not ex.sink.head(ex.status, out):
            return self._diverted(ex, ex.complete and not rest)
        if rest and not ex.head_only:
            # With `dechunk`, on_body writes the decoded body; otherwise forward it once parsed.
            self._feed(rest)
            if self._ex is not ex:
                return False
            if not ex.dechunk:
                ex.sink.write(rest)
        return True

    def _diverted(self, ex: Exchange, whole: bool) -> bool:
        """The sink held the head back for another attempt (`ResponseSink.head`): an answer
        read `whole` ends as usual (its connection reusable); any other is not read on, as its
        body may stall or never end: the connection is closed (vLLM aborts the request) and the
        exchange ends now, its answer having said nothing of the client's connection. Returns
        whether the caller goes on with this read."""
        if whole:
            return True
        ex.client_keep_alive = True
        self._finish(keep=False)
        return False

    # -- httptools callbacks ----------------------------------------------------------------

    def on_message_begin(self) -> None:
        ex = self._ex
        if ex is not None and ex.complete:
            # A second response where one was asked for: never pass it on (response splitting).
            raise ValueError("bytes after the end of the response")

    def on_headers_complete(self) -> None:
        ex = self._ex
        assert ex is not None
        ex.status = self._parser.get_status_code()
        if ex.head_only:
            # A HEAD response has no body whatever its headers say; llhttp cannot know that.
            ex.complete = True

    def on_message_complete(self) -> None:
        ex = self._ex
        if ex is not None:
            ex.complete = True
            # Read now: once the callback returns, llhttp resets its state for the next message.
            ex.reusable = self._parser.should_keep_alive() and not ex.head_only

    # -- the exchange -------------------------------------------------------------------------

    def start(self, ex: Exchange, pooled: bool) -> None:
        """Send `ex` on this connection (`pooled`: it was taken from the pool, not new)."""
        assert self.transport is not None
        if ex.dechunk != self._dechunking:
            # Between two responses a parser holds no state: take the kind this client needs.
            self._dechunking = ex.dechunk
            self._parser = httptools.HttpResponseParser(_Dechunking(self) if ex.dechunk else self)
        self._ex = ex
        self._last = self._loop.time()
        self._gap = self._pool.stream_idle_timeout  # a withdrawal's bound ended with its answer
        # The first-byte timeout. A pooled connection's timer is pending and never sleeps past
        # the pool's idle timeout (its horizon, http/timer.py): a limit at least that long
        # needs no re-arming, only the limit it checks.
        limit = self._pool.first_byte_timeout
        if not pooled or limit < self._pool.idle_timeout:
            self._arm(limit)
        else:
            self._limit = limit
        ex.sink.on_upstream(self)
        self._pool.cork.write(self.transport, ex.request)  # at the end of the pass

    def _client_keep_alive(self, ex: Exchange, head: bytes) -> bool:
        """Whether the client may keep its connection after this response."""
        # A response the parser has seen end is framed (llhttp ends an unframed one only at
        # EOF): a whole answer in one read needs no look at its headers.
        framed = (
            ex.complete
            or ex.head_only
            or ex.status in (204, 304)
            or _FRAMED.search(head) is not None
        )
        ex.close_delimited = not framed
        # Close-delimited bodies and HTTP/1.0 clients (dechunked body) end with a close.
        ex.client_keep_alive = framed and not ex.dechunk and ex.sink.keep_alive
        return ex.client_keep_alive

    def _feed(self, data: bytes | memoryview) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._malformed(exc)

    def _malformed(self, exc: httptools.HttpParserError) -> None:
        self._fail("protocol", f"the replica sent a malformed response ({exc})", True)

    def _finish(self, keep: bool) -> None:
        ex = self._ex
        assert ex is not None
        self._ex = None
        ex.sink.on_upstream(None)
        if keep and not self.closed:
            # A slow client may have paused this connection; in the pool it must read again,
            # or it would neither see the replica close it nor answer its next request.
            self.resume_reading()
            # Closed if unused that long in the pool. Only the limit changes: the idle timeout
            # is the timer's horizon, and the timer of an open connection that was armed once
            # is pending, so `_arm` would not move it (http/timer.py).
            self._limit = self._pool.idle_timeout
            self._pool.put_back(self)
        else:
            self.abort()
        ex.end(None)

    def _fail(self, kind: str, message: str, received: bool) -> None:
        ex = self._ex
        self._ex = None
        self.abort()
        if ex is None or ex.ended:
            return
        ex.sink.on_upstream(None)
        ex.end(UpstreamError(kind, message, received=received))

    # -- timers -----------------------------------------------------------------------------
    # `_last` (the last byte either way, but a head's: until its head is whole an answer is
    # timed from the send) and `_limit` (the timeout of the current phase) say when the
    # connection is due (http/timer.py). The timer never sleeps longer than the pool's idle
    # timeout: an idle or slow connection re-checks itself that often.

    def _arm(self, limit: float) -> None:
        self._limit = limit
        self._timer.arm(self._last, limit)

    def _on_timer(self) -> None:
        if self.closed:
            return
        now = self._loop.time()
        if self._paused:
            self._last = now  # the client does not read: the replica's silence is not counted
        if not self._timer.due(now, self._last + self._limit):
            return
        ex = self._ex
        if ex is None:
            self.abort()  # idle in the pool for too long
            return
        limit, pool = self._limit, self._pool
        if ex.head_sent or (ex.head_buf and limit < pool.first_byte_timeout):
            what = f"nothing between response bytes for {self._gap:g} s"
            if self._gap < pool.stream_idle_timeout:
                what += " after it left service"
        elif ex.head_buf:
            what = f"no whole response head within {limit:g} s"
        else:
            what = f"nothing for the first response byte for {limit:g} s"
        received = ex.head_sent or bool(ex.head_buf)
        self._fail("timeout", f"the replica sent {what}", received)

    # -- the client's flow control (http/request.py's `Upstream`) -----------------------------

    def pause_reading(self) -> None:
        """The client does not read: neither does this connection, and its timer stands still
        (module docstring)."""
        self._paused = True
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_reading(self) -> None:
        """The client reads again: so does this connection, the replica's silence counted from
        now."""
        self._paused = False
        self._last = self._loop.time()
        if self.transport is not None:
            self.transport.resume_reading()

    def withdraw(self, why: str, stalled: bool) -> None:
        """The withdrawal rule (module docstring): an exchange that has received nothing ends;
        one whose answer has begun too, if the replica's engine `stalled`, and otherwise has
        its gaps bounded by the pool's `withdrawn_gap` from now on."""
        ex = self._ex
        if ex is None:
            return
        if not ex.received:
            self._fail("withdrawn", f"the replica left service before it answered ({why})", False)
        elif stalled:
            self._fail("withdrawn", f"the replica left service, its answer begun ({why})", True)
        elif 0 < self._pool.withdrawn_gap < self._gap:
            self._gap = self._pool.withdrawn_gap
            if ex.head_sent:
                self._arm(self._gap)  # from its last byte
            else:  # a head under way is timed from the send: this gap from now
                self._arm(min(self._limit, self._loop.time() - self._last + self._gap))

    def decoded(self, body: bytes) -> None:
        """Body bytes decoded for an HTTP/1.0 client (`_Dechunking`), written on."""
        ex = self._ex
        if ex is not None:
            ex.sink.write(body)

    def cancel(self) -> None:
        """The client went away: drop the exchange and the connection (stops the generation)."""
        self._ex = None
        self.abort()

    def abort(self) -> None:
        """Close the connection at once; an exchange on it fails (`connection_lost`)."""
        self.closed = True
        self._timer.cancel()
        if self.transport is not None:
            self.transport.abort()


class _Dechunking:
    """Parser callbacks for an answer to an HTTP/1.0 client, who cannot read chunked framing:
    the connection's own, plus `on_body`, which writes the decoded body."""

    __slots__ = ("_conn", "on_headers_complete", "on_message_begin", "on_message_complete")

    def __init__(self, conn: UpstreamConnection) -> None:
        self._conn = conn
        self.on_message_begin = conn.on_message_begin
        self.on_headers_complete = conn.on_headers_complete
        self.on_message_complete = conn.on_message_complete

    def on_body(self, body: bytes) -> None:
        self._conn.decoded(body)


class UpstreamPool:
    """Keep-alive connections to one replica, at most `max_connections` busy at once."""

    def __init__(
        self,
        address: ReplicaAddress,
        label: bytes,
        ssl_context: ssl.SSLContext | None,
        *,
        connect_timeout: float,
        first_byte_timeout: float,
        stream_idle_timeout: float,
        idle_timeout: float,
        max_connections: int,
        withdrawn_gap: float = 0.0,
    ) -> None:
        self.address = address
        self.label = label
        self.loop = asyncio.get_running_loop()
        self.cork = cork_for(self.loop)  # every request written (http/cork.py)
        self._ssl = ssl_context if address.tls else None
        self.connect_timeout = connect_timeout
        self.first_byte_timeout = first_byte_timeout
        self.stream_idle_timeout = stream_idle_timeout
        # The bound on a gap in a begun answer once its replica left service (0: none other).
        self.withdrawn_gap = withdrawn_gap
        self.idle_timeout = idle_timeout
        # Idle connections, in the order they were released (a dict: `forget` is O(1)); put
        # back by `put_back`.
        self._idle: dict[UpstreamConnection, None] = {}
        self._all: set[UpstreamConnection] = set()
        self.max_connections = max_connections
        self._busy = 0  # exchanges in progress, at most max_connections
        self._waiters: deque[asyncio.Future[None]] = deque()
        # One per connect in progress (`_connect`): the withdrawal sets it to its reason.
        self._connecting: set[asyncio.Future[str]] = set()

    async def forward(self, ex: Exchange) -> bool:
        """Send one exchange's request (`Exchange.request`, head + body) and stream the answer
        into its sink, waiting for a slot and connecting as needed, and re-sending it once by
        the re-send rule (module docstring).

        Returns whether the client connection may stay open. Raises UpstreamError.
        From here on the request's bytes are held by the exchange alone, which drops them at
        the first response byte; the caller should hold no other reference to them.
        """
        if self._busy < self.max_connections and not self._waiters:
            self._busy += 1
        else:
            await self._wait_for_slot()
        try:
            conn = self._take_idle()
            fresh = conn is None
            while True:
                if conn is None:
                    conn = await self._connect()
                ex.done = self.loop.create_future()
                conn.start(ex, pooled=not fresh)
                try:
                    return await ex.done
                except asyncio.CancelledError:
                    conn.cancel()
                    raise
                except UpstreamError as exc:
                    # A new future on the next pass: the failed one holds `exc`, whose
                    # traceback holds this frame and `ex` (a cycle).
                    ex.done = None
                    ex.ended = False
                    if fresh or not exc.retryable or exc.kind == "withdrawn":
                        raise
                    # A reused connection died before answering (nothing was received, so the
                    # exchange is as new): the re-send rule above.
                    conn, fresh = None, True
        finally:
            self.release_slot()

    async def _wait_for_slot(self) -> None:
        """Queue, first come first served, for a slot; it is handed over already counted. At
        most `first_byte_timeout` (module docstring), then UpstreamError `busy`."""
        waiter: asyncio.Future[None] = self.loop.create_future()
        self._waiters.append(waiter)
        expiry = self.loop.call_later(self.first_byte_timeout, self._expire, waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release_slot()  # handed a slot, then cancelled: the next one's turn
            raise
        finally:
            expiry.cancel()

    def _expire(self, waiter: asyncio.Future[None]) -> None:
        """A waiter's time is up: it leaves the queue without a slot (release_slot skips it)."""
        if not waiter.done():
            waiter.set_exception(
                UpstreamError(
                    "busy",
                    f"all {self.max_connections} of the router's connections to the replica "
                    f"(--max-upstream-connections) stayed busy for {self.first_byte_timeout:g} s",
                    received=False,
                )
            )

    def release_slot(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)  # the slot passes to it as it is
                return
        self._busy -= 1

    def withdraw(self, why: str, stalled: bool = False) -> None:
        """The replica left service (`why`; `stalled`: its engine computes nothing): the
        withdrawal rule (module docstring). O(open connections + waiters), once per departure."""
        for conn in list(self._all):
            conn.withdraw(why, stalled)
        connecting, self._connecting = self._connecting, set()
        for withdrawn in connecting:
            withdrawn.set_result(why)
        waiters, self._waiters = self._waiters, deque()
        for waiter in waiters:
            if not waiter.done():  # holds no slot yet: nothing to release
                waiter.set_exception(
                    UpstreamError("withdrawn", f"the replica left service ({why})", received=False)
                )

    def put_back(self, conn: UpstreamConnection) -> None:
        """An open connection whose exchange ended whole: idle in the pool, the most recent
        last."""
        self._idle[conn] = None

    def _take_idle(self) -> UpstreamConnection | None:
        while self._idle:
            conn, _ = self._idle.popitem()  # LIFO: the most recently used is least likely stale
            if conn.usable:
                return conn
        return None

    async def _connect(self) -> UpstreamConnection:
        """A new connection, open (TLS handshake included) within `connect_timeout`, else
        UpstreamError `connect`; `withdrawn` if the pool is withdrawn first (module docstring)."""
        address = self.address
        opening = self.loop.create_task(
            self.loop.create_connection(
                lambda: UpstreamConnection(self),
                address.host,
                address.port,
                ssl=self._ssl,
                server_hostname=address.host if self._ssl else None,
            )
        )
        withdrawn: asyncio.Future[str] = self.loop.create_future()
        self._connecting.add(withdrawn)
        try:
            await asyncio.wait(
                (opening, withdrawn), timeout=self.connect_timeout, return_when=FIRST_COMPLETED
            )
        except asyncio.CancelledError:
            _abandon(opening)
            raise
        finally:
            self._connecting.discard(withdrawn)
        if withdrawn.done():
            _abandon(opening)
            text = f"the replica left service while connecting ({withdrawn.result()})"
            raise UpstreamError("withdrawn", text, received=False)
        if not opening.done():
            opening.cancel()  # the socket closes with it
            raise UpstreamError("connect", "cannot connect (timed out)", received=False)
        try:
            _, conn = opening.result()
        except (OSError, ssl.SSLError) as exc:
            detail = getattr(exc, "strerror", None) or getattr(exc, "reason", None)
            what = f"{exc.__class__.__name__}: {detail}" if detail else exc.__class__.__name__
            raise UpstreamError("connect", f"cannot connect ({what})", received=False) from None
        if not conn.usable:  # reset as it opened (a replica killed as the router connected)
            raise UpstreamError("connect", "cannot connect (reset as it opened)", received=False)
        self._all.add(conn)
        return conn

    def forget(self, conn: UpstreamConnection) -> None:
        """A connection that closed: nothing here may keep it alive."""
        self._all.discard(conn)
        self._idle.pop(conn, None)

    @property
    def open_connections(self) -> int:
        return len(self._all)

    def close(self) -> None:
        for conn in list(self._all):
            conn.abort()
        self._idle.clear()


def _abandon(opening: asyncio.Task[tuple[asyncio.BaseTransport, UpstreamConnection]]) -> None:
    """A connect nobody waits for any more: stopped, or closed if it opened."""
    if not opening.done():
        opening.cancel()
    elif not opening.cancelled() and opening.exception() is None:
        opening.result()[1].abort()
