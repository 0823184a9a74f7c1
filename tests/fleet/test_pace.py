"""fleet/pace.py: a replica's decode step from its scraped reports, and the weight it gives the
policy."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import example, given, settings
from hypothesis import strategies as st

from lora_router.fleet.pace import (
    BAND,
    MIN_DECODED,
    MIN_SAMPLES,
    PAUSE_SHARE,
    STALE_S,
    UNMEASURED,
    Pace,
    PaceRule,
)
from lora_router.fleet.report import Report
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


def report(step_s: float | None, decoded: float = 200) -> Report:
    """A report whose interval decoded `decoded` tokens at `step_s` seconds each (None: its
    /metrics has no inter-token latency)."""
    known = step_s is not None
    return Report(
        at=0.0,
        running=1,
        waiting=0,
        kv_cache_usage=0.0,
        prefix_queries=0,
        prefix_hits=0,
        generation_tokens=0,
        prompt_tokens=0,
        adapters_running=None,
        adapters_waiting=None,
        max_lora=None,
        token_latency_sum=0.0 if known else None,
        token_latency_count=0.0 if known else None,
        interval=2.0,
        interval_token_latency=(step_s or 0.0) * decoded,
        interval_decoded=decoded if known else 0.0,
    )


class Clock:
    now = 100.0


def rounds(
    rule: PaceRule, members: list[Member], steps: list[float | None], count: int, clock: Clock
) -> None:
    """`count` scrape rounds, 2 s apart: each member's interval at its step, then a judgement."""
    for _ in range(count):
        clock.now += 2.0
        for member, step in zip(members, steps, strict=True):
            rule.scraped(member, report(step), clock.now, 0.0)
        rule.judge(clock.now)


def test_a_half_speed_replica_gets_half_the_weight_and_the_others_keep_theirs() -> None:
    members, rule, told = fleet(4)
    for member, step in zip(members, [0.024, 0.012, 0.012, 0.012], strict=True):
        rule.scraped(member, report(step), 102.0, 0.0)
    assert told == []  # judged after the scrape round only
    assert MIN_SAMPLES == 1
    rule.judge(102.0)
    assert [m.pace.weight for m in members] == [WEIGHT_FULL // 2] + [WEIGHT_FULL] * 3
    assert told == [("r0", WEIGHT_FULL // 2)]  # told once, only of the change


def test_the_weight_is_the_speed_and_holds_however_long_it_stays_slow() -> None:
    # A decode step does not count the queue: dealt fewer families, a half-speed replica is
    # still half as fast, and its weight stays where it is (not halved again).
    members, rule, told = fleet(4)
    clock = Clock()
    rounds(rule, members, [0.024, 0.012, 0.012, 0.012], 20 * MIN_SAMPLES, clock)
    assert told == [("r0", WEIGHT_FULL // 2)]
    # Its batch shrank, its step a little shorter: inside the band of its weight, it holds.
    rounds(rule, members, [0.021, 0.012, 0.012, 0.012], 20 * MIN_SAMPLES, clock)
    assert told == [("r0", WEIGHT_FULL // 2)]
    # Slower still (0.29 of the others' speed): its weight is that speed, whatever it was. (At
    # 0.3 exactly it would stop on the edge of weight 6's band, 0.375 / BAND, and hold there.)
    rounds(rule, members, [0.042, 0.012, 0.012, 0.012], 10 * MIN_SAMPLES, clock)
    assert told[-1] == ("r0", 5) and members[0].pace.weight == 5


def test_of_two_replicas_the_slow_one_is_judged_against_the_faster() -> None:
    # The lower median: the mean of two paces would give a half-speed replica 0.75.
    members, rule, _ = fleet(2)
    rounds(rule, members, [0.024, 0.012], MIN_SAMPLES, Clock())
    assert [m.pace.weight for m in members] == [WEIGHT_FULL // 2, WEIGHT_FULL]


def test_a_weight_never_goes_below_its_floor() -> None:
    members, rule, _ = fleet(4)
    rounds(rule, members, [0.12, 0.012, 0.012, 0.012], 4 * MIN_SAMPLES, Clock())
    assert members[0].pace.weight == WEIGHT_MIN


def test_a_slow_replica_that_catches_up_gets_its_full_weight_back() -> None:
    members, rule, told = fleet(4)
    clock = Clock()
    rounds(rule, members, [0.024, 0.012, 0.012, 0.012], MIN_SAMPLES, clock)
    # As fast as the others again (its GPU no longer throttled): within the dead band of 1.
    rounds(rule, members, [0.0125, 0.012, 0.012, 0.012], 4 * MIN_SAMPLES, clock)
    assert told == [("r0", WEIGHT_FULL // 2), ("r0", WEIGHT_FULL)]


def test_stale_evidence_returns_a_replica_to_full_weight() -> None:
    members, rule, told = fleet(3)
    clock = Clock()
    rounds(rule, members, [0.024, 0.012, 0.012], MIN_SAMPLES, clock)
    assert members[0].pace.weight < WEIGHT_FULL
    # r0 decodes nothing more (idle, or its scrapes fail) past STALE_S.
    rounds(rule, members[1:], [0.012, 0.012], int(STALE_S / 2) + 1, clock)
    assert members[0].pace.weight == WEIGHT_FULL
    assert told[-1] == ("r0", WEIGHT_FULL)
    assert members[0].pace.samples == 0


def test_an_interval_of_few_tokens_or_no_time_is_no_sample() -> None:
    members, rule, _ = fleet(2)
    rule.scraped(members[0], report(0.5, decoded=MIN_DECODED - 1), 1.0, 0.0)
    rule.scraped(members[0], report(0.0), 1.0, 0.0)  # an emulated replica whose steps cost nothing
    rule.scraped(members[0], report(1e-6), 1.0, 0.0)
    assert members[0].pace.samples == 0
    rule.scraped(members[0], report(0.01, decoded=MIN_DECODED), 1.0, 0.0)
    assert members[0].pace.samples == 1


def test_an_interval_paused_for_more_than_its_share_is_no_sample() -> None:
    # A sequence frozen by a pause counts it in its next token's latency: a short pause
    # lengthens the interval's mean step by about its share, a long one says nothing.
    members, rule, _ = fleet(2)
    interval = report(0.01).interval
    rule.scraped(members[0], report(0.01), 1.0, PAUSE_SHARE * interval * 1.01)
    assert members[0].pace.samples == 0
    rule.scraped(members[0], report(0.01), 1.0, PAUSE_SHARE * interval)
    assert members[0].pace.samples == 1


def test_a_replica_without_the_histogram_keeps_full_weight_and_says_why() -> None:
    members, rule, told = fleet(3)
    clock = Clock()
    rounds(rule, members, [0.024, 0.012, 0.012], MIN_SAMPLES, clock)
    assert members[0].pace.weight == WEIGHT_FULL // 2
    rounds(rule, members, [None, 0.012, 0.012], 1, clock)  # its /metrics lost the family
    assert members[0].pace.weight == WEIGHT_FULL and members[0].pace.samples == 0
    assert members[0].pace.unmeasured == UNMEASURED
    assert told[-1] == ("r0", WEIGHT_FULL)
    rounds(rule, members, [None, 0.012, 0.012], 4 * MIN_SAMPLES, clock)
    assert members[0].pace.weight == WEIGHT_FULL
    rounds(rule, members, [0.012, 0.012, 0.012], 1, clock)
    assert members[0].pace.unmeasured == ""


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 8),
    st.lists(st.floats(1.0, BAND), min_size=1, max_size=200),
)
@example(2, [1.0, BAND])  # on the band's edge: 0.012 / 0.015 rounds below 1 / BAND (CI, e834fd9)
def test_steps_inside_the_band_never_change_a_weight(n: int, spreads: list[float]) -> None:
    # A fleet at one speed: each interval's step at most BAND x the fastest possible (batches
    # and prefill chunks differ): the lower median is at least that fastest, so every ratio is
    # at least 1 / BAND, and no weight ever moves, however many rounds.
    members, rule, told = fleet(n)
    now = 0.0
    for i, spread in enumerate(spreads * 3):
        rule.scraped(members[i % n], report(0.012 * spread), now, 0.0)
        if i % n == n - 1:
            now += 2.0
            rule.judge(now)
    assert told == []
    assert all(m.pace.weight == WEIGHT_FULL for m in members)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(2, 6),
    st.lists(
        st.tuples(
            st.integers(0, 5),
            st.one_of(st.none(), st.floats(0.0, 5.0)),
            st.floats(0, 5000),
            st.floats(0, 40),
            st.booleans(),
        ),
        max_size=300,
    ),
)
def test_weights_stay_in_bounds_and_the_policy_hears_every_change(n, intervals) -> None:
    members, rule, told = fleet(n)
    now = 0.0
    last = {m.name: WEIGHT_FULL for m in members}
    for who, step, decoded, gap, judge in intervals:
        now += gap
        rule.scraped(members[who % n], report(step, decoded), now, 0.0)
        if judge:
            rule.judge(now)
        assert all(WEIGHT_MIN <= m.pace.weight <= WEIGHT_FULL for m in members)
    for name, weight in told:
        assert weight != last[name]  # only changes are told
        last[name] = weight
    assert last == {m.name: m.pace.weight for m in members}
