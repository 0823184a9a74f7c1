"""Fault switches and the replica lifecycle: everything the router's fault tolerance meets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import aiohttp
import pytest
from helpers import call, completed, load, until

from lora_router.emulator import Emulator, write_adapter

from .conftest import StartEmulator, frames_of

LOAD = "/v1/load_lora_adapter"
COMPLETIONS = "/v1/completions"


async def test_mount_lag_answers_404_for_the_first_k_attempts_of_a_path(
    emu: Emulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    emu.faults.mount_lag = 2
    path = adapter()
    body = {"lora_name": "trl-policy-v1", "lora_path": path}
    for _ in range(2):
        status, raw, _ = await call(client, "POST", emu.url + LOAD, json=body)
        assert status == 404
        assert json.loads(raw)["error"]["message"].endswith("No adapter found for <path>")
    status, _, _ = await call(client, "POST", emu.url + LOAD, json=body)
    assert status == 200


async def test_load_failures_answer_500_then_loads_succeed(
    emu: Emulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    emu.faults.load_failures = 1
    body = {"lora_name": "v1", "lora_path": adapter()}
    status, raw, _ = await call(client, "POST", emu.url + LOAD, json=body)
    assert status == 500
    assert json.loads(raw)["error"]["type"] == "InternalServerError"
    assert (await call(client, "POST", emu.url + LOAD, json=body))[0] == 200


async def test_slow_loads_take_the_configured_time(
    emu: Emulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    emu.faults.load_delay_s = 0.1
    loop = asyncio.get_running_loop()
    began = loop.time()
    assert (await load(client, emu.url, "v1", adapter()))[0] == 200
    assert loop.time() - began >= 0.1


async def test_error_rate_one_fails_every_completion_with_the_chosen_status(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    emu.faults.error_rate = 1.0
    emu.faults.error_status = 503
    status, raw, _ = await call(client, "POST", emu.url + COMPLETIONS, json={"prompt": [1]})
    assert status == 503
    assert json.loads(raw)["error"]["code"] == 503


async def test_seeded_error_rate_fails_the_same_requests_every_run(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    outcomes = []
    for _ in range(2):
        emu = await start()
        emu.faults.error_rate = 0.5
        emu.faults.error_seed = 11
        statuses = [
            (
                await call(
                    client, "POST", emu.url + COMPLETIONS, json={"prompt": [1], "max_tokens": 1}
                )
            )[0]
            for _ in range(20)
        ]
        outcomes.append(statuses)
    assert outcomes[0] == outcomes[1]
    assert set(outcomes[0]) == {200, 500}


async def test_stall_holds_completions_until_released(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    emu.faults.stall = True
    pending = asyncio.create_task(completed(client, emu.url))
    await until(lambda: emu.faults.stalled == 1)
    assert not pending.done()
    emu.faults.stall = False
    await pending
    assert emu.faults.stalled == 0


async def test_crash_after_frames_cuts_a_stream_after_n_frames(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    emu.faults.crash_after_frames = 2
    received = b""
    with pytest.raises(aiohttp.ClientPayloadError):
        async with client.post(
            emu.url + COMPLETIONS,
            json={"prompt": [1], "max_tokens": 10, "ignore_eos": True, "stream": True},
        ) as r:
            assert r.status == 200
            async for chunk in r.content.iter_any():
                received += chunk
    assert len(frames_of(received)) == 2


async def test_crash_fault_drops_a_non_streamed_request_without_answer(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    emu.faults.crash_after_frames = 0
    with pytest.raises(aiohttp.ServerDisconnectedError):
        await call(client, "POST", emu.url + COMPLETIONS, json={"prompt": [1]})


async def test_dead_engine_answers_503_on_health(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    emu.faults.dead = True
    assert (await call(client, "GET", emu.url + "/health"))[:2] == (503, b"")
    assert (await call(client, "GET", emu.url + "/ping"))[:2] == (503, b"")


async def test_dead_engine_answers_500_on_completions(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    emu.faults.dead = True
    status, raw, _ = await call(client, "POST", emu.url + COMPLETIONS, json={"prompt": [1]})
    assert status == 500
    assert json.loads(raw)["error"]["type"] == "InternalServerError"


async def set_dead_and_mount_lag(emu: Emulator, client: aiohttp.ClientSession) -> tuple[int, bytes]:
    """Set `dead` and `mount_lag=3` through the admin endpoint; returns its answer."""
    status, raw, _ = await call(
        client, "POST", emu.url + "/emulator/faults", json={"dead": True, "mount_lag": 3}
    )
    return status, raw


async def test_admin_endpoint_answers_the_faults_it_set(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    status, raw = await set_dead_and_mount_lag(emu, client)
    assert status == 200
    assert json.loads(raw)["mount_lag"] == 3


async def test_faults_set_through_the_admin_endpoint_take_effect(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    await set_dead_and_mount_lag(emu, client)
    assert emu.faults.dead
    assert (await call(client, "GET", emu.url + "/health"))[0] == 503


async def test_admin_endpoint_refuses_unknown_faults(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    status, raw, _ = await call(client, "POST", emu.url + "/emulator/faults", json={"meteor": True})
    assert status == 400
    assert "unknown fault" in json.loads(raw)["error"]


async def test_admin_endpoint_refuses_a_wrongly_typed_switch(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    status, _, _ = await call(
        client, "POST", emu.url + "/emulator/faults", json={"error_rate": "high"}
    )
    assert status == 400
    assert emu.faults.error_rate == 0.0


async def test_admin_endpoint_releases_a_stall(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    emu.faults.stall = True
    pending = asyncio.create_task(completed(client, emu.url))
    await until(lambda: emu.faults.stalled == 1)
    await call(client, "POST", emu.url + "/emulator/faults", json={"stall": False})
    await pending


async def test_restart_keeps_the_port_with_a_fresh_engine(
    emu: Emulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    assert (await load(client, emu.url, "trl-policy-v1", adapter()))[0] == 200
    await call(client, "POST", emu.url + "/pause?mode=keep")
    port = emu.port
    await emu.restart()
    assert emu.port == port
    assert emu.state.adapters == {}
    assert not emu.state.paused
    _, raw, _ = await call(client, "GET", emu.url + "/v1/models")
    assert [card["id"] for card in json.loads(raw)["data"]] == ["Qwen/Qwen2.5-Math-1.5B"]


async def test_restart_over_http_forgets_adapters(
    emu: Emulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    assert (await load(client, emu.url, "trl-policy-v1", adapter()))[0] == 200
    first = emu.state
    assert (await call(client, "POST", emu.url + "/emulator/restart"))[:2] == (
        200,
        b'{"status":"restarting"}',
    )
    await until(lambda: emu.state is not first and emu.listening)
    assert emu.state.adapters == {}


async def test_crash_refuses_connections_until_restart(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    await emu.crash()
    with pytest.raises(aiohttp.ClientConnectorError):
        await call(client, "GET", emu.url + "/health")
    await emu.restart()
    assert (await call(client, "GET", emu.url + "/health"))[:2] == (200, b"")


async def test_crash_cuts_an_open_stream(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(decode_s_per_token=0.01)
    with pytest.raises(aiohttp.ClientPayloadError):
        async with client.post(
            emu.url + COMPLETIONS,
            json={"prompt": [1], "max_tokens": 100, "ignore_eos": True, "stream": True},
        ) as r:
            await r.content.readuntil(b"\n\n")
            await emu.crash()
            await r.read()


async def test_client_disconnect_cancels_the_generation(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(decode_s_per_token=0.01)
    pending = asyncio.create_task(completed(client, emu.url, max_tokens=500, ignore_eos=True))
    await until(lambda: emu.state.num_running == 1)
    pending.cancel()
    await until(lambda: emu.state.cancelled == 1)
    assert emu.state.num_running == 0


async def test_a_client_leaving_a_request_queued_while_paused_is_counted(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(vllm_version="0.27")
    await call(client, "POST", emu.url + "/pause?mode=keep")
    pending = asyncio.create_task(completed(client, emu.url))
    await until(lambda: emu.state.num_waiting == 1)
    pending.cancel()
    await until(lambda: emu.state.cancelled == 1)
    assert emu.state.num_waiting == 0


async def test_closing_a_stream_cancels_the_generation(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(decode_s_per_token=0.01)
    async with client.post(
        emu.url + COMPLETIONS,
        json={"prompt": [1], "max_tokens": 500, "ignore_eos": True, "stream": True},
    ) as r:
        await r.content.readuntil(b"\n\n")
        r.close()
    await until(lambda: emu.state.cancelled == 1)
    assert emu.state.num_running == 0


async def test_an_evicted_adapter_whose_files_are_gone_kills_the_engine(
    start: StartEmulator, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    emu = await start(max_loras=1, max_cpu_loras=1)
    first = write_adapter(tmp_path / "v1")
    assert (await load(client, emu.url, "v1", str(first)))[0] == 200
    assert (await load(client, emu.url, "v2", str(write_adapter(tmp_path / "v2"))))[
        0
    ] == 200  # evicts v1
    (first / "adapter_config.json").unlink()
    status, _, _ = await call(
        client, "POST", emu.url + COMPLETIONS, json={"model": "v1", "prompt": [1]}
    )
    assert status == 500
    assert (await call(client, "GET", emu.url + "/health"))[0] == 503


async def test_an_evicted_adapter_is_re_read_on_its_next_request(
    start: StartEmulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    emu = await start(max_loras=1, max_cpu_loras=1)
    assert (await load(client, emu.url, "v1", adapter("v1")))[0] == 200
    assert (await load(client, emu.url, "v2", adapter("v2")))[0] == 200
    await completed(client, emu.url, model="v1")
    assert emu.state.slots.disk_reads == 1
    assert emu.state.slots.evictions == 2


async def test_an_engine_death_after_the_headers_is_an_error_frame_then_done(
    start: StartEmulator, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    emu = await start(max_loras=1, max_cpu_loras=1)
    first = write_adapter(tmp_path / "v1")
    assert (await load(client, emu.url, "v1", str(first)))[0] == 200
    assert (await load(client, emu.url, "v2", str(write_adapter(tmp_path / "v2"))))[
        0
    ] == 200  # evicts v1
    (first / "adapter_config.json").unlink()
    async with client.post(
        emu.url + COMPLETIONS, json={"model": "v1", "prompt": [1], "stream": True}
    ) as r:
        assert r.status == 200
        frames = frames_of(await r.read())
    assert json.loads(frames[0])["error"]["code"] == 500
    assert frames[1:] == [b"[DONE]"]


async def test_a_request_admitted_after_its_adapter_was_unloaded_still_runs(
    start: StartEmulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    emu = await start(vllm_version="0.27", max_loras=1, max_cpu_loras=1)
    assert (await load(client, emu.url, "v1", adapter("v1")))[0] == 200
    assert (await load(client, emu.url, "v2", adapter("v2")))[
        0
    ] == 200  # evicts v1: it must be re-read to run
    await call(client, "POST", emu.url + "/pause?mode=keep")
    pending = asyncio.create_task(completed(client, emu.url, model="v1"))
    await until(lambda: emu.state.num_waiting == 1)
    await call(client, "POST", emu.url + "/v1/unload_lora_adapter", json={"lora_name": "v1"})
    await call(client, "POST", emu.url + "/resume")
    await pending
    assert emu.state.crashed is None
