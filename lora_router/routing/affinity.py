"""The affinity table: which replica each recent prompt was sent to, and exact-prefix lookup.

An *anchor* says "this exact prompt went to replica R". It holds the prompt's `full` hash (the
whole prompt under its model's seed, see `keys`) and the length of its tail past its last full
block, and it is filed twice:

- under its `full`, in the exact index (`full -> head`): the commonest lookup, a *sibling* (the
  G samples of a GRPO prompt are G identical requests), is one dict lookup on a hash the key
  computed when it was built, and never needs the key's chain;
- under its *head*, the chain value of its last full block (the model seed when it has none).
  A later prompt Q starts with an earlier prompt P exactly when Q's first `b + tail` bytes hash
  to P's `full`, `b` being P's full blocks in bytes; at that length Q's chain has P's head. So
  `find` intersects Q's chain with the heads that hold anchors, and hashes one prefix of Q per
  anchor there (`PromptKey.prefix_hash`). That finds earlier prompts at any length, not only at
  block boundaries, and only *whole* earlier prompts: two prompts that merely share a chat
  template or a system prompt never match each other, however long the template, because
  neither is a prefix of the other.

A 64-bit `full` names an exact prompt under one model; two different prompts colliding would
only make one be routed as the other's sibling (about one lookup in 2**64 / capacity).

Memory is bounded: at most `capacity` anchors, least recently used head evicted first with all
its anchors (a lookup that matches refreshes its head), and at most `PER_HEAD` anchors under one
head (only prompts that differ within their last partial block share a head). The exact index
holds one entry per anchor, and every eviction removes from both. Nothing here knows about load
or health.

Must never: do I/O, log, hold more than `capacity` anchors, hash anything itself (all hashing is
defined in `keys`: `PromptKey.full`, `.chain` and `.prefix_hash`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from operator import itemgetter

from .keys import PromptKey

PER_HEAD = 32

# (replica, tail bytes, full). One anchor under a head is stored bare, several as a list
# (least recently used first): most heads have one, and a bare tuple is the smaller record.
Anchor = tuple[str, int, int]
_by_tail = itemgetter(1)


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
        for replica, _, anchored in _anchors(self._heads.get(head)):
            if anchored == full:
                return replica
        return None

    def find(self, key: PromptKey) -> Iterator[tuple[str, bool]]:
        """Replicas of earlier prompts that `key` starts with, longest prompt first, as
        (replica, exact) pairs; `exact` means the earlier prompt is this very prompt.

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
        for level in levels:
            head = key.head(level)
            room = size - level * key.block_bytes
            # Longest tail first; the tail that fills `room` is this prompt, looked up above.
            for _, tail, anchored in sorted(_anchors(heads.get(head)), key=_by_tail, reverse=True):
                if tail < room and key.prefix_hash(level, tail) == anchored:
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
                anchor = (replica, key.tail_bytes, full)
                known = heads[head]
                if isinstance(known, tuple):
                    heads[head] = anchor
                else:
                    known[[a[2] for a in known].index(full)] = anchor
            return
        head = key.head(key.blocks)
        anchor = (replica, key.tail_bytes, full)
        entry = heads.get(head)
        if entry is None:
            heads[head] = anchor
        else:
            heads.move_to_end(head)
            group = [entry] if isinstance(entry, tuple) else entry
            group.append(anchor)
            if len(group) > self._per_head:
                del exact[group.pop(0)[2]]
            heads[head] = group if len(group) > 1 else anchor
        exact[full] = head
        while len(exact) > self.capacity:
            _, old = heads.popitem(last=False)
            for _, _, evicted in _anchors(old):
                del exact[evicted]

    def _touch(self, head: int, full: int) -> str | None:
        """The replica of the anchor (head, full), marked as just used; None if absent."""
        entry = self._heads.get(head)
        if entry is None:
            return None
        if isinstance(entry, tuple):
            if entry[2] != full:
                return None
            self._heads.move_to_end(head)
            return entry[0]
        for i, anchor in enumerate(entry):
            if anchor[2] == full:
                entry.append(entry.pop(i))
                self._heads.move_to_end(head)
                return anchor[0]
        return None


def _anchors(entry: Anchor | list[Anchor] | None) -> list[Anchor]:
    if entry is None:
        return []
    return [entry] if isinstance(entry, tuple) else entry
