"""The parser picks out a request's `X-Session-ID` values (http/server.py, `Request.session`) as
it reads the head: in order, whatever the name's case, never from a chunked body's trailers;
the header is still among `headers`, forwarded as sent. routing/sessions.py judges them.

A `ClientConnection` served on a loopback socket, its handler a test's: each answer is what
the request it got carried.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
from helpers import router_config

from lora_router.http.request import ConnectionCount, Request
from lora_router.http.server import ClientConnection
from lora_router.routes import body_cap


async def echo(request: Request, conn: ClientConnection) -> None:
    """Answers with the session values and the headers the request carries."""
    session = [v.decode() for v in request.session]
    names = [n.decode() for n, _ in request.headers]
    conn.send(200, orjson.dumps({"session": session, "names": names}))


@pytest.fixture
async def port() -> AsyncIterator[int]:
    config = router_config(["http://127.0.0.1:1"])
    count = ConnectionCount(config.max_connections, config.max_buffered_bytes)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: ClientConnection(echo, config, count, body_cap), "127.0.0.1", 0
    )
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        for conn in list(count.open):
            conn.abort()
        await server.wait_closed()


async def carried(port: int, raw: bytes) -> dict[str, list[str]]:
    """What the handler saw of the one request in `raw`."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            return orjson.loads(await reader.readexactly(length))  # type: ignore[no-any-return]
    finally:
        writer.close()


def post(*headers: str, body: bytes = b"{}") -> bytes:
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\n" + "".join(h + "\r\n" for h in headers)
    return f"{head}Content-Length: {len(body)}\r\n\r\n".encode() + body


async def test_no_header_no_values(port: int) -> None:
    assert (await carried(port, post()))["session"] == []


async def test_the_values_in_order_whatever_the_case(port: int) -> None:
    seen = await carried(port, post("X-Session-ID: traj-7"))
    assert seen["session"] == ["traj-7"]
    assert "x-session-id" in seen["names"]  # still a header: forwarded as sent
    seen = await carried(port, post("x-session-id: a", "Accept: */*", "X-SESSION-ID: b"))
    assert seen["session"] == ["a", "b"]  # twice: routing/sessions.py refuses it


async def test_a_trailer_is_never_a_session_id(port: int) -> None:
    raw = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"2\r\n{}\r\n0\r\nX-Session-ID: late\r\n\r\n"
    )
    seen = await carried(port, raw)
    assert seen["session"] == [] and "x-session-id" not in seen["names"]
