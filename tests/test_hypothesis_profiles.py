"""tests/hypothesis_profiles.py: the dev profile runs fewer examples of each property test."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis_profiles import DEV_FLOOR, PROFILE, scaled


def test_dev_runs_a_quarter_of_a_tests_examples_but_never_below_the_floor():
    def dev(n: int) -> int:
        return scaled(settings(max_examples=n), "dev").max_examples

    assert [dev(300), dev(100), dev(40), dev(12), dev(5)] == [75, 25, DEV_FLOOR, DEV_FLOOR, 5]


def test_ci_runs_every_example_a_test_asks_for():
    assert scaled(settings(max_examples=300), "ci").max_examples == 300


RUNS: list[int] = []


@settings(max_examples=60)
@given(st.integers())
def test_a_property_test(n: int) -> None:
    RUNS.append(n)


def test_the_profile_reached_the_property_test_above():
    # The collection hook scaled the decorated test's own settings (it runs before this one).
    assert len(RUNS) == scaled(settings(max_examples=60), PROFILE).max_examples
