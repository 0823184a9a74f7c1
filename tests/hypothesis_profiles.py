"""The suite's two Hypothesis profiles (loaded by tests/conftest.py).

- `dev` (the default): every property test runs a quarter of its examples, never fewer than
  `DEV_FLOOR` (nor more than it asked for), so `python -m pytest` stays quick.
- `ci`: every test runs the examples it asks for (its own `@settings(max_examples=...)`, else
  Hypothesis's 100). Chosen by `HYPOTHESIS_PROFILE=ci`, or by `CI` being set, as CI services do.

A test's own `@settings` takes precedence over any profile, so the dev profile is applied to
each collected test's settings (`scaled`), not only to the default. Neither profile has a
deadline: on a loaded 2-core machine (load average 14) Hypothesis's 200 ms per example failed
property tests whose logic held; speed is shown in bench/, never asserted by timed tests.
"""

from __future__ import annotations

import os

from hypothesis import settings

DEV_FLOOR = 10  # examples a property test keeps in the dev profile, if it asked for as many
DEV_SHARE = 4  # the dev profile runs 1 / DEV_SHARE of a test's examples

# The same settings: the dev profile's fewer examples come from `scaled`, applied to every test.
settings.register_profile("ci", deadline=None)
settings.register_profile("dev", deadline=None)
PROFILE = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")


def scaled(given: settings, profile: str = PROFILE) -> settings:
    """`given` as the profile runs it: unchanged in `ci`; in `dev`, a quarter of its examples,
    at least DEV_FLOOR (or all of them, when it asked for fewer)."""
    if profile != "dev":
        return given
    wanted = given.max_examples
    return settings(given, max_examples=min(wanted, max(DEV_FLOOR, wanted // DEV_SHARE)))
