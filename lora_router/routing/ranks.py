"""The dealing ranks: the members of the ring ordered for a new family, kept, never recomputed.

A member's rank is (families dealt, requests in flight, prompt tokens in flight); a new family
goes to the lowest rank with room (`policy.PrefixAffinity._deal`). `Ranks` keeps names grouped
by equal rank and, per count of families dealt, a heap of that count's distinct ranks.

Invariants:
- every member is filed under exactly one rank (`rank[name]`), and `groups[rank]` holds exactly
  the members filed under it; a group never stays empty;
- every live rank is in the heap of its count once (`queued`); a heap may also hold stale
  ranks whose group emptied (lazy deletion): they are dropped when they surface (`first`) or
  when the heap is compacted;
- `counts` lists, ascending, the counts that have a heap; a heap found empty is forgotten with
  its count.

Cost, g the distinct ranks (at most the members): `file` O(log g), amortized with the
compaction, which runs when a count's heap holds more than twice its live ranks plus 32 and
costs O(g); `first` O(log g) per rank it passes over.

Never: knows load caps, ring order or which members are routable (the caller's `pick` and
`cap` decide), and never reorders members of one rank (ties are the caller's: ring order).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Callable
from heapq import heapify, heappop, heappush
from typing import TypeVar

Rank = tuple[int, int, int]  # (families dealt, requests in flight, prompt tokens in flight)
T = TypeVar("T")


class Ranks:
    """The members by dealing rank (module docstring)."""

    __slots__ = ("counts", "groups", "heaps", "queued", "rank")

    def __init__(self) -> None:
        self.rank: dict[str, Rank] = {}  # member -> its rank now
        self.groups: dict[Rank, set[str]] = {}  # rank -> its members
        self.heaps: dict[int, list[Rank]] = {}  # dealt -> ranks, some stale
        self.counts: list[int] = []  # the keys of `heaps`, ascending
        self.queued: set[Rank] = set()  # the ranks in the heaps, once each

    def file(self, name: str, rank: Rank) -> None:
        """File member `name` under `rank` (its old rank, if any, forgotten): O(log g)."""
        old = self.rank.get(name)
        if old == rank:
            return
        groups = self.groups
        if old is not None:
            group = groups[old]
            group.discard(name)
            if not group:
                del groups[old]
        self.rank[name] = rank
        joined = groups.get(rank)
        if joined is not None:
            joined.add(name)
            return
        groups[rank] = {name}
        if rank in self.queued:
            return
        self.queued.add(rank)
        heap = self.heaps.get(rank[0])
        if heap is None:
            heap = self.heaps[rank[0]] = []
            insort(self.counts, rank[0])
        heappush(heap, rank)
        if len(heap) > 2 * len(groups) + 32:
            for queued in heap:
                if queued not in groups:
                    self.queued.discard(queued)
            heap[:] = [queued for queued in heap if queued in groups]
            heapify(heap)

    def first(self, dealt: int, cap: int, pick: Callable[[set[str]], T | None]) -> T | None:
        """What `pick` finds in the lowest rank among those dealt `dealt` families that has
        room (requests in flight below `cap`) and a member `pick` accepts: the heap of that
        count is read in order, stale ranks dropped, ranks `pick` refuses passed over and
        pushed back; a rank without room ends the read (the count's later ranks have none
        either). A heap left empty is forgotten with its count."""
        heap, groups = self.heaps[dealt], self.groups
        passed: list[Rank] = []
        found: T | None = None
        while heap:
            rank = heap[0]
            group = groups.get(rank)
            if group is None:  # stale: its members moved on
                heappop(heap)
                self.queued.discard(rank)
                continue
            if rank[1] >= cap:  # this count's later ranks have no room either
                break
            found = pick(group)
            if found is not None:
                break
            passed.append(heappop(heap))
        for rank in passed:
            heappush(heap, rank)
        if not heap:
            del self.heaps[dealt]
            self.counts.pop(bisect_left(self.counts, dealt))
        return found
