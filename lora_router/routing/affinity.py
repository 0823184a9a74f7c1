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
index holds one entry per anchor, and every eviction removes from both. Nothing here knows about
load or health.

Must never: do I/O, log, hold more than `capacity` anchors, hash anything itself (all hashing is
defined in `keys`: `PromptKey.full`, `.chain`, `.prefix_hash` and `.stem`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from operator import itemgetter

from .keys import PromptKey

PER_HEAD = 32
# Stems hashed by one `find`, at most: a prompt matching more anchors than this is routed by the
# longest ones, which come first.
MAX_STEM_CHECKS = 64

# (replica, stem tail bytes, stem hash, full, prompt bytes). One anchor under a head is stored
# bare, several as a list (least recently used first): most heads have one, and a bare tuple is
# the smaller record. Prompts with one stem are tried longest first.
Anchor = tuple[str, int, int, int, int]
_by_length = itemgetter(1, 4)


class AffinityTable:
    """An LRU map from prompts to the replica they were placed on, with prefix lookup."""

    __slots__ = ("_exact", "_heads", "_per_head", "capacity")

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

    def __len__(self) -> int:
        return len(self._exact)

    def home(self, key: PromptKey) -> str | None:
        """Where this exact prompt was placed, if the table remembers. Needs no chain."""
        full = key.full
        head = self._exact.get(full)
        if head is None:
            return None
        for replica, _, _, anchored, _ in _anchors(self._heads.get(head)):
            if anchored == full:
                return replica
        return None

    def find(self, key: PromptKey) -> Iterator[tuple[str, bool]]:
        """Replicas of earlier prompts whose stems `key` starts with, longest shared block
        prefix first, as (replica, exact) pairs; `exact` means the earlier prompt is this very
        prompt.

        The exact match comes first and costs no chain: a caller that stops there (a sibling
        placed on its home) never computes it."""
        full = key.full
        head = self._exact.get(full)
        if head is not None:
            replica = self._touch(head, full)
            if replica is not None:
                yield replica, True
        heads = self._heads
        chain = key.chain
        # Most levels of a prompt head no anchor; a set intersection (in C) finds the few that
        # do, instead of a Python loop over every block.
        levels = sorted((chain.index(h) + 1 for h in heads.keys() & chain), reverse=True)
        if key.seed in heads:
            levels.append(0)
        size = len(key.data)
        checks = MAX_STEM_CHECKS
        for level in levels:
            head = key.head(level)
            room = size - level * key.block_bytes
            # Longest stem first; this very prompt was looked up above.
            for _, tail, stem, anchored, _ in sorted(
                _anchors(heads.get(head)), key=_by_length, reverse=True
            ):
                if tail > room or anchored == full:
                    continue
                if not checks:
                    return
                checks -= 1
                if key.prefix_hash(level, tail) == stem:
                    replica = self._touch(head, anchored)
                    if replica is not None:
                        yield replica, False

    def record(self, key: PromptKey, replica: str, *, replace: bool = False) -> None:
        """Remember that `key` went to `replica`. An existing anchor is kept (the first
        placement of a prompt is its home) unless `replace`; either way its head is refreshed.
        Only a new prompt needs the key's chain (for its head)."""
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
            return
        level, tail, stem = key.stem()
        head = key.head(level)
        anchor = (replica, tail, stem, full, len(key.data))
        entry = heads.get(head)
        if entry is None:
            heads[head] = anchor
        else:
            heads.move_to_end(head)
            group = [entry] if isinstance(entry, tuple) else entry
            group.append(anchor)
            if len(group) > self._per_head:
                del exact[group.pop(0)[3]]
            heads[head] = group if len(group) > 1 else anchor
        exact[full] = head
        while len(exact) > self.capacity:
            _, old = heads.popitem(last=False)
            for evicted in _anchors(old):
                del exact[evicted[3]]

    def _touch(self, head: int, full: int) -> str | None:
        """The replica of the anchor (head, full), marked as just used; None if absent."""
        entry = self._heads.get(head)
        if entry is None:
            return None
        if isinstance(entry, tuple):
            if entry[3] != full:
                return None
            self._heads.move_to_end(head)
            return entry[0]
        for i, anchor in enumerate(entry):
            if anchor[3] == full:
                entry.append(entry.pop(i))
                self._heads.move_to_end(head)
                return anchor[0]
        return None


def _anchors(entry: Anchor | list[Anchor] | None) -> list[Anchor]:
    if entry is None:
        return []
    return [entry] if isinstance(entry, tuple) else entry
