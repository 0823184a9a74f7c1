"""The unload race: a request that passed the fence just before an unload arrived is answered by
a replica that still holds the name, because the unload waits for it before it is broadcast;
the client that unloaded is answered at once meanwhile, as vLLM answers it, and no other
broadcast waits behind the drain (fleet/broadcast.py, *Unload*)."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from emulated_fleet import FenceMonitor, StartEmulators, StartRouter
from helpers import Adapter, call, complete, load, router_status, unload, until

from lora_router.emulator.server import Emulator
from lora_router.fleet.fence import AdapterState


async def _stuck_request(
    client: aiohttp.ClientSession, url: str, emu: Emulator, path: str
) -> asyncio.Task[tuple[int, object]]:
    """v1 loaded from `path`, and a completion for it stalled on `emu` (its stall set)."""
    assert (await load(client, url, "v1", path))[0] == 200
    stuck = asyncio.create_task(complete(client, url, "v1"))
    await until(lambda: emu.faults.stalled == 1)
    return stuck


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
    # Answered at once, as vLLM answers it (TRL's trainer waits for this answer)...
    status, body, headers = await call(
        client, "POST", rt.url + "/v1/unload_lora_adapter", {"lora_name": "v1"}
    )
    assert (status, body) == (200, b"Success: LoRA adapter 'v1' removed successfully.")
    assert "x-lora-router-replica" not in headers  # no replica has acknowledged it yet
    assert not first.done() and not second.done()
    assert rt.fence.state("v1") is AdapterState.UNLOADING and rt.fence.unload_waits == 1
    assert "v1" in emu.state.adapters  # ...not broadcast while admitted requests are unanswered
    assert (await complete(client, rt.url, "v1"))[0] == 404  # arrived after: vLLM's 404
    broadcasts = (await router_status(client, rt.url))["broadcasts"]
    assert broadcasts["unloads_draining"] == {"v1": 2} and broadcasts["unloads_deferred"] == 1
    emu.faults.stall = False
    assert (await first)[0] == 200
    assert (await second)[0] == 200
    await until(lambda: "v1" not in emu.state.adapters and rt.fence.state("v1") is None)
    assert rt.fence.held("v1") == 0 and monitor.violations == []
    assert rt.broadcaster is not None and rt.broadcaster.deferred() == []


async def test_an_unload_waits_for_admitted_requests_at_most_unload_wait(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    (emu,) = await emulators(1)
    rt = await router([emu], unload_wait=0.2)
    emu.faults.stall = True
    try:
        stuck = await _stuck_request(client, rt.url, emu, adapter("v1"))
        loop = asyncio.get_running_loop()
        started = loop.time()
        assert (await unload(client, rt.url, "v1"))[0] == 200
        assert loop.time() - started < 0.2  # the client does not wait for the drain
        await until(lambda: "v1" not in emu.state.adapters, timeout=2.0)
        assert 0.2 <= loop.time() - started < 2.0
        assert rt.fence.unload_wait_timeouts == 1 and not stuck.done()
    finally:
        emu.faults.stall = False
    assert (await stuck)[0] == 200  # vLLM serves a request whose adapter it unregistered


async def test_a_draining_unload_holds_no_other_broadcast(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    """TRL's next sync (pause, load, resume) goes out while an older version drains."""
    (emu,) = await emulators(1)
    rt = await router([emu], unload_wait=30)
    emu.faults.stall = True
    try:
        stuck = await _stuck_request(client, rt.url, emu, adapter("v1"))
        assert (await unload(client, rt.url, "v1"))[0] == 200
        async with asyncio.timeout(5):  # the drain alone could take 30 s
            assert (await call(client, "POST", rt.url + "/pause?mode=keep"))[0] == 200
            assert (await load(client, rt.url, "v2", adapter("v2")))[0] == 200
            assert (await call(client, "POST", rt.url + "/resume"))[0] == 200
        assert "v2" in emu.state.adapters and "v1" in emu.state.adapters
        assert rt.fence.state("v1") is AdapterState.UNLOADING and not stuck.done()
    finally:
        emu.faults.stall = False
    assert (await stuck)[0] == 200
    await until(lambda: "v1" not in emu.state.adapters and rt.fence.state("v1") is None)
    assert (await complete(client, rt.url, "v2"))[0] == 200


async def test_a_load_of_a_draining_name_goes_out_after_its_unload(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monitor: FenceMonitor,
) -> None:
    """Loaded again while its unload drains: the unload reaches the replica first, so the name
    ends loaded there (the other order would leave the fence live on a replica without it)."""
    (emu,) = await emulators(1)
    rt = await router([emu], unload_wait=30)
    path = adapter("v1")
    assert (await load(client, rt.url, "v1", path))[0] == 200
    emu.faults.stall = True
    try:
        stuck = asyncio.create_task(complete(client, rt.url, "v1"))
        await until(lambda: emu.faults.stalled == 1)
        assert (await unload(client, rt.url, "v1"))[0] == 200
        again = asyncio.create_task(load(client, rt.url, "v1", path))
        waiting = asyncio.create_task(complete(client, rt.url, "v1", prompt=[5] * 30))
        await until(lambda: rt.fence.state("v1") is AdapterState.LOADING and rt.fence.waiting)
        assert not again.done() and "v1" in emu.state.adapters  # the first load's copy
    finally:
        emu.faults.stall = False
    assert (await stuck)[0] == 200
    assert (await again)[0] == 200
    assert (await waiting)[0] == 200  # waited at the fence, served by the new copy
    assert "v1" in emu.state.adapters and rt.fence.state("v1") is AdapterState.LIVE
    assert (await complete(client, rt.url, "v1"))[0] == 200 and monitor.violations == []


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


async def test_an_answered_unload_still_goes_out_when_the_router_stops(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    """Its client was told the name is gone: a stop that cuts the requests it waits for still
    sends it, where a broadcast not yet started is refused."""
    (emu,) = await emulators(1)
    rt = await router([emu], unload_wait=30)
    emu.faults.stall = True
    try:
        stuck = await _stuck_request(client, rt.url, emu, adapter("v1"))
        assert (await unload(client, rt.url, "v1"))[0] == 200
        assert "v1" in emu.state.adapters
        async with asyncio.timeout(10):
            await rt.stop(grace=0)
        assert "v1" not in emu.state.adapters
    finally:
        emu.faults.stall = False
    with contextlib.suppress(aiohttp.ClientError):
        await stuck
