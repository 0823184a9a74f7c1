"""The retry rule (lora_router/proxy/retry.py), driven without sockets, as h11's tests drive its
state machine: a table of cases, then properties over every input.

The socket tests of the same rule are tests/fleet/test_retries.py (one sick replica among
healthy ones, a fleet failing everywhere) and tests/fleet/test_passive_health.py.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lora_router.proxy.retry import (
    BUCKETS,
    MIN_RETRIES,
    WINDOW_S,
    Outcome,
    RetryBudget,
    Verdict,
    counted,
    most_failing,
    verdict,
)

T, X, LOST, E5 = Outcome.TRANSPORT, Outcome.UNSAFE, Outcome.LOST_ADAPTER, Outcome.STATUS_5XX
ANSWER, DENIED, FREE, COUNTED = Verdict.ANSWER, Verdict.DENIED, Verdict.FREE, Verdict.COUNTED

# outcome, status, attempts, limit, paused, others, failing, room -> verdict
CASES = [
    (T, 0, 1, 2, False, True, False, False, FREE),  # refused or reset: costs the replica nothing
    (T, 0, 3, 2, False, True, True, True, ANSWER),  # no attempt left
    (X, 0, 1, 2, False, True, False, True, ANSWER),  # a timeout: the replica may be working
    (LOST, 0, 1, 2, False, True, True, False, FREE),  # a lost adapter: the replay restores it
    (LOST, 0, 3, 2, False, True, False, True, ANSWER),  # the router answers it itself
    (E5, 500, 1, 2, False, True, False, False, FREE),  # one sick replica: free, budget spent
    (E5, 500, 1, 2, False, True, True, True, COUNTED),  # most of the fleet failing: budgeted
    (E5, 500, 1, 2, False, True, True, False, DENIED),  # ... and refused past the budget
    (E5, 500, 1, 2, False, False, False, True, ANSWER),  # no replica left: the replica's 500
    (E5, 500, 3, 2, False, True, False, True, ANSWER),  # no attempt left
    (E5, 503, 1, 2, True, True, False, True, ANSWER),  # paused: vLLM refusing on purpose
    (E5, 502, 1, 2, True, True, False, True, FREE),  # paused, but not a 503
    (E5, 503, 1, 2, False, True, False, True, FREE),  # a 503 while not paused
]


@pytest.mark.parametrize(
    ("outcome", "status", "attempts", "limit", "paused", "others", "failing", "room", "expected"),
    CASES,
)
def test_the_rule_by_case(
    outcome: Outcome,
    status: int,
    attempts: int,
    limit: int,
    paused: bool,
    others: bool,
    failing: bool,
    room: bool,
    expected: Verdict,
) -> None:
    assert (
        verdict(
            outcome,
            status=status,
            attempts=attempts,
            limit=limit,
            paused=paused,
            others=others,
            failing=failing,
            room=room,
        )
        is expected
    )


@given(
    outcome=st.sampled_from(Outcome),
    status=st.integers(500, 599),
    attempts=st.integers(1, 6),
    limit=st.integers(0, 5),
    paused=st.booleans(),
    others=st.booleans(),
    failing=st.booleans(),
    room=st.booleans(),
)
def test_the_rule_never_retries_past_its_bounds(
    outcome: Outcome,
    status: int,
    attempts: int,
    limit: int,
    paused: bool,
    others: bool,
    failing: bool,
    room: bool,
) -> None:
    rule = verdict(
        outcome,
        status=status,
        attempts=attempts,
        limit=limit,
        paused=paused,
        others=others,
        failing=failing,
        room=room,
    )
    retried = rule in (FREE, COUNTED)
    if retried:
        assert attempts <= limit and outcome is not Outcome.UNSAFE
    if outcome is E5:
        assert not (retried and status == 503 and paused)
        assert not (retried and not others)  # held back only when a replica is left
        assert (rule is COUNTED) == (retried and failing)  # a fleet failing: every retry counted
        assert not (rule is COUNTED and not room)
        if rule is DENIED:
            assert failing and not room and others and attempts <= limit
    else:
        assert rule is not COUNTED and rule is not DENIED  # costs the replicas nothing


@given(sick=st.integers(0, 128), extra=st.integers(0, 128))
def test_most_of_the_fleet_is_a_strict_majority(sick: int, extra: int) -> None:
    live = sick + extra
    assert most_failing(sick, live) == (sick > extra)
    assert not most_failing(1, 2) and most_failing(2, 3) and not most_failing(1, 3)


def test_a_retry_is_counted_when_the_fleet_or_its_target_is_failing() -> None:
    assert [counted(failing=f, onto_failing=o) for f in (False, True) for o in (False, True)] == [
        False,
        True,
        True,
        True,
    ]


@given(
    events=st.lists(st.tuples(st.floats(0, 3 * WINDOW_S), st.booleans()), min_size=1, max_size=300),
    ratio=st.sampled_from([0.0, 0.1, 0.2, 1.0]),
)
def test_counted_retries_in_any_window_stay_within_the_budget(
    events: list[tuple[float, bool]], ratio: float
) -> None:
    """Requests and counted retries at increasing times (a retry spent whenever the budget has
    room): in any span the budget's buckets cover (a window less one bucket), the retries stay
    within the minimum or the share of the window's requests (plus the one that reached it)."""
    budget = RetryBudget(ratio)
    requests: list[float] = []
    retries: list[float] = []
    for now, is_retry in sorted(events):
        if not is_retry:
            budget.request(now)
            requests.append(now)
        elif budget.room(now):
            budget.spend(now)
            retries.append(now)
    step = WINDOW_S / BUCKETS
    for t in retries:
        in_span = [r for r in retries if t - WINDOW_S + step < r <= t]
        asked = [r for r in requests if t - WINDOW_S < r <= t]
        assert len(in_span) <= max(MIN_RETRIES, ratio * len(asked) + 1)
