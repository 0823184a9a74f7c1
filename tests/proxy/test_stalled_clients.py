"""A client that stops reading is the client's problem, never its replica's (http/server.py's
write deadline, http/upstream.py's timeouts): the replica's idle timer stands still while the
client does not read, the client is dropped as gone after `--idle-timeout`, and a request that
waits for one of the router's connections to a replica has a deadline of its own."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable

import pytest
from emulated_fleet import StartRouter
from http_harness import FakeReplica, Received, ReplicaConn, completion, post_completion, request

StartReplica = Callable[..., Awaitable[FakeReplica]]
SLACK = 3.0  # scheduling noise on a shared machine, never a second deadline

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
)
FRAME = b"data: " + b"x" * 65536 + b"\n\n"


async def endless(req: Received, conn: ReplicaConn) -> None:
    """A stream that never ends, written as fast as the router reads it; a completion for
    prompt [9] is answered whole."""
    if b"[9]" in req.body:
        await conn.write(SSE_HEAD + b"%x\r\n%s\r\n0\r\n\r\n" % (len(FRAME), FRAME))
        return
    await conn.write(SSE_HEAD)
    while True:
        await conn.write(b"%x\r\n%s\r\n" % (len(FRAME), FRAME))


async def test_a_client_that_stops_reading_is_dropped_and_its_replica_not_blamed(
    replica_factory: StartReplica, router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    replica = await replica_factory(endless)
    idle = 1.0
    rt = await router([replica], idle_timeout=idle, first_byte_timeout=30.0)
    assert rt.fleet is not None
    (upstream,) = rt.fleet.replicas
    # A client with a small receive buffer that sends a streamed completion and reads nothing.
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", int(rt.url.rsplit(":")[-1])))
    _, writer = await asyncio.open_connection(sock=sock)
    try:
        with caplog.at_level(logging.WARNING, logger="lora_router"):
            writer.write(post_completion(completion(stream=True)))
            await replica.wait_requests(1)
            # The router stops reading the replica once the client's buffers are full; the
            # client is dropped after --idle-timeout of that, and the replica's connection
            # closed with it (vLLM aborts the generation).
            async with asyncio.timeout(idle + SLACK):
                await replica.conns[0].closed.wait()
        assert upstream.cut_streams == 0  # not a stream the replica broke off
        assert upstream.breaker.failures == 0
        assert any("read nothing of its answer" in r.getMessage() for r in caplog.records)
        assert not any(r.getMessage().startswith("cut stream") for r in caplog.records)
        # A client that reads is served as before.
        answer = await request(rt.url, "POST", "/v1/completions", completion([9], stream=True))
        assert answer.status == 200 and answer.body.endswith(b"\n\n")
    finally:
        writer.close()


async def test_a_request_waiting_for_a_connection_slot_gets_a_503_at_its_deadline(
    replica_factory: StartReplica, router: StartRouter
) -> None:
    replica = await replica_factory(endless)
    # One connection to the replica, held by a stream that a reading client consumes.
    rt = await router([replica], max_upstream_connections=1, first_byte_timeout=0.5, retries=0)
    assert rt.fleet is not None
    (upstream,) = rt.fleet.replicas
    reader, writer = await asyncio.open_connection("127.0.0.1", int(rt.url.rsplit(":")[-1]))
    drain: asyncio.Task[None] | None = None
    try:
        writer.write(post_completion(completion(stream=True)))
        await replica.wait_requests(1)

        async def consume() -> None:
            while await reader.read(1 << 20):
                pass

        drain = asyncio.create_task(consume())
        loop = asyncio.get_running_loop()
        started = loop.time()
        async with asyncio.timeout(0.5 + SLACK):
            answer = await request(rt.url, "POST", "/v1/completions", completion([9]))
        assert loop.time() - started >= 0.5
        assert answer.status == 503, answer.body
        message = answer.json()["error"]["message"]
        assert "--max-upstream-connections" in message and "busy for 0.5 s" in message
        assert len(replica.requests) == 1  # never sent
        assert upstream.breaker.failures == 0  # the router's own cap, not the replica's fault
    finally:
        if drain is not None:
            drain.cancel()
        writer.close()
