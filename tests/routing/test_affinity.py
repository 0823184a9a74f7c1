"""The affinity table finds earlier prompts by their stems (all but their last 8 tokens, never
less than a block), at any length, the exact one without the prompt's chain, and stays bounded."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lora_router.routing.affinity import AffinityTable, _anchors, anchor_tokens
from lora_router.routing.keys import PromptKey, prompt_key, wire_key

tokens = st.lists(st.integers(0, 1000), max_size=120)
nonempty = st.lists(st.integers(0, 1000), min_size=1, max_size=120)
block_sizes = st.sampled_from([1, 4, 16])


class ChainlessKey(PromptKey):
    """A key that fails if its chain is asked for: what needs only `full` must not ask."""

    @property
    def chain(self) -> list[int]:
        raise AssertionError("the chain was computed")


RERENDER_TOKENS = 8  # keys.RERENDER_BYTES of token ids


def stem_tokens(prompt: list[int], block: int) -> int:
    """A prompt's stem length, computed apart from keys.py."""
    return max(len(prompt) - RERENDER_TOKENS, min(len(prompt), block))


def chainless(key: PromptKey) -> ChainlessKey:
    return ChainlessKey(key.data, key.seed, key.block_bytes, key.length)


def assert_consistent(table: AffinityTable) -> None:
    """The exact index holds one entry per anchor, naming the head it is filed under, and
    the table's length counts them."""
    filed = {a[3]: head for head, entry in table._heads.items() for a in _anchors(entry)}
    assert filed == table._exact
    held = [1 if isinstance(e, tuple) else len(e) for e in table._heads.values()]
    assert sum(held) == len(table) <= table.capacity


@given(tokens, tokens, block_sizes)
def test_an_earlier_prompt_is_found_when_it_is_an_exact_prefix(earlier, extension, block):
    table = AffinityTable(100)
    table.record(prompt_key("m", earlier, block), "A")
    found = [(a[0], exact) for a, exact in table.find(prompt_key("m", earlier + extension, block))]
    assert found == [("A", not extension)]


@given(tokens, tokens, st.lists(st.integers(0, 1000), max_size=8), tokens, block_sizes)
def test_a_re_rendered_turn_is_found_by_the_prompt_it_starts_all_but_8_tokens_of(
    history, continued, rendered, turn, block
):
    # The previous prompt ends in a generation prompt (up to 8 tokens) that the next turn's
    # re-rendering replaces; everything before it is kept.
    earlier = history + continued + rendered
    if len(history + continued) < stem_tokens(earlier, block):
        return
    table = AffinityTable(100)
    table.record(prompt_key("m", earlier, block), "A")
    later = history + continued + turn
    found = [(a[0], exact) for a, exact in table.find(prompt_key("m", later, block))]
    assert ("A", later == earlier) in found


@given(tokens, nonempty, tokens, block_sizes)
def test_a_prompt_is_not_found_by_prompts_whose_stem_it_does_not_start_with(common, a, b, block):
    # Sharing only `common` (a template) is no match, nor is being shorter than the stem.
    earlier = common + a
    stem = stem_tokens(earlier, block)
    later = common + b
    if len(later) >= stem and later[:stem] == earlier[:stem]:
        return
    table = AffinityTable(100)
    table.record(prompt_key("m", earlier, block), "A")
    assert list(table.find(prompt_key("m", later, block))) == []


@given(nonempty, nonempty, tokens, block_sizes)
def test_the_longest_earlier_prompt_comes_first(first, second, third, block):
    table = AffinityTable(100)
    table.record(prompt_key("m", first, block), "short")
    table.record(prompt_key("m", first + second, block), "long")
    found = [
        (a[0], exact) for a, exact in table.find(prompt_key("m", first + second + third, block))
    ]
    assert found == [("long", not third), ("short", False)]


@given(tokens, tokens, block_sizes)
def test_the_exact_prompt_is_found_or_replaced_without_its_chain(prompt, shorter, block):
    # A sibling, the commonest request, costs one hash of the whole prompt; so do reading and
    # replacing a known prompt's home. Only a scan for shorter prompts needs the chain.
    table = AffinityTable(100)
    table.record(prompt_key("m", prompt + shorter, block), "A")
    sibling = chainless(prompt_key("m", prompt + shorter, block))
    anchor, exact = next(table.find(sibling))
    assert (anchor[0], exact) == ("A", True)
    assert table.home(sibling) == "A"
    table.record(sibling, "B")
    table.record(sibling, "C", replace=True)
    assert table.home(sibling) == "C"
    assert_consistent(table)


@given(tokens, block_sizes)
def test_the_first_placement_of_a_prompt_sticks(prompt, block):
    table = AffinityTable(100)
    key = prompt_key("m", prompt, block)
    table.record(key, "A")
    table.record(key, "B")
    assert table.home(key) == "A"
    table.record(key, "C", replace=True)
    assert table.home(key) == "C"


@given(tokens, block_sizes)
def test_versions_do_not_find_each_other(prompt, block):
    table = AffinityTable(100)
    table.record(prompt_key("trl-policy-v3", prompt, block), "A")
    assert list(table.find(prompt_key("trl-policy-v4", prompt, block))) == []


@settings(max_examples=50)
@given(st.integers(1, 20), st.lists(tokens, max_size=60), block_sizes)
def test_the_table_never_holds_more_than_its_capacity(capacity, prompts, block):
    table = AffinityTable(capacity)
    for i, prompt in enumerate(prompts):
        table.record(prompt_key("m", prompt, block), f"r{i % 3}")
        assert_consistent(table)  # every eviction leaves the index and the heads agreeing
    # What is left is found first, as itself, on a replica it was placed on.
    placed: dict[tuple[int, ...], set[str]] = {}
    for i, prompt in enumerate(prompts):
        placed.setdefault(tuple(prompt), set()).add(f"r{i % 3}")
    for prompt, replicas in placed.items():
        key = prompt_key("m", list(prompt), block)
        home = table.home(key)
        if home is not None:
            assert home in replicas
            anchor, exact = next(table.find(key))
            assert (anchor[0], exact) == (home, True)


@given(st.lists(tokens, min_size=3, max_size=10))
def test_a_prompt_found_again_outlives_untouched_ones(suffixes):
    # Distinct first blocks: no prompt is a prefix of another, and each has a head of its own
    # (eviction is by head, least recently used first).
    keys = [prompt_key("m", [2000 + i, *[0] * 15, *s], 16) for i, s in enumerate(suffixes)]
    table = AffinityTable(len(keys) - 1)
    for key in keys[:-1]:
        table.record(key, "A")
    list(table.find(keys[0]))  # the oldest, refreshed
    table.record(keys[-1], "B")  # evicts the least recently used: keys[1]
    assert table.home(keys[0]) == "A"
    assert table.home(keys[1]) is None


short_prompt = st.lists(st.integers(0, 1000), max_size=15)


def under_one_head(capacity: int, prompts: list[list[int]]) -> AffinityTable:
    """A table of `capacity` that recorded `prompts` in turn (the i-th on replica "ri"),
    checked after each. Prompts shorter than a block all sit under the model's seed."""
    table = AffinityTable(capacity)
    for i, prompt in enumerate(prompts):
        table.record(prompt_key("m", prompt, 16), f"r{i}")
        assert_consistent(table)
    return table


@given(st.integers(1, 40), st.lists(short_prompt, max_size=80))
def test_prompts_under_one_head_stay_bounded(capacity, prompts):
    under_one_head(capacity, prompts)


@given(st.integers(1, 40), st.lists(short_prompt, min_size=1, max_size=80))
def test_prompts_under_one_head_keep_the_newest(capacity, prompts):
    table = under_one_head(capacity, prompts)
    last = prompt_key("m", prompts[-1], 16)
    # The newest prompt is kept (an earlier placement of it, if one is left, sticks).
    assert table.home(last) in {f"r{i}" for i, p in enumerate(prompts) if p == prompts[-1]}


@given(st.integers(1, 40), st.lists(short_prompt, min_size=1, max_size=80))
def test_replacing_one_anchor_of_a_shared_head_leaves_the_others_where_they_were(capacity, prompts):
    table = under_one_head(capacity, prompts)
    last = prompt_key("m", prompts[-1], 16)
    before = {tuple(p): table.home(prompt_key("m", p, 16)) for p in prompts}
    table.record(last, "new", replace=True)
    assert_consistent(table)
    for prompt, home in before.items():
        expected = "new" if list(prompt) == prompts[-1] else home
        assert table.home(prompt_key("m", list(prompt), 16)) == expected


def assert_wires_consistent(table: AffinityTable) -> None:
    """The wire index names, for each wire key, the head of the one anchor holding it."""
    linked = [(a[2], head) for head, e in table._heads.items() for a in _anchors(e) if a[2]]
    assert dict(linked) == table._wires
    assert len(linked) == len(table._wires)  # no wire key on two anchors


spellings = st.sampled_from([b"%r", b"%r ", b" %r"])


@settings(max_examples=60)
@given(
    st.integers(1, 12),
    st.lists(st.tuples(st.sampled_from(["link", "record", "replace"]), short_prompt, spellings)),
)
def test_wire_keys_stay_filed_with_their_anchors_and_go_with_them(capacity, ops):
    # Prompts shorter than a block share one head, so linking and eviction within a shared head
    # are exercised too.
    table = AffinityTable(capacity)
    for i, (op, prompt, spelling) in enumerate(ops):
        key = prompt_key("m", prompt, 16)
        if op == "link":
            table.link(key, wire_key("m", spelling % prompt))
        else:
            table.record(key, f"r{i}", replace=op == "replace")
        assert_consistent(table)
        assert_wires_consistent(table)


@given(st.lists(short_prompt, min_size=1, max_size=20), spellings)
def test_a_linked_wire_key_finds_its_prompts_home_and_tokens(prompts, spelling):
    table = AffinityTable(100)
    for i, prompt in enumerate(prompts):
        key = prompt_key("m", prompt, 16)
        table.record(key, f"r{i}")
        table.link(key, wire_key("m", spelling % prompt))
    for prompt in prompts:
        key = prompt_key("m", prompt, 16)
        anchor = table.sibling(wire_key("m", spelling % prompt))
        assert anchor is not None
        assert (anchor[0], anchor_tokens(anchor)) == (table.home(key), len(prompt))


@given(short_prompt)
def test_a_wire_key_unknown_to_the_table_finds_nothing(prompt):
    table = AffinityTable(100)
    key = prompt_key("m", prompt, 16)
    table.record(key, "A")
    assert table.sibling(wire_key("m", b"%r" % prompt)) is None  # recorded, never linked
