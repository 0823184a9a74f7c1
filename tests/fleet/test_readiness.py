"""A replica that cannot take part in a weight sync (no dev mode, no runtime loading, no LoRA)
is named where an operator looks (fleet/readiness.py): a warning when found, its problems on the
replica in `/router/status`, `/health`'s 503 when no replica in service can take part, and the
missing flag in the answer to a sync call it fails."""

from __future__ import annotations

import logging

import aiohttp
import orjson
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, call, load, router_status


async def status_of(client: aiohttp.ClientSession, url: str) -> list[dict[str, object]]:
    return list((await router_status(client, url))["replicas"])


@pytest.mark.parametrize(
    ("flags", "problem"),
    [
        (
            {"dev_mode": False},
            "dev mode is off: /pause, /resume and /server_info do not exist; "
            "fix: start it with VLLM_SERVER_DEV_MODE=1",
        ),
        (
            {"runtime_lora_updating": False},
            "runtime adapter loading is off: POST /v1/load_lora_adapter does not exist; "
            "fix: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1",
        ),
        ({"enable_lora": False}, "LoRA is disabled (vllm_config.lora_config is null)"),
    ],
)
async def test_a_fleet_that_cannot_sync_answers_health_with_the_cause_and_the_fix(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
    flags: dict[str, bool],
    problem: str,
) -> None:
    emus = await emulators(1, **flags)
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        rt = await router(emus)
    status, body, _ = await call(client, "GET", rt.url + "/health")
    assert status == 503
    message = orjson.loads(body)["error"]["message"]
    assert message.startswith("No replica in service can take part in a weight sync: Replica 0")
    assert problem in message
    (replica,) = await status_of(client, rt.url)
    assert replica["state"] == "serving"  # it still serves what it can
    assert len(replica["sync_problems"]) == 1 and problem in replica["sync_problems"][0]
    warned = [r.getMessage() for r in caplog.records if "cannot take part" in r.getMessage()]
    assert len(warned) == 1 and problem in warned[0], warned


async def test_one_replica_that_cannot_sync_is_named_and_health_stays_up(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = [*(await emulators(1)), *(await emulators(1, runtime_lora_updating=False))]
    rt = await router(emus)
    assert (await call(client, "GET", rt.url + "/health"))[0] == 200
    good, bad = await status_of(client, rt.url)
    assert good["sync_problems"] == []
    assert "runtime adapter loading is off" in str(bad["sync_problems"])
    status, body = await load(client, rt.url, "trl-policy-v1", adapter())
    assert status == 404  # what vLLM answers, with the flag named instead of "Not Found"
    message = orjson.loads(body)["error"]["message"]
    assert "Replica 1" in message and "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in message


async def test_a_pause_a_replica_lacks_names_the_missing_flag(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = [*(await emulators(1)), *(await emulators(1, dev_mode=False))]
    rt = await router(emus)
    status, body, _ = await call(client, "POST", rt.url + "/pause?mode=keep")
    assert status == 404
    message = orjson.loads(body)["error"]["message"]
    assert "/pause failed: Replica 1" in message
    assert "dev mode is off: /pause does not exist; fix: start it with VLLM_SERVER_DEV_MODE=1" in (
        message
    )
