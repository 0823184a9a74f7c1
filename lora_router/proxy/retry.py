"""The retry rule of the routed path, and the retry budget it counts against.

`verdict` is the whole rule, a pure function of an attempt's outcome, the attempts made, the
pause state, the fleet's state and the budget's room. A routed request is tried on another
replica only while nothing of its answer has reached the client, at most `--retries` times:

- after a transport failure before any response byte (connection refused or reset, replica
  gone, or withdrawn as its replica left service: http/upstream.py; never a timeout: the
  replica may still be working on it): free;
- after a 404 for an adapter the fence says is live (the replica lost it): free;
- after a 5xx head (never a 503 while the fleet is paused: vLLM refusing work on purpose), when
  a replica is left to try: free while most of the fleet is not failing; when it is, only
  within the budget, and counted.

Counted against the budget is what amplifies load: a retry made while most of the live fleet
is failing (a replica is failing while its breaker counts a run of failures, the replica that
just failed included), and a retry that lands on a replica that is itself failing
(`counted`, decided at the pick). A retry that moves a request off a replica that just failed
onto a healthy one adds no load to the failing part, so one sick replica among healthy ones
costs the client nothing, while a fleet-wide failure is held to the budget: no retry storm.

The budget: counted retries of the last `WINDOW_S` seconds below `ratio` times the routed
requests of that window, or below `MIN_RETRIES` (a lone request, or a trainer's few, may still
be retried on an idle router); a window, not the requests in flight, so the burst of failures
a replica that starts failing causes is what a retry is for, and a fleet that keeps failing is
what the budget stops. It slides by `BUCKETS` steps. `retries` counts every retry made by
reason, `denied` the 5xx retries the budget refused, for `/router/status` and `/metrics`.

Pure bookkeeping: the caller passes the clock; this module never does I/O or reads the clock.
"""

from __future__ import annotations

import enum
from collections import Counter

WINDOW_S = 10.0
BUCKETS = 10
MIN_RETRIES = 10  # counted per window, whatever the traffic


class Outcome(enum.Enum):
    """How an attempt ended, as the retry rule sees it (its value: the retry's reason)."""

    TRANSPORT = "transport"  # failed before any response byte, not a timeout
    UNSAFE = "unsafe"  # a timeout, or a failure after a response byte: never sent again
    LOST_ADAPTER = "missing_adapter"  # a 404 for an adapter the fence says is live
    STATUS_5XX = "5xx"


class Verdict(enum.Enum):
    ANSWER = "answer"  # no retry: the client gets the replica's answer or the router's
    DENIED = "denied"  # a 5xx the budget refused to retry: the client gets the replica's
    FREE = "free"  # retried, not counted
    COUNTED = "counted"  # retried, counted against the budget


def verdict(
    outcome: Outcome,
    *,
    attempts: int,
    limit: int,
    status: int = 0,
    paused: bool = False,
    others: bool = True,
    failing: bool = False,
    room: bool = True,
) -> Verdict:
    """The retry rule (module docstring) for an attempt that ended with `outcome` after
    `attempts` attempts, `limit` retries allowed. For a 5xx only: `status`, the replica's;
    `paused`, the fleet is paused; `others`, a replica is left to try; `failing`, most of the
    live fleet is failing; `room`, the budget has room for a counted retry (the defaults say
    nothing against a retry, and no other outcome reads them)."""
    if attempts > limit or outcome is Outcome.UNSAFE:
        return Verdict.ANSWER
    if outcome is not Outcome.STATUS_5XX:
        return Verdict.FREE
    if (status == 503 and paused) or not others:
        return Verdict.ANSWER
    if not failing:
        return Verdict.FREE
    return Verdict.COUNTED if room else Verdict.DENIED


def counted(*, failing: bool, onto_failing: bool) -> bool:
    """Whether a 5xx retry, at its pick, counts against the budget: made while most of the
    fleet is failing, or onto a replica that is itself failing."""
    return failing or onto_failing


def most_failing(sick: int, live: int) -> bool:
    """Whether most of the live fleet is failing: `sick` of its `live` replicas are."""
    return 2 * sick > live


class RetryBudget:
    """Routed requests and counted retries over a sliding window."""

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

    def room(self, now: float) -> bool:
        """Whether a counted retry fits in the budget now."""
        if now >= self._end:
            self._slide(now)
        spent = sum(self._retries)
        return spent < MIN_RETRIES or spent < self.ratio * sum(self._requests)

    def spend(self, now: float) -> None:
        """A counted retry was made (`room` was asked at its verdict)."""
        if now >= self._end:
            self._slide(now)
        self._retries[-1] += 1

    def made(self, outcome: Outcome) -> None:
        """A retry was made after `outcome`, counted by reason."""
        self.retries[outcome.value] += 1

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
