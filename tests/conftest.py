"""Suite-wide settings: Hypothesis examples have no time limit.

The suite runs on small shared machines. Hypothesis's default 200 ms deadline per example is a
timed assertion, and on a loaded 2-core machine (load average 14) it failed property tests whose
logic held (`DeadlineExceeded` in tests/routing) on a fresh clone. Speed is shown in bench/,
never asserted by timed tests; every test stays bounded by pytest-timeout.
"""

from hypothesis import settings

settings.register_profile("suite", deadline=None)
settings.load_profile("suite")
