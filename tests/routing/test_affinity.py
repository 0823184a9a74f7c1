"""The affinity table finds whole earlier prompts, at any length, and stays bounded."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lora_router.routing.affinity import AffinityTable
from lora_router.routing.keys import prompt_key

tokens = st.lists(st.integers(0, 1000), max_size=120)
nonempty = st.lists(st.integers(0, 1000), min_size=1, max_size=120)
block_sizes = st.sampled_from([1, 4, 16])


@given(tokens, tokens, block_sizes)
def test_an_earlier_prompt_is_found_when_it_is_an_exact_prefix(earlier, extension, block):
    table = AffinityTable(100)
    table.record(prompt_key("m", earlier, block), "A")
    found = list(table.find(prompt_key("m", earlier + extension, block)))
    assert found == [("A", not extension)]


@given(tokens, nonempty, tokens, block_sizes)
def test_a_prompt_is_not_found_by_prompts_it_does_not_start(common, a, b, block):
    # Sharing only `common` (a template), or being a prefix of the earlier prompt, is no match.
    if b[: len(a)] == a:
        return
    table = AffinityTable(100)
    table.record(prompt_key("m", common + a, block), "A")
    assert list(table.find(prompt_key("m", common + b, block))) == []


@given(nonempty, nonempty, tokens, block_sizes)
def test_the_longest_earlier_prompt_comes_first(first, second, third, block):
    table = AffinityTable(100)
    table.record(prompt_key("m", first, block), "short")
    table.record(prompt_key("m", first + second, block), "long")
    found = list(table.find(prompt_key("m", first + second + third, block)))
    assert found == [("long", not third), ("short", False)]


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
        assert len(table) <= capacity
    # The count is honest: it is what the heads hold.
    held = [1 if isinstance(e, tuple) else len(e) for e in table._heads.values()]
    assert sum(held) == len(table)


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


@given(st.integers(1, 40), st.lists(st.lists(st.integers(0, 1000), max_size=15), max_size=80))
def test_prompts_under_one_head_stay_bounded_and_keep_the_newest(capacity, prompts):
    # Prompts shorter than a block all sit under the model's seed.
    table = AffinityTable(capacity)
    for prompt in prompts:
        table.record(prompt_key("m", prompt, 16), "A")
        assert len(table) <= capacity
    if prompts:
        assert table.home(prompt_key("m", prompts[-1], 16)) == "A"
