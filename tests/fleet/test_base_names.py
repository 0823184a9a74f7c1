"""Only agreement names base models (fleet.py, issue 44): a member whose `/v1/models` lists
adapter versions as base models never widens the fence, while it is a member or after.

The hostile member is a small aiohttp server on loopback that answers like vLLM, listing
`trl-policy-v1..v20` as cards without a parent; the real replicas are emulators, one of them
slow to load, so a load of `trl-policy-v8` is under way while completions for it arrive.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest
from emulated_fleet import FenceMonitor, StartEmulators, StartRouter
from helpers import Adapter, call, complete, listing_replica, load, until

BASE = "Qwen/Qwen2.5-Math-1.5B"  # the emulators' model


@pytest.fixture
async def lister() -> AsyncIterator[str]:
    """A replica that lists the base model and `trl-policy-v1..v20` as base models."""
    cards = [
        {"id": name, "object": "model", "root": name, "parent": None}
        for name in (BASE, *(f"trl-policy-v{i}" for i in range(1, 21)))
    ]

    async with listing_replica(lambda: cards) as url:
        yield url


async def test_a_member_listing_adapter_versions_as_bases_never_widens_the_fence(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monitor: FenceMonitor,
    lister: str,
) -> None:
    fast, slow = await emulators(2)
    slow.faults.load_delay_s = 1.0
    rt = await router([fast, slow], replica_hosts=("127.0.0.0/8",))
    assert rt.fleet is not None
    assert rt.fleet.base_models == {BASE}
    code, body, _ = await call(client, "POST", rt.url + "/router/replicas", {"url": lister})
    assert code in (200, 202), body
    rid = orjson.loads(body)["id"]
    assert rt.fleet.base_models == {BASE}  # it is a member: its names still do not count
    code, _, _ = await call(client, "DELETE", rt.url + f"/router/replicas/{rid}")
    assert code == 200
    assert rt.fleet.base_models == {BASE}

    loading = asyncio.create_task(load(client, rt.url, "trl-policy-v8", adapter("trl-policy-v8")))
    await until(lambda: "trl-policy-v8" in fast.state.adapters)  # slow has not got it yet
    traffic = [
        asyncio.create_task(complete(client, rt.url, "trl-policy-v8", prompt=[i] * 40))
        for i in range(8)
    ]
    await asyncio.sleep(0)
    assert "trl-policy-v8" not in slow.state.adapters
    assert (await loading)[0] == 200
    assert [(await t)[0] for t in traffic] == [200] * 8  # waited at the fence, then served
    assert monitor.violations == [] and monitor.checked >= 8
