"""TRL's AsyncGRPOTrainer, call for call (contract §1), against three replicas with mount lag."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp
import orjson
from emulated_fleet import FenceMonitor, StartEmulators, StartRouter
from helpers import call

from lora_router.emulator import write_adapter

STALENESS = 4
G = 8  # samples per prompt: G separate requests, the same prompt, each its own seed (as TRL)


def save_adapter(root: Path, name: str) -> str:
    """TRL saves the adapter, then renames the directory into place (atomic)."""
    final = root / ".vllm_lora" / name
    tmp = root / ".vllm_lora" / f".{name}.tmp"
    write_adapter(tmp)
    os.rename(tmp, final)
    return str(final)


async def rollout(
    client: aiohttp.ClientSession, url: str, model: str, prompt: list[int], seed: int
) -> dict[str, Any]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": 24,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": seed,
    }
    async with client.post(url + "/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        result: dict[str, Any] = await resp.json()
        return result


async def test_the_trl_sync_sequence_with_three_lagging_replicas(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    tmp_path: Path,
    monitor: FenceMonitor,
) -> None:
    emus = await emulators(3, decode_s_per_token=0.004, max_loras=STALENESS + 2)
    for emu in emus[:2]:
        emu.faults.mount_lag = 2  # the reference deployment: most loads on the 3rd attempt
    rt = await router(emus)
    url = rt.url

    # Start: /health until 200, then server_info and the model list.
    status, _, _ = await call(client, "GET", url + "/health")
    assert status == 200
    _, data, _ = await call(client, "GET", url + "/server_info?config_format=json")
    vllm_config = orjson.loads(data)["vllm_config"]
    assert vllm_config["parallel_config"]["data_parallel_size"] == 1
    assert vllm_config["lora_config"]["max_loras"] >= STALENESS + 2
    _, data, _ = await call(client, "GET", url + "/v1/models")
    base = orjson.loads(data)["data"][0]
    assert base["id"] == emus[0].config.model and base["max_model_len"] > 0

    rollouts: list[tuple[str, asyncio.Task[dict[str, Any]]]] = []
    for n in range(1, 11):
        version = f"trl-policy-v{n}"
        path = save_adapter(tmp_path, version)
        # One sync, as TRL sends it; every answer must be 200.
        status, _, _ = await call(client, "POST", url + "/pause?mode=keep")
        assert status == 200
        body = {"lora_name": version, "lora_path": path, "load_inplace": False}
        status, text, _ = await call(client, "POST", url + "/v1/load_lora_adapter", body)
        assert status == 200, text
        status, _, _ = await call(client, "POST", url + "/resume")
        assert status == 200
        if n > STALENESS + 1:
            old = f"trl-policy-v{n - STALENESS - 1}"
            status, _, _ = await call(
                client, "POST", url + "/v1/unload_lora_adapter", {"lora_name": old}
            )
            assert status == 200
            assert all(old not in e.state.adapters for e in emus)
        # Rollouts under the new version start at once and stay in flight over the next
        # syncs (several versions are in flight at any time, as with max_staleness 4).
        for p in range(2):
            prompt = [151644, 8948, 198, n, p, *range(40)]
            for g in range(G):
                task = asyncio.create_task(rollout(client, url, version, prompt, n * 100 + g))
                rollouts.append((version, task))
        await asyncio.sleep(0.02)

    for version, task in rollouts:
        result = await task
        choice = result["choices"][0]
        assert result["model"] == version
        assert 1 <= len(choice["token_ids"]) <= 24  # EOS may come first
        assert len(choice["logprobs"]["token_logprobs"]) == len(choice["token_ids"])
    live = {f"trl-policy-v{n}" for n in range(10 - STALENESS, 11)}
    for emu in emus:
        assert set(emu.state.adapters) == live
    assert monitor.checked == len(rollouts) and monitor.violations == []
