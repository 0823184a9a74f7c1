"""The KV index: what the emulated caches publish, filed under the router's own keys.

The property drives the emulator's prefix cache (LRU, evictions, clears) and its event builder,
feeds the events to the index, and compares the index with the caches themselves: per replica
and adapter name, the keys filed are exactly the router's chain keys of the blocks the cache
holds, and `longest` finds the replicas that hold a prompt's longest prefix.
"""

from __future__ import annotations

import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_router.emulator.kv_events import BlockRemoved, BlockStored, stored_events
from lora_router.emulator.prefix_cache import PrefixCache, block_hashes
from lora_router.routing.keys import Lineages, prompt_key
from lora_router.routing.kv_index import (
    BLOCK_BYTES,
    GAP,
    LIVE,
    MAX_HASH_BYTES,
    MAX_NAME_BYTES,
    MAX_NAMES,
    MISMATCH,
    KvIndex,
    block_cost,
)

BLOCK = 4
LINEAGES = Lineages()
REPLICAS = ("r0", "r1", "r2")
LORAS = (None, "pol-v1", "pol-v2")


def root(lora: str | None) -> int:
    return LINEAGES.seeds(lora, lora is not None).token


def router_chain(tokens: list[int], lora: str | None) -> list[int]:
    """The chain a routed prompt under `lora` looks the index up with."""
    return prompt_key(None, tokens, BLOCK, seed=root(lora)).chain


def fresh_index() -> KvIndex:
    index = KvIndex(root, BLOCK)
    for name in REPLICAS:
        index.set_state(name, LIVE)
    return index


def apply(index: KvIndex, name: str, events: list[object]) -> None:
    for event in events:
        if isinstance(event, BlockStored):
            index.stored(
                name,
                event.block_hashes,
                event.parent_block_hash,
                event.token_ids,
                event.block_size,
                event.lora_name,
            )
        elif isinstance(event, BlockRemoved):
            index.removed(name, event.block_hashes)


# Prompts made of blocks from a small pool, so that prompts share prefixes and blocks.
POOL = [[b * 10 + t for t in range(BLOCK)] for b in range(4)]
prompts = st.lists(st.sampled_from(range(len(POOL))), min_size=0, max_size=5).map(
    lambda picks: [t for p in picks for t in POOL[p]]
)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("store"), st.sampled_from(REPLICAS), st.sampled_from(LORAS), prompts),
        st.tuples(st.just("clear"), st.sampled_from(REPLICAS), st.none(), st.just([])),
    ),
    max_size=30,
)


@settings(max_examples=200)
@given(ops=ops, query=prompts, lora=st.sampled_from(LORAS))
def test_the_index_files_exactly_the_blocks_the_caches_hold(
    ops: list[tuple[str, str, str | None, list[int]]], query: list[int], lora: str | None
) -> None:
    index = fresh_index()
    caches = {name: PrefixCache(BLOCK, capacity=6) for name in REPLICAS}
    truth: dict[int, tuple[str | None, int]] = {}  # vLLM-side hash -> (lora, router key)
    for op, name, op_lora, tokens in ops:
        cache = caches[name]
        if op == "clear":
            cache.clear()
            index.reset(name, LIVE)
            continue
        extra = (op_lora,) if op_lora is not None else ()
        hashes = block_hashes(tokens, BLOCK, extra)
        truth.update(
            zip(hashes, ((op_lora, k) for k in router_chain(tokens, op_lora)), strict=True)
        )
        added, evicted = cache.insert(hashes)
        events = stored_events(tokens, hashes, added, BLOCK, None, op_lora)
        apply(index, name, [*events, *(BlockRemoved([h], "GPU") for h in evicted)])

    for name, cache in caches.items():
        held = {h: truth[h] for h in cache._blocks}
        rep = index.replicas[name]
        assert rep.blocks == held
        assert rep.orphans == 0
        # Every block filed is charged its cost, and every one unfiled refunded.
        assert rep.bytes == sum(block_cost(h, lora, False) for h, (lora, _) in held.items())
    assert index.bytes == sum(rep.bytes for rep in index.replicas.values())

    chain = router_chain(query, lora)
    extra = (lora,) if lora is not None else ()
    leads = {}
    for name, cache in caches.items():
        lead = 0
        for h in block_hashes(query, BLOCK, extra):
            if h not in cache:
                break
            lead += 1
        leads[name] = lead
    best = max(leads.values())
    level, holders = index.longest(lora, chain)
    assert level == best
    assert holders == (frozenset(n for n, lead in leads.items() if lead == best) if best else set())


def test_a_block_whose_parent_is_unknown_is_not_filed() -> None:
    index = fresh_index()
    assert index.stored("r0", [7], 6, [1, 2, 3, 4], BLOCK, None) == 0
    assert index.replicas["r0"].orphans == 1 and index.held("r0") == 0


def test_removing_or_clearing_unknown_blocks_changes_nothing() -> None:
    index = fresh_index()
    index.stored("r0", [1], None, [1, 2, 3, 4], BLOCK, None)
    index.removed("r0", [99])
    index.removed("r9", [1])
    assert index.held("r0") == 1
    assert index.longest(None, router_chain([1, 2, 3, 4], None)) == (1, {"r0"})


def test_versions_of_one_lineage_are_filed_apart() -> None:
    index = fresh_index()
    tokens = [5, 6, 7, 8]
    index.stored("r0", [1], None, tokens, BLOCK, "pol-v1")
    # The same lineage seeds both versions' chains, but vLLM caches each name on its own.
    assert router_chain(tokens, "pol-v1") == router_chain(tokens, "pol-v2")
    assert index.longest("pol-v1", router_chain(tokens, "pol-v1")) == (1, {"r0"})
    assert index.longest("pol-v2", router_chain(tokens, "pol-v2")) == (0, set())


def test_a_replica_not_live_is_not_looked_up() -> None:
    index = fresh_index()
    index.stored("r1", [1], None, [1, 2, 3, 4], BLOCK, None)
    index.set_state("r1", GAP, "missed batch 3")
    assert index.longest(None, router_chain([1, 2, 3, 4], None)) == (0, set())
    assert index.replicas["r1"].reason == "missed batch 3"


def test_another_block_size_marks_the_replica_mismatched() -> None:
    index = fresh_index()
    index.stored("r0", [1], None, [1, 2, 3, 4], BLOCK, None)
    assert index.stored("r0", [2], None, list(range(8)), 8, None) == 0
    rep = index.replicas["r0"]
    assert rep.state == MISMATCH and index.held("r0") == 0 and "block size 8" in (rep.reason or "")


def test_an_index_over_its_bytes_resets_the_replica_holding_the_most() -> None:
    index = KvIndex(root, BLOCK, max_bytes=5 * BLOCK_BYTES)
    for name in ("r0", "r1"):
        index.set_state(name, LIVE)
    index.stored("r0", [1, 2, 3], None, list(range(12)), BLOCK, None)
    index.stored("r1", [4, 5], None, list(range(8)), BLOCK, None)
    assert index.bytes == 5 * BLOCK_BYTES and index.replicas["r0"].state == LIVE
    index.stored("r1", [6], 5, list(range(8, 12)), BLOCK, None)  # one block over
    assert index.replicas["r0"].state == GAP and index.held("r0") == 0
    assert "full" in (index.replicas["r0"].reason or "")
    assert index.held("r1") == 3 and index.bytes == 3 * BLOCK_BYTES


def test_a_replica_over_its_own_bytes_is_reset_alone() -> None:
    index = KvIndex(root, BLOCK, max_replica_bytes=3 * BLOCK_BYTES)
    for name in ("r0", "r1"):
        index.set_state(name, LIVE)
    index.stored("r1", [9], None, list(range(4)), BLOCK, None)
    index.stored("r0", [1, 2, 3], None, list(range(12)), BLOCK, None)
    assert index.replicas["r0"].state == LIVE
    index.stored("r0", [4], 3, list(range(12, 16)), BLOCK, None)  # one block over its own
    assert index.replicas["r0"].state == GAP and index.held("r0") == 0
    assert "passed" in (index.replicas["r0"].reason or "")
    assert index.held("r1") == 1 and index.bytes == BLOCK_BYTES


@pytest.mark.parametrize(
    ("hash_bytes", "name", "inherited"),
    [
        (0, None, False),
        (MAX_HASH_BYTES, None, True),
        (MAX_HASH_BYTES, "a" * MAX_NAME_BYTES, False),
        (0, "\U0001f600" * (MAX_NAME_BYTES // 4), True),
    ],
    ids=["int", "digest-inherited", "ascii-name", "wide-name-inherited"],
)
def test_what_the_index_holds_stays_within_the_bytes_it_counts(
    hash_bytes: int, name: str | None, inherited: bool
) -> None:
    """The stated bound is real memory: one block a store (the costliest shape, each with its
    own copy of the name), hashes and names at their caps; then everything removed."""
    index = KvIndex(root, BLOCK, max_bytes=1 << 40)
    index.set_state("r0", LIVE)
    blocks = 5000
    hashes = [i.to_bytes(hash_bytes, "big") if hash_bytes else i + 2**40 for i in range(blocks)]
    if name is not None:
        root(name)  # the seed cache is `keys`'s memory, not the index's
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i, block_hash in enumerate(hashes):
            lora = None if name is None else "".join(list(name))  # a fresh str, as decoded
            tokens = list(range(i * BLOCK, (i + 1) * BLOCK))
            assert index.stored("r0", [block_hash], None, tokens, BLOCK, lora, inherited) == 1
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert 0 < grown <= index.bytes, (grown, index.bytes)
    index.removed("r0", hashes)
    assert index.bytes == 0 and index.replicas["r0"].bytes == 0


def test_a_new_adapter_name_beyond_the_cap_is_refused() -> None:
    index = KvIndex(lambda lora: 7, BLOCK)
    index.set_state("r0", LIVE)
    for i in range(MAX_NAMES):
        assert index.stored("r0", [i], None, [1, 2, 3, 4], BLOCK, f"n{i}") == 1
    assert index.stored("r0", [-1], None, [1, 2, 3, 4], BLOCK, "one-more") == 0
    assert index.replicas["r0"].nameless == 1
    index.removed("r0", [0])  # n0's last block: its name is no longer held
    assert index.stored("r0", [-1], None, [1, 2, 3, 4], BLOCK, "one-more") == 1


def test_forgetting_a_replica_drops_its_keys() -> None:
    index = fresh_index()
    index.stored("r0", [1], None, [1, 2, 3, 4], BLOCK, None)
    index.forget("r0")
    assert "r0" not in index.replicas and index._holders == {}


def test_an_inherited_block_says_so_until_it_is_removed() -> None:
    index = fresh_index()
    tokens = [1, 2, 3, 4]
    (key,) = router_chain(tokens, None)
    index.stored("r0", [1], None, tokens, BLOCK, None, inherited=True)
    index.stored("r1", [2], None, tokens, BLOCK, None)
    assert index.inherited(None, key, "r0") and not index.inherited(None, key, "r1")
    index.removed("r0", [1])
    assert not index.inherited(None, key, "r0") and index._inherited == {}
