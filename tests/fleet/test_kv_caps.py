"""Over real ZMQ sockets on loopback: a publisher that sends what vLLM never would (oversized
hashes and frames, malformed messages, undecodable payloads) is counted in /router/status and
/metrics, never grows the router beyond the stated bounds (fleet/kv_wire.py,
routing/kv_index.py), and never ends the subscription: the next good batch is applied."""

from __future__ import annotations

import contextlib
import itertools
import time
import tracemalloc
from collections.abc import Iterator
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
from emulated_fleet import StartEmulators, StartRouter
from helpers import call, completed, router_status, until

from lora_router.emulator import Emulator
from lora_router.emulator.kv_events import KVEventsConfig
from lora_router.fleet import kv_events
from lora_router.fleet.kv_wire import MAX_FRAME_BYTES
from lora_router.routing.kv_index import MAX_HASH_BYTES
from lora_router.runtime import RouterRuntime

BLOCK = 16
REPLAYED = KVEventsConfig(
    enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"
)


class Publisher:
    """A PUB socket on 127.0.0.1 the router subscribes to (`--kv-events tcp://{host}:PORT`),
    sending vLLM's frames or any others."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[Any] = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, 0)  # never drop: the test paces itself
        self.port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        self.seq = 0
        self.hashes = itertools.count(1)

    def frames(self, *frames: bytes) -> None:
        self.pub.send_multipart(frames)

    def batch(self, *events: dict[str, Any], seq: int | None = None) -> None:
        """One batch; `seq` the next one unless given."""
        if seq is None:
            seq, self.seq = self.seq, self.seq + 1
        payload = msgspec.msgpack.encode([time.time(), list(events), 0])
        self.frames(b"", seq.to_bytes(8, "big"), payload)

    def stored(self, blocks: int = 1, hashes: list[Any] | None = None) -> dict[str, Any]:
        """A BlockStored of `blocks` first blocks (new tokens each), with int hashes unless
        given."""
        first = next(self.hashes)
        return {
            "type": "BlockStored",
            "block_hashes": hashes or [next(self.hashes) for _ in range(blocks)],
            "parent_block_hash": None,
            "token_ids": list(
                range(first * 1000, first * 1000 + BLOCK * (len(hashes or []) or blocks))
            ),
            "block_size": BLOCK,
            "lora_name": None,
            "medium": "GPU",
        }

    def close(self) -> None:
        self.pub.close(linger=0)
        self.ctx.term()


@pytest.fixture
def publisher() -> Iterator[Publisher]:
    pub = Publisher()
    yield pub
    pub.close()


async def subscribed(rt: RouterRuntime, emu: Emulator, pub: Publisher) -> None:
    """Publish until the router receives (ZMQ's slow joiner)."""
    assert rt.kv_events is not None
    stream = rt.kv_events.streams[emu.url]
    for _ in range(400):
        pub.batch(pub.stored())
        try:
            await until(lambda: stream.batches > 0, timeout=0.025)
            return
        except TimeoutError:
            continue
    raise AssertionError("the router never received a batch")


async def kv_router(
    emulators: StartEmulators, router: StartRouter, pub: Publisher
) -> tuple[RouterRuntime, Emulator]:
    (emu,) = await emulators(1)
    rt = await router([emu], policy="kv", kv_events=f"tcp://{{host}}:{pub.port}")
    await subscribed(rt, emu, pub)
    return rt, emu


async def test_a_malformed_frame_is_counted_and_the_next_good_batch_applied(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    publisher: Publisher,
) -> None:
    rt, emu = await kv_router(emulators, router, publisher)
    assert rt.kv_events is not None
    stream, index = rt.kv_events.streams[emu.url], rt.kv_events.index
    await until(lambda: stream.next_seq == publisher.seq)
    good = stream.batches
    publisher.frames(b"", b"\xff" * (1 << 20), b"\x93")  # a sequence frame of 1 MiB of 0xff
    publisher.frames(b"", b"\xff" * 8, b"\x93")  # above vLLM's int64 (the replay's end mark)
    publisher.frames(b"", (publisher.seq).to_bytes(8, "big"))  # two frames
    publisher.batch()  # an empty batch is a batch: the sequence goes on
    publisher.frames(b"", (publisher.seq).to_bytes(8, "big"), b"\xc1 not msgpack")
    publisher.seq += 1
    await until(lambda: stream.undecodable == 1)
    assert index.replica(emu.url).state == "gap"  # a batch was lost: what it held is dropped
    publisher.batch(publisher.stored(4))
    await until(lambda: index.held(emu.url) == 4)
    # In sequence: the fault ends, and the subscription went on throughout.
    assert index.replica(emu.url).state == "live"
    assert stream.batches == good + 2 and stream.task is not None and not stream.task.done()
    seen = (await router_status(client, rt.url))["kv_events"]["replicas"][emu.url]
    assert (seen["malformed"], seen["undecodable"]) == (3, 1)
    status, data, _ = await call(client, "GET", rt.url + "/metrics")
    assert status == 200
    assert 'lora_router_kv_events_malformed_total{replica="0"} 3.0' in data.decode()
    assert 'lora_router_kv_events_undecodable_total{replica="0"} 1.0' in data.decode()


async def test_a_token_id_the_keys_cannot_hold_is_an_undecodable_batch(
    emulators: StartEmulators, router: StartRouter, publisher: Publisher
) -> None:
    """Token ids are packed in 4 bytes (routing/keys.py): a batch naming 2**32 or -1 is
    counted undecodable (a gap), and the next batch in sequence is applied."""
    rt, emu = await kv_router(emulators, router, publisher)
    assert rt.kv_events is not None
    stream, index = rt.kv_events.streams[emu.url], rt.kv_events.index
    for token in (1 << 32, -1):
        event = publisher.stored()
        event["token_ids"][0] = token
        publisher.batch(event)
    await until(lambda: stream.undecodable == 2)
    publisher.batch(publisher.stored(2))
    await until(lambda: index.held(emu.url) == 2)
    assert index.replica(emu.url).state == "live"
    assert stream.task is not None and not stream.task.done()


async def test_oversized_hashes_never_grow_the_router(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    publisher: Publisher,
) -> None:
    """48 MiB of 64 KiB byte-string hashes, in 1 MiB batches: every event is refused and
    counted, the router's traced memory grows by less than 8 MiB, and a good batch after them
    is applied."""
    rt, emu = await kv_router(emulators, router, publisher)
    assert rt.kv_events is not None
    stream, index = rt.kv_events.streams[emu.url], rt.kv_events.index
    await until(lambda: stream.next_seq == publisher.seq)
    held, index_bytes = index.held(emu.url), index.bytes
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(6):
            for _ in range(8):
                hashes = [next(publisher.hashes).to_bytes(64 << 10, "big") for _ in range(16)]
                publisher.batch(publisher.stored(hashes=hashes))
            await until(lambda: stream.next_seq == publisher.seq, timeout=20)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 8 << 20, grown
    assert index.held(emu.url) == held and index.bytes == index_bytes
    # A hash at the cap is vLLM's shape (a digest): filed, and counted in the index's bytes.
    publisher.batch(publisher.stored(hashes=[b"\x01" * MAX_HASH_BYTES]))
    await until(lambda: index.held(emu.url) == held + 1)
    assert index.bytes > index_bytes
    seen = (await router_status(client, rt.url))["kv_events"]
    assert seen["replicas"][emu.url]["refused"] == 48 and seen["bytes"] == index.bytes


async def test_a_frame_over_the_cap_drops_the_connection_not_the_subscription(
    emulators: StartEmulators, router: StartRouter, publisher: Publisher
) -> None:
    rt, emu = await kv_router(emulators, router, publisher)
    assert rt.kv_events is not None
    stream, index = rt.kv_events.streams[emu.url], rt.kv_events.index
    await until(lambda: stream.next_seq == publisher.seq)
    received = stream.batches
    publisher.frames(b"", publisher.seq.to_bytes(8, "big"), b"\x00" * (MAX_FRAME_BYTES + 1))
    await until(lambda: stream.disconnects >= 1, timeout=10)
    assert stream.batches == received and stream.undecodable == 0  # never read
    held = index.held(emu.url)
    await subscribed_again(rt, emu, publisher, held)


async def subscribed_again(rt: RouterRuntime, emu: Emulator, pub: Publisher, held: int) -> None:
    """Publish until a batch reaches the router again (it reconnects, then subscribes)."""
    assert rt.kv_events is not None
    index = rt.kv_events.index
    for _ in range(400):
        pub.batch(pub.stored())
        try:
            await until(lambda: index.held(emu.url) > held, timeout=0.025)
            return
        except TimeoutError:
            continue
    raise AssertionError(f"the router never received a batch again {rt.kv_events.json()}")


async def test_a_replay_over_its_budget_is_not_applied(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A replay answer larger than MAX_REPLAY_BYTES (here 64 bytes, below one batch) is counted
    and treated as no answer: nothing of it is filed, and the live stream goes on."""
    monkeypatch.setattr(kv_events, "MAX_REPLAY_BYTES", 64)
    (emu,) = await emulators(1, kv_events_config=REPLAYED)
    await completed(client, emu.url, prompt=list(range(3000, 3064)), max_tokens=1)
    rt = await router([emu], policy="kv")
    assert rt.kv_events is not None
    stream, index = rt.kv_events.streams[emu.url], rt.kv_events.index
    await until(lambda: stream.replays_refused == 1)
    assert index.held(emu.url) == 0
    for i in itertools.count():  # the live stream (ZMQ's slow joiner: until one arrives)
        await completed(client, emu.url, prompt=[60_000 + i] * BLOCK, max_tokens=1)
        with contextlib.suppress(TimeoutError):
            await until(lambda: index.held(emu.url) > 0, timeout=0.05)
            break
        assert i < 200
    assert index.replica(emu.url).state == "live"
    status = await router_status(client, rt.url)
    assert status["kv_events"]["replicas"][emu.url]["replays_refused"] == 1
