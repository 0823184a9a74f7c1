"""Amplification and sizes (issue 44): an unauthenticated `/health` storm makes one probe of
each replica at a time, the fleet has a size cap, and dead members are checked less often.

The replica here is a small aiohttp server on loopback that answers like vLLM and holds each
`/health` until a second one arrives alongside it (or 0.5 s pass), so concurrent probes are
seen for sure when they happen.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import pytest
from aiohttp import web
from emulated_fleet import StartRouter
from helpers import call

BASE = "Qwen/Qwen2.5-Math-1.5B"


@dataclass
class Probed:
    url: str
    health: int = 0  # /health requests received
    active: int = 0
    peak: int = 0
    crowd: asyncio.Event | None = None


@pytest.fixture
async def probed() -> AsyncIterator[Probed]:
    state = Probed("")
    state.crowd = asyncio.Event()

    async def health(request: web.Request) -> web.Response:
        assert state.crowd is not None
        state.health += 1
        state.active += 1
        state.peak = max(state.peak, state.active)
        if state.active > 1:
            state.crowd.set()
        try:
            async with asyncio.timeout(0.5):
                await state.crowd.wait()
        except TimeoutError:
            pass
        finally:
            state.active -= 1
        return web.Response()

    async def models(request: web.Request) -> web.Response:
        card = {"id": BASE, "object": "model", "root": BASE, "parent": None}
        return web.json_response({"object": "list", "data": [card]})

    app = web.Application()
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    state.url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    yield state
    await runner.cleanup()


class _Url:
    def __init__(self, url: str) -> None:
        self.url = url


async def test_a_health_storm_makes_one_probe_of_each_replica_at_a_time(
    router: StartRouter, client: aiohttp.ClientSession, probed: Probed
) -> None:
    rt = await router([_Url(probed.url)])
    async with asyncio.timeout(20):
        codes = await asyncio.gather(*(call(client, "GET", rt.url + "/health") for _ in range(200)))
    assert [c for c, _, _ in codes] == [200] * 200
    assert probed.peak == 1  # never two probes of the replica at once
    assert probed.health <= 5  # shared: 200 callers, a wave of probes per 100 connections
