"""Replica telemetry: what each replica says about itself on its `/metrics`, and the fleet's
weight syncs as the router saw them.

A round asks the `/metrics` of the next `scrape_budget` members, round robin, at once, through
the replica client (client.py, so with the replica's token), each call bounded by
`health_timeout`, and keeps the answer as a frozen `Report` on `Replica.report`. The first round
runs as the router starts, before it serves (runtime.py), so that each figure read over an
interval (the decode step, and with it a replica's weight) has its first value one interval
after start; then one task runs a round every `health_interval`. With n members
each report is at most ceil(n / budget) intervals old, and shows its age (`/router/status`'s
`age_s`, `top`). Read:

- queue: `vllm:num_requests_running`, `vllm:num_requests_waiting`;
- KV use: `vllm:kv_cache_usage_perc` (0..1);
- prefix cache: `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` (tokens), over
  the interval since the previous report and since the replica started;
- generated tokens per second: the change of `vllm:generation_tokens_total` over the interval;
  and since when it has computed nothing (that counter and `vllm:prompt_tokens_total` unmoved)
  at every scrape while the router held a request in flight on it and the fleet was not paused
  since the previous one (`Report.still_since`, which health.py's stall rule reads);
- the decode step: the change of `vllm:inter_token_latency_seconds`' `_sum` over its `_count`'s
  over the interval, the mean seconds between a sequence's tokens (a histogram vLLM observes at
  every generated token but a sequence's first); optional: a replica without it reports the
  rest, and `Report.decode_step_s` is None. After each round the rule of fleet/pace.py is
  given every decode step scraped in it with the seconds the fleet spent paused in its
  interval (`PaceRule.scraped`, which refuses one paused for more than a small share of it)
  and judges the weights;
- adapters running and waiting: the labels `running_lora_adapters` / `waiting_lora_adapters`
  (and `max_lora`) of `vllm:lora_requests_info`'s newest sample (largest value).

Samples of several engines (data parallel) add up; KV use is their mean. The page is read as it
arrives, never kept whole (`ReportReader`, fed by the replica client in pieces of at most
`READ_PIECE_BYTES`, the loop free between two): one scan of each piece finds the sample lines of
the families read (the rest are skipped, not split or decoded), and `_sample` reads each by the
text format, refusing a line that breaks it. A page over `MAX_PAGE_BYTES`, or a sample line of
a family read over `MAX_LINE_BYTES`, is refused, saying so; so whatever a replica sends, a
scrape holds the loop at most one piece's scan at a time and keeps at most a few lines. The
scrape asks for `identity` encoding. How, and why it costs what it does:
docs/design/fleet.md#telemetry.

A replica whose `/metrics` fails, is missing a family, or answers something that does not parse
gets `report = None` ("unknown") and `report_error` saying why; nothing else changes. Each
report also feeds a short history: the share of the recent unpaused samples in which the
replica was running or queueing anything (`busy_share`, what `lora-router top` judges on).

`SyncClock` records the fleet's pause → resume intervals (the trainer's weight syncs), fed by
the control plane's `/pause` and `/resume` broadcasts.

This module must never eject, admit or otherwise judge a replica, never run on the health
check's or the data plane's path (its loop is its own task, and a scrape only reads state), and
never keep a failed scrape's figures as if they were current.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from lora_router.config import Config
from lora_router.fleet.client import Answer, ReplicaClient
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.pace import PaceRule
from lora_router.fleet.replica import Replica
from lora_router.fleet.report import Report, ratio
from lora_router.observe.metrics import Histogram

log = logging.getLogger(__name__)

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
PREFIX_HITS = "vllm:prefix_cache_hits_total"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
LORA_INFO = "vllm:lora_requests_info"
TOKEN_LATENCY_SUM = "vllm:inter_token_latency_seconds_sum"
TOKEN_LATENCY_COUNT = "vllm:inter_token_latency_seconds_count"
REQUIRED = (
    RUNNING,
    WAITING,
    KV_USAGE,
    PREFIX_QUERIES,
    PREFIX_HITS,
    GENERATION_TOKENS,
    PROMPT_TOKENS,
)
# A line that begins with one of the names read here, then labels or a blank: the name and the
# rest of the line. The pattern begins with a literal, so the scan skips the other lines fast;
# the text scanned always begins with the newline before its first line.
_LINE = re.compile(
    rb"\n("
    + b"|".join(
        re.escape(n.encode())
        for n in (*REQUIRED, LORA_INFO, TOKEN_LATENCY_SUM, TOKEN_LATENCY_COUNT)
    )
    + rb")([{ \t][^\n]*)"
)
# What follows a sample's name, as the text format has it: optional labels (quoted values
# with `\\`, `\"`, `\n` escapes; a trailing comma allowed), blanks, a value, an optional
# timestamp (ms).
_QUOTED = rb'"[^"\\\n]*(?:\\.[^"\\\n]*)*"'  # unrolled: one step per run of plain bytes
_PAIR = rb"[ \t]*[a-zA-Z_][a-zA-Z0-9_]*[ \t]*=[ \t]*" + _QUOTED + rb"[ \t]*"
_REST = re.compile(
    rb"(?:\{((?:" + _PAIR + rb",)*(?:" + _PAIR + rb")?)\})?[ \t]+(\S+)(?:[ \t]+-?[0-9]+)?[ \t\r]*"
)
_LABEL = re.compile(rb'([a-zA-Z_][a-zA-Z0-9_]*)[ \t]*=[ \t]*"((?:[^"\\\n]|\\.)*)"')
_UNESCAPE = re.compile(rb"\\(.)")
_ESCAPED = {b"n": b"\n", b"\\": b"\\", b'"': b'"'}
_LORA_NAME = LORA_INFO.encode()
_IDENTITY = {"Accept-Encoding": "identity"}

# The largest `/metrics` answer read: vLLM's grows with `vllm:lora_requests_info`'s label sets,
# a few MiB after thousands of weight syncs (docs/design/fleet.md#telemetry). A larger one is
# refused, saying why and what clears it.
MAX_PAGE_BYTES = 64 << 20
# The longest sample line of a family read; a longer one is refused. Longer lines of other
# families are skipped, never kept.
MAX_LINE_BYTES = 256 << 10

WINDOW_S = 300.0  # how far back `busy_share` and the paused share look
SYNC_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
RECENT_SYNCS = 10  # shown in /router/status


class MetricsError(ValueError):
    """A `/metrics` answer that is not a vLLM exposition."""


def parse_report(text: bytes, at: float) -> Report:
    """Read the families of the module docstring out of one whole `/metrics` answer."""
    reader = ReportReader()
    reader.feed(text)
    return reader.finish(at)


class ReportReader:
    """One `/metrics` answer read as it arrives: `feed` each piece in order, then `finish`.

    However the answer is cut into pieces, the report (or the MetricsError) is the same, but
    for an answer over MAX_PAGE_BYTES, refused as soon as it passes it. Kept between pieces:
    each family's running sum and count, the newest `vllm:lora_requests_info` line and the line
    not yet ended, each at most MAX_LINE_BYTES, whatever the answer. A `feed` costs
    O(len(piece) + MAX_LINE_BYTES)."""

    def __init__(self) -> None:
        self._sums: dict[bytes, float] = {}
        self._counts: dict[bytes, int] = {}
        self._newest, self._newest_value = b"", -math.inf
        self._tail = bytearray(b"\n")  # the line not yet ended, after the newline before it
        self._skipping = False  # within a line over MAX_LINE_BYTES of no family read
        self._size = 0

    def feed(self, piece: bytes) -> None:
        self._size += len(piece)
        if self._size > MAX_PAGE_BYTES:
            raise MetricsError(
                f"the page is larger than {MAX_PAGE_BYTES >> 20} MiB (vLLM keeps a "
                f"{LORA_INFO} sample for every set of adapters it ever had in flight: a "
                "restart of the replica starts it afresh)"
            )
        if self._skipping:
            start = piece.find(b"\n")
            if start < 0:
                return
            self._skipping, self._tail = False, bytearray()
            piece = piece[start:]
        end = piece.rfind(b"\n")
        if end >= 0:  # lines ended in this piece: read them, keep the one that goes on
            self._scan(b"".join((self._tail, memoryview(piece)[:end])))
            self._tail = bytearray(memoryview(piece)[end:])
        else:
            self._tail += piece
        if len(self._tail) - 1 > MAX_LINE_BYTES:
            line = _LINE.match(self._tail)
            if line is not None:
                raise _too_long(line.group(1))
            self._skipping, self._tail = True, bytearray()

    def finish(self, at: float) -> Report:
        """The report of the answer fed, whose end this is."""
        if not self._skipping:
            self._scan(bytes(self._tail))
        counts, sums = self._counts, self._sums
        if not counts and not self._newest:
            raise MetricsError("no vLLM metrics in the answer")
        missing = [name for name in REQUIRED if name.encode() not in counts]
        if missing:
            raise MetricsError(f"no {', '.join(missing)}")
        running, waiting, max_lora = None, None, None
        if self._newest:
            block, _ = _sample(_LORA_NAME, self._newest)
            labels = _labels(_LORA_NAME, self._newest, block)
            running = _adapters(labels.get("running_lora_adapters", ""))
            waiting = _adapters(labels.get("waiting_lora_adapters", ""))
            with contextlib.suppress(ValueError):
                max_lora = int(labels.get("max_lora", ""))
        kv = KV_USAGE.encode()
        return Report(
            at=at,
            running=int(sums[RUNNING.encode()]),
            waiting=int(sums[WAITING.encode()]),
            kv_cache_usage=sums[kv] / counts[kv],
            prefix_queries=sums[PREFIX_QUERIES.encode()],
            prefix_hits=sums[PREFIX_HITS.encode()],
            generation_tokens=sums[GENERATION_TOKENS.encode()],
            prompt_tokens=sums[PROMPT_TOKENS.encode()],
            adapters_running=running,
            adapters_waiting=waiting,
            max_lora=max_lora,
            token_latency_sum=sums.get(TOKEN_LATENCY_SUM.encode()),
            token_latency_count=sums.get(TOKEN_LATENCY_COUNT.encode()),
        )

    def _scan(self, text: bytes) -> None:
        """Read the sample lines of the families read in `text`, whole lines after a newline.
        Samples of several engines add up in the order read."""
        sums, counts = self._sums, self._counts
        for match in _LINE.finditer(text):
            name, rest = match.groups()
            if len(name) + len(rest) > MAX_LINE_BYTES:
                raise _too_long(name)
            if name == _LORA_NAME:
                # Thousands of these over a long run: a cheap look at the value picks the newest.
                value = _newest_value(rest)
                if value is not None and value >= self._newest_value:
                    self._newest, self._newest_value = rest, value
                continue
            sums[name] = sums.get(name, 0.0) + _sample(name, rest)[1]
            counts[name] = counts.get(name, 0) + 1


def _sample(name: bytes, rest: bytes) -> tuple[bytes, float]:
    """The label block and value of one sample line (`rest`: what follows its name);
    MetricsError quoting a little of the line if it breaks the text format."""
    line = _REST.fullmatch(rest)
    if line is None:
        raise _broken(name, rest)
    block, value = line.groups()
    try:
        return block or b"", float(value)
    except ValueError:
        raise _broken(name, rest) from None


def _labels(name: bytes, rest: bytes, block: bytes) -> dict[str, str]:
    """The labels of a label block `_sample` accepted, unescaped."""
    try:
        return {
            key.decode(): _UNESCAPE.sub(_unescaped, raw).decode("utf-8")
            for key, raw in _LABEL.findall(block)
        }
    except UnicodeDecodeError:
        raise _broken(name, rest) from None


def _unescaped(match: re.Match[bytes]) -> bytes:
    return _ESCAPED.get(match.group(1), b"\\" + match.group(1))


def _too_long(name: bytes) -> MetricsError:
    return MetricsError(f"a {name.decode()} line longer than {MAX_LINE_BYTES >> 10} KiB")


def _broken(name: bytes, rest: bytes) -> MetricsError:
    line = (name + rest)[:80].decode("utf-8", "replace")
    return MetricsError(f"not a Prometheus exposition (line {line!r})")


class Telemetry:
    """The scrape loop and each replica's recent busy samples (module docstring)."""

    def __init__(
        self,
        config: Config,
        client: ReplicaClient,
        fleet: Fleet,
        syncs: SyncClock,
        pace: PaceRule | None = None,
    ) -> None:
        self.config = config
        self.client = client
        self.fleet = fleet
        self.syncs = syncs  # the fleet's pauses: an interval that saw one is no pace sample
        self.pace = pace  # the weights' rule, given each scraped report (fleet/pace.py)
        self.scrapes = 0
        self.scrape_failures = 0
        self._busy: dict[int, deque[tuple[float, bool]]] = {}  # rid -> (time, busy)
        self._task: asyncio.Task[None] | None = None
        self._next = 0  # where the next round starts among the members (round robin)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        interval = self.config.health_interval
        # The first round waits one interval too, as the health watchers do: start-up has
        # enough requests of its own.
        started = time.monotonic()
        while True:
            await asyncio.sleep(max(0.0, started + interval - time.monotonic()))
            started = time.monotonic()
            try:
                await self.scrape_round()
            except Exception:  # the loop must outlive any one bad answer
                log.exception("replica telemetry failed unexpectedly")

    async def scrape_round(self) -> None:
        """Ask the next `scrape_budget` members' `/metrics` at once, round robin; returns when
        all answered or timed out. O(members) to pick them, `scrape_budget` requests."""
        members = [r for r in self.fleet.replicas if r.life.member]
        budget = self.config.scrape_budget
        if len(members) <= budget:
            await self._scrape_some(members)
            return
        start = self._next % len(members)
        self._next = start + budget
        await self._scrape_some((members + members)[start : start + budget])

    async def scrape_all(self) -> None:
        """Ask every member's `/metrics` at once, whatever the budget."""
        await self._scrape_some([r for r in self.fleet.replicas if r.life.member])

    async def _scrape_some(self, replicas: Sequence[Replica]) -> None:
        await asyncio.gather(*(self.scrape(r) for r in replicas))
        if self.pace is not None:
            self.pace.judge(time.monotonic())
        members = {r.rid for r in self.fleet.replicas}
        for rid in [rid for rid in self._busy if rid not in members]:
            del self._busy[rid]

    async def scrape(self, replica: Replica) -> None:
        self.scrapes += 1
        reader = ReportReader()  # reads a 200 page as it arrives, never kept whole

        def body_to(head: Answer[Replica]) -> Callable[[bytes], None] | None:
            return reader.feed if head.status == 200 and _encoding(head) == b"identity" else None

        try:
            answer = await self.client.call(
                replica,
                "GET",
                "/metrics",
                timeout=self.config.health_timeout,
                headers=_IDENTITY,
                body_to=body_to,
            )
            now = time.monotonic()
            if answer.status != 200:
                raise MetricsError(f"/metrics: {answer.summary()}")
            if _encoding(answer) != b"identity":
                raise MetricsError(f"/metrics came {_encoding(answer).decode('latin-1')}-encoded")
            previous = replica.report
            # Seconds the fleet stood paused since the previous report, a pause still on
            # included: no generation is due then, so a replica that computed nothing was not
            # still (`Report.still_since`).
            paused = self.syncs.paused_within(previous.at, now) if previous is not None else 0.0
            holding = replica.in_flight > 0 and paused == 0.0
            report = reader.finish(now).following(previous, holding)
        except MetricsError as exc:
            self.scrape_failures += 1
            if replica.report is not None or replica.report_error != str(exc):
                log.info("%s reports no figures: %s", replica.describe(), exc)
            replica.report, replica.report_error = None, str(exc)
            return
        replica.report, replica.report_error = report, ""
        if self.pace is not None:
            self.pace.scraped(replica, report, now, paused)
        if not self.fleet.pause.paused:
            # Samples taken while the fleet is paused say nothing about generation.
            samples = self._busy.setdefault(replica.rid, deque())
            samples.append((now, report.running + report.waiting > 0))
            while samples and samples[0][0] < now - WINDOW_S:
                samples.popleft()

    def busy_share(self, replica: Replica) -> float | None:
        """Share of the recent unpaused samples in which the replica ran or queued anything."""
        samples = self._busy.get(replica.rid)
        if not samples:
            return None
        return sum(1 for _, busy in samples if busy) / len(samples)


@dataclass(frozen=True, slots=True)
class FleetFigures:
    """What the reporting replicas add up to."""

    reporting: int
    running: int
    waiting: int
    hit_rate: float | None  # over the last interval
    hit_rate_total: float | None
    tokens_per_s: float | None
    busy_share: float | None


def fleet_figures(replicas: Iterable[Replica], telemetry: Telemetry) -> FleetFigures:
    reports = [(r, r.report) for r in replicas if r.report is not None]
    shares = [s for r, _ in reports if (s := telemetry.busy_share(r)) is not None]
    rates = [rep.tokens_per_s for _, rep in reports if rep.tokens_per_s is not None]
    return FleetFigures(
        reporting=len(reports),
        running=sum(rep.running for _, rep in reports),
        waiting=sum(rep.waiting for _, rep in reports),
        hit_rate=ratio(
            sum(rep.interval_hits for _, rep in reports),
            sum(rep.interval_queries for _, rep in reports),
        ),
        hit_rate_total=ratio(
            sum(rep.prefix_hits for _, rep in reports),
            sum(rep.prefix_queries for _, rep in reports),
        ),
        tokens_per_s=sum(rates) if rates else None,
        busy_share=sum(shares) / len(shares) if shares else None,
    )


class SyncClock:
    """The fleet's pause → resume intervals: how long and how often generation stood still for
    the trainer's weight syncs. Times are `time.monotonic()`."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.paused_at: float | None = None
        self.count = 0
        self.seconds = 0.0  # finished syncs only
        self.durations = Histogram(SYNC_BUCKETS)
        # Finished (start, end) intervals: those of the last WINDOW_S (the windowed share), and
        # the last few whenever they were (shown in /router/status).
        self._window: deque[tuple[float, float]] = deque()
        self._last: deque[tuple[float, float]] = deque(maxlen=RECENT_SYNCS)

    def pause(self, now: float) -> None:
        if self.paused_at is None:  # a second /pause extends the sync, it does not restart it
            self.paused_at = now

    def resume(self, now: float) -> None:
        if self.paused_at is None:
            return
        start, self.paused_at = self.paused_at, None
        self.count += 1
        self.seconds += now - start
        self.durations.observe(now - start)
        self._window.append((start, now))
        self._last.append((start, now))
        while self._window[0][1] < now - WINDOW_S:
            self._window.popleft()

    def paused_seconds(self, now: float) -> float:
        """Time spent paused since the router started, the sync in progress included."""
        return self.seconds + (now - self.paused_at if self.paused_at is not None else 0.0)

    def share_total(self, now: float) -> float:
        """Share of the router's life spent paused."""
        life = now - self.started
        return min(1.0, self.paused_seconds(now) / life) if life > 0 else 0.0

    def share(self, now: float, window: float = WINDOW_S) -> float:
        """Share of the last `window` seconds (or of the router's life, if shorter) paused;
        `window` must not exceed WINDOW_S, the span of the intervals kept."""
        since = max(self.started, now - window)
        if now <= since:
            return 0.0
        return min(1.0, self.paused_within(since, now) / (now - since))

    def paused_within(self, start: float, end: float) -> float:
        """The seconds the fleet was paused from `start` to `end` (`end` now), the sync in
        progress included; the whole span if `start` is older than the WINDOW_S kept. O(1 + s),
        s the syncs that ended after `start`."""
        if start < end - WINDOW_S:
            return end - start
        paused = 0.0 if self.paused_at is None else max(0.0, end - max(self.paused_at, start))
        for began, stop in reversed(self._window):  # newest first
            if stop < start:
                break
            paused += max(0.0, min(stop, end) - max(began, start))
        return paused

    def recent(self, now: float) -> list[tuple[float, float]]:
        """The last few finished syncs as (seconds since it ended, duration), newest first."""
        return [(now - end, end - start) for start, end in reversed(self._last)]


def _adapters(label: str) -> tuple[str, ...]:
    return tuple(sorted(n for n in label.split(",") if n))


def _newest_value(rest: bytes) -> float | None:
    """The value field of a sample line's rest, read cheaply (after the last `}`; a timestamp
    may follow); None if there is none. The line chosen is then read in full by `_sample`."""
    fields = rest[rest.rfind(b"}") + 1 :].split()
    try:
        return float(fields[0]) if fields else None
    except ValueError:
        return None


def _encoding(answer: Answer[Replica]) -> bytes:
    """The answer's content encoding, `identity` when it names none."""
    found = (v.strip().lower() for k, v in answer.headers if k.lower() == b"content-encoding")
    return next(found, b"") or b"identity"
