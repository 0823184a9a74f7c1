"""The emulator's `/abort_requests` and `/inference/v1/abort_requests`, asked directly: vLLM
0.32's answers, read from its code and seen in the tier (tests/vllm/test_vllm_abort.py). The
router checks bodies before they reach a replica (tests/fleet/test_aborts.py); these are the
replica's own answers to what it would let through."""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from helpers import call, until

from .conftest import StartEmulator

SLOW = {"decode_s_per_token": 0.01}
DISABLED = "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out"


@pytest.mark.parametrize(
    ("body", "status", "answer"),
    [
        (b"", 400, {"message": "Invalid JSON format", "type": "Bad Request"}),
        (b"[1]", 400, {"message": "Request body must be a JSON object", "type": "Bad Request"}),
        (b'{"request_ids": ["nobody"]}', 200, {"status": "aborted", "aborted": 1}),
        (b'{"request_ids": false}', 200, {"status": "aborted", "aborted": 0}),  # falsy: all
    ],
)
async def test_the_dev_route_answers_as_vllm(
    start: StartEmulator, client: aiohttp.ClientSession, body: bytes, status: int, answer: dict
) -> None:
    emu = await start()
    got, data, _ = await call(client, "POST", emu.url + "/abort_requests", data=body)
    assert got == status
    doc = orjson.loads(data)
    assert (doc["error"] if status != 200 else doc).items() >= answer.items()


async def test_an_id_vllm_cannot_iterate_is_a_flat_500(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start()
    status, data, _ = await call(client, "POST", emu.url + "/abort_requests", {"request_ids": 5})
    assert status == 500
    assert orjson.loads(data)["error"].startswith("Failed to abort requests: ")


async def test_the_dev_route_needs_dev_mode(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(dev_mode=False)
    status, data, _ = await call(client, "POST", emu.url + "/abort_requests", {})
    assert (status, data) == (404, b'{"detail":"Not Found"}')


async def test_an_abort_ends_only_the_named_prompt_of_a_batch(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(**SLOW)
    body = {"prompt": [[1, 2, 3], [4, 5, 6]], "max_tokens": 300, "ignore_eos": True}
    headers = {"X-Request-Id": "b"}
    answer = asyncio.ensure_future(
        call(client, "POST", emu.url + "/v1/completions", body, headers=headers)
    )
    await until(lambda: emu.state.num_running == 2)
    await call(client, "POST", emu.url + "/abort_requests", {"request_ids": ["cmpl-b-1"]})
    async with asyncio.timeout(10):
        status, data, _ = await answer
    assert status == 200
    reasons = [
        c["finish_reason"] for c in sorted(orjson.loads(data)["choices"], key=lambda c: c["index"])
    ]
    assert reasons == ["length", "abort"]
    assert emu.state.counters.aborted == 1


async def test_the_scale_out_route_is_a_403_without_its_flag(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start()
    status, data, _ = await call(client, "POST", emu.url + "/inference/v1/abort_requests", {})
    assert status == 403
    error = orjson.loads(data)["error"]
    assert error["type"] == "PermissionDeniedError" and error["message"].startswith(DISABLED)


async def test_the_scale_out_route_needs_ids_and_the_api_key(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(enable_scale_out=True, api_key="k")
    url = emu.url + "/inference/v1/abort_requests"
    assert (await call(client, "POST", url, {"request_ids": []}))[0] == 401
    auth = {"Authorization": "Bearer k"}
    status, data, _ = await call(client, "POST", url, {}, headers=auth)
    assert status == 400
    assert orjson.loads(data)["error"]["message"] == "Missing 'request_ids' in request body"
    status, data, headers = await call(client, "POST", url, {"request_ids": []}, headers=auth)
    assert (status, data) == (200, b"")
    assert "content-type" not in headers
