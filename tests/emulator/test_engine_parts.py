"""The pure parts of the engine: prefix cache, adapter slots, scheduler, tokens, timing."""

from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lora_router.emulator import EmulatorConfig, tokens
from lora_router.emulator.adapter_files import AdapterSpec
from lora_router.emulator.adapters import Adapter, AdapterSlots
from lora_router.emulator.engine import Engine
from lora_router.emulator.prefix_cache import PrefixCache, block_hashes
from lora_router.emulator.scheduler import Scheduler, Seq

SPEC = AdapterSpec(rank=1, alpha=2.0, target_modules=("q_proj",), weights_file="w")


def test_only_full_blocks_are_hashed() -> None:
    assert len(block_hashes(list(range(47)), 16)) == 2


def test_block_hashes_chain_so_a_changed_first_block_changes_all() -> None:
    a = block_hashes(list(range(48)), 16)
    b = block_hashes([999, *range(1, 48)], 16)
    assert all(x != y for x, y in zip(a, b, strict=True))


def test_extra_keys_separate_the_same_prompt() -> None:
    prompt = list(range(32))
    assert block_hashes(prompt, 16, ("v3",)) != block_hashes(prompt, 16, ("v4",))


def engine_with_v1(vllm_version: str) -> tuple[Engine, Adapter]:
    """An engine of `vllm_version` with adapter v1 loaded from /a/v1."""
    engine = Engine(EmulatorConfig(vllm_version=vllm_version))
    return engine, engine.register("v1", "/a/v1", SPEC, inplace=False)


def test_027_keys_blocks_by_the_adapter_name() -> None:
    engine, adapter = engine_with_v1("0.27")
    assert engine.extra_keys(adapter) == ("v1",)


@pytest.mark.parametrize("version", ["0.32", "0.33"])
def test_032_on_keys_blocks_by_the_adapter_name_with_its_path(version: str) -> None:
    engine, adapter = engine_with_v1(version)  # 0.32: kv_cache_utils._gen_lora_extra_hash_keys
    assert engine.extra_keys(adapter) == ("v1", "/a/v1")


def test_the_base_model_keys_blocks_by_nothing() -> None:
    engine, _ = engine_with_v1("0.27")
    assert engine.extra_keys(None) == ()


def test_a_fully_cached_prompt_still_recomputes_its_last_token() -> None:
    cache = PrefixCache(block_size=16, capacity=100)
    hashes = block_hashes(list(range(32)), 16)
    cache.insert(hashes)
    assert cache.lookup(hashes, 32) == 16
    assert cache.lookup(hashes, 33) == 32


def test_lookup_counters_count_tokens_not_blocks() -> None:
    cache = PrefixCache(block_size=16, capacity=100)
    hashes = block_hashes(list(range(40)), 16)
    cache.lookup(hashes, 40)
    cache.insert(hashes)
    cache.lookup(hashes, 40)
    assert (cache.queries, cache.hits) == (80, 32)


def test_cache_evicts_the_least_recently_used_block() -> None:
    cache = PrefixCache(block_size=1, capacity=2)
    cache.insert([1, 2])
    cache.lookup([1], 2)  # touches block 1
    cache.insert([3])
    assert 1 in cache and 3 in cache and 2 not in cache


@given(st.lists(st.integers(0, 1000), max_size=80), st.integers(1, 32))
def test_a_prefix_shares_the_leading_block_hashes(prompt: list[int], block: int) -> None:
    whole = block_hashes(prompt, block)
    half = block_hashes(prompt[: len(prompt) // 2], block)
    assert whole[: len(half)] == half


def test_slots_evict_the_least_recently_used_adapter_from_the_cpu_cache() -> None:
    slots = AdapterSlots(gpu_capacity=1, cpu_capacity=2)
    slots.load(1)
    slots.load(2)
    slots.activate(1, running=[])
    slots.load(3)  # evicts 2, the least recently used
    assert slots.in_memory == [1, 3]
    assert slots.needs_read(2)


def test_slots_never_evict_an_adapter_a_running_request_uses() -> None:
    slots = AdapterSlots(gpu_capacity=2, cpu_capacity=2)
    slots.activate(1, running=[])
    slots.activate(2, running=[1])
    slots.activate(3, running=[1])
    assert 1 in slots.on_gpu and 3 in slots.on_gpu


async def test_scheduler_runs_at_most_max_num_seqs() -> None:
    scheduler = Scheduler(max_num_seqs=1, max_loras=4)
    first, second = Seq("a"), Seq("b")
    await scheduler.admit(first)
    waiting = asyncio.create_task(scheduler.admit(second))
    await asyncio.sleep(0)
    assert scheduler.waiting == [second]
    scheduler.release(first)
    await waiting
    assert list(scheduler.running) == [second]


async def test_scheduler_skips_a_request_whose_adapter_would_exceed_max_loras() -> None:
    scheduler = Scheduler(max_num_seqs=8, max_loras=1)
    await scheduler.admit(Seq("a", lora_id=1))
    blocked = asyncio.create_task(scheduler.admit(Seq("b", lora_id=2)))
    await scheduler.admit(Seq("c", lora_id=1))  # same adapter: admitted past the blocked one
    await asyncio.sleep(0)
    assert not blocked.done()
    blocked.cancel()


def test_generation_is_deterministic() -> None:
    a = tokens.generate("v1", [1, 2, 3], seed=5, index=0, max_tokens=50, top_logprobs=3)
    b = tokens.generate("v1", [1, 2, 3], seed=5, index=0, max_tokens=50, top_logprobs=3)
    assert a == b


@given(st.integers(0, 2**31), st.integers(0, 5))
def test_logprobs_of_a_step_sum_to_at_most_one(seed: int, top: int) -> None:
    sample = tokens.generate("m", [7], seed=seed, index=0, max_tokens=5, top_logprobs=top)
    for step in sample.tokens:
        total = math.exp(step.logprob) + sum(math.exp(lp) for _, lp in step.alternatives)
        assert total <= 1.0 + 1e-9
        assert len(step.alternatives) == top


def test_generated_text_detokenizes_without_specials() -> None:
    sample = tokens.generate("m", [7], seed=1, index=0, max_tokens=3000)
    assert sample.finish_reason == "stop"
    assert "<|endoftext|>" not in tokens.detokenize(sample.token_ids)


@given(st.text(max_size=50))
def test_text_round_trips_through_the_tokenizer(text: str) -> None:
    assert tokens.detokenize(tokens.tokenize(text)) == text.encode("utf-8", "replace").decode(
        "utf-8", "replace"
    )


def test_chat_template_wraps_messages_in_chatml() -> None:
    ids = tokens.apply_chat_template([{"role": "user", "content": "hi"}])
    assert ids[0] == tokens.IM_START
    assert tokens.detokenize(ids, skip_special_tokens=False) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


async def test_a_cache_hit_makes_a_request_faster() -> None:
    engine = Engine(EmulatorConfig(prefill_s_per_token=0.0005))
    prompt = list(range(257))  # 256 tokens in full blocks: 0.13 s uncached
    hashes = block_hashes(prompt, 16)
    loop = asyncio.get_running_loop()

    async def timed() -> float:
        sample = tokens.generate("m", prompt, seed=0, index=0, max_tokens=1)
        job = engine.new_job("r", None, prompt, hashes, sample)

        async def emit(_: list[tokens.SampledToken]) -> None:
            return None

        began = loop.time()
        await engine.run(job, emit)
        return loop.time() - began

    cold, warm = await timed(), await timed()
    assert cold >= 0.12
    assert warm < cold / 4


async def test_a_full_batch_makes_a_request_wait() -> None:
    engine = Engine(EmulatorConfig(max_num_seqs=1, decode_s_per_token=0.01))
    prompt = [1, 2, 3]
    loop = asyncio.get_running_loop()

    async def timed() -> float:
        sample = tokens.generate("m", prompt, seed=0, index=0, max_tokens=5, ignore_eos=True)
        job = engine.new_job("r", None, prompt, [], sample)

        async def emit(_: list[tokens.SampledToken]) -> None:
            return None

        began = loop.time()
        await engine.run(job, emit)
        return loop.time() - began

    first, second = await asyncio.gather(timed(), timed())
    assert second >= first + 0.04


def test_keep_alive_comments_default_to_15_s_on_033() -> None:
    assert EmulatorConfig(vllm_version="0.33").keepalive_interval == 15.0


def test_032_sends_keep_alive_comments_only_when_given_an_interval() -> None:
    # vLLM 0.32's --sse-keep-alive-interval defaults to 0: no comments.
    assert EmulatorConfig().keepalive_interval is None
    assert EmulatorConfig(sse_keepalive_s=2).keepalive_interval == 2


def test_keep_alive_comments_are_off_at_0_s() -> None:
    assert EmulatorConfig(sse_keepalive_s=0).keepalive_interval is None


def test_027_never_sends_keep_alive_comments() -> None:
    assert EmulatorConfig(vllm_version="0.27", sse_keepalive_s=1).keepalive_interval is None
