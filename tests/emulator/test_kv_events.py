"""The emulator's KV events, read off its sockets as a vLLM 0.32 consumer reads them: multipart
(topic, 8-byte big-endian seq, msgpack batch), batches as arrays, events as maps tagged "type",
the replay ROUTER's answers and end marker, and `/kv_event_sources`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from helpers import Adapter, call, completed

from lora_router.emulator import Emulator
from lora_router.emulator.kv_events import KVEventsConfig
from lora_router.emulator.prefix_cache import block_hashes

from .conftest import StartEmulator

BLOCK = 16
ON = KVEventsConfig(
    enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0", topic="kv"
)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.destroy(linger=0)


async def replayed(ctx: zmq.asyncio.Context, emu: Emulator, start: int = 0) -> list[list[bytes]]:
    """Every batch the replay socket still holds from `start`, as (topic, seq, payload)."""
    assert emu.kv_publisher is not None and emu.kv_publisher.replay_endpoint is not None
    sock = ctx.socket(zmq.DEALER)
    sock.connect(emu.kv_publisher.replay_endpoint)
    try:
        await sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        async with asyncio.timeout(5):
            while True:
                frames = await sock.recv_multipart()
                assert frames[0] == b"" and len(frames) == 4, frames
                if frames[2] == (-1).to_bytes(8, "big", signed=True):
                    assert frames[1] == b"" and frames[3] == b""
                    return out
                out.append(frames[1:])
    finally:
        sock.close(linger=0)


def batch(frames: list[bytes]) -> tuple[int, list[dict[str, Any]]]:
    """(seq, events) of one message, checking the batch's array shape."""
    topic, seq, payload = frames
    assert topic == b"kv" and len(seq) == 8
    ts, events, rank = msgspec.msgpack.decode(payload)
    assert isinstance(ts, float) and rank == 0
    return int.from_bytes(seq, "big"), events


async def events_of(ctx: zmq.asyncio.Context, emu: Emulator) -> list[dict[str, Any]]:
    return [e for frames in await replayed(ctx, emu) for e in batch(frames)[1]]


async def test_kv_event_sources_names_where_rank_0_publishes(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(kv_events_config=ON)
    status, body, _ = await call(client, "GET", emu.url + "/kv_event_sources")
    assert status == 200
    doc = msgspec.json.decode(body)
    assert list(doc) == ["0"]
    source = doc["0"]
    assert source["endpoint"].startswith("tcp://127.0.0.1:") and source["endpoint"][-2:] != ":0"
    assert source["replay_endpoint"].startswith("tcp://127.0.0.1:")
    assert {k: source[k] for k in ("enable_kv_cache_events", "publisher", "topic")} == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "topic": "kv",
    }
    assert {"buffer_steps", "hwm", "max_queue_size"} <= source.keys()


async def test_kv_event_sources_is_empty_without_events(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    status, body, _ = await call(client, "GET", emu.url + "/kv_event_sources")
    assert (status, msgspec.json.decode(body)) == (200, {})


async def test_a_prompt_is_stored_with_its_tokens_hashes_and_no_parent(
    start: StartEmulator, client: aiohttp.ClientSession, ctx: zmq.asyncio.Context
) -> None:
    emu = await start(kv_events_config=ON)
    prompt = list(range(1000, 1040))  # two full blocks and 8 tokens
    await completed(client, emu.url, prompt=prompt, max_tokens=1)
    (stored,) = await events_of(ctx, emu)
    assert stored == {
        "type": "BlockStored",
        "block_hashes": block_hashes(prompt, BLOCK),
        "parent_block_hash": None,
        "token_ids": prompt[:32],
        "block_size": BLOCK,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
        "group_idx": 0,
    }


async def test_a_continuation_stores_only_its_new_blocks_under_their_parent(
    start: StartEmulator, client: aiohttp.ClientSession, ctx: zmq.asyncio.Context
) -> None:
    emu = await start(kv_events_config=ON)
    first = list(range(2000, 2032))
    longer = [*first, *range(3000, 3020)]
    await completed(client, emu.url, prompt=first, max_tokens=1)
    await completed(client, emu.url, prompt=longer, max_tokens=1)
    events = await events_of(ctx, emu)
    assert [e["type"] for e in events] == ["BlockStored", "BlockStored"]
    hashes = block_hashes(longer, BLOCK)
    assert events[1]["block_hashes"] == hashes[2:3]
    assert events[1]["parent_block_hash"] == hashes[1]
    assert events[1]["token_ids"] == longer[32:48]


async def test_an_adapter_names_its_blocks(
    start: StartEmulator,
    client: aiohttp.ClientSession,
    ctx: zmq.asyncio.Context,
    adapter: Adapter,
) -> None:
    emu = await start(kv_events_config=ON)
    body = {"lora_name": "pol-v1", "lora_path": adapter("pol-v1")}
    assert (await call(client, "POST", emu.url + "/v1/load_lora_adapter", body))[0] == 200
    await completed(client, emu.url, "pol-v1", prompt=list(range(16)), max_tokens=1)
    (stored,) = await events_of(ctx, emu)
    assert stored["lora_name"] == "pol-v1" and isinstance(stored["lora_id"], int)
    assert stored["extra_keys"] == [["pol-v1"]]


async def test_eviction_and_reset_are_published(
    start: StartEmulator, client: aiohttp.ClientSession, ctx: zmq.asyncio.Context
) -> None:
    emu = await start(kv_events_config=ON, cache_blocks=2)
    old = list(range(4000, 4032))
    await completed(client, emu.url, prompt=old, max_tokens=1)
    await completed(client, emu.url, prompt=list(range(5000, 5016)), max_tokens=1)
    assert (await call(client, "POST", emu.url + "/reset_prefix_cache"))[0] == 200
    events = await events_of(ctx, emu)
    assert [e["type"] for e in events] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    assert events[2] == {
        "type": "BlockRemoved",
        "block_hashes": block_hashes(old, BLOCK)[:1],
        "medium": "GPU",
        "group_idx": 0,
    }


async def test_batches_are_numbered_from_0_per_process(
    start: StartEmulator, client: aiohttp.ClientSession, ctx: zmq.asyncio.Context
) -> None:
    emu = await start(kv_events_config=ON)
    endpoints = emu.kv_event_sources()
    for i in range(3):
        await completed(client, emu.url, prompt=list(range(i * 100, i * 100 + 16)), max_tokens=1)
    assert [batch(f)[0] for f in await replayed(ctx, emu)] == [0, 1, 2]
    assert [batch(f)[0] for f in await replayed(ctx, emu, start=2)] == [2]
    await emu.restart()
    assert emu.kv_event_sources() == endpoints  # back where it was
    await completed(client, emu.url, prompt=list(range(16)), max_tokens=1)
    assert [batch(f)[0] for f in await replayed(ctx, emu)] == [0]


async def test_subscribers_receive_what_is_published(
    start: StartEmulator, client: aiohttp.ClientSession, ctx: zmq.asyncio.Context
) -> None:
    emu = await start(kv_events_config=ON)
    assert emu.kv_publisher is not None
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(emu.kv_publisher.endpoint)
    try:
        # A subscription takes effect a moment after the connection (ZMQ's slow joiner):
        # publish until one batch arrives, then every later one must.
        seen = None
        async with asyncio.timeout(5):
            i = 0
            while seen is None:
                i += 1
                await completed(client, emu.url, prompt=[i] * 16, max_tokens=1)
                if await sub.poll(20):
                    seen = batch(await sub.recv_multipart())[0]
                    while await sub.poll(20):
                        seen = batch(await sub.recv_multipart())[0]
        await completed(client, emu.url, prompt=[7, 7, 7, 7] * 8, max_tokens=1)
        async with asyncio.timeout(5):
            seq, events = batch(await sub.recv_multipart())
        assert seq == seen + 1 and events[0]["token_ids"] == [7, 7, 7, 7] * 8
    finally:
        sub.close(linger=0)
