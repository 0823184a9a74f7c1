"""Aborts through the router, over real sockets to emulated replicas (fleet/aborts.py, #43 item
6): `/abort_requests` and `/inference/v1/abort_requests` reach every replica in service, end the
requests they name as vLLM ends them, are checked as vLLM checks them, and answer within the
control deadline whatever a replica does. tests/vllm/test_vllm_abort.py runs them on real vLLM.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import aiohttp
import orjson
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import call, until

from lora_router.config import Secret
from lora_router.emulator import Emulator
from lora_router.fleet import aborts
from lora_router.fleet.lifecycle import State

LONG = 4000  # tokens at 5 ms each: 20 s unless an abort ends it
SLOW = dict(decode_s_per_token=0.005)
SLACK = 3.0  # scheduling noise on a shared machine, never a second deadline


def _sent(emu: Emulator, path: str) -> list[bytes]:
    return [r.body for r in emu.requests if r.path == path]


async def _long(client: aiohttp.ClientSession, url: str, request_id: str, **fields: Any) -> Any:
    body = {"prompt": list(range(40)), "max_tokens": LONG, "ignore_eos": True, **fields}
    headers = {"X-Request-Id": request_id}
    status, data, _ = await call(client, "POST", url + "/v1/completions", body, headers=headers)
    assert status == 200, data
    return data if fields.get("stream") else orjson.loads(data)


def _running(emus: list[Emulator]) -> int:
    return sum(e.state.num_running for e in emus)


def _ended_by_abort(doc: Any) -> None:
    assert doc["choices"][0]["finish_reason"] == "abort", doc["choices"][0]
    assert doc["usage"]["completion_tokens"] < LONG


async def test_an_abort_by_id_reaches_every_replica_and_ends_that_request(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(3, **SLOW)
    rt = await router(emus)
    mine = asyncio.ensure_future(_long(client, rt.url, "mine"))
    other = asyncio.ensure_future(_long(client, rt.url, "other"))
    await until(lambda: _running(emus) == 2)
    body = b'{"request_ids": ["cmpl-mine-0"]}'
    status, data, headers = await call(client, "POST", rt.url + "/abort_requests", data=body)
    assert status == 200, data
    assert orjson.loads(data) == {"status": "aborted", "aborted": 1}  # one vLLM's count
    assert headers["x-lora-router-replica"] == "0,1,2"
    for emu in emus:  # every replica got it, as the client wrote it
        assert _sent(emu, "/abort_requests") == [body]
    async with asyncio.timeout(SLACK):
        _ended_by_abort(await mine)
    assert not other.done()  # an id names one request
    assert _running(emus) == 1
    await call(client, "POST", rt.url + "/abort_requests", {"request_ids": "cmpl-other-0"})
    async with asyncio.timeout(SLACK):
        _ended_by_abort(await other)


async def test_an_aborted_stream_ends_with_an_abort_chunk(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2, **SLOW)
    rt = await router(emus)
    streamed = asyncio.ensure_future(_long(client, rt.url, "s", stream=True))
    await until(lambda: _running(emus) == 1)
    await call(client, "POST", rt.url + "/abort_requests", {"request_ids": ["cmpl-s-0"]})
    async with asyncio.timeout(SLACK):
        frames = (await streamed).split(b"\n\n")
    assert frames[-2:] == [b"data: [DONE]", b""]
    assert orjson.loads(frames[-3][6:])["choices"][0]["finish_reason"] == "abort"


@pytest.mark.parametrize("body", [b"{}", b'{"request_ids": []}', b'{"request_ids": null}'])
async def test_an_empty_abort_ends_every_request_on_every_replica(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, body: bytes
) -> None:
    emus = await emulators(2, **SLOW)
    rt = await router(emus)
    running = [asyncio.ensure_future(_long(client, rt.url, f"r{i}", seed=i)) for i in range(3)]
    await until(lambda: _running(emus) == 3)
    status, data, _ = await call(client, "POST", rt.url + "/abort_requests", data=body)
    assert status == 200, data
    # Each replica counts what it aborted; the router's answer is their sum.
    assert orjson.loads(data) == {"status": "aborted", "aborted": 3}
    async with asyncio.timeout(SLACK):
        for doc in await asyncio.gather(*running):
            _ended_by_abort(doc)


BAD = [
    ("/abort_requests", b"", "Invalid JSON format"),
    ("/abort_requests", b"{nope", "Invalid JSON format"),
    ("/abort_requests", b"[1]", "Request body must be a JSON object"),
    ("/abort_requests", b'{"request_ids": 5}', "'request_ids' must be a list"),
    ("/abort_requests", b'{"request_ids": false}', "'request_ids' must be a list"),
    ("/abort_requests", b'{"request_ids": [1]}', "'request_ids' must be a list"),
    ("/inference/v1/abort_requests", b"", "JSON decode error: "),
    ("/inference/v1/abort_requests", b"{}", "Missing 'request_ids' in request body"),
    ("/inference/v1/abort_requests", b"[]", "Request body must be a JSON object"),
]


@pytest.mark.parametrize(("path", "body", "message"), BAD)
async def test_a_bad_abort_body_is_a_400_and_reaches_no_replica(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    path: str,
    body: bytes,
    message: str,
) -> None:
    emus = await emulators(2, enable_scale_out=True)
    rt = await router(emus)
    status, data, _ = await call(client, "POST", rt.url + path, data=body)
    assert status == 400, data
    error = orjson.loads(data)["error"]
    assert error["message"].startswith(message), error
    assert error["type"] == "Bad Request" and error["code"] == 400
    assert all(not _sent(e, path) for e in emus)


async def test_a_silent_replica_meets_the_control_deadline(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(3)
    emus[1].faults.hang = "/abort_requests"
    rt = await router(emus, control_timeout=0.5)
    started = time.monotonic()
    status, data, _ = await call(client, "POST", rt.url + "/abort_requests", {})
    assert time.monotonic() - started < 0.5 + SLACK
    assert status == 503, data
    message = orjson.loads(data)["error"]["message"]
    assert f"Replica 1 ({emus[1].url}) is unreachable: no answer within 0.5 s" in message
    assert "aborted on Replica 0" in message and "Replica 2" in message
    assert _sent(emus[0], "/abort_requests") == _sent(emus[2], "/abort_requests") == [b"{}"]
    # An abort changes no fleet state: the silent replica stays in service (health judges it).
    assert rt.fleet is not None and rt.fleet.replicas[1].state is State.SERVING
    emus[1].faults.hang = None


async def test_aborts_their_clients_left_are_capped(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A client that sends an abort and leaves: the abort still waits out a silent replica,
    # keeping its body, so such clients must not pile aborts up without end.
    monkeypatch.setattr(aborts, "MAX_RUNNING", 4)
    emus = await emulators(2)
    emus[1].faults.hang = "/abort_requests"
    rt = await router(emus, control_timeout=3.0)
    assert rt.app is not None and rt.server is not None
    running = rt.app.aborts._tasks
    host, port = rt.server.sockets[0].getsockname()[:2]
    head = b"POST /abort_requests HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
    for n in range(1, 5):  # up to the cap: each client gone once its abort is sent
        _, writer = await asyncio.open_connection(host, port)
        writer.write(head + b"content-length: 2\r\n\r\n{}")
        await until(lambda n=n: len(running) == n)
        writer.close()
        await writer.wait_closed()
    async with asyncio.timeout(1):  # before: sent too, and answered at the control deadline
        status, data, headers = await call(client, "POST", rt.url + "/abort_requests", {})
    assert status == 503, data
    assert "Retry-After" in headers and b"still running" in data
    assert len(running) == 4
    assert len(_sent(emus[0], "/abort_requests")) == 4  # the fifth reached no replica
    emus[1].faults.hang = None
    await until(lambda: not running)


async def test_a_replica_without_dev_mode_is_named_with_its_fix(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = [*await emulators(1), *await emulators(1, dev_mode=False)]
    rt = await router(emus)
    status, data, _ = await call(client, "POST", rt.url + "/abort_requests", {})
    assert status == 404, data
    message = orjson.loads(data)["error"]["message"]
    assert f"Replica 1 ({emus[1].url})" in message and "VLLM_SERVER_DEV_MODE=1" in message


async def test_the_scale_out_route_aborts_by_id_and_answers_an_empty_200(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2, enable_scale_out=True, api_key="k", **SLOW)
    rt = await router(emus, token=Secret("k"))
    mine = asyncio.ensure_future(_long(client, rt.url, "m"))
    await until(lambda: _running(emus) == 1)
    body = {"request_ids": ["cmpl-m-0"]}
    status, data, headers = await call(
        client, "POST", rt.url + "/inference/v1/abort_requests", body
    )
    assert (status, data) == (200, b"")
    assert "content-type" not in headers  # vLLM's bare Response(status_code=200)
    async with asyncio.timeout(SLACK):
        _ended_by_abort(await mine)


async def test_the_scale_out_route_disabled_is_passed_on_naming_the_replica(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    body = {"request_ids": ["x"]}
    status, data, _ = await call(client, "POST", rt.url + "/inference/v1/abort_requests", body)
    assert status == 403, data
    error = orjson.loads(data)["error"]
    assert error["type"] == "PermissionDeniedError"
    assert (
        f"Replica 0 ({emus[0].url}) answered: Scale-out endpoints are disabled" in error["message"]
    )


async def test_a_draining_replica_still_running_a_request_gets_the_abort_too(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2, **SLOW)
    rt = await router(emus, shutdown_grace=30.0)
    assert rt.fleet is not None
    mine = asyncio.ensure_future(_long(client, rt.url, "d"))
    await until(lambda: _running(emus) == 1)
    busy = next(i for i, e in enumerate(emus) if e.state.num_running)
    removing = asyncio.ensure_future(call(client, "DELETE", f"{rt.url}/router/replicas/{busy}"))
    await until(lambda: rt.fleet is not None and rt.fleet.replicas[busy].state is State.DRAINING)
    status, data, headers = await call(client, "POST", rt.url + "/abort_requests", {})
    assert status == 200, data
    assert orjson.loads(data)["aborted"] == 1  # the draining replica's count, added
    assert sorted(headers["x-lora-router-replica"].split(",")) == ["0", "1"]
    async with asyncio.timeout(SLACK):
        _ended_by_abort(await mine)
        status, data, _ = await removing
    assert status == 200 and orjson.loads(data)["drained"] is True
