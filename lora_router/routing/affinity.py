"""The affinity table: which replica each recent prompt was sent to, and prefix lookup by stems.

An *anchor* says "this exact prompt went to replica R". It holds the prompt's `full` hash (the
whole prompt under its lineage's seed, see `keys`) and its *stem* (the prompt without its last
`keys.RERENDER_BYTES`: what a re-rendered next turn still starts with), and it is filed twice:

- under its `full`, in the exact index (`full -> head`): the commonest lookup, a *sibling* (the
  G samples of a GRPO prompt are G identical requests), is one dict lookup on a hash the key
  computed when it was built, and never needs the key's chain;
- under its *head*, the chain value of the stem's last full block (the lineage seed when it has
  none). A later prompt Q starts with an earlier prompt P's stem exactly when Q's first
  `level * block + tail` bytes hash to P's stem hash; at that length Q's chain has P's head. So
  `find` intersects Q's chain with the heads that hold anchors, and hashes one prefix of Q per
  anchor there (`PromptKey.prefix_hash`), deepest level first: of the earlier prompts whose
  stems Q starts with, the one sharing the longest block prefix with Q comes first. That follows
  a conversation whether its turns were appended or re-rendered through a chat template, and
  never matches prompts that merely share a chat template or a system prompt (neither starts
  with the other's stem, see `keys`).

Bounded cost: the chain is O(blocks) xxh3 calls (`keys`); the intersection is one set operation
in C; then at most `PER_HEAD` stems per matching level and `MAX_STEM_CHECKS` in all are hashed,
whatever the table holds.

A 64-bit `full` names an exact prompt under one lineage; two different prompts colliding would
only make one be routed as the other's sibling (about one lookup in 2**64 / capacity).

Memory is bounded: at most `capacity` anchors, least recently used head evicted first with all
its anchors (a lookup that matches refreshes its head), and at most `PER_HEAD` anchors under one
head (only prompts that differ within their last block and a half share a head). The exact
index holds one entry per anchor, the wire index one per anchor with a wire key (`link`: the
JSON text of a token-id prompt, by which `sibling` finds it without a key), and every eviction
removes from all three. Nothing here knows about load or health.

An anchor costs about 510 bytes at capacity and 710 once the table evicts, flat from then on
(docs/design/routing.md#stems).

Must never: do I/O, log, hold more than `capacity` anchors, hash anything itself (all hashing is
defined in `keys`: `PromptKey.full`, `.chain`, `.prefix_hash` and `.stem`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from .keys import PromptKey

PER_HEAD = 32
# Stems hashed by one `find`, at most: a prompt matching more anchors than this is routed by the
# longest ones, which come first.
MAX_STEM_CHECKS = 64

# An anchor is (replica, meta, wire, full): the replica name (shared by every anchor on it), the
# prompt's `wire` key (None if it has none), its `full`, and `meta`, one int packing what `find`
# and a sibling by its wire key read of it (four int objects would cost 32-40 bytes each):
#   bits 0-38 the prompt's tokens, bit 39 set on a new family's first prompt (`record`'s
#   `first`), 40-103 the stem hash, 104-143 its bytes, 144- the stem's tail bytes,
# so that `meta >> _ORDER` orders anchors as (stem tail, prompt bytes) do: longest stem first,
# then the longer prompt. A body's size is capped far below 2**40 bytes (`--max-body-bytes`).
# One anchor under a head is stored bare, several as a list (least recently used first): most
# heads have one, and a bare tuple is the smaller record.
Anchor = tuple[str, int, int | None, int]
_HASH = (1 << 64) - 1
_TOKENS = (1 << 39) - 1  # tokens are fewer than a token-id body's bytes / 2, below 2**39
_FIRST = 1 << 39
_STEM, _ORDER, _TAIL = 40, 104, 144


def _order(anchor: Anchor) -> int:
    return anchor[1] >> _ORDER


def anchor_tokens(anchor: Anchor) -> int:
    """The prompt tokens of an anchor's prompt."""
    return anchor[1] & _TOKENS


def anchor_first(anchor: Anchor) -> bool:
    """Whether the anchor's prompt was recorded as a new family's first prompt (`record`'s
    `first`): a later prompt that extends it is a first later turn of that family."""
    return bool(anchor[1] & _FIRST)


class AffinityTable:
    """An LRU map from prompts to the replica they were placed on, with prefix lookup."""

    __slots__ = ("_exact", "_heads", "_per_head", "_wires", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("the affinity table needs a capacity of at least 1")
        self.capacity = capacity
        # Never more under one head than the whole table holds, so that evicting the least
        # recently used heads always stops before the head just written.
        self._per_head = min(PER_HEAD, capacity)
        # head -> its anchors, least recently used head first.
        self._heads: OrderedDict[int, Anchor | list[Anchor]] = OrderedDict()
        # full -> the head its anchor is filed under: exactly one entry per anchor.
        self._exact: dict[int, int] = {}
        # wire -> the head of the one anchor holding that wire key: one entry per anchor that
        # has one.
        self._wires: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._exact)

    def home(self, key: PromptKey) -> str | None:
        """Where this exact prompt was placed, if the table remembers. Needs no chain."""
        full = key.full
        head = self._exact.get(full)
        if head is None:
            return None
        for replica, _, _, anchored in _anchors(self._heads.get(head)):
            if anchored == full:
                return replica
        return None

    def sibling(self, wire: int) -> Anchor | None:
        """The anchor of the prompt whose wire key is `wire` (its replica: `[0]`, its
        tokens: `anchor_tokens`), marked as just used; None if the table holds no such anchor.
        Needs no key at all: O(1), plus a scan of its head's anchors (at most `PER_HEAD`) when
        it shares its head."""
        head = self._wires.get(wire)
        if head is None:
            return None
        heads = self._heads
        heads.move_to_end(head)
        entry = heads[head]
        if isinstance(entry, tuple):  # the head's one anchor is the one with this wire key
            return entry
        for i, anchor in enumerate(entry):
            if anchor[2] == wire:
                entry.append(entry.pop(i))
                return anchor
        raise AssertionError("the wire index names a head without its anchor")

    def link(self, key: PromptKey, wire: int) -> None:
        """File `wire` (the prompt's wire key) with the anchor of `key`, if the table holds
        one: `sibling(wire)` finds it from then on, until the anchor is evicted. A wire key
        names one anchor and an anchor keeps one wire key, its latest: linking either anew
        unlinks what it was linked to. Needs no chain."""
        full = key.full
        head = self._exact.get(full)
        if head is None:
            return
        wires = self._wires
        held = wires.get(wire)
        if held is not None:
            if held == head and any(
                a[3] == full and a[2] == wire for a in _anchors(self._heads[head])
            ):
                return  # already linked: the usual case for a prompt seen before
            self._rewire(held, 2, wire, None)
        old = self._rewire(head, 3, full, wire)
        if old is not None:
            del wires[old]
        wires[wire] = head

    def find(self, key: PromptKey) -> Iterator[tuple[Anchor, bool]]:
        """Anchors of earlier prompts whose stems `key` starts with, longest shared block
        prefix first, as (anchor, exact) pairs (the replica is `anchor[0]`); `exact` means the
        earlier prompt is this very prompt.

        The exact match comes first and costs no chain: a caller that stops there (a sibling
        placed on its home) never computes it."""
        full = key.full
        head = self._exact.get(full)
        if head is not None:
            anchor = self._touch(head, full)
            if anchor is not None:
                yield anchor, True
        heads = self._heads
        chain = key.chain
        # Most levels of a prompt head no anchor; a set intersection (in C) finds the few that
        # do, instead of a Python loop over every block.
        shared = heads.keys() & chain  # empty for most new prompts: then nothing to sort
        levels = sorted((chain.index(h) + 1 for h in shared), reverse=True) if shared else []
        if key.seed in heads:
            levels.append(0)
        size = len(key.data)
        checks = MAX_STEM_CHECKS
        for level in levels:
            head = key.head(level)
            room = size - level * key.block_bytes
            # Longest stem first; this very prompt was looked up above.
            for _, meta, _, anchored in sorted(_anchors(heads.get(head)), key=_order, reverse=True):
                tail = meta >> _TAIL
                if tail > room or anchored == full:
                    continue
                if not checks:
                    return
                checks -= 1
                if key.prefix_hash(level, tail) == meta >> _STEM & _HASH:
                    anchor = self._touch(head, anchored)
                    if anchor is not None:
                        yield anchor, False

    def record(
        self,
        key: PromptKey,
        replica: str,
        *,
        replace: bool = False,
        first: bool = False,
        wire: int | None = None,
    ) -> bool:
        """Remember that `key` went to `replica`. An existing anchor is kept (the first
        placement of a prompt is its home) unless `replace`; either way its head is refreshed.
        Only a new prompt needs the key's chain (for its head). `first` marks a new prompt as
        a new family's first prompt (`anchor_first`). A new anchor is filed with `wire`, as
        `link(key, wire)` would after, if no anchor holds that wire key; returns whether."""
        heads = self._heads
        exact = self._exact
        full = key.full
        head = exact.get(full)
        if head is not None:
            heads.move_to_end(head)
            if replace:
                known = heads[head]
                if isinstance(known, tuple):
                    heads[head] = (replica, *known[1:])
                else:
                    i = [a[3] for a in known].index(full)
                    known[i] = (replica, *known[i][1:])
            return False
        level, tail, stem = key.stem()
        head = key.head(level)
        low = (key.tokens & _TOKENS | _FIRST) if first else key.tokens & _TOKENS
        meta = ((tail << 40 | len(key.data)) << 64 | stem) << 40 | low
        linked = wire is not None and wire not in self._wires
        anchor = (replica, meta, wire if linked else None, full)
        entry = heads.get(head)
        if entry is None:
            heads[head] = anchor
        else:
            heads.move_to_end(head)
            group = [entry] if isinstance(entry, tuple) else entry
            group.append(anchor)
            if len(group) > self._per_head:
                self._forget(group.pop(0))
            heads[head] = group if len(group) > 1 else anchor
        exact[full] = head
        if linked and wire is not None:
            self._wires[wire] = head
        while len(exact) > self.capacity:
            _, old = heads.popitem(last=False)
            for evicted in _anchors(old):
                self._forget(evicted)
        return linked

    def _forget(self, anchor: Anchor) -> None:
        """Take an evicted anchor out of the exact and wire indexes."""
        del self._exact[anchor[3]]
        if anchor[2] is not None:
            del self._wires[anchor[2]]

    def _rewire(self, head: int, field: int, match: int, wire: int | None) -> int | None:
        """Give the anchor under `head` whose `field` (3: full, 2: wire key) is `match` the
        wire key `wire`; returns the wire key it had."""
        heads = self._heads
        entry = heads[head]
        group = [entry] if isinstance(entry, tuple) else entry
        for i, a in enumerate(group):
            if a[field] == match:
                if a[2] != wire:
                    group[i] = (a[0], a[1], wire, a[3])
                    if isinstance(entry, tuple):
                        heads[head] = group[0]
                return a[2]
        raise AssertionError("an index names a head without its anchor")

    def _touch(self, head: int, full: int) -> Anchor | None:
        """The anchor (head, full), marked as just used; None if absent."""
        entry = self._heads.get(head)
        if entry is None:
            return None
        if isinstance(entry, tuple):
            if entry[3] != full:
                return None
            self._heads.move_to_end(head)
            return entry
        for i, anchor in enumerate(entry):
            if anchor[3] == full:
                entry.append(entry.pop(i))
                self._heads.move_to_end(head)
                return anchor
        return None


def _anchors(entry: Anchor | list[Anchor] | None) -> list[Anchor]:
    if entry is None:
        return []
    return [entry] if isinstance(entry, tuple) else entry
