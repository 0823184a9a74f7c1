"""Fixtures for the data-plane tests (tests/http and tests/proxy conftest.py import them):
fake replicas, the settings of their routers (started by tests/emulated_fleet.py's `router`),
raw-socket clients, and the token scan.

The replica token is `TOKEN`; after each test, every log record the router produced (at debug
level) and every byte a `RawClient` received is searched for it.
"""

from __future__ import annotations

import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from http_harness import (
    RECEIVED,
    TEST_CONFIG,
    TOKEN,
    FakeReplica,
    LogCapture,
    RawClient,
    Responder,
    ok_responder,
)


@pytest.fixture
async def replica_factory() -> AsyncIterator[Callable[..., Awaitable[FakeReplica]]]:
    started: list[FakeReplica] = []

    async def make(responder: Responder = ok_responder, **kwargs: Any) -> FakeReplica:
        replica = await FakeReplica(responder, **kwargs).start()
        started.append(replica)
        return replica

    yield make
    for replica in started:
        await replica.stop()


@pytest.fixture
async def replica(replica_factory: Callable[..., Awaitable[FakeReplica]]) -> FakeReplica:
    return await replica_factory()


@pytest.fixture
async def tls_replica(
    replica_factory: Callable[..., Awaitable[FakeReplica]], tmp_path: Path
) -> tuple[FakeReplica, str]:
    """A fake replica serving TLS as 127.0.0.1 under a private CA, and the CA file that
    trusts it (`--ca-file`)."""
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    replica = await replica_factory(ssl_context=server_ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    return replica, str(ca_file)


@pytest.fixture
def router_settings() -> dict[str, Any]:
    """The settings of the routers these tests start with tests/emulated_fleet.py's `router`:
    `TEST_CONFIG`, the replica token and round-robin included."""
    return TEST_CONFIG


@pytest.fixture
async def clients() -> AsyncIterator[Callable[[str | int], Awaitable[RawClient]]]:
    opened: list[RawClient] = []

    async def connect(url: str | int) -> RawClient:
        client = await RawClient.connect(url)
        opened.append(client)
        return client

    yield connect
    for client in opened:
        client.close()
        with contextlib.suppress(Exception):
            await client.writer.wait_closed()


@pytest.fixture(autouse=True)
def token_never_leaks() -> Any:
    """Every test: the router logs at debug level, and no log line of any logger (the router's,
    asyncio's, aiohttp's) nor any byte a client received contains the replica token."""
    capture = LogCapture()
    logger = logging.getLogger("lora_router")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    root = logging.getLogger()
    root.addHandler(capture)
    RECEIVED.clear()
    yield capture
    root.removeHandler(capture)
    logger.setLevel(level)
    for line in capture.records:
        assert TOKEN not in line, "the replica token appeared in a log line"
    assert TOKEN.encode() not in b"".join(RECEIVED), "the replica token reached a client"
    RECEIVED.clear()
