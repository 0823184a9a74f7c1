"""fleet/pace.py: a replica's pace from its answers, and the weight it gives the policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st

from lora_router.fleet.pace import BAND, JUDGE_EVERY, MIN_SAMPLES, STALE_S, Pace, PaceRule
from lora_router.routing.policy import WEIGHT_FULL, WEIGHT_MIN


@dataclass
class Member:
    name: str
    pace: Pace = field(default_factory=Pace)


def fleet(n: int) -> tuple[list[Member], PaceRule, list[tuple[str, int]]]:
    members = [Member(f"r{i}") for i in range(n)]
    told: list[tuple[str, int]] = []
    rule = PaceRule(lambda: members, lambda name, w: told.append((name, w)))
    return members, rule, told


# Four members answer in turn: a judgement every JUDGE_EVERY answers, 8 rounds; the first that
# finds MIN_SAMPLES of each is after JUDGED rounds.
JUDGED = 2 * JUDGE_EVERY // 4
assert JUDGED == MIN_SAMPLES


def rounds(rule: PaceRule, members: list[Member], per_token: list[float], count: int) -> None:
    """`count` answers of 5 tokens from each member in turn, 0.25 s apart (the clock goes on
    from the latest answer), at `per_token` seconds a token."""
    now = max(m.pace.last for m in members) or 100.0
    for _ in range(count):
        for member, seconds in zip(members, per_token, strict=True):
            now += 0.25
            rule.answered(member, seconds * 5, 5, now)


def test_a_half_speed_replica_gets_about_half_the_weight_and_the_others_keep_theirs() -> None:
    members, rule, told = fleet(4)
    rounds(rule, members, [0.02, 0.01, 0.01, 0.01], JUDGED - 1)
    assert told == []  # too few samples yet
    rounds(rule, members, [0.02, 0.01, 0.01, 0.01], 1)
    assert [m.pace.weight for m in members] == [WEIGHT_FULL // 2] + [WEIGHT_FULL] * 3
    assert told == [("r0", WEIGHT_FULL // 2)]  # told once, only of the change


def test_a_weight_is_judged_on_answers_sent_under_it_only() -> None:
    # Still twice as slow right after the cut: its samples restarted, so the next judgement
    # waits for MIN_SAMPLES new ones, and halves it once more only then.
    members, rule, told = fleet(4)
    rounds(rule, members, [0.02, 0.01, 0.01, 0.01], JUDGED)
    assert members[0].pace.samples == 0
    rounds(rule, members, [0.02, 0.01, 0.01, 0.01], JUDGED // 2)  # a judgement, too few
    assert told == [("r0", WEIGHT_FULL // 2)]
    rounds(rule, members, [0.02, 0.01, 0.01, 0.01], JUDGED // 2)
    assert told == [("r0", WEIGHT_FULL // 2), ("r0", WEIGHT_FULL // 4)]


def test_an_answer_sent_before_its_replica_s_weight_changed_is_no_sample() -> None:
    members, rule, _ = fleet(4)
    rounds(rule, members, [0.02, 0.01, 0.01, 0.01], JUDGED)
    changed = members[0].pace.since
    rule.answered(members[0], 5.0, 100, changed + 1.0)  # sent 4 s before the change
    assert members[0].pace.samples == 0
    rule.answered(members[0], 0.5, 100, changed + 1.0)  # sent after it
    assert members[0].pace.samples == 1


def test_a_weight_never_goes_below_its_floor() -> None:
    members, rule, _ = fleet(4)
    for _ in range(6):
        rounds(rule, members, [0.1, 0.01, 0.01, 0.01], JUDGED)
    assert members[0].pace.weight == WEIGHT_MIN


def test_a_slow_replica_that_catches_up_gets_its_weight_back() -> None:
    members, rule, told = fleet(4)
    rounds(rule, members, [0.02, 0.01, 0.01, 0.01], JUDGED)
    assert members[0].pace.weight == WEIGHT_FULL // 2
    # As fast as the others: the weight holds (inside the band, the balance sought).
    rounds(rule, members, [0.011, 0.01, 0.01, 0.01], 3 * JUDGED)
    assert members[0].pace.weight == WEIGHT_FULL // 2
    # Faster than the others (they are loaded): its weight rises, never past full.
    rounds(rule, members, [0.002, 0.01, 0.01, 0.01], 3 * JUDGED)
    assert members[0].pace.weight == WEIGHT_FULL
    weights = [w for _, w in told]
    assert weights[0] == WEIGHT_FULL // 2 and weights[-1] == WEIGHT_FULL
    assert weights[1:] == sorted(weights[1:])  # only up, once it caught up


def test_stale_evidence_returns_a_replica_to_full_weight() -> None:
    members, rule, told = fleet(3)
    rounds(rule, members, [0.02, 0.01, 0.01], 2 * JUDGE_EVERY // 3 + 1)
    assert members[0].pace.weight < WEIGHT_FULL
    last = members[0].pace.last
    # Only the others answer, past STALE_S after r0's last answer.
    for i in range(JUDGE_EVERY):
        rule.answered(members[1 + i % 2], 1.0, 100, last + STALE_S + 1 + i)
    assert members[0].pace.weight == WEIGHT_FULL
    assert told[-1] == ("r0", WEIGHT_FULL)
    assert members[0].pace.samples == 0


def test_answers_without_tokens_are_no_sample() -> None:
    members, rule, _ = fleet(2)
    rule.answered(members[0], 1.0, 0, 1.0)
    rule.answered(members[0], -1.0, 5, 1.0)
    assert members[0].pace.samples == 0


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 8),
    st.lists(st.floats(1 / BAND + 0.01, BAND - 0.01), min_size=1, max_size=400),
)
def test_paces_inside_the_band_never_change_a_weight(n, spreads):
    # A fleet at one speed: every answer's pace within the band of every other's (the median
    # of paces inside [a, a * k] is too, k < BAND): no weight ever moves, however many answers.
    members, rule, told = fleet(n)
    now = 0.0
    for i, spread in enumerate(spreads * 4):
        now += 0.01
        low = min(spreads)
        # Each pace at most BAND^0.5 from the lowest: any two within the band of each other.
        per_token = 0.01 * (1 + (spread - low) / (BAND - low) * (BAND**0.5 - 1))
        rule.answered(members[i % n], per_token * 50, 50, now)
    assert told == []
    assert all(m.pace.weight == WEIGHT_FULL for m in members)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 6),
    st.lists(
        st.tuples(st.integers(0, 5), st.floats(0.0, 5.0), st.integers(0, 600), st.floats(0, 40)),
        max_size=300,
    ),
)
def test_weights_stay_in_bounds_and_the_policy_hears_every_change(n, answers):
    members, rule, told = fleet(n)
    now = 0.0
    last = {m.name: WEIGHT_FULL for m in members}
    for who, seconds, tokens, gap in answers:
        now += gap
        rule.answered(members[who % n], seconds, tokens, now)
        assert all(WEIGHT_MIN <= m.pace.weight <= WEIGHT_FULL for m in members)
    for name, weight in told:
        assert weight != last[name]  # only changes are told
        last[name] = weight
    assert last == {m.name: m.pace.weight for m in members}


def test_an_answer_faster_than_an_engine_step_is_no_sample() -> None:
    # The loop's clock counts whole milliseconds (uvloop): an answer back within one reads 0 s.
    # It says nothing of a pace, and a replica whose samples summed to 0 s made the judgement
    # divide by zero in the answer's end callback, which stalled the request; answers of a few
    # milliseconds (the network's and the router's time) made a uniform fleet's weights flap.
    members, rule, told = fleet(2)
    rounds(rule, members, [0.0, 0.001], 4 * JUDGED)  # 0 and 5 ms answers of 5 tokens
    assert members[0].pace.samples == 0
    assert told == [] and [m.pace.weight for m in members] == [WEIGHT_FULL] * 2
