"""Placement keys follow an adapter's lineage across versions; lineages never mix; keying a
4,000-token prompt costs a bounded number of hashes."""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from routing_doubles import Rep, fleet, watch

from lora_router.proxy.body import read_completion
from lora_router.routing import affinity, keys
from lora_router.routing.keys import Lineages, prompt_key, wire_key
from lora_router.routing.policy import PrefixAffinity

LINEAGES = Lineages()
# The generation prompt a re-rendered turn drops (Qwen3's empty think stub is 4 tokens).
STUBS = st.lists(st.integers(150_000, 151_999), max_size=8)


def placement(model: str | None, prompt: list[int], adapter: bool = True) -> keys.PromptKey:
    return prompt_key(None, prompt, seed=LINEAGES.seeds(model, adapter).token)


def rk(key: keys.PromptKey, wire: int | None = None) -> keys.RouteKey:
    """What the HTTP layer hands a policy for a prompt keyed as `key`."""
    return keys.RouteKey(lambda: key, wire)


def route(policy: PrefixAffinity, reps: list[Rep], model: str, prompt: list[int]) -> Rep:
    """One request that finishes before the next arrives (no load cap in play)."""
    decision = policy.choose(rk(placement(model, prompt)), reps)
    return decision.replica


# -- lineages ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "lineage"),
    [
        ("trl-policy-v7", "trl-policy"),
        ("trl-policy-v12", "trl-policy"),
        ("my-adapter-v1-v2", "my-adapter-v1"),
        ("trl-policy", "trl-policy"),  # no version: its own lineage
        ("v3", "v3"),
        ("policy-v3b", "policy-v3b"),  # the whole name must match
    ],
)
def test_the_default_pattern_strips_trls_version_suffix(name, lineage):
    assert LINEAGES.lineage(name) == lineage


def test_a_pattern_without_a_lineage_group_is_refused():
    with pytest.raises(ValueError, match="lineage"):
        Lineages(r"(.+)-v\d+")
    with pytest.raises(ValueError, match="regular expression"):
        Lineages(r"(?P<lineage>")


def test_a_custom_pattern_names_the_lineage():
    custom = Lineages(r"(?P<lineage>.+)@step\d+")
    assert custom.lineage("grpo@step40") == "grpo"
    assert custom.seeds("grpo@step40", True) == custom.seeds("grpo@step41", True)
    assert custom.seeds("trl-policy-v1", True) != custom.seeds("trl-policy-v2", True)


@given(st.text(min_size=1, max_size=30), st.integers(0, 10**6), st.integers(0, 10**6))
def test_every_version_of_a_lineage_has_one_placement_key(name, a, b):
    assert LINEAGES.seeds(f"{name}-v{a}", True) == LINEAGES.seeds(f"{name}-v{b}", True)


@given(st.lists(st.integers(0, 150_000), min_size=1, max_size=100), st.integers(1, 50))
def test_a_version_bump_changes_the_cache_key_but_not_the_placement_key(prompt, version):
    old, new = f"trl-policy-v{version}", f"trl-policy-v{version + 1}"
    assert placement(old, prompt).full == placement(new, prompt).full
    assert placement(old, prompt).chain == placement(new, prompt).chain
    assert prompt_key(old, prompt).full != prompt_key(new, prompt).full  # what vLLM reuses


@given(
    st.text(min_size=1, max_size=20),
    st.text(min_size=1, max_size=20),
    st.lists(st.integers(0, 150_000), min_size=1, max_size=100),
)
def test_two_lineages_never_share_a_key(a, b, prompt):
    if LINEAGES.lineage(f"{a}-v1") == LINEAGES.lineage(f"{b}-v1"):
        return
    one, other = placement(f"{a}-v1", prompt), placement(f"{b}-v1", prompt)
    assert one.full != other.full and one.seed != other.seed
    raw = b"[" + b",".join(b"%d" % t for t in prompt) + b"]"
    assert wire_key(None, raw, seed=LINEAGES.seeds(f"{a}-v1", True).wire) != wire_key(
        None, raw, seed=LINEAGES.seeds(f"{b}-v1", True).wire
    )


@given(st.text(min_size=1, max_size=20), st.lists(st.integers(0, 150_000), max_size=100))
def test_the_base_model_is_never_an_adapters_lineage(name, prompt):
    # Even a base model named like the lineage itself: another seed domain.
    base = LINEAGES.seeds(name, False)
    assert base != LINEAGES.seeds(f"{name}-v1", True)
    assert LINEAGES.seeds(None, False) != LINEAGES.seeds(f"{name}-v1", True)
    assert placement(name, prompt, adapter=False).full != placement(f"{name}-v1", prompt).full


@given(st.lists(st.integers(0, 150_000), min_size=1, max_size=200), st.integers(2, 8))
def test_placement_is_shared_within_a_lineage_only(prompt, n):
    reps = fleet(n)
    policy = PrefixAffinity()
    watch(policy, reps)
    policy.choose(rk(placement("trl-policy-v3", prompt)), reps)
    assert policy.choose(rk(placement("other-v3", prompt)), reps).kind == "fresh"
    assert policy.choose(rk(placement("trl-policy", prompt, adapter=False)), reps).kind == "fresh"
    assert policy.choose(rk(placement("trl-policy-v4", prompt)), reps).kind == "sibling"


# -- a version bump never moves a family ------------------------------------------------------


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 300),  # shared template
    st.integers(1, 4),  # families
    st.integers(1, 8),  # samples per family (G)
    st.lists(st.integers(0, 2), min_size=2, max_size=4),  # version steps between turns
    STUBS,
    st.booleans(),  # re-rendered (the stub dropped, the completion re-tokenized) or appended
    st.integers(2, 8),
    st.integers(0, 2**32),
)
def test_a_version_bump_never_moves_a_family(template, families, g, bumps, stub, rerender, n, seed):
    rnd = random.Random(seed)
    reps = fleet(n)
    policy = PrefixAffinity()
    watch(policy, reps)
    shared = [rnd.randrange(150_000) for _ in range(template)]
    conversations: dict[tuple[int, int], list[int]] = {}
    for f in range(families):
        problem = [rnd.randrange(150_000) for _ in range(rnd.randrange(20, 200))]
        for s in range(g):
            conversations[f, s] = shared + problem + stub
    homes: dict[int, set[str]] = {f: set() for f in range(families)}
    version = 1
    for bump in bumps:  # one turn of every conversation per round, then maybe a sync
        for (f, s), prompt in conversations.items():
            homes[f].add(route(policy, reps, f"trl-policy-v{version}", prompt).name)
            completion = [rnd.randrange(150_000) for _ in range(rnd.randrange(1, 300))]
            if rerender:
                history = prompt[: len(prompt) - len(stub)]  # the think stub is not history
                completion = [t // 2 for t in completion]  # re-tokenized: other ids
            else:
                history = prompt
            tool = [rnd.randrange(150_000) for _ in range(rnd.randrange(1, 60))]
            conversations[f, s] = history + completion + tool + stub
        version += bump
    assert all(len(replicas) == 1 for replicas in homes.values())


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 8), st.integers(0, 2**32))
def test_later_turns_count_no_new_family(n, seed):
    rnd = random.Random(seed)
    # Every family's later turns follow it, so new families are placed by the work held now:
    # after any number of synced turns the families spread one per replica, as on a fresh fleet.
    reps = fleet(n)
    policy = PrefixAffinity()
    watch(policy, reps)
    prompts = [[rnd.randrange(150_000) for _ in range(100)] for _ in range(n)]
    for turn in range(3):
        for i, prompt in enumerate(prompts):
            decision = policy.choose(rk(placement(f"trl-policy-v{turn + 1}", prompt)), reps)
            assert decision.kind == ("fresh" if turn == 0 else "continuation")
            decision.replica.in_flight += 1  # each family's conversation stays in flight
            prompts[i] = prompt + [rnd.randrange(150_000) for _ in range(50)]
    assert sorted(r.in_flight for r in reps) == [3] * n


# -- bounded cost -----------------------------------------------------------------------------


class Counting:
    """Counts the xxh3 calls of the routing package (its only hash)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        original = keys.xxh3_64_intdigest

        def counted(data: bytes, seed: int = 0) -> int:
            self.calls += 1
            return original(data, seed)

        monkeypatch.setattr(keys, "xxh3_64_intdigest", counted)


TOKENS = 4000
BLOCKS = TOKENS // 16


def adversarial_policy(prompt: list[int], reps: list[Rep]) -> PrefixAffinity:
    """A table holding an anchor at every level of `prompt`'s chain (every one of its prefixes
    a multiple of 7 tokens long was routed), under other models too."""
    policy = PrefixAffinity()
    watch(policy, reps)
    for end in range(7, TOKENS, 7):
        policy.choose(rk(placement("trl-policy-v1", prompt[:end])), reps)
        policy.choose(rk(placement("other-v1", prompt[:end])), reps)
    return policy


def test_a_4000_token_prompt_costs_one_hash_per_block_from_keying_to_routing(monkeypatch):
    rnd = random.Random(4)
    reps = fleet(8)
    prompt = [rnd.randrange(150_000) for _ in range(TOKENS)]
    policy = adversarial_policy(prompt, reps)
    counter = Counting(monkeypatch)
    later = array("I", [*prompt, *(rnd.randrange(150_000) for _ in range(300))])
    decision = policy.choose(rk(placement("trl-policy-v2", list(later))), reps)
    assert decision.kind == "continuation"
    # full + one per block of the chain + the stems checked + recording (the new stem).
    blocks = len(later) // 16
    assert counter.calls <= 1 + blocks + affinity.MAX_STEM_CHECKS + 1


def test_a_sibling_costs_one_hash_of_its_whole_prompt(monkeypatch):
    rnd = random.Random(5)
    reps = fleet(8)
    prompt = [rnd.randrange(150_000) for _ in range(TOKENS)]
    policy = adversarial_policy(prompt, reps)
    body = b'{"model": "trl-policy-v1", "prompt": [%s]}' % b",".join(b"%d" % t for t in prompt)
    seeds = LINEAGES.seeds("trl-policy-v1", True)

    def key() -> keys.RouteKey:
        return keys.completion_key(
            read_completion(body, chat=False, max_prompt_tokens=TOKENS), seeds, 16
        )

    policy.choose(key(), reps)  # placed, and its wire key remembered
    sibling = key()
    counter = Counting(monkeypatch)
    decision = policy.choose(sibling, reps)
    assert decision.kind == "sibling" and decision.tokens == 0  # cached on its home
    assert counter.calls == 0  # the wire hash was computed with the key; the seeds were cached
    # Without a wire key (a text prompt, or another spelling): the whole prompt, once.
    assert policy.choose(rk(placement("trl-policy-v1", prompt)), reps).kind == "sibling"
    assert counter.calls == 1


def test_the_stems_checked_per_lookup_are_capped(monkeypatch):
    # However many earlier prompts sit on the chain of a new prompt, a lookup hashes at most
    # MAX_STEM_CHECKS of their stems.
    rnd = random.Random(6)
    prompt = [rnd.randrange(150_000) for _ in range(TOKENS)]
    table = affinity.AffinityTable(100_000)
    for end in range(32, TOKENS, 7):
        # Each differs from `prompt` in the last token of its stem: none is found.
        earlier = [*prompt[: end - 9], prompt[end - 9] + 1, *prompt[end - 8 : end]]
        table.record(placement("trl-policy-v1", earlier), "A")
    key = placement("trl-policy-v1", prompt)
    assert len(key.chain) == BLOCKS  # computed before counting
    counter = Counting(monkeypatch)
    assert list(table.find(key)) == []
    assert counter.calls == affinity.MAX_STEM_CHECKS
