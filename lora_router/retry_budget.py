"""The retry budget: a cap on the share of routed requests that are retries of a 5xx, so a sick
fleet is not hammered by the router's own retries (Envoy's retry budgets are the model).

A retry of a 5xx is allowed while the retries of the last `WINDOW_S` seconds are fewer than
`ratio` times the routed requests of that window, or fewer than `MIN_RETRIES`, so a lone
request (or a trainer's few) can still be retried on an idle router. A window rather than the
requests in flight: a replica that starts failing fails the requests queued for it all at once,
and a burst like that is what a retry is for; a fleet that keeps failing is what the budget
stops. The window slides by `BUCKETS` steps. Retries after failures that cost the replica
nothing (no connection, a lost adapter) are not budgeted, only counted: `retries` has every
retry by reason, `denied` the refusals, for `/router/status` and `/metrics`.

Pure bookkeeping: the caller passes the clock; it must never do I/O or read the clock itself.
"""

from __future__ import annotations

from collections import Counter

WINDOW_S = 10.0
BUCKETS = 10
MIN_RETRIES = 10  # per window, whatever the traffic


class RetryBudget:
    """Routed requests and 5xx retries over a sliding window; `allow` spends one retry."""

    __slots__ = ("_end", "_requests", "_retries", "_step", "denied", "ratio", "retries")

    def __init__(self, ratio: float) -> None:
        self.ratio = ratio
        self._step = WINDOW_S / BUCKETS
        self._end = 0.0  # when the current (last) bucket ends
        self._requests = [0] * BUCKETS  # oldest first; the last is the current bucket
        self._retries = [0] * BUCKETS
        self.retries: Counter[str] = Counter()  # retries made, by reason
        self.denied = 0  # retries the budget refused

    def request(self, now: float) -> None:
        """A routed request arrived (its retries are not requests)."""
        if now >= self._end:
            self._slide(now)
        self._requests[-1] += 1

    def allow(self, now: float) -> bool:
        """Whether a 5xx may be retried now; if so the retry is counted against the budget."""
        if now >= self._end:
            self._slide(now)
        spent = sum(self._retries)
        if spent >= MIN_RETRIES and spent >= self.ratio * sum(self._requests):
            self.denied += 1
            return False
        self._retries[-1] += 1
        self.retries["5xx"] += 1
        return True

    def unbudgeted(self, reason: str) -> None:
        """A retry the budget does not gate (it cost the replica nothing), counted."""
        self.retries[reason] += 1

    def _slide(self, now: float) -> None:
        if self._end == 0.0 or now >= self._end + WINDOW_S:  # first use, or idle for a window
            self._requests = [0] * BUCKETS
            self._retries = [0] * BUCKETS
            self._end = now + self._step
            return
        while self._end <= now:  # at most BUCKETS steps (see above)
            self._requests = [*self._requests[1:], 0]
            self._retries = [*self._retries[1:], 0]
            self._end += self._step
