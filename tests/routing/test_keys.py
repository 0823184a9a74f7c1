"""Keys are what vLLM caches: whole blocks, chained, seeded by the model, the same everywhere;
the whole prompt is one hash, and the chain is only computed when asked for."""

from __future__ import annotations

import struct
from array import array
from collections.abc import Iterator
from contextlib import contextmanager

import orjson
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from lora_router.proxy.body import read_completion
from lora_router.routing import keys as keys_module
from lora_router.routing.keys import (
    TEXT_SEED,
    TOKEN_SEED,
    Lineages,
    PromptKey,
    completion_key,
    prompt_key,
    text_key,
    wire_key,
)

token_ids = st.lists(st.integers(0, 2**32 - 1), max_size=300)
block_sizes = st.sampled_from([1, 2, 7, 16, 32])
models = st.none() | st.text(max_size=20)


def expected_key(model: str | None, tokens: list[int], block: int) -> tuple[list[int], int]:
    """(chain, full), computed independently from the definitions in the module docstring."""
    seed = TOKEN_SEED if model is None else xxhash.xxh3_64_intdigest(model.encode(), TOKEN_SEED)
    full = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(tokens)}I", *tokens), seed)
    chain = []
    for i in range(len(tokens) // block):
        packed = struct.pack(f"<{block}I", *tokens[i * block : (i + 1) * block])
        seed = xxhash.xxh3_64_intdigest(packed, seed)
        chain.append(seed)
    return chain, full


@given(models, token_ids, block_sizes)
def test_key_is_the_xxh3_of_the_prompt_with_the_chained_xxh3_of_its_blocks(model, tokens, block):
    key = prompt_key(model, tokens, block)
    assert (key.chain, key.full) == expected_key(model, tokens, block)
    assert key.length == len(tokens)
    assert (key.blocks, key.tail_bytes) == (len(tokens) // block, len(tokens) % block * 4)


def test_key_is_the_same_in_every_process():
    # Fixed values: a change here re-homes every prompt of a running fleet's routers.
    key = prompt_key("trl-policy-v3", list(range(40)), 16)
    assert key.chain == [684874375104575926, 16763698087684802013]
    assert key.full == 10202612783900772515
    base = prompt_key(None, list(range(40)), 16)
    assert base.chain == [12714365579011400679, 7121910011406943785]
    assert base.full == 17677036808822813041


@contextmanager
def counted_chains() -> Iterator[list[tuple[object, ...]]]:
    """The calls of `keys._chain` made inside the block."""
    original = keys_module._chain
    calls: list[tuple[object, ...]] = []

    def counting_chain(*args):
        calls.append(args)
        return original(*args)

    keys_module._chain = counting_chain  # (hypothesis and function-scoped monkeypatch clash)
    try:
        yield calls
    finally:
        keys_module._chain = original


@given(models, token_ids, block_sizes)
def test_building_a_key_does_not_compute_its_chain(model, tokens, block):
    with counted_chains() as calls:
        prompt_key(model, tokens, block)  # its `full` is computed: all a sibling needs
    assert calls == []


@given(models, token_ids, block_sizes)
def test_the_chain_is_computed_on_first_ask_then_cached(model, tokens, block):
    key = prompt_key(model, tokens, block)
    with counted_chains() as calls:
        assert key.chain is key.chain
    assert len(calls) == 1


@given(models, token_ids, block_sizes)
def test_a_cached_chain_is_not_part_of_a_keys_equality(model, tokens, block):
    key = prompt_key(model, tokens, block)
    key.chain  # noqa: B018 - computed and cached
    assert key == prompt_key(model, tokens, block)


@given(models, token_ids, st.data(), block_sizes)
def test_a_prefix_hash_is_the_full_hash_of_that_prefix(model, tokens, data, block):
    key = prompt_key(model, tokens, block)
    cut = data.draw(st.integers(0, len(tokens)))
    level, rest = divmod(cut, block)
    assert key.prefix_hash(level, rest * 4) == prompt_key(model, tokens[:cut], block).full


@given(models, token_ids)
def test_the_full_hash_does_not_depend_on_the_block_size(model, tokens):
    # Documented: one router (one table) uses one block size, so `full` need not encode it.
    assert prompt_key(model, tokens, 1).full == prompt_key(model, tokens, 16).full


@given(models, token_ids, token_ids, token_ids, block_sizes)
def test_prompts_share_chain_values_exactly_for_shared_whole_blocks(model, common, a, b, block):
    ka = prompt_key(model, common + a, block)
    kb = prompt_key(model, common + b, block)
    shared = 0
    while (shared + 1) * block <= min(len(common + a), len(common + b)) and (
        (common + a)[: (shared + 1) * block] == (common + b)[: (shared + 1) * block]
    ):
        shared += 1
    assert ka.chain[:shared] == kb.chain[:shared]
    assert set(ka.chain[shared:]).isdisjoint(kb.chain[shared:])


@given(token_ids, block_sizes)
def test_versions_never_share_a_chain_value(tokens, block):
    v3 = prompt_key("trl-policy-v3", tokens, block)
    v4 = prompt_key("trl-policy-v4", tokens, block)
    assert set(v3.chain).isdisjoint(v4.chain)
    assert v3.full != v4.full


@given(st.binary(max_size=400), st.sampled_from([1, 16, 64]))
def test_text_is_keyed_by_blocks_of_utf8_bytes(data, block):
    key = text_key("m", data, block)
    seed = xxhash.xxh3_64_intdigest(b"m", TEXT_SEED)
    chain = []
    for i in range(len(data) // block):
        seed = xxhash.xxh3_64_intdigest(data[i * block : (i + 1) * block], seed)
        chain.append(seed)
    assert key.chain == chain
    assert key.full == xxhash.xxh3_64_intdigest(data, xxhash.xxh3_64_intdigest(b"m", TEXT_SEED))


chat_messages = st.lists(
    st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"])})
    | st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "assistant"]), "content": st.text(max_size=200)}
    ),
    min_size=1,
    max_size=6,
)


def chat_key(messages: list[dict[str, str]]) -> PromptKey | None:
    """A chat body's key as the router builds it: validated by body.py, keyed by keys.py."""
    body = orjson.dumps({"model": "m", "messages": messages})
    completion = read_completion(body, chat=True, max_prompt_tokens=1 << 20)
    return completion_key(completion, Lineages().seeds("m", False), 16).key


@given(chat_messages, chat_messages)
def test_a_later_chat_turn_extends_the_earlier_turns_key(earlier, later):
    first, second = chat_key(earlier), chat_key(earlier + later)
    assert first is not None and second is not None
    assert second.data.startswith(first.data)
    assert second.chain[: len(first.chain)] == first.chain


@given(chat_messages)
def test_chat_is_keyed_as_its_compact_sorted_messages(messages):
    data = b"".join(orjson.dumps(m, option=orjson.OPT_SORT_KEYS) for m in messages)
    assert chat_key(messages) == text_key("m", data)


@given(models, token_ids, block_sizes)
def test_packed_ids_key_like_the_list_they_came_from(model, tokens, block):
    # The HTTP layer validates by packing into array('I'); the key must not depend on that.
    assert prompt_key(model, array("I", tokens), block) == prompt_key(model, tokens, block)


@settings(max_examples=50)
@given(models, token_ids)
def test_seed_domains_keep_token_prompts_apart_from_text_prompts(model, tokens):
    as_tokens = prompt_key(model, tokens, 16)
    as_text = text_key(model, as_tokens.data, 64)
    assert as_tokens.seed != as_text.seed
    assert as_tokens.full != as_text.full


@given(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300))
def test_a_token_id_completion_keys_by_its_wire_text_and_its_ids(tokens):
    raw = orjson.dumps(tokens)
    completion = read_completion(
        b'{"model": "a-v1", "prompt": %s}' % raw, chat=False, max_prompt_tokens=1 << 20
    )
    seeds = Lineages().seeds("a-v1", True)
    key = completion_key(completion, seeds, 16)
    assert key.wire == wire_key(None, raw, seed=seeds.wire)
    assert key.key == prompt_key(None, tokens, 16, seed=seeds.token)


def test_the_block_key_is_built_once_and_only_when_asked_for():
    class Counting:
        raw_tokens = None
        text = None
        calls = 0

        def token_ids(self) -> list[int]:
            self.calls += 1
            return [1, 2, 3]

    prompt = Counting()
    key = completion_key(prompt, Lineages().seeds(None, False), 16)
    assert key.wire is None and prompt.calls == 0
    assert key.key is key.key and prompt.calls == 1


def test_a_prompt_without_ids_or_text_has_no_block_key():
    completion = read_completion(
        b'{"prompt_embeds": "AAAA"}', chat=False, max_prompt_tokens=1 << 20
    )
    assert completion_key(completion, Lineages().seeds(None, False), 16).key is None
