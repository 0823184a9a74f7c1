"""A family's first later turn leaves a home that holds more work than the next replica on its
family's ring path by more than the turn's price (`PrefixAffinity._lighter`), within bounds on
how many conversations move and what they may recompute."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from routing_doubles import Pool, Rep, fleet, watch

from lora_router.routing import policy as policy_module
from lora_router.routing.affinity import AffinityTable, anchor_first
from lora_router.routing.keys import PromptKey, RouteKey, prompt_key, wire_key
from lora_router.routing.policy import (
    DEFAULT_MOVE_PRICE,
    MOVE_BUDGET,
    MOVE_REQUEST_TOKENS,
    MOVE_SHARE,
    PrefixAffinity,
)

family_prompts = st.lists(st.integers(0, 150_000), min_size=20, max_size=120)
turns = st.lists(st.integers(0, 150_000), min_size=1, max_size=80)
# Longer than a stem's cut (keys.RERENDER_BYTES): a turn's stem then reaches into the turn,
# so another first later turn of the family does not start with it.
long_turns = st.lists(st.integers(0, 150_000), min_size=9, max_size=80)
fleet_sizes = st.integers(2, 8)
# The filler prompt's tokens: each filler request routed adds FILLER_TOKENS / MOVE_BUDGET
# tokens to the moves' budget (about 3, room for the moves the tests below make).
FILLER_TOKENS = 1_000


def primed(n: int, routed: int, **options: int) -> tuple[PrefixAffinity, Pool]:
    """A policy over n idle replicas that has routed `routed` requests (one filler prompt of
    FILLER_TOKENS and its siblings, by wire key), so that the share and budget bounds leave
    room for moves."""
    reps = fleet(n)
    policy = PrefixAffinity(**options)
    watch(policy, reps)
    filler = [7] * FILLER_TOKENS
    key = prompt_key("filler", filler)
    wire = wire_key("filler", str(filler).encode())
    for _ in range(routed):
        policy.choose(RouteKey(lambda: key, wire), reps)
    return policy, reps


def place(policy: PrefixAffinity, key: PromptKey, reps: Pool) -> Rep:
    decision = policy.choose(RouteKey(lambda: key, None), reps)
    assert decision.kind == "fresh"
    return decision.replica


def target_of(policy: PrefixAffinity, family: PromptKey, home: Rep, reps: Pool) -> Rep:
    """The first replica other than the home on the ring from the family's key (the rule's
    one candidate when every replica has room)."""
    name = next(n for n in policy.ring.walk(family.full) if n != home.name)
    return next(r for r in reps if r.name == name)


def price(tokens: int, move_price: int = DEFAULT_MOVE_PRICE) -> int:
    return move_price * tokens + MOVE_REQUEST_TOKENS


def routed_enough(n: int) -> int:
    return MOVE_SHARE * n * 4


@settings(max_examples=40, deadline=None)
@given(family_prompts, turns, fleet_sizes)
def test_a_first_later_turn_moves_when_its_home_outweighs_the_next_by_more_than_its_price(
    prompt, turn, n
):
    policy, reps = primed(n, routed_enough(n))
    family = prompt_key("m", prompt)
    home = place(policy, family, reps)
    later = prompt_key("m", prompt + turn)
    home.in_flight = 1
    home.in_flight_tokens = price(later.tokens) - MOVE_REQUEST_TOKENS + 1
    decision = policy.choose(RouteKey(lambda: later, None), reps)
    assert decision.replica is target_of(policy, family, home, reps)
    assert (decision.kind, decision.tokens) == ("spill", later.tokens)


@settings(max_examples=40, deadline=None)
@given(family_prompts, long_turns, fleet_sizes, st.integers(0, 5_000))
def test_a_first_later_turn_stays_home_when_the_difference_is_exactly_its_price(
    prompt, turn, n, other
):
    policy, reps = primed(n, routed_enough(n))
    family = prompt_key("m", prompt)
    home = place(policy, family, reps)
    target = target_of(policy, family, home, reps)
    later = prompt_key("m", prompt + turn)
    target.in_flight, target.in_flight_tokens = 1, other  # W(target) = other + D
    home.in_flight = 2
    home.in_flight_tokens = price(later.tokens) + other - MOVE_REQUEST_TOKENS  # W = that + price
    decision = policy.choose(RouteKey(lambda: later, None), reps)
    assert (decision.replica, decision.kind) == (home, "continuation")
    # Another first later turn (that one is now known where it went), one token above its price.
    other_turn = prompt_key("m", [*prompt, 150_001, *turn])
    home.in_flight_tokens = price(other_turn.tokens) + other - MOVE_REQUEST_TOKENS + 1
    assert policy.choose(RouteKey(lambda: other_turn, None), reps).replica is target


@settings(max_examples=40, deadline=None)
@given(family_prompts, turns, turns, fleet_sizes)
def test_a_deeper_later_turn_stays_home_however_heavy_its_home(prompt, turn, deeper, n):
    # Its history is its own: recomputing it elsewhere costs the hit rate what no balance pays.
    policy, reps = primed(n, routed_enough(n))
    family = prompt_key("m", prompt)
    home = place(policy, family, reps)
    first_later = prompt_key("m", prompt + turn)
    assert policy.choose(RouteKey(lambda: first_later, None), reps)[:2] == (home, "continuation")
    home.in_flight = 8
    home.in_flight_tokens = 10**9
    second_later = prompt_key("m", prompt + turn + deeper)
    decision = policy.choose(RouteKey(lambda: second_later, None), reps)
    assert (decision.replica, decision.kind) == (home, "continuation")


@settings(max_examples=40, deadline=None)
@given(family_prompts, turns, turns, fleet_sizes)
def test_the_next_turn_of_a_moved_conversation_follows_it(prompt, turn, deeper, n):
    policy, reps = primed(n, routed_enough(n))
    family = prompt_key("m", prompt)
    home = place(policy, family, reps)
    later = prompt_key("m", prompt + turn)
    home.in_flight, home.in_flight_tokens = 1, 10**9
    moved = policy.choose(RouteKey(lambda: later, None), reps)
    assert moved.kind == "spill" and moved.replica is not home
    home.in_flight, home.in_flight_tokens = 0, 0
    next_turn = prompt_key("m", prompt + turn + deeper)
    decision = policy.choose(RouteKey(lambda: next_turn, None), reps)
    assert (decision.replica, decision.kind) == (moved.replica, "continuation")


def later_turns(prompt: list[int], count: int) -> list[PromptKey]:
    """First later turns of one family that differ from each other early (each one's stem is
    no prefix of another), as siblings' turns do."""
    return [prompt_key("m", prompt + [1_000 + i] + [5] * 10) for i in range(count)]


@settings(max_examples=20, deadline=None)
@given(family_prompts, fleet_sizes, st.integers(1, 3))
def test_moves_into_one_replica_stop_at_one_per_share_of_the_requests_per_replica(
    prompt, n, allowed
):
    # `routed` decisions allow `allowed` moves into one replica, and every later turn of one
    # family tries the same replica: exactly that many move, the rest stay home.
    routed = MOVE_SHARE * n * allowed
    policy, reps = primed(n, routed - 1)  # the family prompt below is the routed-th
    home = place(policy, prompt_key("m", prompt), reps)
    home.in_flight, home.in_flight_tokens = 1, 10**9
    kinds = [
        policy.choose(RouteKey(lambda k=later: k, None), reps).kind
        for later in later_turns(prompt, allowed + 3)
    ]
    assert kinds == ["spill"] * allowed + ["continuation"] * 3


@settings(max_examples=20, deadline=None)
@given(family_prompts, fleet_sizes, st.integers(0, 60), st.integers(30, 40))
def test_moves_stop_once_their_priced_tokens_reach_the_budget(prompt, n, routed, count):
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(policy_module, "MOVE_SHARE", 0)  # the share never binds here
        budgeted(prompt, n, routed, count)


def budgeted(prompt: list[int], n: int, routed: int, count: int) -> None:
    policy, reps = primed(n, routed)
    family = prompt_key("m", prompt)
    home = place(policy, family, reps)
    home.in_flight, home.in_flight_tokens = 1, 10**9
    spent, seen, kinds, expected = 0, FILLER_TOKENS * routed + family.tokens, [], []
    for later in later_turns(prompt, count):
        # The k-th move is allowed while all moves' prompt tokens stay within 1 / MOVE_BUDGET
        # of the prompt tokens routed, its own included.
        seen += later.tokens
        fits = (spent + later.tokens) * MOVE_BUDGET <= seen
        expected.append("spill" if fits else "continuation")
        spent += later.tokens * fits
        kinds.append(policy.choose(RouteKey(lambda k=later: k, None), reps).kind)
    assert kinds == expected and "continuation" in kinds


@settings(max_examples=30, deadline=None)
@given(family_prompts, turns, fleet_sizes)
def test_a_zero_move_price_never_moves_a_turn(prompt, turn, n):
    policy, reps = primed(n, routed_enough(n), move_price=0)
    family = prompt_key("m", prompt)
    home = place(policy, family, reps)
    home.in_flight, home.in_flight_tokens = 1, 10**9
    later = prompt_key("m", prompt + turn)
    decision = policy.choose(RouteKey(lambda: later, None), reps)
    assert (decision.replica, decision.kind) == (home, "continuation")


@settings(max_examples=30, deadline=None)
@given(family_prompts, turns, fleet_sizes)
def test_a_turn_moves_only_to_a_replica_below_the_load_cap(prompt, turn, n):
    policy, reps = primed(n, routed_enough(n))
    family = prompt_key("m", prompt)
    home = place(policy, family, reps)
    full = target_of(policy, family, home, reps)
    full.in_flight = 100  # above the load cap of 100 requests over n replicas
    assert full.in_flight >= policy.cap(reps)
    home.in_flight_tokens = 10**12
    later = prompt_key("m", prompt + turn)
    decision = policy.choose(RouteKey(lambda: later, None), reps)
    assert decision.replica is not full
    if n == 2:  # no other replica: it stays
        assert (decision.replica, decision.kind) == (home, "continuation")
    else:  # the next on the family's ring path
        assert decision.kind == "spill" and decision.replica.in_flight < policy.cap(reps)


@settings(max_examples=30, deadline=None)
@given(family_prompts, turns, fleet_sizes)
def test_a_sibling_is_charged_no_tokens_and_a_continuation_those_past_its_prefix(prompt, turn, n):
    policy, reps = primed(n, 0)
    family = prompt_key("m", prompt)
    fresh = policy.choose(RouteKey(lambda: family, None), reps)
    assert fresh.tokens == family.tokens  # a new family: all of it is computed
    sibling = policy.choose(RouteKey(lambda: family, None), reps)
    assert (sibling.kind, sibling.tokens) == ("sibling", 0)
    later = prompt_key("m", prompt + turn)
    continuation = policy.choose(RouteKey(lambda: later, None), reps)
    assert continuation.kind == "continuation"
    assert continuation.tokens == later.tokens - family.tokens


@given(family_prompts, turns)
def test_only_a_prompt_recorded_as_first_is_marked_as_a_familys_first(prompt, turn):
    table = AffinityTable(100)
    first, later = prompt_key("m", prompt), prompt_key("m", prompt + turn)
    table.record(first, "A", first=True)
    table.record(later, "A")
    marks = {anchor[3]: anchor_first(anchor) for anchor, _ in table.find(later)}
    assert marks == {later.full: False, first.full: True}
