"""Routing keys: what a prompt looks like to the prefix caches of the replicas, and to placement.

**Two keys, two names.** vLLM keys a replica's KV blocks by the *full* adapter name: the blocks
`trl-policy-v7` computed are useless to `trl-policy-v8`. Placement must not work that way: TRL's
rollout worker names the *current* policy version on every request (`_request_model` re-reads
the shared version for every turn), so a multi-turn rollout that straddles a weight sync sends
turn k under `trl-policy-v7` and turn k+1 under `trl-policy-v8`, and that turn belongs on its
conversation's replica (its siblings' turns share the problem's prefix under v8 there too).

- *Where a request goes* (the affinity table, the ring, dealing) is keyed by the model's
  **lineage**: an adapter's name with its version stripped by `Lineages` (the pattern is
  `--lineage-pattern`; the default `(?P<lineage>.+)-v\\d+` matches TRL's `{lora_name}-v{N}`, so
  `trl-policy-v7` -> `trl-policy`). A name the pattern does not match is its own lineage. The
  base model is never an adapter's lineage: base names are seeded in their own domain
  (`model_seed`), lineages in another (`LINEAGE_TAG`), so a base model called `trl-policy` and
  the adapters `trl-policy-vN` never share a key, and two lineages never do either (different
  seeds: their placements meet only where their prompts' hashes do, about 2**-64).
- *What a replica's cache can reuse* is keyed by the full name, as vLLM keys it: `model_seed`
  of the name, the key `prompt_key(model, ...)` builds when given no seed. The router's policy
  places by lineage only and has no other use for the full-name key; the property tests compare
  the two (a version bump changes the cache key, never the placement key).

**A key.** A replica's vLLM caches the KV of a prompt in whole blocks of `block_size` tokens,
each block identified by a hash chained over every block before it and over the adapter that
computed it. A `PromptKey` mirrors that with two kinds of hash, both xxh3-64 under one `seed`
(the lineage's, for placement):

- `full = xxh3(data, seed)`, the whole packed prompt, partial last block included: one C call,
  computed when the key is built. It is all a *sibling* needs (the G samples of a GRPO prompt
  are G identical requests; the affinity table finds an exact prompt by `full` alone), and it
  is the prompt's position on the hash ring. `prefix_hash(level, nbytes)` is the `full` the
  prompt's first `level` blocks plus `nbytes` bytes would have, so "does this prompt start with
  that much of an earlier one?" is answered at any length, not only at block boundaries.
- `chain[i] = xxh3(block i, chain[i - 1])` (`chain[-1]` read as `seed`) identifies the first
  `(i + 1) * block_size` units, so two prompts share `chain[i]` exactly when they share their
  first `i + 1` blocks. It costs one Python-level xxh3 call per block, most of what routing a
  long prompt costs, so it is lazy: computed on first access and cached, and a request routed
  as a sibling never computes it.

**Re-rendered turns and the stem.** TRL re-tokenizes the whole conversation through the chat
template on every turn (`_generate_one`, and the OpenEnv harness's `_sample_turn`). The next
prompt then starts with the previous one's messages, but not always with the previous prompt:
the generation prompt at its end may render differently once the assistant message exists
(Qwen3's empty `<think>` stub is dropped from history), and the completion's ids re-tokenize
differently after it. So a conversation is followed through its earlier prompts' *stems*: a
prompt's stem is the prompt without its last `RERENDER_BYTES` bytes (8 tokens), but never less
than its first block (`stem_bytes`), and a later prompt continues an earlier one when it
starts with that stem (`stem`; the affinity table files anchors by it). Among the earlier prompts
whose stems a prompt starts with, the longest shared block prefix wins: the deepest level of its
chain holding such an anchor. Why not "the longest shared block prefix" with any earlier prompt:
prompts of different problems share a chat template or a system prompt of any length (1,000
tokens in bench/routing.py's `system-1000`), and following that prefix would pile every new
problem onto the template's first replica. A stem is whole but for 8 tokens, so two problems
are conflated only when their prompts differ in nothing but their last 8 tokens (then both go
to one replica, a cache win at worst a family out of balance).

**Bounded cost.** Keying is one C-level xxh3 of the prompt (`full`) plus, only when the table
must be scanned (a prompt that is not a known sibling), one xxh3 per full block (`chain`: 250
calls for 4,000 tokens). The scan (affinity.py) intersects the chain with the table's heads in
C (one set operation, no Python loop over blocks), then hashes at most `PER_HEAD` stems per
matching level and at most `MAX_STEM_CHECKS` in all before it gives up: O(blocks) hashing plus
a constant. tests/routing/test_keys_lineage.py counts the hash calls on 4,000-token prompts.

**One object per request.** `completion_key` turns a validated completion (`body.Completion`,
read through the `Prompt` protocol) into a `RouteKey`, the one thing a policy's `choose` is
given: its `wire` (one xxh3 of a token-id prompt's JSON text, computed at once: all a sibling
needs) and its `key`, the block `PromptKey`, built on first access only (parsing the ids if
validation did not). A policy that stops at the wire key never builds it. The caller drops the
`RouteKey` once a replica is chosen, which frees the prompt's parsed forms (ids, packed bytes,
chain); a retry builds a new one from the request.

How each kind of request is keyed (the HTTP layer, `lora_router/body.py`, extracts the prompt
and validates it; this module only hashes):

- token ids (`prompt: [int, ...]`, TRL's case): packed as little-endian uint32 and cut into
  blocks of `block_size` tokens (`prompt_key`; an `array('I')` from validation is used as is);
- text (`prompt: "..."`): its UTF-8 bytes cut into blocks of 64 bytes, about 16 tokens
  (`text_key`); the router does not tokenize, so a text prompt and the same prompt as token ids
  are different keys;
- chat (`messages: [...]`): each message serialized compactly by orjson with sorted keys, the
  results concatenated (body.py does it while validating) and keyed as text. A later turn of
  a conversation repeats the earlier messages byte for byte, so its key extends the earlier
  one; serializing the list as a whole would not (the closing bracket moves);
- a batch (`prompt: [[int, ...], ...]` or `["...", ...]`): one upstream request, forwarded byte
  for byte, so it is routed as a whole and keyed by its first prompt (the samples of a GRPO
  batch share a prompt; splitting would mean rewriting bodies and merging responses);
- anything else (e.g. `prompt_embeds`): no key; the policy then balances by load alone.

Every hash is xxh3-64 with fixed seeds, never Python's `hash()` (salted per process): two router
processes compute the same keys, which is what lets them agree on placements without talking.
Token keys, text keys and wire keys have separate seed domains and cannot alias each other.
`full` does not depend on the block size: keys compared with each other (one router's, one
affinity table's) all use the same one.

This module must never do I/O, log, or validate requests (the HTTP layer validates; a key is a
pure function of its inputs). It is on the hot path: no per-token Python work beyond packing,
no per-block Python work until the chain is asked for, and a model's seeds are one dict lookup
(`Lineages.seeds`, cached per name).
"""

from __future__ import annotations

import re
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple, Protocol

import msgspec
from xxhash import xxh3_64_intdigest

# Seed domains (ASCII tags): the same bytes keyed as tokens and as text never collide.
TOKEN_SEED = int.from_bytes(b"lr-token", "big")
TEXT_SEED = int.from_bytes(b"lr-text\0", "big")
WIRE_SEED = int.from_bytes(b"lr-wire\0", "big")
# XORed into a domain seed for lineages, so that no base model name keys like an adapter lineage.
LINEAGE_TAG = int.from_bytes(b"lineage\0", "big")

# TRL's adapter names: `{lora_name}-v{N}` (async_rollout_worker.py, `_request_model`).
DEFAULT_LINEAGE_PATTERN = r"(?P<lineage>.+)-v\d+"
# What a re-rendered turn may change at the end of the previous prompt (module docstring): 8
# tokens of ids, or 32 bytes of text (about 8 tokens). Qwen3's empty think stub is 4 tokens.
RERENDER_BYTES = 32
TEXT_BYTES_PER_TOKEN = 4  # for in-flight accounting of text prompts, which are not tokenized
_MAX_NAMES = 4096  # model names whose seeds are cached (TRL uses a handful at a time)

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

    Built by `prompt_key` and `text_key`. `data` and `block_bytes` are kept so
    that the chain can be computed when first asked for and so that the affinity table can ask
    "does this prompt start with that earlier one?" at any length (`prefix_hash`). Two keys are
    equal when they key the same units under the same seed and block size.
    """

    data: bytes  # the packed units
    seed: int  # the lineage's (or model's) seed: the head of level 0, the seed of every `full`
    block_bytes: int
    length: int  # in units: tokens for token prompts, bytes for text and chat
    tokens: int = 0  # prompt tokens (text: bytes / TEXT_BYTES_PER_TOKEN), for load accounting
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

    @property
    def stem_bytes(self) -> int:
        """The length of the prompt's stem (module docstring): all but its last
        `RERENDER_BYTES`, but never less than one block (or the whole prompt, if shorter), so
        that no stem is a template's first few tokens. Never shorter for a longer prompt."""
        size = len(self.data)
        return max(size - RERENDER_BYTES, min(size, self.block_bytes))

    def stem(self) -> tuple[int, int, int]:
        """(level, tail bytes, hash) of the stem: its full blocks, the bytes after them, and
        `prefix_hash(level, tail)`, which a later prompt starting with the stem reproduces."""
        size = self.stem_bytes
        level, tail = divmod(size, self.block_bytes)
        stem = (
            self.full if size == len(self.data) else xxh3_64_intdigest(self.data[:size], self.seed)
        )
        return level, tail, stem


def model_seed(model: str | None, domain: int = TOKEN_SEED) -> int:
    """The seed of a model's keys (`full` and `chain`); `None` (the base model) is the
    domain seed itself."""
    if model is None:
        return domain
    return xxh3_64_intdigest(model.encode("utf-8", "surrogatepass"), domain)


class Seeds(NamedTuple):
    """The seeds of one model name's placement keys, one per domain."""

    token: int
    text: int
    wire: int


class Lineages:
    """Where a request goes: the placement seeds of a model name (module docstring).

    `pattern` is a regular expression with a `lineage` group, matched against the whole name;
    a match's group is the lineage, any other name is its own. Seeds are cached per (name,
    adapter): one dict lookup per request, the cache cleared when `_MAX_NAMES` names were seen
    (names reach here only once the fence has admitted them).
    """

    __slots__ = ("_regex", "_seeds", "pattern")

    def __init__(self, pattern: str = DEFAULT_LINEAGE_PATTERN) -> None:
        try:
            regex = re.compile(pattern, re.DOTALL)  # `.` is any character of a name
        except re.error as exc:
            raise ValueError(
                f"the lineage pattern {pattern!r} is not a regular expression: {exc}"
            ) from None
        if "lineage" not in regex.groupindex:
            raise ValueError(
                f"the lineage pattern {pattern!r} needs a (?P<lineage>...) group, "
                "e.g. (?P<lineage>.+)-v\\d+"
            )
        self.pattern = pattern
        self._regex = regex
        self._seeds: dict[tuple[str | None, bool], Seeds] = {}

    def lineage(self, model: str) -> str:
        """An adapter name's lineage: the pattern's group, or the name itself."""
        found = self._regex.fullmatch(model)
        return found.group("lineage") if found and found.group("lineage") else model

    def seeds(self, model: str | None, adapter: bool) -> Seeds:
        """The placement seeds of a request naming `model`: its lineage's for an adapter, the
        name's own (the cache key's, `model_seed`) for a base model or None."""
        known = self._seeds.get((model, adapter))
        if known is not None:
            return known
        if adapter and model is not None:
            name: str | None = self.lineage(model)
            tag = LINEAGE_TAG
        else:
            name, tag = model, 0
        seeds = Seeds(
            model_seed(name, TOKEN_SEED ^ tag),
            model_seed(name, TEXT_SEED ^ tag),
            model_seed(name, WIRE_SEED ^ tag),
        )
        if len(self._seeds) >= _MAX_NAMES:
            self._seeds.clear()
        self._seeds[model, adapter] = seeds
        return seeds


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
    model: str | None,
    tokens: Sequence[int],
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    seed: int | None = None,
) -> PromptKey:
    """Key a token-id prompt: a list of ints, or the `array('I')` validation already packed.

    `seed` is the placement seed (`Lineages.seeds(...).token`); without it the key is seeded by
    the full model name, as the replica's cache keys it. Ids must fit in uint32 (validation is
    upstream; packing a list raises OverflowError or TypeError otherwise)."""
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
    if seed is None:
        seed = model_seed(model)
    return PromptKey(data, seed, block_size * _TOKEN_BYTES, len(packed), len(packed))


def wire_key(model: str | None, raw: bytes, *, seed: int | None = None) -> int:
    """The identity of a token-id prompt as the client wrote it on the wire (its JSON text).

    The G samples of a GRPO prompt are separate requests from one client, so their prompts are
    the same bytes: a sibling is recognised by this one hash, before (and instead of) parsing
    its ids and building its block chain. Two spellings of one prompt get different wire keys;
    the policy then falls back to `prompt_key`. `seed`: as for `prompt_key` (`Seeds.wire`).
    """
    return xxh3_64_intdigest(raw, model_seed(model, WIRE_SEED) if seed is None else seed)


def text_key(
    model: str | None,
    data: bytes,
    block_bytes: int = TEXT_BLOCK_BYTES,
    *,
    seed: int | None = None,
) -> PromptKey:
    """Key a text prompt given as its UTF-8 bytes; `seed` as for `prompt_key` (`Seeds.text`)."""
    if seed is None:
        seed = model_seed(model, TEXT_SEED)
    size = len(data)
    return PromptKey(bytes(data), seed, block_bytes, size, size // TEXT_BYTES_PER_TOKEN)


class RouteKey(msgspec.Struct):
    """What a policy is given for one request (module docstring): the prompt's `wire` key, if
    it has one, and its block `key`, built by `_build` on first access, then cached.

    Building is deferred so that a request routed by its wire key alone (a sibling) never
    parses ids or packs blocks. The builder is dropped once it ran, so that what it read (the
    completion) goes as soon as the key exists; the key goes with this object. A msgspec
    Struct rather than a plain class: built in C, with no Python `__init__` frame, once per
    request (`RouteKey(build, wire)`; `_key` is never passed).
    """

    _build: Callable[[], PromptKey | None] | None
    wire: int | None = None  # `wire_key` of a token-id prompt's JSON text, or None
    _key: PromptKey | None = None

    @property
    def key(self) -> PromptKey | None:
        """The prompt's block key (None: a prompt without one, e.g. `prompt_embeds`)."""
        build = self._build
        if build is not None:
            self._key = build()
            self._build = None
        return self._key


class Prompt(Protocol):
    """What `completion_key` reads of a validated completion (`body.Completion`)."""

    @property
    def raw_tokens(self) -> bytes | None:
        """A flat token-id prompt as the client wrote it, validated."""
        ...

    @property
    def text(self) -> bytes | None:
        """A text prompt, or chat messages in their prefix-stable encoding."""
        ...

    def token_ids(self) -> Sequence[int] | None:
        """The (first) token-id prompt's ids; cannot fail once validated."""
        ...


def completion_key(prompt: Prompt, seeds: Seeds, block_size: int) -> RouteKey:
    """The `RouteKey` of a validated completion under its placement `seeds`
    (`Lineages.seeds`): the wire key now (one C call), the block key when first needed."""
    raw = prompt.raw_tokens
    wire = None if raw is None else xxh3_64_intdigest(raw, seeds.wire)
    return RouteKey(partial(_block_key, prompt, seeds, block_size), wire)


def _block_key(prompt: Prompt, seeds: Seeds, block_size: int) -> PromptKey | None:
    tokens = prompt.token_ids()
    if tokens is not None:
        return prompt_key(None, tokens, block_size, seed=seeds.token)
    if prompt.text is not None:
        return text_key(None, prompt.text, seed=seeds.text)
    return None
