"""The simulated automatic prefix cache of one replica (vLLM v1's KV block cache).

Only full blocks are cached. Each block's hash chains its parent's hash, the block's token ids
and the request's extra keys: the LoRA adapter name on vLLM 0.27, (name, path) from 0.32 on, nothing
for the base model. So one prompt under two adapter versions shares no block, and on 0.27 a
name re-pointed at new weights would hit stale blocks, as on a real server.

A lookup is limited to `len(prompt) - 1` tokens, because vLLM always recomputes the last prompt
token to get logits: a fully cached prompt of 32 tokens reports 16 cached tokens, not 32.
Capacity is a number of blocks with least-recently-used eviction. Counters follow vLLM's
`vllm:prefix_cache_queries` (prompt tokens looked up) and `vllm:prefix_cache_hits` (tokens found).

`insert` returns what changed (the blocks it added, those it evicted) and `clear` whether
anything was held, so that the engine can publish vLLM's KV events (kv_events.py).

Pure: no I/O, no clock.
"""

from __future__ import annotations

from array import array
from collections import OrderedDict
from collections.abc import Sequence

import xxhash

_ROOT = 0  # the parent hash of a prompt's first block


def block_hashes(
    token_ids: Sequence[int], block_size: int, extra_keys: tuple[str, ...] = ()
) -> list[int]:
    """Chained hashes of the full blocks of `token_ids`."""
    extra = "\0".join(extra_keys).encode("utf-8")
    hashes: list[int] = []
    parent = _ROOT
    for end in range(block_size, len(token_ids) + 1, block_size):
        h = xxhash.xxh3_64()
        h.update(parent.to_bytes(8, "little"))
        h.update(array("I", token_ids[end - block_size : end]).tobytes())
        h.update(extra)
        parent = h.intdigest()
        hashes.append(parent)
    return hashes


class PrefixCache:
    """An LRU set of block hashes with vLLM's hit accounting."""

    __slots__ = ("_blocks", "block_size", "capacity", "hits", "queries")

    def __init__(self, block_size: int, capacity: int) -> None:
        self.block_size = block_size
        self.capacity = capacity
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.queries = 0  # prompt tokens looked up
        self.hits = 0  # of which were found cached

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def lookup(self, prompt_hashes: Sequence[int], prompt_len: int) -> int:
        """Count a lookup and return the number of cached prompt tokens."""
        usable = (prompt_len - 1) // self.block_size if prompt_len > 0 else 0
        hit_blocks = 0
        for block_hash in prompt_hashes[:usable]:
            if block_hash not in self._blocks:
                break
            self._blocks.move_to_end(block_hash)
            hit_blocks += 1
        cached = hit_blocks * self.block_size
        self.queries += prompt_len
        self.hits += cached
        return cached

    def insert(self, hashes: Sequence[int]) -> tuple[list[int], list[int]]:
        """Mark blocks as computed (most recently used), evicting the oldest beyond capacity.
        Returns the indices into `hashes` of the blocks added and the hashes evicted."""
        blocks = self._blocks
        added: list[int] = []
        for i, block_hash in enumerate(hashes):
            if block_hash in blocks:
                blocks.move_to_end(block_hash)
            else:
                blocks[block_hash] = None
                added.append(i)
        evicted: list[int] = []
        while len(blocks) > self.capacity:
            evicted.append(blocks.popitem(last=False)[0])
        return added, evicted

    def clear(self) -> bool:
        """Drop every block (`/reset_prefix_cache`); the counters keep counting. Whether any
        block was held."""
        held = bool(self._blocks)
        self._blocks.clear()
        return held
