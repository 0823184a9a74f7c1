"""A replica's pace, measured by the router, and the routing weight it gives the policy.

Rules:
- *Sample*: a routed completion a replica answered 200 whose answer reported its
  `usage.completion_tokens` (proxy/routed.py reads it at the answer's end): the seconds from its
  send to its end, and those tokens. Text and chat prompts, streams without usage and refused
  answers give none, nor does an answer back within `MIN_SAMPLE_S`: its time is the network's
  and the router's, not an engine's (a vLLM decode step alone takes about that long), and the
  loop's clock counts whole milliseconds; so a pace judged is never 0.
- *Pace*: per replica, seconds over output tokens of its samples, both summed with an
  exponential decay of `DECAY` per sample (a long answer weighs more than a short one, whose
  time is mostly its prefill and its queue).
- *Judged*: every `max(JUDGE_EVERY, n)` samples over the fleet, each replica with at least
  `MIN_SAMPLES` samples since its weight last changed, the latest within `STALE_S`, is compared
  with the median pace of those replicas. Outside the dead band, slower than `BAND` times the
  median or faster than the median over `BAND`, its weight becomes its weight times median
  over pace, in sixteenths, between `WEIGHT_MIN` and `WEIGHT_FULL`; inside it, it keeps its
  weight. Its samples then start again, and an answer sent before the change is no sample, so
  a weight is judged only on answers sent under it (not on the queue the old weight built).
  The weight is a controller's output, not a speed: with fewer requests a slow replica's pace
  nears the median and its weight holds (inside the band), which is the balance sought.
- *Stale*: a replica with no sample within `STALE_S` (or that left) is back at full weight,
  its evidence dropped.

On a fleet at one speed paces differ by noise and by their queues: inside the band on
single-turn groups, not always on multi-turn rollouts at saturating load (measured in
docs/design/routing.md). Weights reach the policy only when they change (`on_weight`), and
/router/status and /metrics show them (`Pace.weight`).

Cost: a sample O(1); a judgement O(n log n) once per at least n samples, O(log n) a sample.
Never: I/O, logging, reading answers (the caller passes the figures).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Protocol

from lora_router.routing.policy import WEIGHT_FULL, WEIGHT_MIN

# Each sample's share of the pace: the last 16 or so answers decide it.
DECAY = 1 / 16
# The dead band: a pace within BAND x the median either way changes no weight.
BAND = 1.25
# Samples a replica needs to be judged, and answers between judgements. Half these judged
# full-speed replicas slow at saturating load (the queues differ more than the band over 4
# answers); these keep a uniform fleet's weights at 1 on single-turn groups, not always on
# multi-turn at saturating load (docs/design/routing.md).
MIN_SAMPLES = 8
JUDGE_EVERY = 16
STALE_S = 30.0
# The shortest answer that is a sample (module docstring, *Sample*): 10 loop-clock ticks.
MIN_SAMPLE_S = 0.01


class Pace:
    """One replica's pace: its decayed sums, its samples since its weight last changed, its
    latest sample's time, its weight in sixteenths and how often that changed (`PaceRule`
    writes it)."""

    __slots__ = ("changes", "last", "samples", "seconds", "since", "tokens", "weight")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.tokens = 0.0
        self.samples = 0
        self.last = 0.0
        self.since = float("-inf")  # when its weight last changed: earlier sends are no sample
        self.weight = WEIGHT_FULL
        self.changes = 0

    def restart(self) -> None:
        """Its evidence dropped (a new weight, or stale)."""
        self.seconds = self.tokens = 0.0
        self.samples = 0

    @property
    def per_token(self) -> float:
        """Seconds per output token; 0 when it has none."""
        return self.seconds / self.tokens if self.tokens else 0.0


class Paced(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def pace(self) -> Pace: ...


class PaceRule:
    """The pace of every replica of a fleet and their weights (module docstring)."""

    def __init__(
        self,
        replicas: Callable[[], Sequence[Paced]],
        on_weight: Callable[[str, int], None],
    ) -> None:
        self.replicas = replicas  # the fleet's members now
        self.on_weight = on_weight  # the policy's `set_weight`
        self._until_judged = JUDGE_EVERY

    def answered(self, replica: Paced, seconds: float, tokens: int, now: float) -> None:
        """A sample (module docstring): O(1), and every so often a judgement."""
        pace = replica.pace
        if tokens <= 0 or seconds < MIN_SAMPLE_S or now - seconds < pace.since:
            return
        keep = 1.0 - DECAY
        pace.seconds = pace.seconds * keep + seconds
        pace.tokens = pace.tokens * keep + tokens
        pace.samples += 1
        pace.last = now
        self._until_judged -= 1
        if self._until_judged <= 0:
            self.judge(now)

    def judge(self, now: float) -> None:
        """Every replica's weight from the evidence now: O(n log n)."""
        members = self.replicas()
        self._until_judged = max(JUDGE_EVERY, len(members))
        judged = []
        for replica in members:
            pace = replica.pace
            if (pace.samples or pace.weight != WEIGHT_FULL) and now - pace.last > STALE_S:
                pace.restart()
                self._set(replica, WEIGHT_FULL, now)
            elif pace.samples >= MIN_SAMPLES:
                judged.append(replica)
        if len(judged) < 2:
            return
        median = statistics.median(r.pace.per_token for r in judged)
        for replica in judged:
            pace = replica.pace
            ratio = median / pace.per_token
            if 1 / BAND <= ratio <= BAND:
                continue
            weight = min(WEIGHT_FULL, max(WEIGHT_MIN, round(pace.weight * ratio)))
            if weight != pace.weight:
                pace.restart()
                self._set(replica, weight, now)

    def _set(self, replica: Paced, weight: int, now: float) -> None:
        pace = replica.pace
        if pace.weight != weight:
            pace.weight = weight
            pace.since = now
            pace.changes += 1
            self.on_weight(replica.name, weight)
