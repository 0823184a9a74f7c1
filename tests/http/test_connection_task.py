"""The connection's Task (http/server.py): one Task answers a connection's requests in turn,
pipelined or not, waits for the next between them, and ends with its connection.

A `ClientConnection` served on a loopback socket, its handler a test's: each answer names the
Task that wrote it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from helpers import router_config

from lora_router.http.errors import HTTPError
from lora_router.http.request import ConnectionCount, Request
from lora_router.http.server import ClientConnection
from lora_router.routes import body_cap


class Served:
    """A loopback server whose connections run `handler`; the Tasks that answered, in order."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[object]] = []
        self.port = 0

    async def handler(self, request: Request, conn: ClientConnection) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.append(task)
        if request.path == b"/fail":
            raise HTTPError(404, "No such thing.")
        conn.send(200, request.path)


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    served = Served()
    config = router_config(["http://127.0.0.1:1"])
    count = ConnectionCount(config.max_connections, config.max_buffered_bytes)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        lambda: ClientConnection(served.handler, config, count, body_cap), "127.0.0.1", 0
    )
    served.port = server.sockets[0].getsockname()[1]
    try:
        yield served
    finally:
        server.close()
        for conn in list(count.open):
            conn.abort()
        await server.wait_closed()


def get(path: str, close: bool = False) -> bytes:
    connection = b"Connection: close\r\n" if close else b""
    return f"GET {path} HTTP/1.1\r\nHost: x\r\n".encode() + connection + b"\r\n"


async def answers(reader: asyncio.StreamReader, n: int) -> list[bytes]:
    """`n` answers' bodies (each a Content-Length one), in the order they came."""
    out = []
    async with asyncio.timeout(5):
        for _ in range(n):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
            out.append(await reader.readexactly(length))
    return out


async def test_one_task_answers_a_connections_requests_in_turn(served: Served) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    try:
        writer.write(get("/a"))
        assert await answers(reader, 1) == [b"/a"]
        writer.write(get("/b"))  # after a wait: the Task waited for it
        assert await answers(reader, 1) == [b"/b"]
        writer.write(get("/c") + get("/fail") + get("/d"))  # pipelined, an error among them
        (c, failed, d) = await answers(reader, 3)
        assert (c, d) == (b"/c", b"/d")
        assert b"No such thing." in failed
        assert len(served.tasks) == 5
        assert len(set(served.tasks)) == 1, "a Task per request, not per connection"
        # Another connection: a Task of its own.
        other_reader, other_writer = await asyncio.open_connection("127.0.0.1", served.port)
        other_writer.write(get("/e"))
        assert await answers(other_reader, 1) == [b"/e"]
        other_writer.close()
        assert served.tasks[-1] is not served.tasks[0]
    finally:
        writer.close()


@pytest.mark.parametrize("how", ["client-left-while-idle", "connection-close"])
async def test_the_connections_task_ends_with_it(served: Served, how: str) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", served.port)
    writer.write(get("/a"))
    assert await answers(reader, 1) == [b"/a"]
    (task,) = served.tasks
    if how == "client-left-while-idle":
        assert not task.done()  # it waits for the next request
        writer.close()
    else:
        writer.write(get("/b", close=True))
        assert await answers(reader, 1) == [b"/b"]
    # At once: not when the closing connection's linger ends (2 s, http/server.py).
    async with asyncio.timeout(1):
        await asyncio.wait({task})
    assert task.done() and not task.cancelled()
    writer.close()
