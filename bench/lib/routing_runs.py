"""One run of the routing bench: a workload replayed through one router, as TRL sends it
(syncs included), and the figures derived from where each request went."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import re
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import aiohttp
import orjson

from lora_router.emulator import write_adapter

from .procs import free_port, process_cpu_seconds
from .routing_procs import (
    FAMILY_HEADER,
    REQUEST_TIMEOUT_S,
    Contender,
    ReplicaHost,
    RouterOptions,
    RouterProcess,
    router_argv,
)
from .routing_traces import MAX_STALENESS, MODEL, Item, Scale, Timing

REPLICA_HEADER = "x-lora-router-replica"
_DECISION = re.compile(r'^lora_router_routing_decisions(?:_total)?\{kind="(\w+)"\}\s+(\S+)', re.M)
_METRIC = re.compile(r"^(vllm:prefix_cache_(?:queries|hits))(?:_total)?\{[^}]*\}\s+(\S+)", re.M)


# --- one run -------------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    status: int = 0  # 0: no HTTP answer
    error: str = ""
    header: str | None = None  # x-lora-router-replica
    uncached: int = 0
    generated: int = 0
    output_ok: bool | None = None
    sent_at: float = 0.0  # perf_counter, this load generator's clock
    done_at: float = 0.0


@dataclass(slots=True)
class RunResult:
    trace: str
    replicas: int
    contender: str
    label: str
    mode: str  # lora | base
    status: str = "ok"
    requests: int = 0
    failed: int = 0
    first_error: str = ""
    queries: int = 0
    hits: int = 0
    hit_rate: float = 0.0
    of_oracle: float | None = None
    siblings_on_majority: float = 0.0
    continuations_on_parent: float | None = None
    later_turns: int = 0
    later_elsewhere: int = 0  # later turns not where their previous turn ran
    spills: int | None = None  # lora-router's spill decisions (the load cap), from /metrics
    per_replica_requests: list[int] = field(default_factory=list)
    max_mean_requests: float = 0.0
    # Time-weighted max/mean requests in flight per replica: the integral over the run of the
    # busiest replica's in-flight count over that of the mean count (client-side intervals).
    in_flight_balance: float = 0.0
    per_replica_busy_s: list[float] = field(default_factory=list)
    max_mean_busy: float = 0.0
    wall_s: float = 0.0
    router_cpu_s: float = 0.0
    replica_cpu_s: float = 0.0  # the emulator host, over the run (core 1)
    client_cpu_s: float = 0.0  # this load generator, over the run (core 0)
    syncs: int = 0
    sync_failures: int = 0
    unexpected_outputs: int = 0
    header_mismatches: int | None = None
    round: int = 0  # which repeat this run was
    seed: int = 0  # the trace seed (`--seeds`)
    # Filled in the summaries of repeated runs (`aggregate`): medians above, and these.
    repeats: int = 1
    wall_range_s: list[float] = field(default_factory=list)
    worst_of_oracle: float | None = None
    worst_max_mean_requests: float = 0.0
    worst_in_flight_balance: float = 0.0
    worst_follow: float | None = None  # of later turns, spills excepted
    # Every run's wall time by "seed:round", so two contenders' runs on the same trace seed
    # and in the same interleaved round can be paired (`targets`).
    wall_by_run: dict[str, float] = field(default_factory=dict)
    # A summary's makespan: the median over its runs (`aggregate`), since the trace seed, not
    # the run the wall time picked as the middle one, decides how evenly the work falls.
    median_makespan_s: float | None = None

    @property
    def makespan_s(self) -> float:
        """The busiest replica's modeled service time: the wall time the placement implies,
        free of the machine's noise (of a summary: the median over its runs)."""
        if self.median_makespan_s is not None:
            return self.median_makespan_s
        return max(self.per_replica_busy_s, default=0.0)


async def post(session: aiohttp.ClientSession, url: str, body: object = None) -> int:
    async with session.post(url, json=body) as resp:
        await resp.read()
        return resp.status


class Run:
    """Replays a workload through one router and measures it."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        items: list[Item],
        in_flight: int,
        timing: Timing,
        adapters: Path | None,
        deadline_s: float,
    ) -> None:
        self.session = session
        self.url = url
        self.items = items
        self.in_flight_cap = in_flight
        self.timing = timing
        self.adapters = adapters  # None: base-model names, no syncs
        self.deadline_s = deadline_s
        self.outcomes: dict[int, Outcome] = {}
        self.loaded = 0
        self.syncs = 0
        self.sync_failures = 0
        # Called with each item as its outcome is recorded (bench/cache_pressure.py's windows).
        self.on_answer: Callable[[Item, Outcome], None] | None = None

    async def sync(self, version: int) -> None:
        """What TRL does for each new version: pause (keep), load, resume, unload v(N-5)."""
        assert self.adapters is not None
        name = f"trl-policy-v{version}"
        statuses = [await post(self.session, self.url + "/pause?mode=keep")]
        load = {"lora_name": name, "lora_path": str(self.adapters / name)}
        statuses.append(await post(self.session, self.url + "/v1/load_lora_adapter", load))
        statuses.append(await post(self.session, self.url + "/resume"))
        old = version - MAX_STALENESS - 1
        if old >= 1:
            unload = {"lora_name": f"trl-policy-v{old}"}
            await post(self.session, self.url + "/v1/unload_lora_adapter", unload)
        self.syncs += 1
        self.sync_failures += any(s != 200 for s in statuses)
        self.loaded = version

    async def send(self, item: Item) -> Outcome:
        out = Outcome(sent_at=time.perf_counter())
        headers = {"content-type": "application/json", FAMILY_HEADER: str(item.family)}
        try:
            async with self.session.post(
                self.url + "/v1/completions",
                data=item.body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
            ) as resp:
                raw = await resp.read()
                out.done_at = time.perf_counter()
                out.status = resp.status
                out.header = resp.headers.get(REPLICA_HEADER)
        except (aiohttp.ClientError, TimeoutError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
            return out
        if out.status != 200:
            out.error = f"{out.status}: {raw[:200].decode(errors='replace')}"
            return out
        answer = orjson.loads(raw)
        usage = answer.get("usage") or {}
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        out.uncached = int(usage.get("prompt_tokens", item.prompt_len)) - int(cached)
        out.generated = int(usage.get("completion_tokens", 0))
        if item.expected is not None:
            out.output_ok = answer["choices"][0].get("token_ids") == item.expected
        return out

    async def replay(self) -> float:
        """Send every item (`drive`), syncing the version a turn names first; returns the wall
        time."""

        async def send(item: Item) -> Outcome:
            outcome = await self.send(item)
            if self.on_answer is not None:
                self.on_answer(item, outcome)
            return outcome

        async def before(item: Item) -> None:
            while self.adapters is not None and item.version > self.loaded:
                await self.sync(self.loaded + 1)

        return await drive(
            self.items, self.outcomes, self.in_flight_cap, self.deadline_s, send, before
        )


async def replica_metrics(session: aiohttp.ClientSession, urls: list[str]) -> tuple[int, int]:
    """(queries, hits) in tokens, summed over the replicas' /metrics."""
    queries = hits = 0
    for url in urls:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text()
        values = {name: float(value) for name, value in _METRIC.findall(text)}
        queries += int(values.get("vllm:prefix_cache_queries", 0))
        hits += int(values.get("vllm:prefix_cache_hits", 0))
    return queries, hits


def max_mean(values: Sequence[float]) -> float:
    mean = statistics.fmean(values) if values else 0.0
    return max(values) / mean if mean > 0 else float("nan")


def in_flight_balance(intervals: list[tuple[float, float, int]], n: int) -> float:
    """Time-weighted max/mean in flight: ∫ max_i f_i(t) dt / ∫ mean_i f_i(t) dt, f_i(t) the
    requests replica i holds at t, from (sent, answered, replica) intervals."""
    events = sorted(
        [(t0, 1, r) for t0, _, r in intervals] + [(t1, -1, r) for _, t1, r in intervals]
    )
    counts = [0] * n
    total = 0
    peak_area = mean_area = 0.0
    last = events[0][0] if events else 0.0
    for at, step, replica in events:
        if total:
            peak_area += (at - last) * max(counts)
            mean_area += (at - last) * total / n
        counts[replica] += step
        total += step
        last = at
    return peak_area / mean_area if mean_area > 0 else float("nan")


def follow_rate(r: RunResult) -> float | None:
    """Later turns where their previous turn ran, the load cap's spills excepted (each spill
    excuses one later turn placed elsewhere, at most)."""
    if not r.later_turns:
        return None
    excused = min(r.spills or 0, r.later_elsewhere)
    return (r.later_turns - r.later_elsewhere + excused) / r.later_turns


def summarize(
    result: RunResult,
    items: list[Item],
    outcomes: dict[int, Outcome],
    seeds: list[list[int]],
    timing: Timing,
) -> None:
    """Fill the placement-derived figures of `result` from the replicas' seed logs."""
    index_of = {item.seed: item.index for item in items}
    replica_of: dict[int, int] = {}
    for replica, received in enumerate(seeds):
        for seed in received:
            if seed in index_of:
                replica_of[index_of[seed]] = replica  # a retry counts where it last went
    n = len(seeds)
    result.per_replica_requests = [len(received) for received in seeds]
    result.max_mean_requests = max_mean(result.per_replica_requests)
    busy = [0.0] * n
    intervals = []
    for item in items:
        out = outcomes[item.index]
        if out.status == 200 and item.index in replica_of:
            busy[replica_of[item.index]] += timing.service_s(out.uncached, out.generated)
            intervals.append((out.sent_at, out.done_at, replica_of[item.index]))
    result.per_replica_busy_s = [round(b, 4) for b in busy]
    result.max_mean_busy = max_mean(busy)
    result.in_flight_balance = in_flight_balance(intervals, n)

    groups: dict[int, list[int]] = {}
    follow = total_later = 0
    for item in items:
        placed = replica_of.get(item.index)
        if item.turn == 0:
            groups.setdefault(item.family, []).append(-1 if placed is None else placed)
        else:
            total_later += 1
            parent = replica_of.get(item.parent) if item.parent is not None else None
            follow += placed is not None and placed == parent
    majority = sum(Counter(g).most_common(1)[0][1] for g in groups.values())
    result.siblings_on_majority = majority / max(1, sum(len(g) for g in groups.values()))
    result.continuations_on_parent = follow / total_later if total_later else None
    result.later_turns, result.later_elsewhere = total_later, total_later - follow

    headers = [(o.header, replica_of.get(i)) for i, o in outcomes.items() if o.header is not None]
    if headers:
        result.header_mismatches = sum(h != str(r) for h, r in headers)
    result.unexpected_outputs = sum(o.output_ok is False for o in outcomes.values())


async def router_spills(session: aiohttp.ClientSession, url: str) -> int | None:
    """lora-router's spill decisions so far, from its /metrics (None for other routers)."""
    try:
        async with session.get(url + "/metrics") as resp:
            text = await resp.text() if resp.status == 200 else ""
    except aiohttp.ClientError:
        return None
    counts = {kind: float(value) for kind, value in _DECISION.findall(text)}
    return int(counts["spill"]) if "spill" in counts else None


class Bench:
    """Everything for one replica count: the replica host, the adapters, the runs."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args = args
        self.timing: Timing = args.timing
        self.scale: Scale = args.scale
        self.options = RouterOptions(
            args.load_factor, args.load_slack, args.lr_source, args.alt_source
        )
        self.workdir = workdir
        self.adapters = workdir / "adapters"

    def write_adapters(self, versions: int) -> None:
        for version in range(1, versions + 1):
            path = self.adapters / f"trl-policy-v{version}"
            if not path.exists():
                write_adapter(path, rank=1, base_model=MODEL)

    async def run(
        self, host: ReplicaHost, c: Contender, trace: str, n: int, items: list[Item]
    ) -> RunResult:
        result = RunResult(trace, n, c.key, c.label, "base" if c.base else "lora")
        result.requests = len(items)
        await host.command("reset")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = self.workdir / f"{c.key}-{trace}-{n}.log"
        source = None
        if c.kind == "lora-router":
            source = self.options.alt_source if c.alt else self.options.source
        router = RouterProcess(router_argv(c, port, host.urls, self.options), log, source)
        connector = aiohttp.TCPConnector(limit=self.scale.in_flight_per_replica * n + 16)
        try:
            async with aiohttp.ClientSession(connector=connector) as session:
                await router.wait_ready(session, url)
                if c.kind == "sglang-router":
                    probe = await Run(session, url, items, 1, self.timing, None, 60).send(items[0])
                    if probe.status != 200:
                        result.status = f"rejects token-id prompts ({probe.status or 'no answer'})"
                        result.first_error = probe.error[:200]
                        result.failed = len(items)
                        return result
                    await host.command("reset")  # the probe must not warm a cache
                run = Run(
                    session,
                    url,
                    items,
                    self.scale.in_flight_per_replica * n,
                    self.timing,
                    None if c.base else self.adapters,
                    self.args.deadline,
                )
                if not c.base:
                    await run.sync(1)  # v1 is live before the clock starts, as in TRL
                    run.syncs = run.sync_failures = 0
                host_cpu, own_cpu = process_cpu_seconds(host.proc.pid), time.process_time()
                result.wall_s = round(await run.replay(), 3)
                result.router_cpu_s = round(router.cpu_seconds(), 3)
                result.replica_cpu_s = round(process_cpu_seconds(host.proc.pid) - host_cpu, 3)
                result.client_cpu_s = round(time.process_time() - own_cpu, 3)
                result.queries, result.hits = await replica_metrics(session, host.urls)
                if c.kind == "lora-router":
                    result.spills = await router_spills(session, url)
                seeds = (await host.command("dump"))["seeds"]
        except Exception as exc:
            result.status = f"error: {type(exc).__name__}: {exc}"[:300]
            result.failed = len(items)
            return result
        finally:
            router.stop()
        result.hit_rate = result.hits / result.queries if result.queries else 0.0
        failures = [o for o in run.outcomes.values() if o.status != 200]
        result.failed = len(failures)
        result.first_error = failures[0].error[:200] if failures else ""
        result.syncs, result.sync_failures = run.syncs, run.sync_failures
        summarize(result, items, run.outcomes, seeds, self.timing)
        return result


class Linked(Protocol):
    index: int
    parent: int | None


def eligibility(items: Sequence[Linked]) -> tuple[list[int], dict[int, list[int]]]:
    """The client's order (`drive`): the items eligible at once (no parent) as a heap of
    indices, the lowest sent first, and each parent's later turns, eligible once it answered."""
    children: dict[int, list[int]] = {}
    ready: list[int] = []
    for item in items:
        if item.parent is None:
            ready.append(item.index)
        else:
            children.setdefault(item.parent, []).append(item.index)
    heapq.heapify(ready)
    return ready, children


async def drive(
    items: list[Item],
    outcomes: dict[int, Outcome],
    cap: int,
    deadline_s: float,
    send: Callable[[Item], Awaitable[Outcome]],
    before: Callable[[Item], Awaitable[None]],
    after: Callable[[Item], Awaitable[None]] | None = None,
) -> float:
    """Send every item, in trace order among the eligible ones, at most `cap` at a time; a
    later turn becomes eligible when its parent has answered. `before(item)` runs before its
    send (a weight sync), `after(item)` once it ended, whatever its outcome. Whatever was not
    sent by `deadline_s` is an error outcome. Returns the wall time (first send to last
    answer)."""
    ready, children = eligibility(items)
    by_index = {item.index: item for item in items}
    wake = asyncio.Event()
    running = 0
    tasks: set[asyncio.Task[None]] = set()

    async def one(item: Item) -> None:
        nonlocal running
        try:
            outcomes[item.index] = await send(item)
        finally:
            running -= 1
            for child in children.get(item.index, ()):
                heapq.heappush(ready, child)
            if after is not None:
                await after(item)
            wake.set()

    start = time.perf_counter()
    deadline = start + deadline_s
    while len(outcomes) < len(items):
        while ready and running < cap:
            item = by_index[heapq.heappop(ready)]
            await before(item)
            running += 1
            task = asyncio.create_task(one(item))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        wake.clear()
        left = deadline - time.perf_counter()
        if left <= 0:
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), left)
    wall = time.perf_counter() - start
    for task in list(tasks):
        task.cancel()
    for item in items:
        outcomes.setdefault(item.index, Outcome(error="not sent before the deadline"))
    return wall
