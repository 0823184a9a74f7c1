"""A client's load of a name the fleet already holds from another path (a trainer restarted
against a running router, writing to a new output_dir) is refused with 400 in vLLM's words,
plus the fix, and logged as a WARNING; following the fix lets the load through."""

from __future__ import annotations

import logging

import aiohttp
import orjson
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, load

pytestmark = pytest.mark.timeout(30)

FIX = "restart the router with --unload-stale 'trl-policy-*'"


def refusal(status: int, data: bytes) -> str:
    """The message of a 400 `InvalidUserInput` in vLLM's error shape."""
    assert status == 400, data
    error = orjson.loads(data)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "InvalidUserInput" and error["code"] == 400
    return str(error["message"])


def warnings(caplog: pytest.LogCaptureFixture) -> str:
    return "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


async def test_a_restarted_trainers_first_load_is_a_warning_with_the_fix_that_works(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    assert (await load(client, rt.url, "trl-policy-v1", adapter("run-1/trl-policy-v1")))[0] == 200
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        message = refusal(*await load(client, rt.url, "trl-policy-v1", adapter("run-2/v1")))
    assert message.startswith("The lora adapter 'trl-policy-v1' has already been loaded")
    assert FIX in message
    assert message in warnings(caplog)
    # The fix, followed: a router started with --unload-stale clears the earlier run's names.
    again = await router(emus, unload_stale="trl-policy-*")
    assert (await load(client, again.url, "trl-policy-v1", adapter("run-2/v1")))[0] == 200


async def test_a_replicas_already_loaded_keeps_vllms_words_and_adds_the_fix(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emus = await emulators(2)
    # Left by an earlier run on one replica only: the router does not serve it.
    assert (await load(client, emus[1].url, "trl-policy-v1", adapter("old-run")))[0] == 200
    rt = await router(emus)
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        message = refusal(*await load(client, rt.url, "trl-policy-v1", adapter("trl-policy-v1")))
    vllm = (
        "The lora adapter 'trl-policy-v1' has already been loaded. If you want to load the "
        "adapter in place, set 'load_inplace' to True."
    )
    assert message.startswith(f"Replica 1 ({emus[1].url}) answered: {vllm}"), message
    assert "old-run" in message and FIX in message
    assert message in warnings(caplog)
