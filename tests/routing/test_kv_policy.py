"""`--policy kv`: a new family goes where its prefix really is; everything else is `prefix`."""

from __future__ import annotations

import ast
from collections.abc import Sequence
from pathlib import Path

from routing_doubles import Pool, Rep, fleet, watch

from lora_router.routing import kv_policy
from lora_router.routing.keys import Lineages, PromptKey, RouteKey, prompt_key
from lora_router.routing.kv_index import LIVE, STALE, KvIndex
from lora_router.routing.kv_policy import KvLookup
from lora_router.routing.policy import PrefixAffinity

BLOCK = 16
LINEAGES = Lineages()
MODEL = "pol-v1"


def root(lora: str | None) -> int:
    return LINEAGES.seeds(lora, lora is not None).token


def key(tokens: list[int], model: str | None = MODEL) -> PromptKey:
    return prompt_key(None, tokens, BLOCK, seed=root(model))


def route(tokens: list[int], model: str | None = MODEL) -> RouteKey:
    built = key(tokens, model)
    return RouteKey(lambda: built)


def pool(n: int, model: str | None = MODEL) -> Pool:
    reps = fleet(n)
    reps.model = model
    return reps


def setup(reps: Sequence[Rep]) -> tuple[PrefixAffinity, KvIndex]:
    index = KvIndex(root, BLOCK)
    for r in reps:
        index.set_state(r.name, LIVE)
    policy = PrefixAffinity(prefer=KvLookup(index))
    watch(policy, reps)
    return policy, index


def hold(index: KvIndex, replica: Rep, tokens: list[int], lora: str | None = MODEL) -> None:
    """The replica's events said it stored the full blocks of `tokens` (any vLLM hashes)."""
    blocks = len(tokens) // BLOCK
    salt = hash(replica.name)
    hashes = [(salt, lora, tuple(tokens[: (i + 1) * BLOCK])) for i in range(blocks)]
    index.stored(replica.name, hashes, None, tokens[: blocks * BLOCK], BLOCK, lora)


PROMPT = list(range(100, 164))  # 4 blocks


def dealt(reps: Pool, tokens: list[int]) -> Rep:
    """Where `prefix` sends `tokens` as a new family on an idle fleet."""
    policy = PrefixAffinity()
    watch(policy, reps)
    return policy.choose(route(tokens), reps).replica


def test_a_new_family_goes_where_its_prefix_really_is() -> None:
    reps = pool(3)
    predicted = dealt(reps, PROMPT)
    holder = next(r for r in reps if r is not predicted)
    policy, index = setup(reps)
    hold(index, holder, PROMPT[:48])
    decision = policy.choose(route(PROMPT), reps)
    assert (decision.replica, decision.kind, decision.tokens) == (holder, "kv", 64 - 48)
    assert policy.counts.kv == 1 and policy.counts.fresh == 0


def test_the_longest_prefix_wins() -> None:
    reps = pool(3)
    policy, index = setup(reps)
    hold(index, reps[0], PROMPT[:16])
    hold(index, reps[1], PROMPT[:48])
    hold(index, reps[2], PROMPT[:32])
    assert policy.choose(route(PROMPT), reps).replica is reps[1]


def test_without_a_hit_the_deal_decides_as_prefix_does() -> None:
    reps = pool(3)
    predicted = dealt(reps, PROMPT)
    policy, index = setup(reps)
    hold(index, reps[0], list(range(900, 964)))  # another prompt
    decision = policy.choose(route(PROMPT), reps)
    assert (decision.replica, decision.kind) == (predicted, "fresh")


def test_a_holder_at_the_load_cap_is_passed_over() -> None:
    reps = pool(2)
    policy, index = setup(reps)
    hold(index, reps[0], PROMPT)
    while reps[0].in_flight < policy.cap(reps):  # the cap grows with the load
        reps[0].in_flight += 1
    decision = policy.choose(route(PROMPT), reps)
    assert (decision.replica, decision.kind) == (reps[1], "fresh")


def test_a_replica_whose_events_are_not_live_gets_the_prediction() -> None:
    reps = pool(3)
    predicted = dealt(reps, PROMPT)
    holder = next(r for r in reps if r is not predicted)
    policy, index = setup(reps)
    hold(index, holder, PROMPT)
    index.set_state(holder.name, STALE, "publisher disconnected")
    assert policy.choose(route(PROMPT), reps).replica is predicted


def test_another_version_of_the_adapter_holds_nothing_of_it() -> None:
    reps = pool(3, model="pol-v2")
    predicted = dealt(reps, PROMPT)
    holder = next(r for r in reps if r is not predicted)
    policy, index = setup(reps)
    hold(index, holder, PROMPT, lora="pol-v1")  # same lineage, other name: other blocks
    assert policy.choose(route(PROMPT, "pol-v2"), reps).kind == "fresh"


def test_a_known_family_keeps_its_lineage_placement() -> None:
    reps = pool(3)
    policy, index = setup(reps)
    hold(index, reps[2], PROMPT)
    assert policy.choose(route(PROMPT), reps).replica is reps[2]
    # Its blocks move elsewhere (evicted on 2, held by 0): the family stays where it lives.
    index.reset(reps[2].name, LIVE)
    hold(index, reps[0], [*PROMPT, *range(7000, 7040)])
    later = policy.choose(route([*PROMPT, *range(7000, 7040)]), reps)
    assert (later.replica, later.kind) == (reps[2], "continuation")
    assert policy.choose(route(PROMPT), reps).kind == "sibling"


def test_holders_tied_are_dealt_among_and_counted_as_dealt() -> None:
    reps = pool(3)
    policy, index = setup(reps)
    for r in reps[:2]:
        hold(index, r, PROMPT)
    first = policy.choose(route(PROMPT), reps).replica
    second = policy.choose(route([*PROMPT[:32], *range(5000, 5032)]), reps).replica
    assert {first, second} == {reps[0], reps[1]}  # the second family went to the other holder


def test_a_text_prompt_is_never_looked_up() -> None:
    reps = pool(2)
    policy, index = setup(reps)
    hold(index, reps[1], PROMPT)
    text_key = prompt_key(None, PROMPT, BLOCK, seed=LINEAGES.seeds(MODEL, True).text)
    assert policy.choose(RouteKey(lambda: text_key), reps).kind == "fresh"


def test_a_prefix_every_family_shares_does_not_pull_them_all() -> None:
    reps = pool(2)
    policy, index = setup(reps)
    system = list(range(40_000, 40_064))  # a system prompt only replica 0 holds
    hold(index, reps[0], system)
    chosen = [
        policy.choose(route([*system, *range(1000 * i, 1000 * i + 32)]), reps).replica
        for i in range(1, 11)
    ]
    # The deal window keeps families within 5 % of the mean (floored): 5 each.
    assert chosen.count(reps[0]) == chosen.count(reps[1]) == 5
    assert policy.counts.kv >= 1 and policy.counts.kv + policy.counts.fresh == 10


def test_families_placed_before_the_router_started_are_followed_past_the_window() -> None:
    reps = pool(2)
    policy, index = setup(reps)
    firsts = [list(range(1000 * i, 1000 * i + 64)) for i in range(1, 5)]
    for i, tokens in enumerate(firsts):  # four families an earlier router put on replica 0
        index.stored(reps[0].name, [(i, b) for b in range(4)], None, tokens, BLOCK, MODEL, True)
    chosen = [policy.choose(route([*t, *range(90, 110)]), reps).replica for t in firsts]
    assert chosen == [reps[0]] * 4 and policy.counts.kv == 4


def test_the_kv_lookup_is_given_to_the_prefix_policy_not_derived_from_it() -> None:
    """Composition (#41): kv_policy.py's classes inherit nothing and read no underscore
    attribute but those they set themselves; what they need of the deal is `contract.Deal`."""
    tree = ast.parse(Path(kv_policy.__file__).read_text())
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        assert cls.bases == [], cls.name
        own = {
            node.attr
            for node in ast.walk(cls)
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
        }
        read = {
            node.attr
            for node in ast.walk(cls)
            if isinstance(node, ast.Attribute) and node.attr.startswith("_")
        }
        assert read <= own, (cls.name, read - own)
