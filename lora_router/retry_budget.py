"""The retry budget: a cap on the share of routed requests that are retries of a 5xx, so a sick
fleet is not hammered by the router's own retries. Envoy's retry budgets are the model: a retry
may start while the retries in flight are fewer than `ratio` times the routed requests in
flight, or fewer than `MIN_RETRIES`, so a lone request (or a trainer's few) can always be
retried.

A request that is being retried holds one retry slot from its first retry until it ends (its
retries are sequential); `allow` is asked before each retry of a 5xx. Retries after failures
that cost the replica nothing (no connection, a lost adapter) are not budgeted, only counted:
`retries` has every retry by reason, `denied` the refusals, for `/router/status` and
`/metrics`.

Pure bookkeeping, no I/O and no clock; the routed path (app.py) keeps `active` exact with a
try/finally around every routed request.
"""

from __future__ import annotations

from collections import Counter

MIN_RETRIES = 3  # retries in flight always allowed, whatever the traffic (Envoy's default)


class RetryBudget:
    """Routed requests and retry slots in flight; `allow` grants a slot if there is room."""

    __slots__ = ("active", "denied", "ratio", "retries", "retrying")

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self.active = 0  # routed requests in flight
        self.retrying = 0  # of them, those holding a retry slot
        self.retries: Counter[str] = Counter()  # retries made, by reason
        self.denied = 0  # retries the budget refused

    def allow(self, holding: bool) -> bool:
        """Whether a request may retry a 5xx now; `holding`: it already holds a slot (kept).
        A request granted one holds it until `release`."""
        others = self.retrying - holding
        if others >= MIN_RETRIES and others >= self.ratio * self.active:
            self.denied += 1
            return False
        if not holding:
            self.retrying += 1
        self.retries["5xx"] += 1
        return True

    def release(self) -> None:
        """A request holding a slot ended."""
        self.retrying -= 1
