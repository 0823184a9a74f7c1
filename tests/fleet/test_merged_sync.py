"""TRL's merged-weight sync fallback is refused, not passed to one replica of the fleet."""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import call

from lora_router.emulator import Emulator

# What TRL 1.16's VLLMClient posts when `select_adapter_sync` returned False
# (trl/experimental/async_grpo/vllm_client.py, init_weight_transfer_engine .. finish_weight_update).
MERGED_SYNC_CALLS = [
    ("/init_weight_transfer_engine", {"init_info": {"master_address": "10.0.0.1"}}),
    ("/start_weight_update", {"is_checkpoint_format": True}),
    ("/update_weights", {"update_info": {"names": ["w"]}}),
    ("/finish_weight_update", None),
]


async def merged_sync_call(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    path: str,
    body: object,
) -> tuple[list[Emulator], int, bytes]:
    """Post one merged-sync call to a router of two replicas: the replicas and the answer."""
    emus = await emulators(2)
    rt = await router(emus)
    status, data, _ = await call(client, "POST", rt.url + path, body)
    return emus, status, data


@pytest.mark.parametrize(("path", "body"), MERGED_SYNC_CALLS)
async def test_merged_weight_sync_reaches_no_replica(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    path: str,
    body: object,
) -> None:
    emus, _, _ = await merged_sync_call(emulators, router, client, path, body)
    assert not any(r.path.split("?")[0] == path for emu in emus for r in emu.requests)


@pytest.mark.parametrize(("path", "body"), MERGED_SYNC_CALLS)
async def test_merged_weight_sync_is_refused_with_the_cause(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    path: str,
    body: object,
) -> None:
    _, status, data = await merged_sync_call(emulators, router, client, path, body)
    assert status == 501
    error = orjson.loads(data)["error"]
    assert error["code"] == 501 and error["type"] == "NotImplemented"
    message = error["message"]
    assert path in message
    assert "Only adapter-only sync" in message and "every replica" in message
    assert "--enable-lora" in message and "peft_config" in message
