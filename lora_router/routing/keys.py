"""Routing keys: what a prompt looks like to the prefix caches of the replicas.

A replica's vLLM caches the KV of a prompt in whole blocks of `block_size` tokens, each block
identified by a hash chained over every block before it and over the adapter (`model`) that
computed it. A `PromptKey` mirrors that with two kinds of hash, both xxh3-64 under the model's
`seed`:

- `full = xxh3(data, seed)`, the whole packed prompt, partial last block included: one C call,
  computed when the key is built. It is all a *sibling* needs (the G samples of a GRPO prompt
  are G identical requests; the affinity table finds an exact prompt by `full` alone), and it
  is the prompt's position on the hash ring. `prefix_hash(level, nbytes)` is the `full` the
  prompt's first `level` blocks plus `nbytes` bytes would have, so "does this prompt start with
  that earlier one?" is answered at any length, not only at block boundaries.
- `chain[i] = xxh3(block i, chain[i - 1])` (`chain[-1]` read as `seed`) identifies the first
  `(i + 1) * block_size` units under one model, so two prompts share `chain[i]` exactly when
  vLLM could reuse their first `i + 1` blocks for each other. It costs one Python-level xxh3
  call per block, most of what routing a long prompt costs, so it is lazy: computed on first
  access and cached, and a request routed as a sibling never computes it. Only a scan for
  earlier prompts this one extends (continuations, fresh prompts) and recording a new prompt
  (the affinity table files it under its last chain value) need it.

How each kind of request is keyed (the HTTP layer, `lora_router/body.py`, extracts the prompt
and validates it; this module only hashes):

- token ids (`prompt: [int, ...]`, TRL's case): packed as little-endian uint32 and cut into
  blocks of `block_size` tokens (`prompt_key`; an `array('I')` from validation is used as is);
- text (`prompt: "..."`): its UTF-8 bytes cut into blocks of 64 bytes, about 16 tokens
  (`text_key`); the router does not tokenize, so a text prompt and the same prompt as token ids
  are different keys;
- chat (`messages: [...]`): each message serialized compactly by orjson with sorted keys, the
  results concatenated (`encode_messages`) and keyed as text (`messages_key`). A later turn of
  a conversation repeats the earlier messages byte for byte, so its key extends the earlier
  one; serializing the list as a whole would not (the closing bracket moves);
- a batch (`prompt: [[int, ...], ...]` or `["...", ...]`): one upstream request, forwarded byte
  for byte, so it is routed as a whole and keyed by its first prompt (the samples of a GRPO
  batch share a prompt; splitting would mean rewriting bodies and merging responses);
- anything else (e.g. `prompt_embeds`): no key; the policy then balances by load alone.

Every hash is xxh3-64 with fixed seeds, never Python's `hash()` (salted per process): two router
processes compute the same keys, which is what lets them agree on placements without talking.
The model name seeds both hashes, so adapter versions (`trl-policy-v3`, `-v4`) never share a
key, as they never share KV blocks in vLLM; `model=None` (the base model) has a fixed seed of
its own. Token keys and text keys have separate seed domains and cannot alias each other.
`full` does not depend on the block size: keys compared with each other (one router's, one
affinity table's) all use the same one.

This module must never do I/O, log, or validate requests (the HTTP layer validates; a key is a
pure function of its inputs). It is on the hot path: no per-token Python work beyond packing,
and no per-block Python work until the chain is asked for.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
from xxhash import xxh3_64_intdigest

# Seed domains (ASCII tags): the same bytes keyed as tokens and as text never collide.
TOKEN_SEED = int.from_bytes(b"lr-token", "big")
TEXT_SEED = int.from_bytes(b"lr-text\0", "big")
WIRE_SEED = int.from_bytes(b"lr-wire\0", "big")

DEFAULT_BLOCK_SIZE = 16  # vLLM's default cache_config.block_size
TEXT_BLOCK_BYTES = 64  # about 16 tokens of English text

_TOKEN_BYTES = 4
if array("I").itemsize != _TOKEN_BYTES:  # pragma: no cover - every platform CPython supports
    raise ImportError("lora_router.routing.keys needs a 4-byte array('I')")
_SWAP = sys.byteorder != "little"  # keys are defined on little-endian bytes everywhere


@dataclass(slots=True)
class PromptKey:
    """The identity of a prompt under one model: `full` for the whole of it, `chain` (lazy) for
    its full blocks (module docstring).

    Built by `prompt_key`, `text_key` and `messages_key`. `data` and `block_bytes` are kept so
    that the chain can be computed when first asked for and so that the affinity table can ask
    "does this prompt start with that earlier one?" at any length (`prefix_hash`). Two keys are
    equal when they key the same units under the same seed and block size.
    """

    data: bytes  # the packed units
    seed: int  # the model's seed: the head of level 0, and the seed of every `full`
    block_bytes: int
    length: int  # in units: tokens for token prompts, bytes for text and chat
    full: int = field(init=False)
    _chain: list[int] | None = field(init=False, default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.full = xxh3_64_intdigest(self.data, self.seed)

    @property
    def chain(self) -> list[int]:
        """One hash per full block, each seeded by the one before (the first by `seed`).
        Computed on first access and cached: the list is shared, never mutate it."""
        chain = self._chain
        if chain is None:
            chain = self._chain = _chain(self.data, self.seed, self.block_bytes)
        return chain

    @property
    def blocks(self) -> int:
        """The number of full blocks (`len(chain)`, without computing the chain)."""
        return len(self.data) // self.block_bytes

    def head(self, level: int) -> int:
        """The hash identifying the first `level` full blocks (`seed` for level 0)."""
        return self.chain[level - 1] if level else self.seed

    @property
    def tail_bytes(self) -> int:
        """Bytes after the last full block."""
        return len(self.data) % self.block_bytes

    def prefix_hash(self, level: int, nbytes: int) -> int:
        """The `full` of the prompt made of this one's first `level` full blocks and `nbytes`
        more bytes: `xxh3(data[: level * block_bytes + nbytes], seed)`. Equal to an earlier
        key's `full` exactly when this prompt starts with that one (up to hash collisions)."""
        return xxh3_64_intdigest(self.data[: level * self.block_bytes + nbytes], self.seed)


def model_seed(model: str | None, domain: int = TOKEN_SEED) -> int:
    """The seed of a model's keys (`full` and `chain`); `None` (the base model) is the
    domain seed itself."""
    if model is None:
        return domain
    return xxh3_64_intdigest(model.encode("utf-8", "surrogatepass"), domain)


def _chain(data: bytes, seed: int, block_bytes: int) -> list[int]:
    """The chained hashes of the full blocks of `data` (`PromptKey.chain`)."""
    chain: list[int] = []
    append = chain.append
    h = seed
    # The one loop per prompt, run only if the chain is asked for: each block's hash is seeded
    # with the previous one, like vLLM's.
    # Bytes slices beat memoryview slices here (measured): the blocks are small.
    for start in range(0, len(data) - len(data) % block_bytes, block_bytes):
        h = xxh3_64_intdigest(data[start : start + block_bytes], h)
        append(h)
    return chain


def prompt_key(
    model: str | None, tokens: Sequence[int], block_size: int = DEFAULT_BLOCK_SIZE
) -> PromptKey:
    """Key a token-id prompt: a list of ints, or the `array('I')` validation already packed.

    Ids must fit in uint32 (validation is upstream; packing a list raises OverflowError or
    TypeError otherwise)."""
    if isinstance(tokens, array) and tokens.typecode == "I":
        packed = tokens
    else:
        packed = array("I")
        packed.fromlist(tokens if isinstance(tokens, list) else list(tokens))
    data = packed.tobytes()
    if _SWAP:  # pragma: no cover - big-endian hosts
        swapped = array("I", data)
        swapped.byteswap()
        data = swapped.tobytes()
    return PromptKey(data, model_seed(model), block_size * _TOKEN_BYTES, len(packed))


def wire_key(model: str | None, raw: bytes) -> int:
    """The identity of a token-id prompt as the client wrote it on the wire (its JSON text).

    The G samples of a GRPO prompt are separate requests from one client, so their prompts are
    the same bytes: a sibling is recognised by this one hash, before (and instead of) parsing
    its ids and building its block chain. Two spellings of one prompt get different wire keys;
    the policy then falls back to `prompt_key`, which is what vLLM caches.
    """
    return xxh3_64_intdigest(raw, model_seed(model, WIRE_SEED))


def text_key(model: str | None, data: bytes, block_bytes: int = TEXT_BLOCK_BYTES) -> PromptKey:
    """Key a text prompt given as its UTF-8 bytes."""
    return PromptKey(bytes(data), model_seed(model, TEXT_SEED), block_bytes, len(data))


def encode_messages(messages: Iterable[Any]) -> bytes:
    """The prefix-stable encoding of chat messages: each one compact, keys sorted, concatenated.

    Raises orjson.JSONEncodeError for what JSON cannot hold (a parsed body always can)."""
    dumps = orjson.dumps
    return b"".join([dumps(m, option=orjson.OPT_SORT_KEYS) for m in messages])


def messages_key(
    model: str | None, messages: Iterable[Any], block_bytes: int = TEXT_BLOCK_BYTES
) -> PromptKey:
    """Key a chat conversation: `text_key` of `encode_messages(messages)`."""
    return text_key(model, encode_messages(messages), block_bytes)
