"""A load no replica can finish (a mistyped path answers "No adapter found" until the deadline):
what the operator sees while it waits, and how the wait ends when its client gives up."""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import aiohttp
import orjson
import pytest
from emulated_fleet import StartEmulators, StartRouter, paths_of
from helpers import Adapter, call, load, router_status, until

from lora_router.emulator import Emulator
from lora_router.runtime import RouterRuntime


async def _send_load_and_hang_up_later(
    url: str, name: str, path: str
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A client that posts a load on a raw socket it will close itself."""
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    body = orjson.dumps({"lora_name": name, "lora_path": path})
    writer.write(
        b"POST /v1/load_lora_adapter HTTP/1.1\r\nHost: router\r\n"
        b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    return reader, writer


async def replica_2_waiting_for_the_files(
    emulators: StartEmulators, router: StartRouter, adapter: Adapter
) -> tuple[list[Emulator], RouterRuntime, asyncio.StreamWriter]:
    """Three replicas, the third of which never sees trl-policy-v1's files, and a load of it
    whose wait has begun. Returns the replicas, the router and the load's connection."""
    emus = await emulators(3)
    emus[2].faults.mount_lag = 10_000  # replica 2 never sees the files
    rt = await router(emus, load_deadline=20.0)
    assert rt.broadcaster is not None
    rt.broadcaster.loads.mount_wait_log_interval = 0.05  # 30 s in production
    _, writer = await _send_load_and_hang_up_later(
        rt.url, "trl-policy-v1", adapter("trl-policy-v1")
    )
    async with asyncio.timeout(10):
        await until(lambda: bool(rt.broadcaster and rt.broadcaster.loads.mount_waits))
    return emus, rt, writer


async def test_a_replica_that_cannot_see_the_adapter_is_logged_while_it_waits(
    emulators: StartEmulators,
    router: StartRouter,
    adapter: Adapter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="lora_router")
    emus, _, writer = await replica_2_waiting_for_the_files(emulators, router, adapter)
    async with asyncio.timeout(10):
        await until(lambda: "still answers 'No adapter found'" in caplog.text)
    started = [
        r.getMessage()
        for r in caplog.records
        if "still" not in r.getMessage() and "answers 'No adapter found' for" in r.getMessage()
    ]
    assert len(started) == 1 and f"Replica 2 ({emus[2].url})" in started[0]
    writer.close()


async def test_a_replica_that_cannot_see_the_adapter_is_shown_while_it_waits(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    _, rt, writer = await replica_2_waiting_for_the_files(emulators, router, adapter)
    # The wait has just begun, and the loop's clock counts whole milliseconds (uvloop): let
    # some pass, so that "how long so far" is more than 0 when read.
    await asyncio.sleep(0.01)
    async with asyncio.timeout(10):
        waits = (await router_status(client, rt.url))["broadcasts"]["mount_waits"]
        assert [(w["replica"], w["adapter"]) for w in waits] == [(2, "trl-policy-v1")]
        assert waits[0]["seconds"] > 0
        _, metrics, _ = await call(client, "GET", rt.url + "/metrics")
        line = next(
            ln
            for ln in metrics.decode().splitlines()
            if ln.startswith('lora_router_load_mount_wait_seconds{replica="2"}')
        )
        assert float(line.split()[-1]) > 0
        assert 'lora_router_load_mount_wait_seconds{replica="0"} 0.0' in metrics.decode()
    writer.close()


async def test_the_wait_ends_when_the_client_disconnects(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="lora_router")
    emus = await emulators(2)
    emus[1].faults.mount_lag = 10_000
    rt = await router(emus, load_deadline=60.0)
    path = adapter("typo")
    _, writer = await _send_load_and_hang_up_later(rt.url, "trl-policy-v1", path)
    async with asyncio.timeout(10):
        await until(lambda: bool(rt.broadcaster and rt.broadcaster.loads.mount_waits))
        resume = asyncio.create_task(call(client, "POST", rt.url + "/resume"))
        await until(lambda: "/resume waits for load 'trl-policy-v1'" in caplog.text)
        assert not resume.done()
        writer.close()  # the trainer gave up
        status, _, _ = await resume  # well before the 60 s deadline
    assert status == 200
    assert rt.broadcaster is not None and not rt.broadcaster.loads.mount_waits
    # No retry after the disconnect; the replica that took the adapter gave it back.
    attempts = len(paths_of(emus[1], "/v1/load_lora_adapter"))
    await call(client, "GET", rt.url + "/health")
    assert len(paths_of(emus[1], "/v1/load_lora_adapter")) == attempts
    assert "trl-policy-v1" not in emus[0].state.adapters
    assert rt.broadcaster.counts["load", "failed"] == 1
    assert f"disconnected while Replica 1 ({emus[1].url}) still answered" in caplog.text
    # The name is free: the corrected load then works.
    emus[1].faults.mount_lag = 0
    assert (await load(client, rt.url, "trl-policy-v1", path))[0] == 200
