"""A consistent-hash ring of replica names (the shape of groupcache's `consistenthash`).

Each replica owns `vnodes` points on a 64-bit ring, placed by xxh3 of its name with a fixed
seed, so every router process given the same names builds the same ring. A key is served by
the first point at or after it; `walk` goes on from there and yields each replica once, which
is the order in which bounded-load routing tries them. For "which of these few names comes
first from here?" (dealing's ties) `first_of` answers without walking the ring: one bisection
in each name's own points, or a walk of about n / k points when the k names are many.
Removing a replica moves only the arcs that ended at its points, and with many points per
replica those arcs are spread over all the survivors rather than handed to one neighbour.
`with_members` builds the ring of a changed membership from this one: the names it keeps keep
their points, only the new names are hashed, and their points are merged into the sorted ring
(O(N + k vnodes log N), N the ring's points, k the new names), so a ring followed through many
single joins is never rebuilt from scratch; it equals the ring built from the names.

Pure: no I/O, no clock, no randomness, no knowledge of load or health (the policy filters).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Iterable, Iterator

from xxhash import xxh3_64_intdigest

RING_SEED = int.from_bytes(b"lr-ring\0", "big")
DEFAULT_VNODES = 160
_TURN = 1 << 64  # the ring's circumference
_WALK_PER_BISECT = 5  # `first_of`: steps of the ring walk one name's bisection costs


def point(name: str, index: int) -> int:
    """Where virtual node `index` of replica `name` sits on the ring."""
    return xxh3_64_intdigest(f"{name}#{index}".encode(), RING_SEED)


class HashRing:
    """Replica names on a ring; immutable once built (membership changes build a new one)."""

    __slots__ = ("_names", "_own", "_owners", "_points", "vnodes")

    def __init__(self, names: Iterable[str] = (), vnodes: int = DEFAULT_VNODES) -> None:
        if vnodes < 1:
            raise ValueError("vnodes must be at least 1")
        self.vnodes = vnodes
        self._names = frozenset(names)
        self._own: dict[str, list[int]] = {}
        self._points: list[int] = []
        self._owners: list[str] = []
        self._place([], self._names)

    def _place(self, kept: list[tuple[int, str]], new: Iterable[str]) -> None:
        """Fill the ring from `kept`, sorted (point, name) pairs of members already placed,
        and the `new` names, hashed here. Sorting on (point, name) makes the ring independent
        of the order names were given, even in the (2^-64) case of two names landing on one
        point; `kept` and the new points are two sorted runs, which the sort merges."""
        added = sorted((point(name, i), name) for name in new for i in range(self.vnodes))
        for p, name in added:  # each member's own points, sorted: where it first appears
            self._own.setdefault(name, []).append(p)
        placed = kept + added if kept else added
        placed.sort()
        self._points = [p for p, _ in placed]
        self._owners = [name for _, name in placed]

    def with_members(self, names: Iterable[str]) -> HashRing:
        """The ring of `names` (module docstring): this ring's points for the names it keeps."""
        wanted = frozenset(names)
        if wanted == self._names:
            return self
        ring = HashRing((), self.vnodes)
        ring._names = wanted
        ring._own = {name: own for name, own in self._own.items() if name in wanted}
        pairs = zip(self._points, self._owners, strict=True)
        if len(ring._own) == len(self._names):
            kept = list(pairs)
        else:
            kept = [(p, name) for p, name in pairs if name in wanted]
        ring._place(kept, wanted - self._names)
        return ring

    @property
    def names(self) -> frozenset[str]:
        return self._names

    def __len__(self) -> int:
        return len(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def walk(self, key: int) -> Iterator[str]:
        """Every member once, in ring order from the first point at or after `key`."""
        owners = self._owners
        n = len(owners)
        if not n:
            return
        wanted = len(self._names)
        seen: set[str] = set()
        i = bisect_left(self._points, key)
        for step in range(n):
            name = owners[(i + step) % n]
            if name not in seen:
                seen.add(name)
                yield name
                if len(seen) == wanted:
                    return

    def first_of(self, key: int, names: Collection[str]) -> str | None:
        """The first of `names` (members) in ring order from `key`, as `walk` would meet them;
        None if none is a member.

        O(k log vnodes) by bisecting each name's own points when k * k * _WALK_PER_BISECT <= n
        (few names), else a walk over the ring's points that stops at the first of them: about
        n / k points, as a member's points are spread evenly. Either way O(sqrt(n) log vnodes)
        at most. A bisection (about 0.55 µs) costs about as much as `_WALK_PER_BISECT` steps of
        the walk, which start from one bisection of the whole ring (about 1.2 µs with the
        call); the threshold takes whichever is cheaper (at 128 members: bisect up to 5 names,
        walk from 6, where bisecting 6 to 11 names cost 3.4-8.6 µs, walking them 1.7-2.0)."""
        k = len(names)
        if k == 1:  # the usual case: a rank held by one replica
            for name in names:
                return name if name in self._names else None
        if k * k * _WALK_PER_BISECT <= len(self._names):
            best: tuple[int, str] | None = None
            for name in names:
                own = self._own.get(name)
                if own is None:
                    continue
                i = bisect_left(own, key)
                # Distance along the ring; past the last point it wraps to the first.
                ahead = own[i] - key if i < len(own) else own[0] + _TURN - key
                if best is None or (ahead, name) < best:
                    best = (ahead, name)
            return None if best is None else best[1]
        owners = self._owners
        i = bisect_left(self._points, key)
        for j in range(i, len(owners)):
            if owners[j] in names:
                return owners[j]
        for j in range(i):  # wrapped past the last point
            if owners[j] in names:
                return owners[j]
        return None
