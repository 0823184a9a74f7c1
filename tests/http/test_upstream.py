"""The replica side on its own: a pool with sinks the test controls."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import struct
import threading

import pytest
from helpers import until
from http_harness import FakeReplica

from lora_router.config import ReplicaAddress
from lora_router.http.exchange import Exchange, UpstreamError
from lora_router.http.request import Upstream
from lora_router.http.upstream import UpstreamPool


class Sink:
    """A client connection stand-in; `pausing` behaves like a client whose buffer is full."""

    keep_alive = True

    def __init__(self, pausing: bool = False) -> None:
        self.pausing = pausing
        self.data = b""
        self.upstream: Upstream | None = None

    def head(self, status: int, data: bytes, body: memoryview | None = None) -> bool:
        self.write(data)
        if body is not None:
            self.write(body)
        return True

    def write(self, data: bytes | memoryview) -> None:
        self.data += bytes(data)
        if self.pausing and self.upstream is not None:
            self.upstream.pause_reading()

    def on_upstream(self, upstream: Upstream | None) -> None:
        self.upstream = upstream


def pool_for(replica: FakeReplica, **kw: float) -> UpstreamPool:
    settings = dict(connect_timeout=1.0, first_byte_timeout=1.0, stream_idle_timeout=1.0)
    settings.update(kw)
    return UpstreamPool(
        ReplicaAddress.parse(replica.url),
        b"0",
        None,
        idle_timeout=settings.pop("idle_timeout", 5.0),
        max_connections=4,
        **settings,
    )


GET = b"GET /a HTTP/1.1\r\nhost: x\r\n\r\n"


async def test_a_connection_paused_by_a_slow_client_reads_again_back_in_the_pool(replica):
    pool = pool_for(replica)
    try:
        first = Sink(pausing=True)  # pauses the replica connection on the last write
        assert await pool.forward(Exchange(first, GET, False, True))
        assert first.data.endswith(b'{"ok":true}')
        second = Sink()
        assert await pool.forward(Exchange(second, GET, False, True))
        assert second.data.endswith(b'{"ok":true}')
        assert len(replica.conns) == 1  # the same, reused connection
    finally:
        pool.close()


async def test_an_idle_pooled_connection_is_closed_after_its_timeout(replica):
    pool = pool_for(replica, idle_timeout=0.2)
    try:
        await pool.forward(Exchange(Sink(), GET, False, True))
        assert pool.open_connections == 1
        async with asyncio.timeout(2):
            await replica.conns[0].closed.wait()
        assert pool.open_connections == 0
    finally:
        pool.close()


async def test_a_replica_closing_an_idle_connection_is_noticed_in_the_pool(replica):
    pool = pool_for(replica)
    try:
        await pool.forward(Exchange(Sink(), GET, False, True))
        replica.conns[0].abort()
        async with asyncio.timeout(2):
            while pool.open_connections:
                await asyncio.sleep(0.01)
        assert await pool.forward(Exchange(Sink(), GET, False, True))
        assert len(replica.conns) == 2
    finally:
        pool.close()


async def test_waiters_for_a_full_pool_get_freed_slots_in_turn_minus_the_cancelled(
    replica,
):
    release = asyncio.Event()

    async def respond(req, conn) -> None:
        await release.wait()
        await conn.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    replica.responder = respond
    pool = pool_for(replica)  # max_connections=4
    try:
        sinks = [Sink() for _ in range(7)]
        order: list[int] = []

        async def send(i: int) -> None:
            await pool.forward(Exchange(sinks[i], GET, False, True))
            order.append(i)

        first = [asyncio.create_task(send(i)) for i in range(4)]
        await replica.wait_requests(4)
        waiting = [asyncio.create_task(send(i)) for i in range(4, 7)]
        await until(lambda: len(pool._waiters) == 3)  # the other three wait for a slot
        assert len(replica.requests) == 4
        waiting[0].cancel()  # gives up before its turn: its place goes to the next in line
        release.set()
        async with asyncio.timeout(5):
            await asyncio.gather(*first, *waiting[1:])
        assert sorted(order[:4]) == [0, 1, 2, 3] and sorted(order[4:]) == [5, 6]
        assert len(replica.requests) == 6 and replica.peak_active <= 4
        assert pool._busy == 0 and not pool._waiters  # every slot came back
    finally:
        pool.close()


async def test_withdrawing_a_pool_ends_what_waits_on_it_and_lets_a_begun_answer_finish(
    replica,
):
    release = asyncio.Event()

    async def respond(req, conn) -> None:
        if req.target == b"/stream":  # an answer under way: its head, then the rest later
            await conn.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab")
            await release.wait()
            await conn.write(b"cd")
        elif req.target == b"/ok":
            await conn.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
        # Any other request waits for a first byte that never comes (a hung replica).

    replica.responder = respond
    pool = pool_for(replica, first_byte_timeout=60.0, stream_idle_timeout=60.0)  # 4 slots
    try:
        # A pooled connection: one of the hung requests reuses it, which the re-send rule
        # would otherwise send again once it fails unanswered.
        assert await pool.forward(Exchange(Sink(), GET.replace(b"/a", b"/ok"), False, True))
        hung = [
            asyncio.create_task(pool.forward(Exchange(Sink(), GET, False, True))) for _ in range(3)
        ]
        await replica.wait_requests(4)
        streaming = Sink()
        stream = asyncio.create_task(
            pool.forward(Exchange(streaming, GET.replace(b"/a", b"/stream"), False, True))
        )
        await until(lambda: streaming.data.endswith(b"ab"))
        queued = asyncio.create_task(pool.forward(Exchange(Sink(), GET, False, True)))
        await until(lambda: len(pool._waiters) == 1)
        pool.withdraw("ejected by the test")
        async with asyncio.timeout(5):
            failures = await asyncio.gather(*hung, queued, return_exceptions=True)
        for failure in failures:
            assert isinstance(failure, UpstreamError) and failure.kind == "withdrawn"
            assert failure.retryable and not failure.news
            assert "ejected by the test" in str(failure)
        assert len(replica.requests) == 5  # none was sent again to the withdrawn replica
        assert not stream.done()  # the begun answer goes on, and ends whole
        release.set()
        async with asyncio.timeout(5):
            assert await stream
        assert streaming.data.endswith(b"abcd")
        assert pool._busy == 0 and not pool._waiters
    finally:
        pool.close()


async def test_withdrawing_a_pool_whose_engine_stalled_ends_a_begun_answer_too(replica):
    async def respond(req, conn) -> None:  # its head and two bytes, then nothing
        await conn.write(b"HTTP/1.1 200 OK\r\ncontent-length: 4\r\n\r\nab")
        await asyncio.Event().wait()

    replica.responder = respond
    pool = pool_for(replica, first_byte_timeout=60.0, stream_idle_timeout=60.0)
    try:
        streaming = Sink()
        stream = asyncio.create_task(pool.forward(Exchange(streaming, GET, False, True)))
        await until(lambda: streaming.data.endswith(b"ab"))
        pool.withdraw("stalled by the test", stalled=True)
        async with asyncio.timeout(5):  # not --idle-timeout (60 s here)
            with pytest.raises(UpstreamError) as failure:
                await stream
        # Part of the answer came: never retried, and no news of a replica already out.
        assert failure.value.kind == "withdrawn" and failure.value.received
        assert not failure.value.retryable and not failure.value.news
        assert "its answer begun (stalled by the test)" in str(failure.value)
        assert pool._busy == 0 and pool.open_connections == 0  # its connection closed
    finally:
        pool.close()


async def test_a_begun_answer_on_a_withdrawn_pool_goes_on_while_it_streams_and_ends_once_silent(
    replica,
):
    """From its withdrawal on, a gap in a begun answer is bounded by `withdrawn_gap`, not the
    stream idle timeout: bytes that keep coming are forwarded, a silence that long ends it. The
    bound leaves with the answer: the next one on the same pooled connection has the usual."""
    gaps = {b"/a": [0.1] * 6 + [None], b"/b": [0.5, 0.0]}  # None: silent for good
    loop = asyncio.get_running_loop()
    last_byte_at = 0.0

    async def respond(req, conn) -> None:
        nonlocal last_byte_at
        size = len(gaps[req.target]) + (None in gaps[req.target])  # one byte never sent
        await conn.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % size)
        for gap in gaps[req.target]:
            await conn.write(b"x")
            last_byte_at = loop.time()
            if gap is None:
                await asyncio.Event().wait()
            await asyncio.sleep(gap)

    replica.responder = respond
    pool = pool_for(replica, stream_idle_timeout=60.0, withdrawn_gap=0.3)
    try:
        warm = Sink()  # the /b answer, whole before the withdrawal: its connection is pooled
        assert await pool.forward(Exchange(warm, GET.replace(b"/a", b"/b"), False, True))
        streaming = Sink()
        stream = asyncio.create_task(pool.forward(Exchange(streaming, GET, False, True)))
        await until(lambda: streaming.data.endswith(b"x"))
        pool.withdraw("ejected by the test")
        async with asyncio.timeout(5):  # not the stream idle timeout (60 s here)
            with pytest.raises(UpstreamError) as failure:
                await stream
        # Every byte sent 0.1 s apart reached the sink; the silence after them ended it.
        assert streaming.data.endswith(b"x" * 7)
        silent_for = loop.time() - last_byte_at
        assert failure.value.kind == "timeout" and failure.value.received
        assert "nothing between response bytes for 0.3 s after it left service" in str(
            failure.value
        )
        assert 0.3 <= silent_for < 2.0
        # The pooled connection's next answer has a 0.5 s gap, under the usual bound.
        again = Sink()
        assert await pool.forward(Exchange(again, GET.replace(b"/a", b"/b"), False, True))
        assert again.data.endswith(b"xx")
    finally:
        pool.close()


async def test_a_head_dripped_a_byte_at_a_time_times_out_at_the_first_byte_timeout(replica):
    async def drip(req, conn) -> None:
        head = b"HTTP/1.1 200 OK\r\nx-pad: " + b"a" * 1000 + b"\r\ncontent-length: 2\r\n\r\nok"
        for i in range(len(head)):  # a byte every 20 ms: each gap well within the idle timeout
            await conn.write(head[i : i + 1])
            await asyncio.sleep(0.02)

    replica.responder = drip
    pool = pool_for(replica, first_byte_timeout=1.0, stream_idle_timeout=0.5)
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        with pytest.raises(UpstreamError) as failed:
            async with asyncio.timeout(1.0 + 3.0):  # the drip would last 20 s
                await pool.forward(Exchange(Sink(), GET, False, True))
        assert failed.value.kind == "timeout" and failed.value.received
        assert "no whole response head within 1 s" in str(failed.value)
        assert loop.time() - started >= 1.0
    finally:
        pool.close()


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


async def test_thousands_of_idle_client_connections_cost_bounded_memory(router, replica):
    rt = await router([replica])
    loop = asyncio.get_running_loop()
    socks = []
    base = _rss()
    try:
        for _ in range(2000):
            s = socket.socket()
            s.setblocking(False)
            await loop.sock_connect(s, ("127.0.0.1", rt.port))
            socks.append(s)
        async with asyncio.timeout(10):
            while len(rt.connections.open) < 2000:
                await asyncio.sleep(0.01)
        # both ends of each connection live in this process; about 4 KB is measured
        assert (_rss() - base) / 2000 < 16 * 1024
    finally:
        for s in socks:
            s.close()


async def test_a_pooled_connection_the_replica_closed_leaves_the_idle_list(replica):
    pool = pool_for(replica)
    try:
        await pool.forward(Exchange(Sink(), GET, False, True))
        (idle,) = pool._idle
        replica.conns[0].abort()
        async with asyncio.timeout(2):
            while pool.open_connections:
                await asyncio.sleep(0.01)
        assert idle not in pool._idle  # nothing keeps a closed connection alive
    finally:
        pool.close()


async def test_a_pooled_connection_closed_before_its_loss_is_reported_is_not_reused(replica):
    """A replica killed under an idle connection: its transport is closed at once, the pool
    hears of it (`connection_lost`) a loop turn later, and writing on it by then raises. A
    request in between goes on a new connection; the closing one is never given it."""
    pool = pool_for(replica)
    try:
        await pool.forward(Exchange(Sink(), GET, False, True))
        (idle,) = pool._idle
        assert idle.transport is not None
        idle.transport.abort()  # closing now; connection_lost is scheduled, not run
        assert not idle.closed
        answered = Sink()
        assert await pool.forward(Exchange(answered, GET, False, True))
        assert answered.data.endswith(b'{"ok":true}')
        assert len(replica.conns) == 2
    finally:
        pool.close()


class ResetAtAccept:
    """A listener that resets every connection the moment it accepts it (a replica killed
    as the router connects: the kernel completed the handshake, the process is gone)."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self.sock.accept()
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
                self.accepted += 1

    def close(self) -> None:
        self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(timeout=5)


async def test_a_connection_reset_as_it_opens_fails_as_not_sent():
    """Reset before the request is written, or as it is: either way a failure with nothing
    received (the caller may send the request elsewhere), never an error of the router's."""
    server = ResetAtAccept()
    pool = UpstreamPool(
        ReplicaAddress.parse(f"http://127.0.0.1:{server.port}"),
        b"0",
        None,
        idle_timeout=5.0,
        max_connections=4,
        connect_timeout=1.0,
        first_byte_timeout=1.0,
        stream_idle_timeout=1.0,
    )
    try:
        for _ in range(50):
            with pytest.raises(UpstreamError) as failed:
                await pool.forward(Exchange(Sink(), GET, False, True))
            assert failed.value.retryable, failed.value
        assert server.accepted > 0
    finally:
        pool.close()
        server.close()


async def test_withdrawing_a_pool_ends_a_connect_in_progress_and_closes_its_socket() -> None:
    # A listener that accepts and never answers the TLS ClientHello: the handshake hangs.
    accepted: asyncio.Queue[asyncio.StreamReader] = asyncio.Queue()
    writers: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writers.append(writer)
        accepted.put_nowait(reader)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = UpstreamPool(
        ReplicaAddress.parse(f"https://127.0.0.1:{port}"),
        b"0",
        ssl.create_default_context(),
        connect_timeout=30.0,
        first_byte_timeout=30.0,
        stream_idle_timeout=30.0,
        idle_timeout=30.0,
        max_connections=4,
    )
    try:
        forwarding = asyncio.create_task(pool.forward(Exchange(Sink(), GET, False, True)))
        async with asyncio.timeout(5):
            reader = await accepted.get()
            assert await reader.read(5)  # the ClientHello's record header: handshaking
        pool.withdraw("ejected by the test")
        async with asyncio.timeout(5):  # not --connect-timeout (30 s)
            with pytest.raises(UpstreamError) as failure:
                await forwarding
            assert failure.value.kind == "withdrawn" and failure.value.retryable
            assert "ejected by the test" in str(failure.value)
            with contextlib.suppress(ConnectionResetError):  # the abandoned socket is closed
                while await reader.read(65536):
                    pass
        assert pool.open_connections == 0 and pool._busy == 0
    finally:
        pool.close()
        server.close()
        for writer in writers:
            writer.transport.abort()
