"""The policy's weights (policy.py, *Weights*): a slow member is dealt fewer families and has
less room, and no family while the full-weight members would finish it sooner (the finish
rule); with every weight full, decisions are those of a policy never given a weight."""

from __future__ import annotations

import random
from collections.abc import Callable
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from routing_doubles import Pool, Rep, fleet, watch

from lora_router.routing import policy as policy_module
from lora_router.routing.keys import PromptKey, RouteKey, prompt_key, wire_key
from lora_router.routing.policy import (
    BATCH_FLOOR,
    DEAL_REQUEST_TOKENS,
    DEAL_UNIT,
    DEFAULT_LOAD_SLACK,
    WEIGHT_FULL,
    WEIGHT_MIN,
    PrefixAffinity,
    scaled_cap,
)


def route(key: PromptKey, wire: int | None = None) -> RouteKey:
    return RouteKey(lambda: key, wire)


def families(n_families: int, seed: int = 0) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(150_000) for _ in range(40)] for _ in range(n_families)]


def run(
    policy: PrefixAffinity, reps: Pool, steps: list[tuple[int, int, int]], prompts: list[list[int]]
) -> list[tuple[str, str, int]]:
    """Replay `steps` (family, sibling or not, answers to retire first) through `policy`,
    counting each request in flight until retired: the decisions made."""
    out = []
    outstanding: list[Rep] = []
    for family, sample, retire in steps:
        for _ in range(min(retire, len(outstanding))):
            outstanding.pop(0).in_flight -= 1
        prompt = prompts[family]
        wire = wire_key("m", repr(prompt).encode()) if sample else None
        decision = policy.choose(route(prompt_key("m", prompt), wire), reps)
        decision.replica.in_flight += 1
        outstanding.append(decision.replica)
        out.append((decision.replica.name, decision.kind, decision.tokens))
    return out


def dealt_to(policy: PrefixAffinity, reps: Pool, prompts: list[list[int]]) -> dict[str, int]:
    """Route each prompt as a new family (loads held where the test set them): how many went
    to each replica."""
    dealt = dict.fromkeys((r.name for r in reps), 0)
    for prompt in prompts:
        dealt[policy.choose(route(prompt_key("m", prompt)), reps).replica.name] += 1
    return dealt


step_lists = st.lists(
    st.tuples(st.integers(0, 60), st.booleans(), st.integers(0, 3)), min_size=1, max_size=250
)


def watched(
    n: int, walk: bool, policy: PrefixAffinity | None = None
) -> tuple[list[Rep], PrefixAffinity]:
    """`n` replicas and a prefix policy watching them, dealing by one ring walk (`walk`) or by
    its kept ranks (policy.py, `WALK_DEAL_MEMBERS`)."""
    reps = fleet(n)
    policy = policy or PrefixAffinity()
    with mock.patch.object(policy_module, "WALK_DEAL_MEMBERS", n if walk else 0):
        watch(policy, reps)
    return reps, policy


@pytest.mark.parametrize("walk", [False, True], ids=["kept ranks", "walk deal"])
@settings(max_examples=40, deadline=None)
@given(st.integers(2, 9), step_lists, st.lists(st.integers(0, 8), max_size=6))
def test_full_weights_decide_exactly_as_no_weights(walk, n, steps, told):
    # Weights set to full (and reset to it) leave every decision as it was without them.
    prompts = families(61)
    decisions = []
    for tell in (False, True):
        reps, policy = watched(n, walk)
        if tell:
            for i in told:
                name = reps[i % n].name
                policy.set_weight(name, WEIGHT_MIN)
                policy.set_weight(name, WEIGHT_FULL)
        decisions.append(run(policy, reps, steps, prompts))
    assert decisions[0] == decisions[1]


def one_slow(walk: bool, weight: int, busy: int) -> tuple[list[Rep], PrefixAffinity]:
    """4 replicas watched (`watched`), the first at `weight`, the others holding `busy`
    requests each."""
    reps, policy = watched(4, walk)
    policy.set_weight(reps[0].name, weight)
    for rep in reps[1:]:
        rep.in_flight = busy
    return reps, policy


@pytest.mark.parametrize("walk", [False, True], ids=["kept ranks", "walk deal"])
@pytest.mark.parametrize("weight", [WEIGHT_FULL // 2, WEIGHT_MIN, 12])
def test_a_slow_member_is_dealt_its_weight_s_share_of_the_families(walk, weight):
    # The full-weight members busy past their batch (60 each, the floor 16), the slow one idle:
    # it would finish every family sooner, and the weighted deal alone decides (its prompt
    # tokens in flight keep the deal window shut: it holds as much work as each of them).
    n = 4
    reps, policy = one_slow(walk, weight, 60)
    reps[0].in_flight_tokens = 60 * DEAL_REQUEST_TOKENS
    dealt = dealt_to(policy, reps, families(700, seed=3))
    share = weight / WEIGHT_FULL
    expected = 700 * share / (n - 1 + share)
    assert abs(dealt[reps[0].name] - expected) <= 2
    others = [dealt[r.name] for r in reps[1:]]
    assert max(others) - min(others) <= 1


@pytest.mark.parametrize("walk", [False, True], ids=["kept ranks", "walk deal"])
@pytest.mark.parametrize("weight", [WEIGHT_FULL // 2, WEIGHT_MIN, 12])
def test_a_slow_member_is_dealt_nothing_while_the_others_run_below_the_batch_floor(walk, weight):
    # The finish rule: every full-weight member holds at most BATCH_FLOOR, so each family would
    # finish 1 / weight times later on the slow member. Its turns pass, and count: once back
    # at full weight it is dealt its even share at once, not a burst of the families it passed
    # (the deal window, which offers it turns while it holds less work, keeps its count within
    # 1.05 x the mean).
    n = 4
    reps, policy = one_slow(walk, weight, BATCH_FLOOR)
    prompts = families(1100, seed=4)
    dealt = dealt_to(policy, reps, prompts[:700])
    assert dealt[reps[0].name] == 0
    assert sorted(dealt.values())[1:] == [233, 233, 234]
    assert 233 <= policy.families(reps[0].name) <= policy.window()  # it kept pace
    policy.set_weight(reps[0].name, WEIGHT_FULL)
    later = dealt_to(policy, reps, prompts[700:])
    # No burst: within the deal window's 5 % of an even share (uncounted turns: all 400).
    assert later[reps[0].name] <= 400 // n * 11 // 10, later


@pytest.mark.parametrize("walk", [False, True], ids=["kept ranks", "walk deal"])
@pytest.mark.parametrize(
    ("slow", "full", "kept"),
    [(0, BATCH_FLOOR, False), (0, BATCH_FLOOR + 1, True), (20, 21, False), (20, 22, True)],
)
def test_the_finish_rule_s_threshold_at_three_quarters(walk, slow, full, kept):
    # Weight 12/16: the slow member keeps its turn when 16 (1 + its requests past the floor) is
    # below 12 (1 + the full-weight member's past the floor).
    reps, policy = watched(2, walk)
    policy.set_weight(reps[0].name, 12)
    policy._dealt[reps[1].name] = DEAL_UNIT * 5  # the slow member's turn by the count
    reps[0].in_flight, reps[1].in_flight = slow, full
    assert scaled_cap(policy.cap(reps), 12) > slow  # room under its scaled cap
    decision = policy.choose(route(prompt_key("m", families(1)[0])), reps)
    assert decision.kind == "fresh"
    assert (decision.replica is reps[0]) is kept


def one_family() -> tuple[list[Rep], PrefixAffinity, Callable[[], RouteKey], Rep]:
    """4 replicas watched by a prefix policy, and one family's first sample routed: the
    replicas, the policy, a new key of a sibling (wire key and block key) per call, the home."""
    reps = fleet(4)
    policy = PrefixAffinity()
    watch(policy, reps)
    prompt = prompt_key("m", families(1)[0])

    def sibling() -> RouteKey:
        return route(prompt, wire_key("m", b"a"))

    return reps, policy, sibling, policy.choose(sibling(), reps).replica


def test_siblings_spill_off_a_slow_home_at_its_scaled_cap() -> None:
    reps, policy, sibling, home = one_family()
    policy.set_weight(home.name, WEIGHT_FULL // 2)
    for rep in reps:
        rep.in_flight = 2
    # 9 at home, 6 elsewhere: a full-weight member's mean counts the home as half a member,
    # 16 requests over 3.5 (4.57), so the cap is 5 + the slack (21), the home's half of it 10.
    home.in_flight = 9
    assert policy.cap(reps) == 5 + DEFAULT_LOAD_SLACK
    assert scaled_cap(policy.cap(reps), WEIGHT_FULL // 2) == 10
    assert policy.choose(sibling(), reps).replica is home  # room for one more
    home.in_flight = 10  # the cap is still 21, its half 10: full
    decision = policy.choose(sibling(), reps)
    assert decision.replica is not home and decision.kind == "spill"
    policy.set_weight(home.name, WEIGHT_FULL)  # back at full speed: room again
    assert policy.choose(sibling(), reps).replica is home


@pytest.mark.parametrize("walk", [False, True], ids=["kept ranks", "walk deal"])
def test_a_slow_member_dealt_the_fewest_is_passed_over_without_room(walk):
    # Its rank is the lowest (fewest families), but it is at its scaled cap: the deal goes on.
    policy = PrefixAffinity()
    names = [r.name for r in fleet(4)]  # the replicas `watched` makes
    policy._dealt = {name: (0 if i == 0 else 5 * DEAL_UNIT) for i, name in enumerate(names)}
    reps, policy = watched(4, walk, policy)
    policy.set_weight(reps[0].name, WEIGHT_MIN)
    for rep in reps[1:]:
        rep.in_flight = 40  # past the batch floor: it would finish a family sooner (finish rule)
    # The cap is 42 + the slack (58: 135 requests over 3.25 members' worth), a quarter of it
    # 14: full.
    reps[0].in_flight = 14
    assert scaled_cap(policy.cap(reps), WEIGHT_MIN) == 14
    decision = policy.choose(route(prompt_key("m", families(1)[0])), reps)
    assert decision.kind == "fresh" and decision.replica is not reps[0]
    reps[0].in_flight = 13  # room for one
    decision = policy.choose(route(prompt_key("m", families(2)[1])), reps)
    assert decision.replica is reps[0]


@pytest.mark.parametrize("walk", [False, True], ids=["kept ranks", "walk deal"])
@settings(max_examples=30, deadline=None)
@given(
    st.integers(2, 9),
    step_lists,
    st.lists(st.integers(WEIGHT_MIN, WEIGHT_FULL), min_size=9, max_size=9),
)
def test_the_kept_ranks_and_the_walk_deal_agree_under_weights(walk, n, steps, weights):
    # The two ways of dealing (policy.py, WALK_DEAL_MEMBERS) make the same choice, weights or
    # not, and no member is ever sent past its scaled cap's room... unless none has any.
    prompts = families(61)
    decisions = []
    for small in (True, False):
        reps, policy = watched(n, small)
        for rep, weight in zip(reps, weights, strict=False):
            policy.set_weight(rep.name, weight)
        decisions.append(run(policy, reps, steps, prompts))
    assert decisions[0] == decisions[1]


def test_a_weight_outside_its_bounds_is_refused() -> None:
    policy = PrefixAffinity()
    with pytest.raises(ValueError, match="weight"):
        policy.set_weight("a", WEIGHT_MIN - 1)
    with pytest.raises(ValueError, match="weight"):
        policy.set_weight("a", WEIGHT_FULL + 1)


family_prompts = st.lists(st.integers(0, 150_000), min_size=20, max_size=120)
turns = st.lists(st.integers(0, 150_000), min_size=1, max_size=80)
# Longer than a stem's cut (keys.RERENDER_BYTES): another first later turn of the family then
# does not start with this one's stem (tests/routing/test_move.py says the same).
long_turns = st.lists(st.integers(0, 150_000), min_size=9, max_size=80)


@settings(max_examples=40, deadline=None)
@given(family_prompts, long_turns, turns, st.integers(2, 8))
def test_a_later_turn_leaves_a_slow_home_for_the_first_full_weight_member_with_room(
    prompt, turn, deeper, n
):
    # The finish rule for later turns: the conversation moves (its next turn follows it), and
    # once its home is back at full weight a later turn stays there.
    reps = fleet(n)
    policy = PrefixAffinity()
    watch(policy, reps)
    family = prompt_key("m", prompt)
    home = policy.choose(route(family), reps).replica
    policy.set_weight(home.name, WEIGHT_FULL // 2)
    later = prompt_key("m", prompt + turn)
    decision = policy.choose(route(later), reps)
    first_full = next(name for name in policy.ring.walk(family.full) if name != home.name)
    assert (decision.replica.name, decision.kind) == (first_full, "spill")
    assert decision.tokens == later.tokens  # its history is computed there
    next_turn = prompt_key("m", prompt + turn + deeper)
    assert policy.choose(route(next_turn), reps)[:2] == (decision.replica, "continuation")
    policy.set_weight(home.name, WEIGHT_FULL)
    other = prompt_key("m", [*prompt, 150_001, *turn])
    assert policy.choose(route(other), reps)[:2] == (home, "continuation")


def test_a_later_turn_stays_on_a_slow_home_when_no_full_weight_member_has_room() -> None:
    reps = fleet(4)
    policy = PrefixAffinity()
    watch(policy, reps)
    prompt = families(1)[0]
    home = policy.choose(route(prompt_key("m", prompt)), reps).replica
    others = [r for r in reps if r is not home]
    # Two members at half speed, idle: the cap is 1.25 x the mean of a full-weight member (201
    # requests over 3 members' worth, 67), 84, and the two full-weight members hold more.
    # (With one half-speed member of four, some full-weight one always has room.)
    for slow in (home, others[0]):
        policy.set_weight(slow.name, WEIGHT_FULL // 2)
    for rep in others[1:]:
        rep.in_flight = 100
    # The home's follow cap (67 + twice the slack) scaled to half (49) leaves it room.
    assert policy.cap(reps) == 84 and scaled_cap(policy.follow_cap(reps), WEIGHT_FULL // 2) == 49
    decision = policy.choose(route(prompt_key("m", [*prompt, 5, 6, 7])), reps)
    assert decision[:2] == (home, "continuation")
    others[-1].in_flight = 73  # room for one more under the cap (now 74): the one it finds
    decision = policy.choose(route(prompt_key("m", [*prompt, 8, 9, 10])), reps)
    assert decision[:2] == (others[-1], "spill")


def teach_family_size(policy: PrefixAffinity, size: int) -> None:
    """Make the policy's record say families of `size` requests: 100 families dealt and their
    siblings (`_family_size` reads the decision counts)."""
    policy.counts.fresh = 100
    policy.counts.sibling = 100 * (size - 1)


@pytest.mark.parametrize("walk", [False, True], ids=["kept ranks", "walk deal"])
@pytest.mark.parametrize("size", [2, 8, 16])
def test_a_slow_member_keeps_a_new_family_only_with_room_for_all_of_it(walk, size):
    # The others past the floor: the slow member would finish a family sooner (the finish
    # rule), and it keeps one only while its scaled cap has room for as many requests as the
    # families so far brought (a group split over it would wait for its slow siblings). (With
    # room for one request alone it holds about its share of the weighted cap: a full-weight
    # member finishes sooner.)
    policy = PrefixAffinity()
    names = [r.name for r in fleet(4)]  # the replicas `watched` makes
    policy._dealt = {name: (0 if i == 0 else 5 * DEAL_UNIT) for i, name in enumerate(names)}
    reps, policy = watched(4, walk, policy)
    slow = reps[0]
    policy.set_weight(slow.name, WEIGHT_FULL // 2)
    for rep in reps[1:]:
        rep.in_flight = 60
    teach_family_size(policy, size)

    def load_until(room: int) -> None:
        """The fewest requests on the slow member that leave it `room` under its scaled cap
        (each one more takes one from its room or none: the cap grows with the load)."""
        for held in range(100):
            slow.in_flight = held
            if scaled_cap(policy.cap(reps), WEIGHT_FULL // 2) - held == room:
                return
        raise AssertionError(f"no load leaves room for {room}")

    load_until(size)
    assert slow.in_flight > BATCH_FLOOR  # past the floor itself, still sooner than the others
    prompts = families(2, seed=9)
    assert policy.choose(route(prompt_key("m", prompts[0])), reps).replica is slow
    load_until(size - 1)  # one short of the family's room
    decision = policy.choose(route(prompt_key("m", prompts[1])), reps)
    assert decision.kind == "fresh" and decision.replica is not slow


@pytest.mark.parametrize("walk", [False, True], ids=["kept ranks", "walk deal"])
def test_a_slow_member_counts_the_siblings_still_to_come_of_a_family_it_was_dealt(walk):
    # A family's samples are separate requests: the finish rule counts the siblings of a family
    # dealt to the slow member as held there until they are routed, so a second family dealt
    # before they arrive cannot take their room and be split. A member that holds nothing
    # awaits nothing: siblings are sent with their first.
    size = 8
    policy = PrefixAffinity()
    names = [r.name for r in fleet(4)]  # the replicas `watched` makes
    # The others dealt far more: the deal offers every family to the slow member first.
    policy._dealt = {name: (0 if i == 0 else 50 * DEAL_UNIT) for i, name in enumerate(names)}
    reps, policy = watched(4, walk, policy)
    slow = reps[0]
    policy.set_weight(slow.name, WEIGHT_MIN)
    for rep in reps[1:]:
        rep.in_flight = 22  # past the floor: the slow member would finish a family sooner
    teach_family_size(policy, size)
    first, second, third, fourth = families(4, seed=4)

    def sample(prompt: list[int]) -> RouteKey:
        return route(prompt_key("m", prompt), wire_key("m", repr(prompt).encode()))

    def sent(prompt: list[int]) -> Rep:
        replica = policy.choose(sample(prompt), reps).replica
        replica.in_flight += 1
        return replica

    assert scaled_cap(policy.cap(reps), WEIGHT_MIN) == size + 1  # one family, and one more
    assert sent(first) is slow
    # Its 7 siblings on their way: the second family would have room only without them.
    assert slow.in_flight + size <= scaled_cap(policy.cap(reps), WEIGHT_MIN)
    assert sent(second) is not slow
    assert [sent(first) for _ in range(size - 1)] == [slow] * (size - 1)  # all of them home
    slow.in_flight = 1  # the siblings answered, the first still decoding: none to come
    assert sent(third) is slow
    slow.in_flight = 0  # the third family's first answered, its siblings never sent
    assert sent(fourth) is slow


def test_a_spill_passes_over_a_slow_member_for_a_full_weight_one_with_room() -> None:
    reps, policy, sibling, home = one_family()
    block = sibling().key
    assert block is not None
    walk = [name for name in policy.ring.walk(block.full) if name != home.name]
    first = next(r for r in reps if r.name == walk[0])  # where a spill goes at full weights
    for rep in reps:
        rep.in_flight = 2
    home.in_flight = 30  # the cap is 26 (9.25 + the slack, rounded up): the home is full
    assert policy.cap(reps) == 26
    assert policy.choose(sibling(), reps)[:2] == (first, "spill")
    policy.set_weight(first.name, WEIGHT_FULL // 2)  # room under its scaled cap (13) still
    second = next(r for r in reps if r.name == walk[1])
    assert policy.choose(sibling(), reps)[:2] == (second, "spill")
    third = next(r for r in reps if r.name == walk[2])
    policy.set_weight(third.name, WEIGHT_FULL // 2)
    home.in_flight = second.in_flight = 100  # no full-weight member has room under the cap
    assert policy.cap(reps) == 86  # 205 requests over 3 members' worth (68.3) + the slack
    assert policy.choose(sibling(), reps)[:2] == (first, "spill")
