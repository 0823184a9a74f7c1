"""What a stream and a connection keep alive, and for how long.

A stream that has begun holds no copy of its request (a retry needs one only until the first
response byte: tests/http/test_passthrough.py shows those re-sends).
"""

from __future__ import annotations

import asyncio
import os
import tracemalloc

from http_harness import Received, ReplicaConn, completion

import lora_router

_PACKAGE = os.path.dirname(lora_router.__file__)
# Where the proxy itself allocates request bytes: the client parser, the upstream request,
# the dispatcher. (body.py's parsed prompt forms are the routing step's to drop.)
_PROXY_FILES = (
    os.path.join(_PACKAGE, "http") + os.sep,
    os.path.join(_PACKAGE, "app.py"),
)


SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def test_a_stream_that_has_begun_holds_no_copy_of_its_request(router, replica, clients):
    hold = asyncio.Event()

    async def respond(req: Received, conn: ReplicaConn) -> None:
        await conn.write(SSE_HEAD + chunk(b'data: {"text": "first"}\n\n'))
        await hold.wait()  # the stream stays open, as a long generation's does

    replica.responder = respond
    body = completion(prompt=tuple(range(100_000, 160_000)), stream=True)  # about 420 KB
    client = await clients(router.url)
    tracemalloc.start()
    try:
        await client.send(
            b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
            b"content-length: %d\r\n\r\n%s" % (len(body), body)
        )
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
