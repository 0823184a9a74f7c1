"""A stream a replica breaks off after its head reached the client (proxy/routed.py's cut
stream): the client sees a truncated answer, never a clean end; the router counts it on the
replica (`/router/status`, `/metrics`) and logs it with the bytes that came."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import call, router_status, samples


async def test_a_cut_stream_is_counted_logged_and_seen_truncated(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    (emu,) = await emulators(1)
    emu.faults.crash_after_frames = 2  # two SSE frames, then the connection is cut
    rt = await router([emu])
    body = {"prompt": list(range(20)), "max_tokens": 8, "stream": True}
    got = b""
    with (
        caplog.at_level(logging.WARNING, logger="lora_router"),
        pytest.raises(aiohttp.ClientPayloadError),
    ):
        async with client.post(rt.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            async for chunk in resp.content.iter_any():
                got += chunk
    assert got.count(b"data: ") == 2 and b"[DONE]" not in got  # truncated, not a clean end
    assert (await router_status(client, rt.url))["replicas"][0]["cut_streams"] == 1
    _, metrics, _ = await call(client, "GET", rt.url + "/metrics")
    assert samples(metrics.decode())["lora_router_cut_streams_total", (("replica", "0"),)] == 1
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("cut stream")]
    assert f"Replica 0 ({emu.url}) broke off its answer to /v1/completions after" in line
    assert "bytes" in line and "never retried" in line


async def test_a_whole_stream_is_not_a_cut_one(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (emu,) = await emulators(1)
    rt = await router([emu])
    body = {"prompt": list(range(20)), "max_tokens": 8, "stream": True}
    async with client.post(rt.url + "/v1/completions", json=body) as resp:
        assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    assert (await router_status(client, rt.url))["replicas"][0]["cut_streams"] == 0
