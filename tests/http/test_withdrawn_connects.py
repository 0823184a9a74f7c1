"""A request whose connection to its replica is still opening when the replica leaves service is
withdrawn like one waiting for its answer (http/upstream.py's withdrawal rule): it is retried on
another replica at once, not after `--connect-timeout`.

The https replica stands behind a loopback listener (`Gate`) that passes connections through,
until the test makes it hold every new one: accepted, its TLS ClientHello never answered (a
replica whose handshake hangs), and the connections already through cut, so the health checks
too must connect anew, hang, and eject it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from helpers import until
from http_harness import FakeReplica, completion, request

from lora_router.fleet.lifecycle import State


class Gate:
    """A listener in front of a replica: connections pass through until `hold`, then hang."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.holding = False
        self._server: asyncio.Server | None = None
        self._through: list[asyncio.StreamWriter] = []
        self._held: list[asyncio.StreamWriter] = []

    async def start(self) -> Gate:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    def hold(self) -> None:
        """Every new connection hangs from now on; those already through are cut."""
        self.holding = True
        for writer in self._through:
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.holding:
            self._held.append(writer)  # accepted, never answered
            return
        self._through.append(writer)
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        pipes = (_pipe(reader, up_writer), _pipe(up_reader, writer))
        await asyncio.gather(*pipes, return_exceptions=True)

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in self._through + self._held:
            writer.transport.abort()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.transport.abort()


@pytest.fixture
async def gated(tls_replica: tuple[FakeReplica, str]) -> AsyncIterator[tuple[Gate, str]]:
    """A TLS replica behind a `Gate`; yields the gate and the CA file that trusts the replica."""
    replica, ca_file = tls_replica
    gate = await Gate(replica.port).start()
    yield gate, ca_file
    gate.stop()


async def test_a_request_still_connecting_to_an_ejected_replica_is_retried_at_once(
    router, replica, gated
):
    gate, ca_file = gated
    rt = await router(
        [f"https://127.0.0.1:{gate.port}", replica],
        ca_file=ca_file,
        connect_timeout=30.0,
        first_byte_timeout=30.0,
        health_interval=0.1,
        health_timeout=0.5,
        health_failures=2,
    )
    assert rt.fleet is not None
    hanging = rt.fleet.replicas[0]
    assert hanging.state is State.SERVING
    gate.hold()
    # Round robin: one of the two goes to the replica behind the gate, where its connection
    # (the first of the data plane there) hangs in the TLS handshake.
    work = [
        asyncio.create_task(request(rt.url, "POST", "/v1/completions", completion()))
        for _ in range(2)
    ]
    await until(lambda: hanging.in_flight == 1)
    assert hanging.pool.open_connections == 0  # still connecting
    assert hanging.state is State.SERVING
    # Ejected by its health checks within a second or so (two of 0.5 s); the request then
    # goes to the other replica at once, not after --connect-timeout (30 s).
    async with asyncio.timeout(8.0):
        answers = await asyncio.gather(*work)
    assert [a.status for a in answers] == [200, 200]
    assert len(replica.requests) == 2
    assert hanging.state is State.EJECTED
    assert hanging.in_flight == 0
    assert hanging.breaker.failures == 0  # the withdrawal is not a failure of the replica
