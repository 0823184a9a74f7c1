"""Fast mode: pre-rendered completions on the raw protocol, control routes still answered."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import aiohttp
from helpers import call, load

from .conftest import StartEmulator, frames_of

COMPLETIONS = "/v1/completions"


async def test_fast_mode_answers_a_completion_with_every_requested_field(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(fast=True)
    status, raw, _ = await call(
        client,
        "POST",
        emu.url + COMPLETIONS,
        json={"prompt": list(range(512)), "max_tokens": 8, "return_token_ids": True, "logprobs": 0},
    )
    assert status == 200
    choice = json.loads(raw)["choices"][0]
    assert len(choice["token_ids"]) == 8
    assert len(choice["logprobs"]["token_logprobs"]) == 8
    assert json.loads(raw)["usage"]["prompt_tokens"] == 512


async def test_fast_mode_streams_one_frame_per_token(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(fast=True)
    async with client.post(
        emu.url + COMPLETIONS, json={"prompt": [1], "max_tokens": 200, "stream": True}
    ) as r:
        assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        frames = frames_of(await r.read())
    assert len(frames) == 200 + 2  # tokens, usage, [DONE]
    assert frames[-1] == b"[DONE]"


async def test_fast_mode_answers_the_routes_a_router_needs_to_start(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(fast=True, max_lora_rank=1)
    assert (await call(client, "GET", emu.url + "/health"))[:2] == (200, b"")
    _, raw, _ = await call(client, "GET", emu.url + "/server_info?config_format=json")
    assert json.loads(raw)["vllm_config"]["lora_config"]["max_lora_rank"] == 1
    _, raw, _ = await call(client, "GET", emu.url + "/v1/models")
    assert json.loads(raw)["data"][0]["max_model_len"] == 4096


async def fast_with_v1(start: StartEmulator, client: aiohttp.ClientSession, path: str) -> str:
    """A fast-mode emulator with trl-policy-v1 loaded; returns its URL."""
    emu = await start(fast=True)
    assert (await load(client, emu.url, "trl-policy-v1", path))[0] == 200
    return emu.url


async def test_fast_mode_serves_a_loaded_adapter(
    start: StartEmulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    url = await fast_with_v1(start, client, adapter())
    status, raw, _ = await call(
        client, "POST", url + COMPLETIONS, json={"model": "trl-policy-v1", "prompt": [1]}
    )
    assert status == 200
    assert json.loads(raw)["model"] == "trl-policy-v1"


async def test_fast_mode_unloads_an_adapter_with_vllms_bare_answer(
    start: StartEmulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    url = await fast_with_v1(start, client, adapter())
    async with client.post(
        url + "/v1/unload_lora_adapter", json={"lora_name": "trl-policy-v1"}
    ) as r:
        assert r.status == 200
        assert "Content-Type" not in r.headers


async def test_fast_mode_answers_404_for_an_unknown_model(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(fast=True)
    status, raw, _ = await call(
        client, "POST", emu.url + COMPLETIONS, json={"model": "x", "prompt": [1]}
    )
    assert status == 404
    assert json.loads(raw)["error"]["type"] == "NotFoundError"


async def test_fast_mode_keeps_pipelined_responses_in_order(start: StartEmulator) -> None:
    emu = await start(fast=True)
    reader, writer = await asyncio.open_connection(emu.host, emu.port)
    body = b'{"prompt":[1],"max_tokens":1}'
    completion = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    writer.write(health + completion + health)
    statuses = []
    for _ in range(3):
        head = await reader.readuntil(b"\r\n\r\n")
        statuses.append(head.split(b"\r\n")[0])
        length = int(head.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
        payload = await reader.readexactly(length)
        statuses.append(b"json" if payload.startswith(b"{") else b"empty")
    writer.close()
    assert statuses == [
        b"HTTP/1.1 200 OK",
        b"empty",
        b"HTTP/1.1 200 OK",
        b"json",
        b"HTTP/1.1 200 OK",
        b"empty",
    ]


async def test_fast_mode_requires_the_api_key(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(fast=True, api_key="k")
    assert (await call(client, "POST", emu.url + COMPLETIONS, json={"prompt": [1]}))[0] == 401
    status, _, _ = await call(
        client,
        "POST",
        emu.url + COMPLETIONS,
        json={"prompt": [1]},
        headers={"Authorization": "Bearer k"},
    )
    assert status == 200


async def test_fast_mode_restarts_on_the_same_port(
    start: StartEmulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    emu = await start(fast=True)
    assert (await load(client, emu.url, "v1", adapter()))[0] == 200
    await emu.crash()
    await emu.restart()
    assert emu.state.adapters == {}
    assert (await call(client, "GET", emu.url + "/health"))[:2] == (200, b"")
