"""The affinity table: which replica each recent prompt was sent to, and exact-prefix lookup.

An *anchor* says "this exact prompt went to replica R". It is filed under the prompt's *head*
(the chain value of its last full block, or the model seed when it has none) and holds the
length of the prompt's tail past that block and its `full` hash. A later prompt Q starts with
an earlier prompt P exactly when, at P's number of full blocks, Q has the same head and Q's
next `tail` bytes hash (seeded by that head) to P's `full`. So `find` looks up only the levels
of Q's chain that head some anchor, and hashes a few tail slices there. That finds earlier
prompts at any length, not only at block boundaries, and only *whole* earlier prompts: two
prompts that merely share a chat template or a system prompt never match each other, however
long the template, because neither is a prefix of the other.

Memory is bounded: at most `capacity` anchors, least recently used head evicted first (a
lookup that matches refreshes its head), and at most `PER_HEAD` anchors under one head (only
prompts that differ within their last partial block share a head). Nothing here knows about
load or health.

Must never: do I/O, log, hold more than `capacity` anchors, hash anything itself except tail
slices through `PromptKey.prefix_hash` (all hashing is defined in `keys`).
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

    __slots__ = ("_heads", "_per_head", "_size", "capacity")

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError("the affinity table needs a capacity of at least 1")
        self.capacity = capacity
        # Never more under one head than the whole table holds, so that evicting the least
        # recently used heads always stops before the head just written.
        self._per_head = min(PER_HEAD, capacity)
        self._heads: OrderedDict[int, Anchor | list[Anchor]] = OrderedDict()
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def home(self, key: PromptKey) -> str | None:
        """Where this exact prompt was placed, if the table remembers."""
        entry = self._heads.get(key.head(len(key.chain)))
        for replica, _, full in _anchors(entry):
            if full == key.full:
                return replica
        return None

    def find(self, key: PromptKey) -> Iterator[tuple[str, bool]]:
        """Replicas of earlier prompts that `key` starts with, longest prompt first, as
        (replica, exact) pairs; `exact` means the earlier prompt is this very prompt."""
        heads = self._heads
        chain = key.chain
        own = len(chain)
        # The commonest case, a sibling, needs no scan.
        exact = self._touch(key.head(own), key.full)
        if exact is not None:
            yield exact, True
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
            for _, tail, full in sorted(_anchors(heads.get(head)), key=_by_tail, reverse=True):
                if tail < room and key.prefix_hash(level, tail) == full:
                    replica = self._touch(head, full)
                    if replica is not None:
                        yield replica, False

    def record(self, key: PromptKey, replica: str, *, replace: bool = False) -> None:
        """Remember that `key` went to `replica`. An existing anchor is kept (the first
        placement of a prompt is its home) unless `replace`."""
        heads = self._heads
        head = key.head(len(key.chain))
        anchor = (replica, key.tail_bytes, key.full)
        entry = heads.get(head)
        if entry is None:
            heads[head] = anchor
            self._size += 1
        else:
            heads.move_to_end(head)
            group = [entry] if isinstance(entry, tuple) else entry
            for i, (_, _, full) in enumerate(group):
                if full == key.full:
                    if replace:
                        group[i] = anchor
                        heads[head] = group if len(group) > 1 else anchor
                    return
            group.append(anchor)
            self._size += 1
            if len(group) > self._per_head:
                del group[0]
                self._size -= 1
            heads[head] = group if len(group) > 1 else anchor
        while self._size > self.capacity:
            _, old = heads.popitem(last=False)
            self._size -= 1 if isinstance(old, tuple) else len(old)

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
