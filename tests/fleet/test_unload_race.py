"""The unload race: a request that passed the fence just before an unload arrived is answered by
a replica that still holds the name, because the unload waits for it before it is broadcast."""

from __future__ import annotations

import asyncio

import aiohttp
from emulated_fleet import FenceMonitor, StartEmulators, StartRouter
from helpers import Adapter, complete, load, unload, until

from lora_router.fleet.fence import AdapterState


async def test_a_request_admitted_before_an_unload_is_answered_by_a_replica_still_holding_it(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monitor: FenceMonitor,
) -> None:
    (emu,) = await emulators(1)
    # One upstream connection: a second request waits between the fence and the replica,
    # the window in which the unload used to overtake it.
    rt = await router([emu], max_upstream_connections=1)
    assert (await load(client, rt.url, "v1", adapter("v1")))[0] == 200
    emu.faults.stall = True
    first = asyncio.create_task(complete(client, rt.url, "v1"))
    await until(lambda: emu.faults.stalled == 1)
    second = asyncio.create_task(complete(client, rt.url, "v1", prompt=[7] * 30))
    await until(lambda: rt.fence.held("v1") == 2)
    unloading = asyncio.create_task(unload(client, rt.url, "v1"))
    await until(lambda: rt.fence.state("v1") is AdapterState.UNLOADING and rt.fence.unload_waits)
    assert "v1" in emu.state.adapters  # not broadcast while admitted requests are unanswered
    assert (await complete(client, rt.url, "v1"))[0] == 404  # arrived after: vLLM's 404
    emu.faults.stall = False
    assert (await first)[0] == 200
    assert (await second)[0] == 200
    assert (await unloading)[0] == 200
    assert "v1" not in emu.state.adapters and rt.fence.state("v1") is None
    assert rt.fence.held("v1") == 0 and monitor.violations == []


async def test_an_unload_waits_for_admitted_requests_at_most_unload_wait(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    (emu,) = await emulators(1)
    rt = await router([emu], unload_wait=0.2)
    assert (await load(client, rt.url, "v1", adapter("v1")))[0] == 200
    emu.faults.stall = True
    try:
        stuck = asyncio.create_task(complete(client, rt.url, "v1"))
        await until(lambda: emu.faults.stalled == 1)
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert (await unload(client, rt.url, "v1"))[0] == 200
        assert 0.2 <= loop.time() - started < 2.0
        assert rt.fence.unload_wait_timeouts == 1 and "v1" not in emu.state.adapters
    finally:
        emu.faults.stall = False
    assert (await stuck)[0] == 200  # vLLM serves a request whose adapter it unregistered


async def test_streams_count_as_answered_once_their_head_arrived(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    (emu,) = await emulators(1, decode_s_per_token=0.05)
    rt = await router([emu])
    assert (await load(client, rt.url, "v1", adapter("v1")))[0] == 200
    body = {"model": "v1", "prompt": [1] * 20, "max_tokens": 40, "stream": True}
    async with client.post(rt.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        await resp.content.readline()  # a first frame: the head arrived long ago
        assert rt.fence.held("v1") == 0
        # The unload does not wait for the rest of the stream, which goes on to its end.
        assert (await unload(client, rt.url, "v1"))[0] == 200
        assert rt.fence.unload_waits == 0
        rest = await resp.read()
    assert rest.endswith(b"data: [DONE]\n\n")
