"""KV-cache events as vLLM 0.32 publishes them (`--kv-events-config`), from the simulated cache.

The wire, read from vLLM 0.32.0's `vllm/distributed/kv_events.py` and `vllm/config/kv_events.py`:
- a ZMQ PUB socket sends one multipart message per batch: `(topic, seq, payload)`, `topic` the
  config's `topic` in UTF-8, `seq` an unsigned 8-byte big-endian counter from 0 per process,
  `payload` msgpack (msgspec) of `KVEventBatch`: an array `[ts, events, data_parallel_rank]`;
- each event is a map tagged `"type"`: `BlockStored` (block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name always; extra_keys, group_idx when set),
  `BlockRemoved` (block_hashes, medium, group_idx), `AllBlocksCleared`. Hashes are 64-bit
  ints (vLLM's default, `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1`);
- the optional replay ROUTER socket takes `(identity, b"", start_seq)` and answers each buffered
  batch with `seq >= start_seq` as `(identity, b"", topic, seq, payload)`, then the end marker
  `(identity, b"", b"", -1 as signed 8 bytes, b"")`; it keeps the last `buffer_steps` batches;
- an endpoint with `*` (or ipc/inproc) is bound, any other is connected to; `tcp://*:0` binds
  an ephemeral port on the node's address and reports the bound endpoint. Here the node's
  address is the emulator's `host`; `GET /kv_event_sources` answers `{"0": config}` with the
  resolved endpoints (`{}` when events are off).

What the engine publishes (engine.py): a `BlockStored` per run of consecutive blocks a
cache insert added (parent: the block before the run, None for a prompt's first), one
`BlockRemoved` per evicted block, `AllBlocksCleared` when the cache is cleared. One batch per
engine step that changed the cache. A restart is a new publisher: the sequence starts again at 0.

Never: block the event loop (PUB never blocks: beyond `hwm` ZMQ drops, as vLLM's does), import
anything of the router.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import msgspec
import orjson
import zmq
import zmq.asyncio

MEDIUM_GPU = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_BIND_TRIES = 200  # a port a stopped publisher held is freed by ZMQ's own thread, soon after


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """A KV-cache event: a msgpack map tagged with its class name under "type"."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


@dataclass(slots=True)
class KVEventsConfig:
    """vLLM's `KVEventsConfig` (`--kv-events-config '<json>'`); unknown fields are refused."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None  # "zmq" or "null"; None: zmq when enabled
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"unknown KV event publisher {self.publisher!r}")

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        doc = orjson.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        try:
            return cls(**doc)
        except TypeError as exc:
            raise ValueError(f"--kv-events-config: {exc}") from None

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def stored_events(
    tokens: Sequence[int],
    hashes: Sequence[int],
    new: Sequence[int],
    block_size: int,
    lora_id: int | None,
    lora_name: str | None,
) -> list[KVCacheEvent]:
    """One `BlockStored` per run of consecutive new block indices `new` of a chain `hashes`
    over `tokens`, as vLLM's `cache_full_blocks` reports the blocks it caches."""
    events: list[KVCacheEvent] = []
    start = 0
    while start < len(new):
        end = start
        while end + 1 < len(new) and new[end + 1] == new[end] + 1:
            end += 1
        first, last = new[start], new[end]
        count = last - first + 1
        events.append(
            BlockStored(
                block_hashes=list(hashes[first : last + 1]),
                parent_block_hash=hashes[first - 1] if first else None,
                token_ids=list(tokens[first * block_size : (last + 1) * block_size]),
                block_size=block_size,
                lora_id=lora_id,
                medium=MEDIUM_GPU,
                lora_name=lora_name,
                extra_keys=[(lora_name,)] * count if lora_name is not None else None,
                group_idx=0,
            )
        )
        start = end + 1
    return events


def removed_events(hashes: Sequence[int]) -> list[KVCacheEvent]:
    return [BlockRemoved(block_hashes=[h], medium=MEDIUM_GPU, group_idx=0) for h in hashes]


class KvEventPublisher:
    """vLLM's `ZmqEventPublisher` for one emulated process (module docstring)."""

    def __init__(
        self, config: KVEventsConfig, host: str, bound: tuple[str, str | None] | None = None
    ) -> None:
        """`bound`: the endpoints an earlier process of this replica bound, bound again (a
        restart comes back where it was, as on a fixed `--kv-events-config`)."""
        self.config = config
        self._host = host
        self._ctx = zmq.asyncio.Context()
        # PUB is written from plain code and never blocks: a synchronous socket on the same
        # ZMQ context; only the replay ROUTER needs awaiting.
        self._sync: zmq.Context[Any] = zmq.Context.shadow(self._ctx.underlying)
        self._pub: zmq.Socket[Any] | None = None
        self._replay: zmq.asyncio.Socket | None = None
        self._replay_task: asyncio.Task[None] | None = None
        self._encode = msgspec.msgpack.Encoder().encode
        self._topic = config.topic.encode("utf-8")
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.seq = 0  # the next batch's sequence number
        self.published = 0  # batches sent
        self.endpoint = config.endpoint  # as bound (tcp://*:0 resolved)
        self.replay_endpoint = config.replay_endpoint
        self._rebind = bound is not None
        if bound is not None:
            self.endpoint, self.replay_endpoint = bound

    async def start(self) -> None:
        """Bind (or connect) the sockets: once per emulated process."""
        pub = self._sync.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.config.hwm)
        pub.setsockopt(zmq.LINGER, 0)
        self._pub = pub
        self.endpoint = await self._attach(pub, self.endpoint, bind=self._rebind)
        if self.replay_endpoint is not None:
            replay = self._ctx.socket(zmq.ROUTER)
            replay.setsockopt(zmq.LINGER, 0)
            self._replay = replay
            self.replay_endpoint = await self._attach(replay, self.replay_endpoint, bind=True)
            self._replay_task = asyncio.get_running_loop().create_task(self._serve_replay())

    async def _attach(self, sock: Any, endpoint: str, bind: bool = False) -> str:
        wildcard = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc:", "inproc:"))
        if not (bind or wildcard):
            sock.connect(endpoint)
            return endpoint
        if endpoint == "tcp://*:0":
            port = sock.bind_to_random_port(f"tcp://{self._host}")
            return f"tcp://{self._host}:{port}"
        for _ in range(_BIND_TRIES):  # a restart rebinds the port the last process held
            try:
                sock.bind(endpoint)
                return endpoint
            except zmq.ZMQError as exc:
                if exc.errno != zmq.EADDRINUSE:
                    raise
                await asyncio.sleep(0.01)
        sock.bind(endpoint)
        return endpoint

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Send one batch (nothing for no events, as vLLM's scheduler step does)."""
        if not events or self._pub is None:
            return
        seq = self.seq
        self.seq += 1
        payload = self._encode(EventBatch(ts=time.time(), events=events, data_parallel_rank=0))
        frames = (self._topic, seq.to_bytes(8, "big"), payload)
        with contextlib.suppress(zmq.Again):
            self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))
        self.published += 1

    async def _serve_replay(self) -> None:
        replay = self._replay
        assert replay is not None
        while True:
            frames = await replay.recv_multipart()
            if len(frames) != 3:
                continue  # vLLM logs "Invalid replay request" and ignores it
            client, _, start = frames
            first = int.from_bytes(start, "big")
            for seq, payload in list(self._buffer):
                if seq >= first:
                    await replay.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                    )
            await replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def sources(self) -> dict[str, dict[str, Any]]:
        """The `/kv_event_sources` answer: the publisher config of DP rank 0, resolved."""
        config = asdict(self.config)
        config.update(endpoint=self.endpoint, replay_endpoint=self.replay_endpoint)
        return {"0": config}

    async def stop(self) -> None:
        """Close the sockets (the process ends); the ports are free again soon after."""
        if self._replay_task is not None:
            self._replay_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replay_task
            self._replay_task = None
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._pub = self._replay = None
        self._ctx.term()
