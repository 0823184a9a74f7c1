"""A 5xx head the retry rule diverts is not read on (proxy/routed.py, http/upstream.py): its
connection is closed at once and the retry goes out then, whatever the rest of that answer
would have been (a body that stalls, one that never ends)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
from emulated_fleet import StartRouter
from http_harness import FakeReplica, Received, ReplicaConn, completion, ok_responder, request

StartReplica = Callable[..., Awaitable[FakeReplica]]
SLACK = 3.0  # scheduling noise on a shared machine, never a second deadline


async def stalls(req: Received, conn: ReplicaConn) -> None:
    """A 500 head announcing a body that never comes."""
    await conn.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 100\r\n\r\n{")
    await asyncio.Event().wait()


async def endless(req: Received, conn: ReplicaConn) -> None:
    """A 500 head, then a chunked body that never ends."""
    await conn.write(b"HTTP/1.1 500 Internal Server Error\r\ntransfer-encoding: chunked\r\n\r\n")
    while True:
        await conn.write(b"%x\r\n%s\r\n" % (4096, b"x" * 4096))
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("sick", [stalls, endless], ids=["stalled-body", "endless-body"])
async def test_a_diverted_5xx_is_retried_at_once_and_its_connection_closed(
    replica_factory: StartReplica,
    router: StartRouter,
    sick: Callable[[Received, ReplicaConn], Awaitable[None]],
) -> None:
    bad = await replica_factory(sick)
    good = await replica_factory(ok_responder)
    idle = 30.0
    rt = await router([bad, good], idle_timeout=idle, first_byte_timeout=idle)
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.timeout(SLACK):  # not --idle-timeout, nor never
        answer = await request(rt.url, "POST", "/v1/completions", completion())
    assert answer.status == 200 and answer.header(b"x-lora-router-replica") == b"1"
    assert loop.time() - started < idle
    async with asyncio.timeout(SLACK):
        await bad.conns[0].closed.wait()  # not read on, not kept
    assert len(bad.requests) == 1 and len(good.requests) == 1
