"""Counters and histograms the request path updates, rendered for Prometheus at scrape time.

The request path only adds to plain Python ints and lists (`Histogram.observe` is a bisect and
two additions); nothing here takes a lock or formats text per request. When `/metrics` is
scraped, `MetricsCollector` reads these numbers, plus the live state of the fleet and the
routing policy, and builds prometheus-client metric families from them — the library does the
exposition format, which is the part worth not writing by hand.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from operator import add
from typing import TypeVar

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector, CollectorRegistry

# Latency buckets (seconds): generation runs from milliseconds (cache hits, short answers) to
# many minutes (3,000-token rollouts behind a queue).
LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0,
    300.0, 600.0, 1800.0,
)  # fmt: skip


class Histogram:
    """A fixed-bucket histogram that is cheap to update and read all at once."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...] = LATENCY_BUCKETS) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last one is +Inf
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def cumulative(self) -> list[tuple[str, float]]:
        out, running = [], 0
        for bound, count in zip((*self.bounds, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), float(running)))
        return out


# Lineages a `CacheAccount` keeps apart, at most; the answers of any other are counted under
# OTHER_LINEAGE (`CacheAccount`).
MAX_LINEAGES = 256
OTHER_LINEAGE = "(other lineages)"
# The replica label the rows of replicas removed from the fleet are folded into (`forget`).
DEPARTED = b"departed"


K = TypeVar("K")
V = TypeVar("V")


def _fold(rows: dict[K, V], folded: Callable[[K], K | None], add: Callable[[V, V], V]) -> None:
    """Each row whose key `folded` maps to another key is merged into that key's row."""
    for key in list(rows):
        to = folded(key)
        if to is not None:
            value = rows.pop(key)
            rows[to] = add(rows[to], value) if to in rows else value


@dataclass
class CacheAccount:
    """Cached prompt tokens predicted against reported (proxy/usage.py says which answers
    count and how each figure is read): per (replica label, lineage), `[answers, predicted,
    reported]` over the answers that carried vLLM's report; per replica label, the answers that
    did not.

    A lineage is a name clients chose (each adapter name the fence ever admitted, routing/
    keys.py), and every one is a label set of `/metrics` and a row here for the router's life:
    at most `MAX_LINEAGES` are kept apart, the first seen; the answers of any later one are
    counted under `OTHER_LINEAGE`, so loading ever new names grows nothing. A replica removed
    from the fleet has its rows folded into `DEPARTED` (`forget`)."""

    reported: dict[tuple[bytes, str], list[int]] = field(default_factory=dict)
    unreported: dict[bytes, int] = field(default_factory=dict)
    lineages: set[str] = field(default_factory=set)  # those kept apart

    def record(self, replica: bytes, lineage: str, predicted: int, reported: int | None) -> None:
        if reported is None:
            self.unreported[replica] = self.unreported.get(replica, 0) + 1
            return
        if lineage not in self.lineages:
            if len(self.lineages) >= MAX_LINEAGES:
                lineage = OTHER_LINEAGE
            else:
                self.lineages.add(lineage)
        row = self.reported.get((replica, lineage))
        if row is None:
            row = self.reported[replica, lineage] = [0, 0, 0]
        row[0] += 1
        row[1] += predicted
        row[2] += reported

    def forget(self, replica: bytes) -> None:
        """`replica` left the fleet: its rows fold into DEPARTED (`RequestStats.forget`)."""
        _fold(
            self.reported,
            lambda key: (DEPARTED, key[1]) if key[0] == replica else None,
            lambda a, b: [x + y for x, y in zip(a, b, strict=True)],
        )
        _fold(self.unreported, lambda key: DEPARTED if key == replica else None, add)


@dataclass
class RequestStats:
    """What the request path records; keys are small tuples of short strings.

    Rows keyed by a replica are kept while it is a member: when it is removed for good, they
    fold into one replica label, DEPARTED (`forget`), so replicas that come and go (a discovery
    source whose members change addresses) grow the rows and the `/metrics` series by nothing,
    and every total stays as it was (a counter summed over replicas never goes down)."""

    requests: dict[tuple[str, int, bytes], int] = field(default_factory=dict)
    latency: dict[str, Histogram] = field(default_factory=dict)
    first_byte: dict[str, Histogram] = field(default_factory=dict)
    cached: CacheAccount = field(default_factory=CacheAccount)

    def observe(
        self,
        route: str,
        status: int,
        replica: bytes,
        started: float,
        now: float,
        first_byte_at: float,
    ) -> None:
        """A request that arrived at `started` answered by `now` (loop time), its first
        response byte at `first_byte_at` (0.0: none reached the client)."""
        key = (route, status, replica)
        self.requests[key] = self.requests.get(key, 0) + 1
        hist = self.latency.get(route)
        if hist is None:
            hist = self.latency[route] = Histogram()
        hist.observe(now - started)
        if first_byte_at:
            hist = self.first_byte.get(route)
            if hist is None:
                hist = self.first_byte[route] = Histogram()
            hist.observe(first_byte_at - started)

    def forget(self, replica: bytes) -> None:
        """`replica` (its label) was removed from the fleet: its rows fold into DEPARTED."""
        _fold(
            self.requests,
            lambda key: (key[0], key[1], DEPARTED) if key[2] == replica else None,
            add,
        )
        self.cached.forget(replica)


Source = Callable[[], Iterator[Metric]]


class MetricsCollector(Collector):
    """Renders the request stats and every registered live source at scrape time."""

    def __init__(self, stats: RequestStats) -> None:
        self._stats = stats
        self._sources: list[Source] = []

    def add_source(self, source: Source) -> None:
        """A callable yielding metric families built from live state (fleet, policy, fence)."""
        self._sources.append(source)

    def collect(self) -> Iterator[Metric]:
        stats = self._stats
        requests = CounterMetricFamily(
            "lora_router_requests",
            "Requests answered, by route, HTTP status and replica (- when the router answered).",
            labels=["route", "status", "replica"],
        )
        for (route, status, replica), count in sorted(stats.requests.items()):
            requests.add_metric([route, str(status), replica.decode()], count)
        yield requests
        yield _histogram(
            "lora_router_request_duration_seconds",
            "Time from a request's arrival to the end of its answer.",
            stats.latency,
        )
        yield _histogram(
            "lora_router_time_to_first_byte_seconds",
            "Time from a request's arrival to the replica's first response byte.",
            stats.first_byte,
        )
        for source in self._sources:
            yield from source()


def _histogram(name: str, doc: str, by_route: dict[str, Histogram]) -> HistogramMetricFamily:
    family = HistogramMetricFamily(name, doc, labels=["route"])
    for route, hist in sorted(by_route.items()):
        family.add_metric([route], hist.cumulative(), sum_value=hist.total)
    return family


Rows = list[tuple[list[str], float]]  # (label values, value)


def gauge(name: str, doc: str, labels: list[str], rows: Rows) -> Metric:
    return _family(GaugeMetricFamily(name, doc, labels=labels), rows)


def counter(name: str, doc: str, labels: list[str], rows: Rows) -> Metric:
    return _family(CounterMetricFamily(name, doc, labels=labels), rows)


def _family(family: GaugeMetricFamily | CounterMetricFamily, rows: Rows) -> Metric:
    for values, value in rows:
        family.add_metric(values, value)
    return family


def make_registry(collector: MetricsCollector) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry
