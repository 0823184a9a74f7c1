"""A replica's pace, its decode step as it reports it, and the routing weight it gives the policy.

Rules:
- *Sample*: one scrape interval of a replica's `/metrics` (fleet/telemetry.py): the change of
  `vllm:inter_token_latency_seconds`' sum (seconds) and count (tokens) since the previous
  scrape, each token's time since its sequence's previous one, so their ratio is the mean
  decode step over the interval. That is what the replica's speed decides, not its queue nor
  its prompts' prefill (a sequence decodes one token a step; the steps' prefill chunks share
  them, as on vLLM). An interval with fewer than `MIN_DECODED` tokens is none (a few tokens
  say more of one step's prefill chunk than of the replica), nor is one whose mean step is
  under `MIN_STEP_S` (no engine's: an emulated replica whose steps cost nothing), nor one the
  fleet spent more than `PAUSE_SHARE` of paused (telemetry says how long): a sequence frozen
  by `/pause?mode=keep` counts the pause in its next token's latency, which lengthens the
  interval's mean step by about the share of the interval the pause took.
- *Unmeasured*: a replica whose `/metrics` lacks the histogram keeps full weight, its evidence
  dropped, and `Pace.unmeasured` says why (/router/status).
- *Pace*: per replica, the samples' seconds over their tokens, both summed with an exponential
  decay of `DECAY` per sample (the last few intervals decide it, each weighed by its tokens).
- *Judged*: after each scrape round (`judge`), each replica with at least `MIN_SAMPLES` samples
  since its weight last changed, the latest within `STALE_S`, is compared with the lower
  median of those replicas' paces (of two, the faster): `ratio` = median / pace, its speed
  relative to the fleet's. Its weight (w, as a share of full) holds while `ratio` is within
  `BAND` of w either way (w / BAND to w x BAND); outside, it becomes full if `ratio` is at
  least 1 / BAND (the dead band of a fleet at one speed), else `ratio` in sixteenths, at least
  `WEIGHT_MIN`. Its samples then start again (a new weight changes its batch).
- *Stale*: a replica with no sample within `STALE_S` (idle, or no longer reporting) is back at
  full weight, its evidence dropped.

The weight is the replica's measured relative speed, not a controller's output: a decode step
does not count the queue, so a half-speed replica keeps about half the weight however few
families it is dealt. A fleet at one speed differs only by its batches (a step grows with the
sequences in it) and the prefill chunks in its steps: inside the band on the emulated fleets
measured (docs/design/routing.md#a-slow-replica-pace-and-weights). Weights reach the policy
only when they change (`on_weight`); /router/status and /metrics show them.

Cost: a sample O(1) (per replica per scrape, off the request path); a judgement O(n log n) per
scrape round. Never: I/O, logging, reading `/metrics` (the caller passes the report).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Protocol

from lora_router.fleet.report import Report
from lora_router.routing.policy import WEIGHT_FULL, WEIGHT_MIN

# Each sample's share of the pace: the last 4 intervals or so decide it (8 s at the default
# --health-interval of 2 s).
DECAY = 1 / 4
# The dead band: a speed within BAND x the weight either way changes no weight.
BAND = 1.25
# A ratio on the band's edge is inside it: its float rounding (a few ulps) moves no weight.
_EDGE = 1e-9
# Samples a replica needs since its weight last changed to be judged: one interval's mean over
# at least MIN_DECODED tokens (on the emulated fleets measured, a full-speed replica's intervals
# stayed within 10 % of each other; two samples judged a light-load run's slow replica only
# after most of its families had been dealt).
MIN_SAMPLES = 1
# The fewest tokens an interval's sample must have (module docstring, *Sample*).
MIN_DECODED = 16
# The shortest mean decode step that is a sample: 0.1 ms, below any engine's.
MIN_STEP_S = 1e-4
# The most of an interval the fleet may have spent paused for it to be a sample: a pause
# lengthens the mean step by about its share, a fifth of the dead band's 25 %
# (docs/design/routing.md#a-slow-replica-pace-and-weights).
PAUSE_SHARE = 1 / 20
STALE_S = 30.0
UNMEASURED = "its /metrics has no vllm:inter_token_latency_seconds"


class Pace:
    """One replica's pace: its decayed sums, its samples since its weight last changed, its
    latest sample's time, its weight in sixteenths, how often that changed, and why it is not
    measured ("" when it is) (`PaceRule` writes it)."""

    __slots__ = ("changes", "last", "samples", "seconds", "tokens", "unmeasured", "weight")

    def __init__(self) -> None:
        self.seconds = 0.0
        self.tokens = 0.0
        self.samples = 0
        self.last = 0.0
        self.weight = WEIGHT_FULL
        self.changes = 0
        self.unmeasured = ""

    def restart(self) -> None:
        """Its evidence dropped (a new weight, stale, or unmeasured)."""
        self.seconds = self.tokens = 0.0
        self.samples = 0

    @property
    def step_s(self) -> float:
        """Mean seconds per decode step; 0 when it has none."""
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

    def scraped(self, replica: Paced, report: Report, now: float, paused: float) -> None:
        """A report following an earlier one, over an interval the fleet spent `paused`
        seconds of paused: a sample or none (module docstring), O(1)."""
        if paused > PAUSE_SHARE * report.interval:
            return
        pace = replica.pace
        if report.token_latency_count is None:
            if not pace.unmeasured:
                pace.unmeasured = UNMEASURED
                pace.restart()
                self._set(replica, WEIGHT_FULL)
            return
        pace.unmeasured = ""
        seconds, tokens = report.interval_token_latency, report.interval_decoded
        if tokens < MIN_DECODED or seconds < MIN_STEP_S * tokens:
            return
        keep = 1.0 - DECAY
        pace.seconds = pace.seconds * keep + seconds
        pace.tokens = pace.tokens * keep + tokens
        pace.samples += 1
        pace.last = now

    def judge(self, now: float) -> None:
        """Every member's weight from the evidence now: O(n log n)."""
        judged = []
        for replica in self.replicas():
            pace = replica.pace
            if (pace.samples or pace.weight != WEIGHT_FULL) and now - pace.last > STALE_S:
                pace.restart()
                self._set(replica, WEIGHT_FULL)
            elif pace.samples >= MIN_SAMPLES:
                judged.append(replica)
        if len(judged) < 2:
            return
        median = statistics.median_low(r.pace.step_s for r in judged)
        for replica in judged:
            pace = replica.pace
            ratio = median / pace.step_s
            held = pace.weight / WEIGHT_FULL
            if held / BAND * (1 - _EDGE) <= ratio <= held * BAND * (1 + _EDGE):
                continue
            weight = WEIGHT_FULL
            if ratio < (1 - _EDGE) / BAND:
                weight = max(WEIGHT_MIN, round(ratio * WEIGHT_FULL))
            if weight != pace.weight:
                pace.restart()
                self._set(replica, weight)

    def _set(self, replica: Paced, weight: int) -> None:
        pace = replica.pace
        if pace.weight != weight:
            pace.weight = weight
            pace.changes += 1
            self.on_weight(replica.name, weight)
