"""/v1/load_lora_adapter, /v1/unload_lora_adapter and /v1/models, as vLLM answers them."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import aiohttp
from helpers import load

from lora_router.emulator import Emulator, write_adapter

from .conftest import StartEmulator

LOAD = "/v1/load_lora_adapter"
UNLOAD = "/v1/unload_lora_adapter"


async def test_load_answers_200_plain_text_without_content_type(
    emu: Emulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    path = adapter()
    async with client.post(
        emu.url + LOAD,
        json={"lora_name": "trl-policy-v1", "lora_path": path, "load_inplace": False},
    ) as r:
        assert r.status == 200
        assert "Content-Type" not in r.headers
        assert await r.read() == b"Success: LoRA adapter 'trl-policy-v1' added successfully."
    assert emu.state.adapters == {"trl-policy-v1": path}


async def test_loading_a_loaded_name_again_is_400_invalid_user_input(
    emu: Emulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    path = adapter()
    assert (await load(client, emu.url, "trl-policy-v1", path))[0] == 200
    async with client.post(
        emu.url + LOAD, json={"lora_name": "trl-policy-v1", "lora_path": path}
    ) as r:
        assert r.status == 400
        body = await r.json()
    assert body == {
        "error": {
            "message": "The lora adapter 'trl-policy-v1' has already been loaded. If you want to "
            "load the adapter in place, set 'load_inplace' to True.",
            "type": "InvalidUserInput",
            "param": None,
            "code": 400,
        }
    }


async def test_load_inplace_repoints_a_loaded_name(
    emu: Emulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    assert (await load(client, emu.url, "policy", adapter("a")))[0] == 200
    new_path = adapter("b")
    async with client.post(
        emu.url + LOAD, json={"lora_name": "policy", "lora_path": new_path, "load_inplace": True}
    ) as r:
        assert r.status == 200
    assert emu.state.adapters == {"policy": new_path}


async def test_missing_path_is_404_no_adapter_found_with_the_path_hidden(
    emu: Emulator, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    path = str(tmp_path / "not-there")
    async with client.post(emu.url + LOAD, json={"lora_name": "v1", "lora_path": path}) as r:
        assert r.status == 404
        body = await r.json()
    assert body["error"]["type"] == "NotFoundError"
    # vLLM's sanitize_message hides the path (it is under /tmp).
    assert body["error"]["message"] == "Loading lora v1 failed: No adapter found for <path>"
    assert body["error"]["code"] == 404


async def test_rank_above_max_lora_rank_is_500(
    start: StartEmulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    emu = await start(max_lora_rank=1)
    async with client.post(
        emu.url + LOAD, json={"lora_name": "v1", "lora_path": adapter(rank=8)}
    ) as r:
        assert r.status == 500
        body = await r.json()
    assert body["error"] == {
        "message": "Call to add_lora method failed: LoRA rank 8 is greater than max_lora_rank 1.",
        "type": "InternalServerError",
        "param": None,
        "code": 500,
    }
    assert emu.state.adapters == {}


async def test_adapter_config_is_read_from_the_directory(
    emu: Emulator, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    path = write_adapter(tmp_path / "a", rank=4, alpha=16, target_modules=("q_proj", "v_proj"))
    assert (await load(client, emu.url, "a", str(path)))[0] == 200
    adapter = emu.state.registry.get("a")
    assert adapter is not None
    assert (adapter.spec.rank, adapter.spec.alpha) == (4, 16.0)
    assert adapter.spec.target_modules == ("q_proj", "v_proj")


async def test_adapter_without_weights_is_500(
    emu: Emulator, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    path = write_adapter(tmp_path / "a")
    (path / "adapter_model.safetensors").unlink()
    async with client.post(emu.url + LOAD, json={"lora_name": "a", "lora_path": str(path)}) as r:
        assert r.status == 500
        assert "doesn't contain tensors" in (await r.json())["error"]["message"]


async def test_dora_adapter_is_500(
    emu: Emulator, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    path = write_adapter(tmp_path / "a")
    config = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    async with client.post(emu.url + LOAD, json={"lora_name": "a", "lora_path": str(path)}) as r:
        assert r.status == 500


async def test_legacy_bin_weights_are_accepted(
    emu: Emulator, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    path = write_adapter(tmp_path / "a")
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    assert (await load(client, emu.url, "a", str(path)))[0] == 200


async def test_missing_field_is_400_bad_request(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    async with client.post(emu.url + LOAD, json={"lora_name": "v1"}) as r:
        assert r.status == 400
        body = await r.json()
    assert body["error"]["type"] == "Bad Request"
    assert body["error"]["code"] == 400
    assert "lora_path" in body["error"]["message"]


async def test_non_json_content_type_is_400(emu: Emulator, client: aiohttp.ClientSession) -> None:
    async with client.post(
        emu.url + LOAD,
        data=b'{"lora_name":"a","lora_path":"/x"}',
        headers={"Content-Type": "text/plain"},
    ) as r:
        assert r.status == 400
        body = await r.json()
    assert body["error"]["type"] == "Bad Request"
    assert "Only 'application/json' is allowed" in body["error"]["message"]


async def test_unload_answers_200_plain_text(
    emu: Emulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    assert (await load(client, emu.url, "trl-policy-v1", adapter()))[0] == 200
    async with client.post(emu.url + UNLOAD, json={"lora_name": "trl-policy-v1"}) as r:
        assert r.status == 200
        assert "Content-Type" not in r.headers
        assert await r.read() == b"Success: LoRA adapter 'trl-policy-v1' removed successfully."
    assert emu.state.adapters == {}


async def test_unload_of_an_unknown_name_is_404(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    async with client.post(emu.url + UNLOAD, json={"lora_name": "trl-policy-v0"}) as r:
        assert r.status == 404
        body = await r.json()
    assert body["error"] == {
        "message": "The lora adapter 'trl-policy-v0' cannot be found.",
        "type": "NotFoundError",
        "param": None,
        "code": 404,
    }


async def test_unload_keeps_the_weights_in_memory_until_evicted(
    emu: Emulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    assert (await load(client, emu.url, "v1", adapter()))[0] == 200
    lora_id = emu.state.registry.get("v1").lora_id  # type: ignore[union-attr]
    async with client.post(emu.url + UNLOAD, json={"lora_name": "v1"}) as r:
        assert r.status == 200
    assert lora_id in emu.state.slots.in_memory


async def test_models_lists_the_base_model_first_then_each_adapter(
    emu: Emulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    path = adapter()
    assert (await load(client, emu.url, "trl-policy-v1", path))[0] == 200
    async with client.get(emu.url + "/v1/models") as r:
        assert r.status == 200
        body = await r.json()
    assert body["object"] == "list"
    base, card = body["data"]
    assert base["id"] == "Qwen/Qwen2.5-Math-1.5B"
    assert base["max_model_len"] == 4096
    assert card["id"] == "trl-policy-v1"
    assert card["root"] == path
    assert card["parent"] == "Qwen/Qwen2.5-Math-1.5B"
    assert card["max_model_len"] is None


async def test_loads_of_different_names_run_concurrently(
    start: StartEmulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    emu = await start()
    emu.faults.load_delay_s = 0.2
    loop = asyncio.get_running_loop()
    began = loop.time()
    loads = (load(client, emu.url, f"v{i}", adapter(f"v{i}")) for i in range(4))
    assert [status for status, _ in await asyncio.gather(*loads)] == [200] * 4
    # Four serial loads would take 0.8 s.
    assert loop.time() - began < 0.6
    assert len(emu.state.adapters) == 4


async def test_adapter_routes_are_404_without_runtime_lora_updating(
    start: StartEmulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    emu = await start(runtime_lora_updating=False)
    async with client.post(emu.url + LOAD, json={"lora_name": "a", "lora_path": adapter()}) as r:
        assert r.status == 404
        assert await r.json() == {"detail": "Not Found"}
