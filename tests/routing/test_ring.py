"""The ring: deterministic, and a membership change moves only what it must."""

from __future__ import annotations

import random
from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from lora_router.routing.ring import HashRing

names = st.lists(
    st.integers(1, 65535).map(lambda port: f"http://10.0.0.1:{port}"),
    min_size=2,
    max_size=9,
    unique=True,
)
positions = st.integers(0, 2**64 - 1)

_RNG = random.Random(7)
KEYS = [_RNG.getrandbits(64) for _ in range(4000)]


def owner(ring: HashRing, key: int) -> str | None:
    """The member that serves `key` when every member has room: the first of its walk."""
    return next(ring.walk(key), None)


@given(names, positions)
def test_walk_yields_every_member_once(members, key):
    walked = list(HashRing(members, vnodes=40).walk(key))
    assert sorted(walked) == sorted(members)


@given(names, st.randoms(use_true_random=False), positions)
def test_ring_does_not_depend_on_the_order_of_its_members(members, rnd, key):
    shuffled = list(members)
    rnd.shuffle(shuffled)
    assert list(HashRing(members).walk(key)) == list(HashRing(shuffled).walk(key))


@settings(max_examples=30)
@given(names, st.data())
def test_removing_a_member_moves_only_its_keys(members, data):
    gone = data.draw(st.sampled_from(members))
    before = HashRing(members)
    after = HashRing([m for m in members if m != gone])
    for key in KEYS[:1000]:
        if owner(before, key) != gone:
            assert owner(after, key) == owner(before, key)


@settings(max_examples=20)
@given(names.filter(lambda m: len(m) >= 4), st.data())
def test_a_removed_members_keys_spread_over_the_survivors(members, data):
    gone = data.draw(st.sampled_from(members))
    before = HashRing(members)
    after = HashRing([m for m in members if m != gone])
    moved = Counter(owner(after, k) for k in KEYS if owner(before, k) == gone)
    survivors = len(members) - 1
    # Every survivor takes some, none takes the lot: no hotspot next to the dead replica.
    assert len(moved) == survivors
    assert max(moved.values()) <= 2.5 * sum(moved.values()) / survivors


@settings(max_examples=20)
@given(names)
def test_adding_a_member_moves_about_one_nth_of_the_keys(members):
    before = HashRing(members[:-1])
    after = HashRing(members)
    moved = [k for k in KEYS if owner(before, k) != owner(after, k)]
    assert all(owner(after, k) == members[-1] for k in moved)
    share = len(moved) / len(KEYS)
    assert 0.5 / len(members) <= share <= 1.6 / len(members)


def test_an_empty_ring_walks_nothing():
    assert list(HashRing([]).walk(5)) == []
    assert owner(HashRing([]), 5) is None


@given(names, positions, st.data())
def test_first_of_is_the_first_of_those_names_the_walk_meets(members, key, data):
    ring = HashRing(members, vnodes=40)
    wanted = set(data.draw(st.lists(st.sampled_from(members), min_size=1, unique=True)))
    # Few names (k * k * 5 <= n) are bisected in their own points, many are met walking the ring.
    assert ring.first_of(key, wanted) == next(n for n in ring.walk(key) if n in wanted)


big_rings = st.lists(
    st.integers(1, 65535).map(lambda port: f"http://10.0.0.2:{port}"),
    min_size=20,
    max_size=90,
    unique=True,
)


@settings(max_examples=60)
@given(big_rings, positions, st.data())
def test_first_of_bisects_few_names_and_walks_many_with_the_walks_answer(members, key, data):
    ring = HashRing(members, vnodes=40)
    # 2 to 4 names are bisected (n >= 20 .. 80), more are walked: both ways answer alike.
    size = data.draw(st.integers(2, len(members)))
    wanted = set(data.draw(st.permutations(members))[:size])
    assert ring.first_of(key, wanted) == next(n for n in ring.walk(key) if n in wanted)


def test_first_of_names_outside_the_ring_is_none():
    ring = HashRing(["a", "b", "c", "d"], vnodes=8)
    assert ring.first_of(5, {"x"}) is None and ring.first_of(5, {"x", "y", "z"}) is None


def _same_ring(a: HashRing, b: HashRing) -> bool:
    """Equal as rings: the same members, points, owners and each member's own points."""
    return (
        a.names == b.names
        and a._points == b._points
        and a._owners == b._owners
        and a._own == b._own
    )


pools = st.lists(
    st.integers(1, 65535).map(lambda port: f"http://10.0.0.2:{port}"),
    min_size=1,
    max_size=12,
    unique=True,
)


@settings(max_examples=60)
@given(pools, st.lists(st.sets(st.integers(0, 11)), min_size=1, max_size=6), positions)
def test_a_ring_followed_through_membership_changes_equals_the_ring_built_from_its_names(
    pool, steps, key
):
    """`with_members` keeps the points of the names it keeps and hashes only the new ones: after
    any sequence of joins and leaves, the ring is the one built from scratch."""
    ring = HashRing((), vnodes=16)
    for step in steps:
        members = [pool[i] for i in step if i < len(pool)]
        ring = ring.with_members(members)
        fresh = HashRing(members, vnodes=16)
        assert _same_ring(ring, fresh)
        assert list(ring.walk(key)) == list(fresh.walk(key))


def test_with_the_same_members_the_ring_is_reused():
    ring = HashRing(["http://10.0.0.1:1", "http://10.0.0.1:2"])
    assert ring.with_members(["http://10.0.0.1:2", "http://10.0.0.1:1"]) is ring
