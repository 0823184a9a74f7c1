"""GRPO groups through the router: the replicas' own prefix-cache counters reach the maximum,
and the router's predictions of them meet what the replicas report."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable

from lora_router.testbed.trl_client import LORA_NAME, Rollouts, vllm_client
from lora_router.testbed.vllm_harness import Replica, Router

BLOCK = 128  # the KV block size of vLLM's CPU build (/server_info cache_config.block_size)
PROMPT_TOKENS = 300
GROUP = 8
PROMPTS = 4
VOCAB = range(3, 480)  # the tiny tokenizer's ordinary tokens


def grpo_prompts(count: int) -> list[list[int]]:
    """Token-id prompts no replica has seen (fresh random ids every run), none a prefix of
    another."""
    rng = random.Random()
    return [rng.choices(VOCAB, k=PROMPT_TOKENS) for _ in range(count)]


def test_grpo_groups_hit_the_most_the_block_size_allows(
    fleet: list[Replica], router: Router, publish: Callable[..., str], base: str
) -> None:
    """8 seeded requests per prompt, all in flight at once, as TRL sends them: the 7 siblings
    of each prompt hit every full 128-token block of it on the replica the first one went to,
    which is every block but the partial last one, and the prompts spread over both replicas."""
    client = vllm_client(router.url)
    client.pause()
    client.load_lora_adapter(f"{LORA_NAME}-v1", publish(f"{LORA_NAME}-v1", 0))
    client.resume()
    hits = [r.metric("vllm:prefix_cache_hits_total") for r in fleet]
    queries = [r.metric("vllm:prefix_cache_queries_total") for r in fleet]

    asyncio.run(
        Rollouts(router.url, base, version=1, max_tokens=2).groups(grpo_prompts(PROMPTS), GROUP)
    )

    hit = [r.metric("vllm:prefix_cache_hits_total") - h for r, h in zip(fleet, hits, strict=True)]
    asked = [
        r.metric("vllm:prefix_cache_queries_total") - q for r, q in zip(fleet, queries, strict=True)
    ]
    cacheable = (PROMPT_TOKENS - 1) // BLOCK * BLOCK  # the last token is always computed
    assert sum(hit) == PROMPTS * (GROUP - 1) * cacheable
    # Each replica was dealt half the prompts, every sample of a prompt on one replica.
    assert asked == [PROMPTS // 2 * GROUP * PROMPT_TOKENS] * 2
    assert hit == [PROMPTS // 2 * (GROUP - 1) * cacheable] * 2


def test_the_routers_predictions_meet_what_vllm_reports_it_reused(
    fleet: list[Replica], router: Router, publish: Callable[..., str], base: str
) -> None:
    """Two turns of GRPO groups (every request of a turn in flight at once; a later turn is
    the prompt, one sample's completion and 8 new tokens), no cache pressure: the cached
    tokens the router read from vLLM's answers (`--enable-prompt-tokens-details`) are the
    replicas' own prefix-cache hits, and its predictions meet them exactly (the stated
    tolerance on this trace: none)."""
    client = vllm_client(router.url)
    client.pause()
    client.load_lora_adapter(f"{LORA_NAME}-v1", publish(f"{LORA_NAME}-v1", 0))
    client.resume()
    hits = [r.metric("vllm:prefix_cache_hits_total") for r in fleet]
    rollouts = Rollouts(router.url, base, version=1, max_tokens=2)

    prompts = grpo_prompts(PROMPTS)
    completions = asyncio.run(rollouts.groups(prompts, GROUP))
    later = [p + c + [5] * 8 for p, c in zip(prompts, completions[::GROUP], strict=True)]
    asyncio.run(rollouts.groups(later, 2))

    hit = sum(r.metric("vllm:prefix_cache_hits_total") for r in fleet) - sum(hits)
    accuracy = router.get("/router/status").json()["routing_accuracy"]
    assert accuracy["answers"] == PROMPTS * (GROUP + 2) and accuracy["unreported"] == 0
    assert accuracy["reported_cached_tokens"] == hit
    assert accuracy["predicted_cached_tokens"] == hit
    assert accuracy["lineages"][LORA_NAME]["answers"] == PROMPTS * (GROUP + 2)
    assert not accuracy["overpredicting"]
