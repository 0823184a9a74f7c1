"""Routing keys: what a prompt looks like to the prefix caches of the replicas.

A replica's vLLM caches the KV of a prompt in whole blocks of `block_size` tokens, each block
identified by a hash chained over every block before it and over the adapter (`model`) that
computed it. A `PromptKey` mirrors that: `chain[i]` identifies the first `(i + 1) * block_size`
tokens under one model, so two prompts share `chain[i]` exactly when vLLM could reuse their
first `i + 1` blocks for each other.

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
The model name seeds the chain, so adapter versions (`trl-policy-v3`, `-v4`) never share a key,
as they never share KV blocks in vLLM; `model=None` (the base model) has a fixed seed of its own.
Token keys and text keys have separate seed domains and cannot alias each other.

This module must never do I/O, log, or validate requests (the HTTP layer validates; a key is a
pure function of its inputs). It is on the hot path: one pass over the prompt, no per-token
Python work beyond packing.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
from xxhash import xxh3_64_intdigest

# Seed domains (ASCII tags): the same bytes keyed as tokens and as text never collide.
TOKEN_SEED = int.from_bytes(b"lr-token", "big")
TEXT_SEED = int.from_bytes(b"lr-text\0", "big")

DEFAULT_BLOCK_SIZE = 16  # vLLM's default cache_config.block_size
TEXT_BLOCK_BYTES = 64  # about 16 tokens of English text

_TOKEN_BYTES = 4
if array("I").itemsize != _TOKEN_BYTES:  # pragma: no cover - every platform CPython supports
    raise ImportError("lora_router.routing.keys needs a 4-byte array('I')")
_SWAP = sys.byteorder != "little"  # keys are defined on little-endian bytes everywhere


@dataclass(slots=True)
class PromptKey:
    """The identity of a prompt, block by block, under one model.

    `chain` has one hash per full block; `full` identifies the whole prompt, partial tail
    included (it is the hash of the tail seeded by the last chain value, or by `seed` when
    there is no full block). `data` and `block_bytes` are kept so that the affinity table can
    ask "does this prompt start with that earlier one?" at any length, not only at block
    boundaries (`prefix_hash`).
    """

    chain: list[int]
    full: int
    length: int  # in units: tokens for token prompts, bytes for text and chat
    seed: int  # the model's seed: the head of level 0
    data: bytes  # the packed units
    block_bytes: int

    def head(self, level: int) -> int:
        """The hash identifying the first `level` full blocks (`seed` for level 0)."""
        return self.chain[level - 1] if level else self.seed

    @property
    def tail_bytes(self) -> int:
        """Bytes after the last full block."""
        return len(self.data) - len(self.chain) * self.block_bytes

    def prefix_hash(self, level: int, nbytes: int) -> int:
        """The `full` an earlier prompt would have if it were this prompt's first
        `level` blocks plus `nbytes` more bytes (`nbytes < block_bytes`)."""
        start = level * self.block_bytes
        return xxh3_64_intdigest(self.data[start : start + nbytes], self.head(level))


def model_seed(model: str | None, domain: int = TOKEN_SEED) -> int:
    """The seed of a model's chains; `None` (the base model) is the domain seed itself."""
    if model is None:
        return domain
    return xxh3_64_intdigest(model.encode("utf-8", "surrogatepass"), domain)


def _key(data: bytes, seed: int, block_bytes: int, length: int) -> PromptKey:
    chain: list[int] = []
    append = chain.append
    h = seed
    end = len(data) - len(data) % block_bytes
    # The one loop per prompt: each block's hash is seeded with the previous one, like vLLM's.
    # Bytes slices beat memoryview slices here (measured): the blocks are small.
    for start in range(0, end, block_bytes):
        h = xxh3_64_intdigest(data[start : start + block_bytes], h)
        append(h)
    full = xxh3_64_intdigest(data[end:], h)
    return PromptKey(chain, full, length, seed, data, block_bytes)


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
    return _key(data, model_seed(model), block_size * _TOKEN_BYTES, len(packed))


def text_key(model: str | None, data: bytes, block_bytes: int = TEXT_BLOCK_BYTES) -> PromptKey:
    """Key a text prompt given as its UTF-8 bytes."""
    return _key(bytes(data), model_seed(model, TEXT_SEED), block_bytes, len(data))


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
