"""`/metrics`: the replica's Prometheus exposition, with vLLM's metric names and labels.

Routers and gateways read these to balance load and LoRA affinity: the prefix-cache counters
(`vllm:prefix_cache_queries_total`, `vllm:prefix_cache_hits_total`, in tokens), the queue gauges
(`vllm:num_requests_running`, `vllm:num_requests_waiting`), `vllm:kv_cache_usage_perc` (the
blocks the batch holds, not the cached ones: 0 when idle, as a real server reports it),
`vllm:inter_token_latency_seconds` (a histogram of each generated token's time since its
sequence's previous one: the engine steps' durations, emulator/batching.py) and
`vllm:lora_requests_info`, whose labels list the adapters running and waiting and whose value
is a timestamp, as vLLM sets it.
Rendered from the engine's state at scrape time; never cached.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from lora_router.emulator.batching import ITL_BUCKETS
from lora_router.emulator.engine import Engine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        engine = self._engine
        labels = ["engine", "model_name"]
        values = ["0", engine.config.model]

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            engine.num_running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            engine.num_waiting,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "KV-cache usage. 1 means 100 percent usage.",
            engine.kv_cache_usage,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            engine.cache.queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            engine.cache.hits,
        )
        yield counter(
            "vllm:prompt_tokens",
            "Number of prefill tokens processed.",
            engine.counters.prompt_tokens,
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            engine.counters.generated_tokens,
        )
        itl = engine.inter_token_latency
        cumulative = list(itertools.accumulate(itl.buckets))
        latency = HistogramMetricFamily(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            labels=labels,
        )
        latency.add_metric(
            values,
            [(str(b), c) for b, c in zip([*ITL_BUCKETS, "+Inf"], cumulative, strict=True)],
            itl.sum,
        )
        yield latency
        info = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        running = _names(s.lora_name for s in engine.scheduler.running)
        waiting = _names(s.lora_name for s in engine.scheduler.waiting)
        info.add_metric([str(engine.config.max_loras), waiting, running], time.time())
        yield info


def _names(names: Iterator[str | None]) -> str:
    return ",".join(sorted({n for n in names if n}))


def render(engine: Engine) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_EngineCollector(engine))
    return generate_latest(registry)
