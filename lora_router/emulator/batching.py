"""The replica's capacity model: continuous batching, one engine step at a time.

Every sequence the scheduler admitted runs in the same engine steps, as on vLLM v1. A step
has a token budget (`--max-num-batched-tokens`) that it fills in this order:
1. every decoding sequence, one token each (its next generated token);
2. sequences still prefilling, in admission order, each a chunk of its uncached prompt
   tokens as large as the budget left allows (chunked prefill: a long prompt takes several
   steps, and its chunks compete with the decodes for the same steps).
A sequence's prompt tokens found in the prefix cache are never computed, so a hit cuts its
prefill. A sequence starts decoding in the step after its last prefill chunk, and each
generated token costs one step: a lone sequence of P uncached prompt tokens and N generated
ones takes P * prefill + N * decode seconds, the emulator's timing before batching.

A step's duration (`StepCosts.step_s`) is the replica's whole cost model:

    (decode_s_per_token + decode_s_per_seq * (decoding - 1)  if decoding else 0)
    + prefill_s_per_token * prefill_tokens,   all divided by speed

so a replica slows gradually as its batch grows, instead of queueing, and a replica with
`speed` 0.5 takes twice as long for the same work. The constants are the replica's settings
(config.py); all 0 by default, so that answers come at once.

What `/metrics` shows of these steps (`InterTokenLatency`), as vLLM's
`vllm:inter_token_latency_seconds` histogram: one observation per generated token but a
sequence's first, the time from its previous token's step end to this one's. So a token's
latency is the duration of the step that decoded it (a sequence decodes in every step until it
ends), the steps' prefill chunks included, as on vLLM, where each engine step's outputs carry
one timestamp (vllm/v1/metrics/stats.py, `IterationStats.update_from_output`).

Pure: no I/O, no clock (the engine passes each step's planned end). The engine (engine.py)
runs the steps and sleeps their durations.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

# vLLM 0.32's buckets for `vllm:inter_token_latency_seconds` (upper bounds, seconds; +Inf after).
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class StepCosts:
    """The seconds an engine step costs, from what it computes."""

    prefill_s_per_token: float = 0.0  # per uncached prompt token computed in the step
    decode_s_per_token: float = 0.0  # a step that decodes one sequence
    decode_s_per_seq: float = 0.0  # added by each further sequence decoding in the step
    speed: float = 1.0  # relative speed of this replica: every cost is divided by it

    def __post_init__(self) -> None:
        if min(self.prefill_s_per_token, self.decode_s_per_token, self.decode_s_per_seq) < 0:
            raise ValueError("step costs must be >= 0")
        if self.speed <= 0:
            raise ValueError("speed must be > 0")

    def step_s(self, decoding: int, prefill_tokens: int) -> float:
        """The duration of a step that decodes `decoding` sequences and computes
        `prefill_tokens` prompt tokens."""
        decode = 0.0
        if decoding > 0:
            decode = self.decode_s_per_token + self.decode_s_per_seq * (decoding - 1)
        return (decode + self.prefill_s_per_token * prefill_tokens) / self.speed

    @property
    def free(self) -> bool:
        """Whether every step takes no time (the emulator's default: answers at once)."""
        return self.step_s(1, 1) == 0.0


@dataclass(slots=True, eq=False)
class Progress:
    """What one running sequence still has to compute, and what it may emit."""

    prefill_left: int  # uncached prompt tokens not computed yet
    decode_left: int  # tokens still to generate
    granted: int = 0  # tokens generated so far (the engine emits them after the step)
    last_token_at: float | None = None  # its latest token's step end (`InterTokenLatency`)

    @property
    def done(self) -> bool:
        return self.prefill_left == 0 and self.decode_left == 0


@dataclass(frozen=True, slots=True)
class Step:
    """One planned step: how many sequences decode, how many prompt tokens are computed."""

    decoding: int
    prefill_tokens: int


def plan_step(running: Sequence[Progress], budget: int) -> tuple[Step, list[Progress]]:
    """Fill one step's `budget` of tokens from `running` (in admission order), apply it, and
    return the step and the sequences it advanced, its `decoding` decoders first. A sequence
    whose prefill ends in this step decodes from the next one."""
    decoders = [p for p in running if p.prefill_left == 0 and p.decode_left > 0][:budget]
    left = budget - len(decoders)
    for p in decoders:
        p.decode_left -= 1
        p.granted += 1
    advanced = list(decoders)
    prefill_tokens = 0
    for p in running:
        if left <= 0:
            break
        if p.prefill_left > 0:
            chunk = min(p.prefill_left, left)
            p.prefill_left -= chunk
            left -= chunk
            prefill_tokens += chunk
            advanced.append(p)
    return Step(len(decoders), prefill_tokens), advanced


@dataclass(slots=True)
class InterTokenLatency:
    """`vllm:inter_token_latency_seconds` (module docstring): its bucket counts (not
    cumulative; the last one +Inf), sum and count since the replica started."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(ITL_BUCKETS) + 1))
    sum: float = 0.0
    count: int = 0

    def decoded(self, sequences: Iterable[Progress], at: float) -> None:
        """A step that ended at `at` gave each of `sequences` a token: O(len) plus a bucket's
        search each."""
        buckets = self.buckets
        for p in sequences:
            last, p.last_token_at = p.last_token_at, at
            if last is None:
                continue  # a first token: its latency is the time to it, not between tokens
            latency = at - last
            buckets[bisect_left(ITL_BUCKETS, latency)] += 1
            self.sum += latency
            self.count += 1
