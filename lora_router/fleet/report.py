"""One replica's `/metrics` at one scrape, as the router keeps it (`Report`).

Its own module, below both `replica.py` (which holds a replica's last report) and
`telemetry.py` (which scrapes and parses them), so neither imports the other: no import cycle,
type-only ones included (tests/test_import_graph.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True, slots=True)
class Report:
    """One replica's `/metrics` at one scrape; counters are since the replica started."""

    at: float  # time.monotonic() when the answer arrived
    running: int
    waiting: int
    kv_cache_usage: float  # 0..1
    prefix_queries: float  # tokens looked up in the prefix cache
    prefix_hits: float  # tokens found there
    generation_tokens: float
    prompt_tokens: float
    adapters_running: tuple[str, ...] | None  # None: the replica has no LoRA metrics
    adapters_waiting: tuple[str, ...] | None
    max_lora: int | None
    # `vllm:inter_token_latency_seconds`' sum and count (None: the replica does not export it).
    token_latency_sum: float | None = None
    token_latency_count: float | None = None
    # Changes since the previous report (interval 0.0: there was none).
    interval: float = 0.0
    interval_queries: float = 0.0
    interval_hits: float = 0.0
    interval_generation_tokens: float = 0.0
    # Seconds between tokens and tokens after a sequence's first (0.0, 0.0 if either report
    # lacks them): the mean decode step over the interval is their ratio (`decode_step_s`).
    interval_token_latency: float = 0.0
    interval_decoded: float = 0.0
    # Since when the replica has computed nothing, no prompt token and no generated one, at
    # every scrape while the router had a request in flight on it, the fleet not paused
    # (`following`): a replica that holds work and never moves on it; None: it moved, or held
    # nothing. health.py ejects one still for `--stall-timeout`.
    still_since: float | None = None

    @property
    def hit_rate(self) -> float | None:
        """Prefix-cache hit rate over the last interval (None: no lookups in it)."""
        return ratio(self.interval_hits, self.interval_queries)

    @property
    def hit_rate_total(self) -> float | None:
        """Prefix-cache hit rate since the replica started."""
        return ratio(self.prefix_hits, self.prefix_queries)

    @property
    def tokens_per_s(self) -> float | None:
        """Generated tokens per second over the last interval."""
        return self.interval_generation_tokens / self.interval if self.interval > 0 else None

    @property
    def decode_step_s(self) -> float | None:
        """Mean seconds between a sequence's tokens over the last interval, its decode step
        (None: it decoded nothing then, or does not say)."""
        return ratio(self.interval_token_latency, self.interval_decoded)

    def following(self, previous: Report | None, holding: bool) -> Report:
        """This report with its interval figures taken against `previous`, `holding` whether
        the router had a request in flight on the replica as it arrived, the fleet not paused
        since `previous` (telemetry.py) (`still_since`: the previous report's time, or its own
        `still_since`, while holding and no counter moved)."""
        if previous is None or self.at <= previous.at:
            return self
        still = None
        if holding and (
            self.generation_tokens == previous.generation_tokens
            and self.prompt_tokens == previous.prompt_tokens
        ):
            still = previous.still_since if previous.still_since is not None else previous.at
        latency = decoded = 0.0
        if (
            self.token_latency_sum is not None
            and self.token_latency_count is not None
            and previous.token_latency_sum is not None
            and previous.token_latency_count is not None
        ):
            latency = delta(self.token_latency_sum, previous.token_latency_sum)
            decoded = delta(self.token_latency_count, previous.token_latency_count)
        return replace(
            self,
            interval=self.at - previous.at,
            interval_queries=delta(self.prefix_queries, previous.prefix_queries),
            interval_hits=delta(self.prefix_hits, previous.prefix_hits),
            interval_generation_tokens=delta(self.generation_tokens, previous.generation_tokens),
            interval_token_latency=latency,
            interval_decoded=decoded,
            still_since=still,
        )


def delta(now: float, before: float) -> float:
    # A counter that went down was reset (the replica restarted): it counted from zero since.
    return now - before if now >= before else now


def ratio(part: float, whole: float) -> float | None:
    return part / whole if whole > 0 else None
