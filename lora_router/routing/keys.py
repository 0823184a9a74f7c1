"""Routing keys: what a prompt looks like to the prefix caches of the replicas, and to placement.

Rules (docs/design/routing.md#lineage-keys and #stems give the reasons):
- *Two keys, two names.* Where a request goes is keyed by the model's **lineage** (`Lineages`:
  `--lineage-pattern`, default TRL's `{lora_name}-v{N}`, so `trl-policy-v7` -> `trl-policy`; a
  name it does not match is its own lineage); what a replica's cache can reuse, by the full
  name, as vLLM keys it (`model_seed` of the name). Base names (`model_seed`) and lineages
  (`LINEAGE_TAG`) are seeded in separate domains: the base model is never an adapter's lineage.
- *A key* (`PromptKey`, xxh3-64 under one `seed`): `full`, the whole packed prompt in one C
  call, is all a sibling needs and the prompt's ring position; `chain[i] = xxh3(block i,
  chain[i - 1])` identifies its first `i + 1` blocks, as vLLM's prefix-cache keys do, and is
  lazy (computed on first access, cached); `prefix_hash(level, nbytes)` is the `full` of any
  prefix, so "does it start with that much of an earlier prompt?" is answered at any length.
- *The stem*: a prompt without its last `RERENDER_BYTES` (8 tokens), never less than its first
  block (`stem`); a later prompt continues an earlier one when it starts with that stem.
- *One object per request*: `completion_key` makes a `RouteKey` of a validated completion: its
  `wire` (one xxh3 of a token-id prompt's JSON text, at once) and its block `key`, built on first
  access only. The caller drops it once a replica is chosen; a retry builds a new one.
- *How each kind is keyed* (body.py extracts and validates; this module only hashes): token ids
  packed as little-endian uint32 in blocks of `block_size` tokens (`prompt_key`); text as its
  UTF-8 in 64-byte blocks (`text_key`; a text prompt and the same prompt as ids are different
  keys); chat `messages` as the concatenation of each message serialized compactly with sorted
  keys (so a later turn's key extends the earlier one's); a batch by its first prompt (one
  upstream request, forwarded byte for byte); anything else (`prompt_embeds`) has no key.

Invariants: every hash is xxh3-64 with fixed seeds, never Python's salted `hash()`, so two
router processes compute the same keys and agree on placements without talking; token, text
and wire keys have separate seed domains and cannot alias; `full` does not depend on the block
size; a version bump changes the cache key, never the placement key.

Cost: one C-level xxh3 of the prompt (`full`), plus one per full block only when the affinity
table must be scanned (250 calls for 4,000 tokens; tests/routing/test_keys.py counts
them); no per-token Python work beyond packing; a model's seeds are one dict lookup
(`Lineages.seeds`, cached per name).

Never: I/O, logging, validating requests (a key is a pure function of its inputs).
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
        stem = self.full if size == len(self.data) else self.prefix_hash(level, tail)
        return level, tail, stem


def model_seed(model: str | None, domain: int = TOKEN_SEED) -> int:
    """The seed of a model's keys (`full` and `chain`); `None` (the base model) is the
    domain seed itself."""
    if model is None:
        return domain
    return xxh3_64_intdigest(model.encode("utf-8", "surrogatepass"), domain)


class Seeds(NamedTuple):
    """The seeds of one model name's placement keys, one per domain, and the name they are
    seeded by (an adapter's lineage, a base model's own name; "" for none)."""

    token: int
    text: int
    wire: int
    lineage: str = ""


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

    def versioned(self, model: str) -> bool:
        """Whether the pattern matches `model` (a name the trainer may give a version)."""
        return self._regex.fullmatch(model) is not None

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
            name or "",
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
