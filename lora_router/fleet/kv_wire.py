"""vLLM's KV events on the wire, decoded and bounded, and where a replica publishes them
(`parse_sources`: its `/kv_event_sources` answer); fleet/kv_events.py follows them.

The wire (emulator/kv_events.py states it, from vLLM 0.32): a PUB message `(topic, seq,
payload)`, seq 8 bytes big-endian from 0 per process (a signed int64: the replay socket's end
marker is -1), the payload a msgpack array `[ts, events, dp_rank]`, events maps tagged "type".

Caps, so that no publisher grows the router beyond a stated bound:
- a frame is at most MAX_FRAME_BYTES (ZMQ's MAXMSGSIZE on the subscriber and the replay
  socket: a larger one drops the connection, which the subscriber reads as a stop), at most
  RCV_HWM messages wait per replica while the loop is busy, and a replay's answer is kept to
  MAX_REPLAY_BYTES (more is treated as no answer);
- a message that is not three frames with a sequence number (`is_seq`) is *malformed*, a payload
  that does not decode as a batch *undecodable*: both counted and skipped by the caller;
- a stored event naming a block hash over MAX_HASH_BYTES or an adapter name over
  MAX_NAME_BYTES is *refused* (`bounded`): counted and skipped, which leaves the index a subset
  of the truth (its blocks' children become orphans); a removal is always applied (a hash over
  the cap was never filed);
- the index's memory is bounded by the index (routing/kv_index.py: `max_bytes`, MAX_NAMES).

Never: I/O, or a cost beyond O(frame bytes) for a message.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import msgspec

from lora_router.routing.kv_index import MAX_HASH_BYTES, MAX_NAME_BYTES

# A batch is one engine step's events: a step of 64k prompt tokens is about 0.5 MiB of msgpack.
MAX_FRAME_BYTES = 8 << 20
RCV_HWM = 64  # so at most 64 x 3 frames of 8 MiB wait per replica
# One replay's answer, kept encoded until applied one batch at a time: vLLM keeps 10,000 steps.
MAX_REPLAY_BYTES = 64 << 20
END_SEQ = (-1).to_bytes(8, "big", signed=True)
_GPU = (None, "GPU")
_WILDCARDS = ("*", "0.0.0.0", "[::]", "::")

Hash = int | bytes
# A token id as the router's keys pack it (routing/keys.py: 4 bytes): a batch naming another is
# undecodable, as vLLM never sends one.
Token = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]


class Stored(msgspec.Struct, tag="BlockStored", tag_field="type"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[Token]
    block_size: int
    lora_name: str | None = None
    medium: str | None = None
    group_idx: int | None = None


class Removed(msgspec.Struct, tag="BlockRemoved", tag_field="type"):
    block_hashes: list[Hash]
    medium: str | None = None
    group_idx: int | None = None


class Cleared(msgspec.Struct, tag="AllBlocksCleared", tag_field="type"):
    pass


class Batch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Stored | Removed | Cleared]
    data_parallel_rank: int | None = None


decode = msgspec.msgpack.Decoder(Batch).decode


def is_seq(frame: bytes) -> bool:
    """Whether a frame is a batch's sequence number: 8 bytes, a signed int64 from 0."""
    return len(frame) == 8 and frame[0] < 0x80


def filed(event: Stored | Removed) -> bool:
    """Whether the event is about blocks the index files: GPU, KV-cache group 0 (or unnamed)."""
    return event.medium in _GPU and event.group_idx in (None, 0)


def bounded(event: Stored) -> bool:
    """Whether a stored event's hashes and adapter name are within their caps: O(blocks)."""
    name = event.lora_name
    if name is not None and (len(name) > MAX_NAME_BYTES or len(name.encode()) > MAX_NAME_BYTES):
        return False
    parent = event.parent_block_hash
    if isinstance(parent, bytes) and len(parent) > MAX_HASH_BYTES:
        return False
    return not any(isinstance(h, bytes) and len(h) > MAX_HASH_BYTES for h in event.block_hashes)


@dataclass(frozen=True, slots=True)
class Source:
    """Where one replica publishes."""

    endpoint: str
    replay: str | None = None
    topic: str = ""


def parse_sources(doc: object, host: str) -> Source | None:
    """DP rank 0's source in a `/kv_event_sources` answer, its wildcard host made `host`."""
    if not isinstance(doc, dict):
        return None
    rank0 = doc.get("0")
    if not isinstance(rank0, dict) or rank0.get("publisher") not in (None, "zmq"):
        return None
    endpoint, replay = rank0.get("endpoint"), rank0.get("replay_endpoint")
    if not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
        return None
    topic = rank0.get("topic")
    return Source(
        _reachable(endpoint, host),
        _reachable(replay, host) if isinstance(replay, str) else None,
        topic if isinstance(topic, str) else "",
    )


def host_of(endpoint: str) -> str:
    """The host of a `tcp://HOST:PORT` endpoint, IPv6 brackets off."""
    return endpoint.partition("://")[2].rpartition(":")[0].strip("[]")


def _reachable(endpoint: str, host: str) -> str:
    scheme, _, rest = endpoint.partition("://")
    where, _, port = rest.rpartition(":")
    if where in _WILDCARDS:
        where = f"[{host}]" if ":" in host else host
    return f"{scheme}://{where}:{port}"
