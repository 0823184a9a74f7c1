"""What the router says at start about a fleet that is half right: adapters left on a reused
replica that the trainer's loads would collide with, named with the replica and the fix."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, load


async def test_a_leftover_trainer_version_is_named_at_start_with_its_fix(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emus = await emulators(2)
    # An earlier run's version, on one replica only, and a name no trainer gives.
    assert (await load(client, emus[1].url, "trl-policy-v3", adapter("trl-policy-v3")))[0] == 200
    assert (await load(client, emus[1].url, "sql-expert", adapter("sql-expert")))[0] == 200
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        await router(emus)
    lines = [r.getMessage() for r in caplog.records if "leftover" in r.getMessage()]
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"Replica 1 ({emus[1].url}) holds 1 leftover adapter(s)")
    assert "trl-policy-v3" in lines[0] and "sql-expert" not in lines[0]
    assert "--unload-stale trl-policy-v3" in lines[0]
    held = [r.getMessage() for r in caplog.records if "held by" in r.getMessage()]
    assert any(f"held by Replica 1 ({emus[1].url})" in m for m in held), held


async def test_a_leftover_the_given_pattern_clears_is_not_warned_of(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emus = await emulators(1)
    assert (await load(client, emus[0].url, "trl-policy-v3", adapter("trl-policy-v3")))[0] == 200
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        await router(emus, unload_stale="trl-policy-*")
    assert not [r for r in caplog.records if "leftover" in r.getMessage()]
    assert "trl-policy-v3" not in emus[0].state.adapters
