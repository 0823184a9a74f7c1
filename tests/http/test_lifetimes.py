"""What a stream and a connection keep alive, and for how long.

A stream that has begun holds no copy of its request (a retry needs one only until the first
response byte: tests/http/test_passthrough.py shows those re-sends), and the connection objects
of both sides die with their connection, by reference counting, not by the cycle collector.
"""

from __future__ import annotations

import asyncio
import gc
import os
import tracemalloc
import weakref
from collections.abc import Iterator

import pytest
from http_harness import RawClient, Received, ReplicaConn, chunk, completion, post_completion

import lora_router

_PACKAGE = os.path.dirname(lora_router.__file__)
# Where the proxy itself allocates request bytes: the client parser, the upstream request,
# the dispatcher. (body.py's parsed prompt forms are the routing step's to drop.)
_PROXY_FILES = (
    os.path.join(_PACKAGE, "http") + os.sep,
    os.path.join(_PACKAGE, "proxy", "dispatch.py"),
    os.path.join(_PACKAGE, "proxy", "routed.py"),
)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


@pytest.fixture
def collector_off() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def test_a_stream_that_has_begun_holds_no_copy_of_its_request(router, replica, clients):
    rt = await router([replica])
    hold = asyncio.Event()

    async def respond(req: Received, conn: ReplicaConn) -> None:
        await conn.write(SSE_HEAD + chunk(b'data: {"text": "first"}\n\n'))
        await hold.wait()  # the stream stays open, as a long generation's does

    replica.responder = respond
    body = completion(prompt=tuple(range(100_000, 160_000)), stream=True)  # about 420 KB
    client = await clients(rt.url)
    tracemalloc.start()
    try:
        await client.send(post_completion(body))
        received = b""
        async with asyncio.timeout(10):
            while b"first" not in received:
                data = await client.reader.read(65536)
                assert data
                received += data
        assert replica.requests[0].body == body  # it went out whole
        snapshot = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
        hold.set()
    copies = [
        f"{trace.size} bytes from {trace.traceback[0]}"
        for trace in snapshot.traces
        if trace.size >= len(body) // 2 and trace.traceback[0].filename.startswith(_PROXY_FILES)
    ]
    assert not copies, copies


async def _answered(req: Received, conn: ReplicaConn) -> None:
    await conn.write(SSE_HEAD + chunk(b'data: {"n": 1}\n\n') + b"0\r\n\r\n")


async def _held(req: Received, conn: ReplicaConn) -> None:
    await conn.write(SSE_HEAD + chunk(b'data: {"n": 1}\n\n'))
    await conn.closed.wait()


async def _reset(req: Received, conn: ReplicaConn) -> None:
    conn.abort()


async def _burst(rt, n: int, mid_stream: bool) -> None:
    """`n` completions, each on a client connection of its own, closed once answered (or
    `mid_stream`, once the first frame arrived)."""
    body = completion(stream=True)
    for _ in range(n):
        client = await RawClient.connect(rt.url)
        await client.send(post_completion(body))
        if mid_stream:
            async with asyncio.timeout(5):
                while b"data:" not in await client.reader.read(65536):
                    pass
        else:
            await client.response()
        client.close()
        await client.writer.wait_closed()


async def _all_closed(rt, replica) -> None:
    """Wait until the router saw every client leave and every replica connection close."""
    pool = rt.fleet.replicas[0].pool
    async with asyncio.timeout(5):
        while rt.connections.open:
            await asyncio.sleep(0.01)
        for conn in replica.conns:
            conn.abort()
        while pool.open_connections:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0)  # the transports' own close callbacks


@pytest.mark.parametrize(
    ("responder", "mid_stream"),
    [(_answered, False), (_held, True), (_reset, False)],
    ids=["answered", "client-left-mid-stream", "replica-reset-before-answering"],
)
async def test_connection_objects_die_with_their_connection_without_the_cycle_collector(
    collector_off, replica_factory, router, responder, mid_stream
):
    refs: list[weakref.ref[object]] = []
    runtimes = []

    async def respond(req: Received, conn: ReplicaConn) -> None:
        # While the router is in the exchange: its connection objects of both sides.
        (rt,) = runtimes
        refs.extend(weakref.ref(c) for c in rt.connections.open)
        refs.extend(weakref.ref(c) for c in rt.fleet.replicas[0].pool._all)
        await responder(req, conn)

    replica = await replica_factory(respond)
    rt = await router([replica], breaker_failures=100)
    runtimes.append(rt)
    await _burst(rt, 20, mid_stream)
    assert len(refs) >= 40
    await _all_closed(rt, replica)
    alive = {type(ref()).__name__ for ref in refs if ref() is not None}
    assert not alive, f"kept alive by reference cycles only: {alive}"
