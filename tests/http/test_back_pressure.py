"""Back-pressure on the router's own answers (http/server.py, #44 item 2), over real sockets: a
client that pipelines requests and never reads its answers costs the router bounded memory,
authenticated or not. The router runs as a process of its own, its memory read from
/proc/PID/status.
"""

from __future__ import annotations

import asyncio
import re
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from helpers import router_process
from http_harness import TOKEN, FakeReplica

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")

SEND_S = 3.0  # how long the client pipelines
BOUND_MIB = 48  # the router's growth allowed meanwhile (today's fix: a few MiB)
ROUTER_KEY = "router-key-9c4e"


def rss_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmRSS:\s+(\d+) kB", status)
    assert match, status
    return int(match.group(1)) / 1024


@asynccontextmanager
async def router_before(replica: FakeReplica, *args: str) -> AsyncIterator[tuple[int, int]]:
    """A router process in front of `replica` (its token in HF_TOKEN, the router key in
    ROUTER_KEY): (pid, port)."""
    argv = ("--replicas", replica.url, "--token-env", "HF_TOKEN", "--keepalive-timeout", "60")
    env = {"HF_TOKEN": TOKEN, "ROUTER_KEY": ROUTER_KEY}
    async with router_process(*argv, *args, env=env) as router:
        yield router.proc.pid, router.port


async def one_answer(port: int, request: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(request)
        async with asyncio.timeout(5):
            return await reader.readuntil(b"\r\n\r\n")
    finally:
        writer.close()


async def pipeline_without_reading(port: int, request: bytes) -> int:
    """Pipelines `request` on one connection for SEND_S seconds, reading nothing; how many
    it sent."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    batch = request * 200
    sent = 0
    deadline = time.monotonic() + SEND_S
    try:
        for _ in range(100_000):  # bounded by the deadline first
            left = deadline - time.monotonic()
            if left <= 0:
                break
            writer.write(batch)
            sent += 200
            try:
                async with asyncio.timeout(left):
                    await writer.drain()  # the router stops reading: this waits
            except TimeoutError:
                break
    finally:
        writer.transport.abort()
    return sent


StartReplica = Callable[..., Awaitable[FakeReplica]]
STATUS = b"GET /router/status HTTP/1.1\r\nhost: r\r\n\r\n"


@pytest.mark.parametrize("keyed", [False, True], ids=["status", "401"])
async def test_a_client_pipelining_without_reading_holds_bounded_memory(
    keyed: bool, replica: FakeReplica
) -> None:
    args = ("--api-key-env", "ROUTER_KEY") if keyed else ()
    async with router_before(replica, *args) as (pid, port):
        expected = b"HTTP/1.1 401" if keyed else b"HTTP/1.1 200"
        assert (await one_answer(port, STATUS)).startswith(expected)
        before = rss_mib(pid)
        sent = await pipeline_without_reading(port, STATUS)
        grown = rss_mib(pid) - before
        assert sent > 0
        assert grown < BOUND_MIB, f"{grown:.0f} MiB after {sent} pipelined requests"
        # The router still answers others.
        assert (await one_answer(port, STATUS)).startswith(expected)


async def test_a_client_that_reads_slowly_gets_every_pipelined_answer_in_order(
    replica: FakeReplica,
) -> None:
    """The other side: held for back-pressure, the connection goes on when the client reads.
    A small receive buffer makes the router's transport pause after a few answers."""
    n = 4000
    async with router_before(replica) as (_, port):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", port))
        reader, writer = await asyncio.open_connection(sock=sock)
        paths = [b"/router/status", b"/nope"] * (n // 2)
        writer.write(b"".join(b"GET %s HTTP/1.1\r\nhost: r\r\n\r\n" % p for p in paths))
        got = b""
        try:
            async with asyncio.timeout(20):
                while got.count(b"HTTP/1.1 ") < n or not got.endswith(b"}"):
                    chunk = await reader.read(4096)
                    assert chunk, f"closed after {got.count(b'HTTP/1.1 ')} answers"
                    got += chunk
        finally:
            writer.transport.abort()
        statuses = re.findall(rb"HTTP/1.1 (\d+)", got)
        assert statuses == [b"200", b"404"] * (n // 2)
