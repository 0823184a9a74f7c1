"""One run of the cache-pressure bench (bench/cache_pressure.py): a workload replayed through
one router, one replica restarted mid-run, the replicas' own counters read in windows."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from .procs import free_port
from .routing_procs import Contender, ReplicaHost, RouterOptions, RouterProcess, router_argv
from .routing_runs import Outcome, Run, RunResult, summarize
from .routing_traces import Item, Timing

_METRIC = re.compile(r"^(vllm:prefix_cache_(?:queries|hits))(?:_total)?\{[^}]*\}\s+(\S+)", re.M)
KV_LIVE_TIMEOUT_S = 15.0
KV_CONNECT_S = 0.5  # a SUB socket misses what is published before it connects


@dataclass(frozen=True, slots=True)
class Plan:
    """What every run of a cell does: where the restart falls, the windows."""

    restart_at: float | None  # fraction of the requests answered; None: no restart
    restart_replica: int
    down_s: float
    windows: int
    slots: int  # rollouts at once (TRL's max_inflight_tasks)
    deadline_s: float


@dataclass(slots=True)
class Snapshot:
    answered: int  # requests answered when the counters were read
    queries: list[int]  # per replica, since the run began (a restart's loss added back)
    hits: list[int]


@dataclass(slots=True)
class CacheRun:
    trace: str
    cache_blocks: int
    pressure: float  # the trace's working set per replica over cache_blocks
    contender: str
    label: str
    mode: str
    round: int = 0
    status: str = "ok"
    requests: int = 0
    failed: int = 0
    first_error: str = ""
    queries: int = 0
    hits: int = 0
    hit_rate: float = 0.0
    usage_cached: int = 0  # cached tokens the answers' usage reported, summed
    makespan_s: float = 0.0
    per_replica_busy_s: list[float] = field(default_factory=list)
    per_replica_requests: list[int] = field(default_factory=list)
    wall_s: float = 0.0
    router_cpu_s: float | None = None
    continuations_on_parent: float | None = None
    restart_answered: int | None = None  # requests answered when the restart began
    restart_s: float | None = None  # seconds into the run
    snapshots: list[dict[str, Any]] = field(default_factory=list)
    window_hit_rate: list[float | None] = field(default_factory=list)  # the replicas' counters
    # From each answer's usage, in order of answer: the restarted replica's share of the
    # requests of each window and its own hit rate in each.
    window_restarted_share: list[float | None] = field(default_factory=list)
    window_restarted_hit_rate: list[float | None] = field(default_factory=list)
    routing: dict[str, int] | None = None  # lora-router's decisions by kind
    accuracy: dict[str, Any] | None = None  # lora-router's routing_accuracy, when it has one
    kv_events: dict[str, Any] | None = None  # lora-router's KV-event streams, at the end
    retries: dict[str, int] | None = None
    unexpected_outputs: int = 0

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> CacheRun:
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in doc.items() if k in known})


async def counters(session: aiohttp.ClientSession, urls: list[str]) -> tuple[list[int], list[int]]:
    """(queries, hits) per replica from each one's /metrics (0 for a replica not answering)."""
    queries, hits = [], []
    for url in urls:
        values: dict[str, float] = {}
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(5)) as r:
                values = {k: float(v) for k, v in _METRIC.findall(await r.text())}
        queries.append(int(values.get("vllm:prefix_cache_queries", 0)))
        hits.append(int(values.get("vllm:prefix_cache_hits", 0)))
    return queries, hits


async def router_status(session: aiohttp.ClientSession, url: str) -> dict[str, Any] | None:
    with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
        async with session.get(url + "/router/status", timeout=aiohttp.ClientTimeout(5)) as r:
            if r.status == 200:
                doc: dict[str, Any] = orjson.loads(await r.read())
                return doc
    return None


async def wait_kv_subscribed(session: aiohttp.ClientSession, url: str, n: int) -> str:
    """Until the router follows every replica's KV events: each stream subscribed (`stale`,
    "not connected yet", until its first batch, which an idle replica does not send) or
    `live`; the states seen, if not in time."""
    deadline = time.monotonic() + KV_LIVE_TIMEOUT_S
    states: list[str] = []
    while time.monotonic() < deadline:
        doc = await router_status(session, url)
        streams = ((doc or {}).get("kv_events") or {}).get("replicas") or {}
        states = [f"{s.get('state')} ({s.get('reason')})" for s in streams.values()]
        if len(streams) == n and all(
            s.get("state") == "live" or s.get("reason") == "not connected yet"
            for s in streams.values()
        ):
            await asyncio.sleep(KV_CONNECT_S)  # ZMQ connects in the background
            return ""
        await asyncio.sleep(0.1)
    return f"KV-event streams not subscribed after {KV_LIVE_TIMEOUT_S} s: {states}"


class RolloutRun(Run):
    """`Run` with TRL's gating: at most `slots` rollouts at once (`max_inflight_tasks` of
    `AsyncRolloutWorker._generate_loop`: a new rollout, one sample's whole conversation,
    starts only when a slot frees, in trace order; its later turns go out as soon as the turn
    before answers). New families therefore arrive all through the run, onto caches already
    full, as they do under TRL, rather than all at the start."""

    def __init__(self, *args: Any, slots: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.slots = slots

    async def replay(self) -> float:
        children: dict[int, list[int]] = {}
        firsts: list[int] = []
        for item in self.items:
            if item.parent is None:
                firsts.append(item.index)
            else:
                children.setdefault(item.parent, []).append(item.index)
        heapq.heapify(firsts)
        later: list[int] = []  # later turns whose turn before answered
        by_index = {item.index: item for item in self.items}
        wake = asyncio.Event()
        rollouts = 0
        tasks: set[asyncio.Task[None]] = set()

        async def one(item: Item) -> None:
            nonlocal rollouts
            try:
                self.outcomes[item.index] = outcome = await self.send(item)
                if self.on_answer is not None:
                    self.on_answer(item, outcome)
            finally:
                nexts = children.get(item.index, ())
                for child in nexts:
                    heapq.heappush(later, child)
                if not nexts:
                    rollouts -= 1  # the rollout's last turn: its slot frees
                wake.set()

        async def launch(item: Item) -> None:
            while self.adapters is not None and item.version > self.loaded:
                await self.sync(self.loaded + 1)
            task = asyncio.create_task(one(item))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

        start = time.perf_counter()
        deadline = start + self.deadline_s
        while len(self.outcomes) < len(self.items):
            while later:
                await launch(by_index[heapq.heappop(later)])
            while firsts and rollouts < self.slots:
                rollouts += 1
                await launch(by_index[heapq.heappop(firsts)])
            wake.clear()
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), left)
        wall = time.perf_counter() - start
        for task in list(tasks):
            task.cancel()
        for item in self.items:
            self.outcomes.setdefault(item.index, Outcome(error="not sent before the deadline"))
        return wall


class Monitor:
    """Reads the replicas' counters at each window boundary and restarts one replica when
    `plan.restart_at` of the requests have answered."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        host: ReplicaHost,
        total: int,
        plan: Plan,
    ) -> None:
        self.session, self.host, self.total, self.plan = session, host, total, plan
        self.answered = 0
        self.order: list[int] = []  # item indices in order of answer
        n = len(host.urls)
        self.lost_queries, self.lost_hits = [0] * n, [0] * n  # what a restart made /metrics forget
        self.snapshots: list[Snapshot] = []
        self.bounds = [round(total * (k + 1) / plan.windows) for k in range(plan.windows)]
        self.restart_at = None if plan.restart_at is None else round(total * plan.restart_at)
        self.restart_answered: int | None = None
        self.restart_started: float | None = None
        self.wake = asyncio.Event()
        self.start = time.perf_counter()

    def on_answer(self, item: Item, outcome: Outcome) -> None:
        self.answered += 1
        self.order.append(item.index)
        self.wake.set()

    async def snapshot(self) -> None:
        answered = self.answered
        queries, hits = await counters(self.session, self.host.urls)
        self.snapshots.append(
            Snapshot(
                answered,
                [q + lost for q, lost in zip(queries, self.lost_queries, strict=True)],
                [h + lost for h, lost in zip(hits, self.lost_hits, strict=True)],
            )
        )

    async def watch(self) -> None:
        await self.snapshot()  # all zero: the run's origin
        next_bound = 0
        while next_bound < len(self.bounds):
            await self.wake.wait()
            self.wake.clear()
            due = self.restart_at is not None and self.answered >= self.restart_at
            if due and self.restart_answered is None:
                await self.snapshot()
                await self.restart()
            while next_bound < len(self.bounds) and self.answered >= self.bounds[next_bound]:
                next_bound += 1
                await self.snapshot()

    async def restart(self) -> None:
        i = self.plan.restart_replica
        self.restart_answered = self.answered
        self.restart_started = time.perf_counter() - self.start
        lost = await self.host.command(f"restart {i} {self.plan.down_s}")
        self.lost_queries[i] += int(lost["queries"])
        self.lost_hits[i] += int(lost["hits"])


def windows_from_snapshots(snaps: list[Snapshot], bounds: list[int]) -> list[float | None]:
    """Hit rate between consecutive window-boundary snapshots (the restart's own is skipped)."""
    at_bound: list[Snapshot] = [snaps[0]]
    for bound in bounds:
        # the first snapshot taken once `bound` requests had answered
        later = [s for s in snaps if s.answered >= bound]
        at_bound.append(later[0] if later else snaps[-1])
    out: list[float | None] = []
    for a, b in itertools.pairwise(at_bound):
        q = sum(b.queries) - sum(a.queries)
        h = sum(b.hits) - sum(a.hits)
        out.append(round(h / q, 4) if q > 0 else None)
    return out


async def run_one(
    host: ReplicaHost,
    c: Contender,
    items: list[Item],
    timing: Timing,
    plan: Plan,
    adapters: Path | None,
    workdir: Path,
    result: CacheRun,
    options: RouterOptions,
) -> CacheRun:
    """One run; the result's figures filled in (`status` says why not, when not)."""
    result.requests = len(items)
    n = len(host.urls)
    await host.command("reset")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = workdir / f"{c.key}-{result.trace}-{result.cache_blocks}-{result.round}.log"
    router = RouterProcess(router_argv(c, port, host.urls, options), log)
    connector = aiohttp.TCPConnector(limit=plan.slots + 16)
    monitor: Monitor | None = None
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            await router.wait_ready(session, url)
            if c.policy == "kv":
                problem = await wait_kv_subscribed(session, url, n)
                if problem:
                    result.status = problem
                    return result
            run = RolloutRun(
                session, url, items, plan.slots, timing, adapters, plan.deadline_s, slots=plan.slots
            )
            if adapters is not None:
                await run.sync(1)  # v1 is live before the clock starts, as in TRL
            monitor = Monitor(session, host, len(items), plan)
            run.on_answer = monitor.on_answer
            watcher = asyncio.create_task(monitor.watch())
            monitor.start = time.perf_counter()
            result.wall_s = round(await run.replay(), 3)
            monitor.wake.set()
            try:
                await asyncio.wait_for(watcher, 30)
            except TimeoutError:
                watcher.cancel()
            if c.kind == "lora-router":
                result.router_cpu_s = round(router.cpu_seconds(), 3)
            await monitor.snapshot()
            if c.kind == "lora-router":
                doc = await router_status(session, url) or {}
                result.routing = doc.get("routing")
                result.accuracy = doc.get("routing_accuracy")
                result.kv_events = doc.get("kv_events")
                result.retries = doc.get("retries")
            seeds = (await host.command("dump"))["seeds"]
    except Exception as exc:
        result.status = f"error: {type(exc).__name__}: {exc}"[:300]
        return result
    finally:
        router.stop()
    assert monitor is not None
    last = monitor.snapshots[-1]
    result.queries, result.hits = sum(last.queries), sum(last.hits)
    result.hit_rate = round(result.hits / result.queries, 4) if result.queries else 0.0
    failures = [o for o in run.outcomes.values() if o.status != 200]
    result.failed = len(failures)
    result.first_error = failures[0].error[:200] if failures else ""
    by_index = {item.index: item for item in items}
    result.usage_cached = sum(
        by_index[i].prompt_len - o.uncached for i, o in run.outcomes.items() if o.status == 200
    )
    placed = RunResult(result.trace, n, c.key, c.label, result.mode)
    summarize(placed, items, run.outcomes, seeds, timing)
    result.per_replica_busy_s = placed.per_replica_busy_s
    result.per_replica_requests = placed.per_replica_requests
    result.makespan_s = round(placed.makespan_s, 4)
    result.continuations_on_parent = placed.continuations_on_parent
    result.unexpected_outputs = placed.unexpected_outputs
    result.restart_answered = monitor.restart_answered
    result.restart_s = (
        None if monitor.restart_started is None else round(monitor.restart_started, 3)
    )
    result.snapshots = [asdict(s) for s in monitor.snapshots]
    result.window_hit_rate = windows_from_snapshots(monitor.snapshots, monitor.bounds)
    share, own = restarted_windows(items, run.outcomes, monitor, seeds, plan)
    result.window_restarted_share, result.window_restarted_hit_rate = share, own
    return result


def restarted_windows(
    items: list[Item],
    outcomes: dict[int, Outcome],
    monitor: Monitor,
    seeds: list[list[int]],
    plan: Plan,
) -> tuple[list[float | None], list[float | None]]:
    """Per window of answers: the restarted replica's share of the requests and its own hit
    rate (from usage: cached tokens over prompt tokens)."""
    index_of = {item.seed: item.index for item in items}
    on_restarted = {index_of[s] for s in seeds[plan.restart_replica] if s in index_of}
    by_index = {item.index: item for item in items}
    share: list[float | None] = []
    own: list[float | None] = []
    lo = 0
    for hi in monitor.bounds:
        window = monitor.order[lo:hi]
        lo = hi
        mine = [i for i in window if i in on_restarted and outcomes[i].status == 200]
        share.append(round(len(mine) / len(window), 4) if window else None)
        prompt = sum(by_index[i].prompt_len for i in mine)
        cached = sum(by_index[i].prompt_len - outcomes[i].uncached for i in mine)
        own.append(round(cached / prompt, 4) if prompt else None)
    return share, own
