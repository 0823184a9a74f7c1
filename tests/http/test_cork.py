"""Over real sockets: the cork (http/cork.py) sends the first write of a pass of the loop at once
and holds the rest, in the order given, to the end of the pass; body bytes written through
follow what is held; a pass holds no more than HELD_BYTES; a transport aborted meanwhile drops
what it held; and the router flushes before it closes a connection, so answers under load
arrive whole."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from emulated_fleet import StartRouter
from http_harness import RawClient, Received, ReplicaConn, json_response

from lora_router.http.cork import HELD_BYTES, cork_for

Connect = Callable[[], Awaitable[tuple[asyncio.Transport, asyncio.Future[bytes]]]]


@pytest.fixture
async def connect() -> AsyncIterator[Connect]:
    """Connections to a loopback server; each future is what the server read until EOF."""
    futures: asyncio.Queue[asyncio.Future[bytes]] = asyncio.Queue()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        future, got = await futures.get(), b""
        try:
            while data := await reader.read(65536):
                got += data
        except ConnectionResetError:
            got += b"<reset>"
        future.set_result(got)
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    transports: list[asyncio.Transport] = []

    async def make() -> tuple[asyncio.Transport, asyncio.Future[bytes]]:
        future = asyncio.get_running_loop().create_future()
        await futures.put(future)
        transport, _ = await asyncio.get_running_loop().create_connection(
            asyncio.Protocol, "127.0.0.1", port
        )
        transports.append(transport)
        return transport, future

    yield make
    for transport in transports:
        transport.abort()
    server.close()


async def test_the_first_write_of_a_pass_goes_at_once_the_rest_at_its_end(
    connect: Connect,
) -> None:
    (a, got_a), (b, got_b) = await connect(), await connect()
    cork = cork_for(asyncio.get_running_loop())
    cork.write(a, b"1")  # the pass's first: at once
    cork.write(b, b"2")
    cork.writelines(b, [b"3", b"4"])
    cork.write(a, b"held")
    # `a` aborted before the pass ends: its first write left, what it held never does, and the
    # flush skips it without an error.
    a.abort()
    await asyncio.sleep(0)  # one turn of the loop: the flush, scheduled first, runs first
    b.write_eof()
    async with asyncio.timeout(10):
        assert await got_b == b"234"
        assert await got_a in (b"1", b"1<reset>")


async def test_bytes_written_through_follow_what_is_held(connect: Connect) -> None:
    (a, got_a), (b, got_b) = await connect(), await connect()
    cork = cork_for(asyncio.get_running_loop())
    cork.write(a, b"first")
    cork.writelines(b, [b"head", b"+"])
    cork.write_through(b, b"body")  # after the held head, and at once
    cork.write(b, b"!")  # a new pass: at once too
    a.write_eof()
    b.write_eof()
    async with asyncio.timeout(10):
        assert await got_b == b"head+body!"
        assert await got_a == b"first"


async def test_a_pass_holds_no_more_than_its_budget() -> None:
    """The write that would pass HELD_BYTES sends what is held and itself before the pass ends:
    the peer, a blocking socket read within the same pass, receives them."""
    loop = asyncio.get_running_loop()
    with socket.create_server(("127.0.0.1", 0)) as listener:
        transport, _ = await loop.create_connection(asyncio.Protocol, *listener.getsockname()[:2])
        peer, _ = listener.accept()
    with peer:
        peer.settimeout(10)
        cork = cork_for(loop)
        big = b"x" * HELD_BYTES
        cork.write(transport, b"<")  # the pass's first: at once
        cork.write(transport, b"h")  # held
        cork.writelines(transport, [big[:10], big[10:]])  # past the budget: all of it, now
        cork.write(transport, b">")  # held again
        got = b""
        while len(got) < 2 + HELD_BYTES:  # the pass has not ended: nothing else runs
            got += peer.recv(1 << 20)
        assert got == b"<h" + big
        await asyncio.sleep(0)  # the pass's end
        assert peer.recv(16) == b">"
        transport.abort()


async def test_answers_that_end_their_connection_arrive_whole_under_load(
    router: StartRouter, replica, clients: Callable[[str], Awaitable[RawClient]]
) -> None:
    """Many clients at once: most answers are held for the end of a pass, and each one's
    connection is then closed (`connection: close`): the flush before the close sends it."""
    rt = await router([replica])

    async def respond(req: Received, conn: ReplicaConn) -> None:
        await conn.write(json_response(req.target))

    replica.responder = respond
    opened = [await clients(rt.url) for _ in range(48)]

    async def one(i: int, client: RawClient) -> bytes:
        proxied = f"GET /version?n={i} HTTP/1.1\r\nhost: r\r\nconnection: close\r\n\r\n"
        own = f"GET /nowhere/{i} HTTP/1.1\r\nhost: r\r\nconnection: close\r\n\r\n"
        await client.send((proxied if i % 2 else own).encode())
        response = await client.response()
        assert await client.closed()
        return response.body if i % 2 else str(response.status).encode()

    bodies = await asyncio.gather(*(one(i, c) for i, c in enumerate(opened)))
    assert bodies == [f"/version?n={i}".encode() if i % 2 else b"404" for i in range(48)]
