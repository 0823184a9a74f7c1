"""RL's clock (bench/rl_clock.py): the fleet of batching replicas, the TRL-shaped rollouts
replayed through one router, and the figures a trainer feels.

A *group* is one problem's G samples and all their later turns (a GRPO step can use it only
when its slowest sample is back); its time runs from its first request's send to its last
answer. A *step* is complete when its last group is; the step time is the gap between two
steps' completions (the first one's from the start). Accepted samples: rollouts whose every
turn answered 200. The hit rate is the replicas' own: `vllm:prefix_cache_hits` /
`vllm:prefix_cache_queries` summed over their /metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import aiohttp

from lora_router.emulator import EmulatorConfig, write_adapter

from .procs import free_port, pinned
from .routing_procs import (
    FAMILY_HEADER,
    HOST_LINE_LIMIT,
    REPLICA_CPUS,
    REQUEST_TIMEOUT_S,
    START_TIMEOUT_S,
    Contender,
    ReplicaHost,
    RouterOptions,
    RouterProcess,
    router_argv,
    serve_emulators,
)
from .routing_runs import Outcome, drive, post, replica_metrics
from .routing_traces import MAX_STALENESS, MODEL, Item

SESSION_HEADER = "X-Session-ID"  # vllm-router's session key, as prime-rl sends it


@dataclass(frozen=True, slots=True)
class Fleet:
    """The emulated replicas: their capacity model (batching.py) and their speeds."""

    replicas: int
    speeds: tuple[float, ...]  # one per replica
    prefill_s_per_token: float
    decode_s_per_token: float
    decode_s_per_seq: float
    max_num_seqs: int
    max_num_batched_tokens: int = 8192
    cache_blocks: int = 4096

    @property
    def slow(self) -> frozenset[int]:
        """The replicas below full speed."""
        return frozenset(i for i, speed in enumerate(self.speeds) if speed < 1)

    def settings(self) -> list[dict[str, Any]]:
        """Each replica's `EmulatorConfig` keyword arguments."""
        return [
            {
                "host": "127.0.0.1",
                "port": 0,
                "max_num_seqs": self.max_num_seqs,
                "max_num_batched_tokens": self.max_num_batched_tokens,
                "cache_blocks": self.cache_blocks,
                "prefill_s_per_token": self.prefill_s_per_token,
                "decode_s_per_token": self.decode_s_per_token,
                "decode_s_per_seq": self.decode_s_per_seq,
                "speed": speed,
                "max_lora_rank": 1,
                "max_loras": MAX_STALENESS + 2,
                "max_model_len": 16384,
                "record_requests": True,
            }
            for speed in self.speeds
        ]


async def serve_fleet(settings: list[dict[str, Any]]) -> None:
    """`serve-fleet`: one emulator per settings object in this process, driven on stdin as
    bench/lib/routing_procs.py's `serve_emulators` says (`reset`, `dump`, `quit`)."""
    await serve_emulators([EmulatorConfig(**s) for s in settings])


async def start_fleet(script: Path, fleet: Fleet, log: IO[bytes]) -> ReplicaHost:
    """The fleet in a subprocess (`script serve-fleet`), pinned to the replicas' core."""
    argv = [sys.executable, str(script), "serve-fleet", json.dumps(fleet.settings())]
    proc = await asyncio.create_subprocess_exec(
        *pinned(argv, REPLICA_CPUS),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=log,
        limit=HOST_LINE_LIMIT,
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), START_TIMEOUT_S)
        if not line:
            raise RuntimeError("the replica host exited (see its log)")
        return ReplicaHost(proc, json.loads(line)["urls"])
    except BaseException:
        await ReplicaHost(proc, []).close()
        raise


@dataclass(slots=True)
class ClockResult:
    """One run: a trace through one router to one fleet, at one load."""

    trace: str
    fleet: str  # e.g. "4 uniform", "4, one at half speed"
    load: str  # light | saturating
    contender: str
    label: str
    round: int = 0
    seed: int = 0  # the trace's (grpo_trace.TraceSpec.seed): which draw of the workload
    status: str = "ok"
    requests: int = 0
    failed: int = 0
    first_error: str = ""
    groups: int = 0
    group_p50_s: float = 0.0
    group_p90_s: float = 0.0
    group_max_s: float = 0.0
    step_s: float = 0.0  # median gap between two steps' completions
    samples_per_s: float = 0.0  # accepted samples (every turn answered) per second
    hit_rate: float = 0.0
    wall_s: float = 0.0
    per_replica_requests: list[int] = field(default_factory=list)
    # Groups whose requests more than one replica answered (`split_groups`); None in runs
    # recorded before the replicas logged families.
    split_groups: int | None = None
    # On a fleet with a replica below full speed (`slow_share`): the complete groups a slower
    # replica answered a request of, and the group p90 of the others. None on a uniform fleet.
    slow_groups: int | None = None
    rest_p90_s: float | None = None
    syncs: int = 0
    sync_failures: int = 0
    # The longest weight sync, pause to the unload's answer: TRL's trainer waits for all of it
    # before it trains on, and its rollouts name the new version only after it.
    sync_max_s: float = 0.0
    finished_sessions: int | None = None  # /finish_session answered 200 (a `sessions` contender)
    # lora-router's routing weight of each replica at the run's end (/router/status; 1: full
    # speed, fleet/pace.py); empty for the other routers.
    weights: list[float] = field(default_factory=list)
    weight_changes: list[int] = field(default_factory=list)  # how often each weight changed


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values`, linearly interpolated between order statistics."""
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class Rollouts:
    """Replays a workload as TRL's rollout worker sends it: items in trace order, at most
    `cap` in flight, a later turn once its parent answered, and each new version synced
    before its first request: through the router for lora-router (its fence broadcasts it),
    directly to every replica for the others (as a trainer that drives each server does).
    With `sessions`, every request carries the group's id in `X-Session-ID` and the group is
    released (`POST /finish_session`) when its last answer is in, as prime-rl does."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        url: str,
        replica_urls: list[str],
        items: list[Item],
        cap: int,
        adapters: Path,
        through_router: bool,
        sessions: bool,
        deadline_s: float,
    ) -> None:
        self.session = session
        self.url = url
        self.replica_urls = replica_urls
        self.items = items
        self.cap = cap
        self.adapters = adapters
        self.through_router = through_router
        self.sessions = sessions
        self.deadline_s = deadline_s
        self.outcomes: dict[int, Outcome] = {}
        self.loaded = 0
        self.syncs = self.sync_failures = 0
        self.sync_max_s = 0.0
        self.finished_sessions = 0
        self._left: dict[int, int] = {}  # family -> its items not answered yet
        for item in items:
            self._left[item.family] = self._left.get(item.family, 0) + 1

    async def sync(self, version: int) -> None:
        """TRL's weight sync for `version`: pause (keep), load, resume, unload v(N-5)."""
        name = f"trl-policy-v{version}"
        load = {"lora_name": name, "lora_path": str(self.adapters / name)}
        old = version - MAX_STALENESS - 1
        targets = [self.url] if self.through_router else self.replica_urls

        async def one(url: str) -> list[int]:
            statuses = [await post(self.session, url + "/pause?mode=keep")]
            statuses.append(await post(self.session, url + "/v1/load_lora_adapter", load))
            statuses.append(await post(self.session, url + "/resume"))
            if old >= 1:
                await post(
                    self.session,
                    url + "/v1/unload_lora_adapter",
                    {"lora_name": f"trl-policy-v{old}"},
                )
            return statuses

        started = time.perf_counter()
        results = await asyncio.gather(*(one(u) for u in targets))
        self.sync_max_s = max(self.sync_max_s, time.perf_counter() - started)
        self.syncs += 1
        self.sync_failures += any(s != 200 for statuses in results for s in statuses)
        self.loaded = version

    async def send(self, item: Item) -> Outcome:
        out = Outcome(sent_at=time.perf_counter())
        headers = {"content-type": "application/json", FAMILY_HEADER: str(item.family)}
        if self.sessions:
            headers[SESSION_HEADER] = f"group-{item.family}"
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
        except (aiohttp.ClientError, TimeoutError) as exc:
            out.error = f"{type(exc).__name__}: {exc}"
            return out
        if out.status != 200:
            out.error = f"{out.status}: {raw[:200].decode(errors='replace')}"
        return out

    async def finish_session(self, family: int) -> None:
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            status = await post(
                self.session, f"{self.url}/finish_session?session_id=group-{family}"
            )
            self.finished_sessions += status == 200

    async def replay(self) -> float:
        """Send every item (routing_runs.py's `drive`); returns the wall time."""

        async def before(item: Item) -> None:
            while item.version > self.loaded:
                await self.sync(self.loaded + 1)

        async def after(item: Item) -> None:
            self._left[item.family] -= 1
            if self.sessions and self._left[item.family] == 0:
                await self.finish_session(item.family)

        return await drive(
            self.items, self.outcomes, self.cap, self.deadline_s, self.send, before, after
        )


def group_spans(items: list[Item], outcomes: dict[int, Outcome]) -> dict[int, tuple[float, float]]:
    """Each complete group's first send and last answer (a group with a failed request has no
    span: it measured another workload)."""
    spans: dict[int, tuple[float, float]] = {}
    failed_families: set[int] = set()
    for item in items:
        out = outcomes[item.index]
        if out.status != 200:
            failed_families.add(item.family)
            continue
        first, last = spans.get(item.family, (out.sent_at, out.done_at))
        spans[item.family] = (min(first, out.sent_at), max(last, out.done_at))
    return {f: s for f, s in spans.items() if f not in failed_families}


def clock_figures(
    result: ClockResult,
    complete: dict[int, tuple[float, float]],
    items: list[Item],
    outcomes: dict[int, Outcome],
    per_step: int,
) -> None:
    """Fill the group, step and throughput figures of `result` from the outcomes and the
    complete groups' spans (`group_spans`)."""
    durations = [end - begin for begin, end in complete.values()]
    result.groups = len(complete)
    if durations:
        result.group_p50_s = round(quantile(durations, 0.5), 4)
        result.group_p90_s = round(quantile(durations, 0.9), 4)
        result.group_max_s = round(max(durations), 4)
    start = min((o.sent_at for o in outcomes.values() if o.sent_at), default=0.0)
    step_done: dict[int, float] = {}
    for family, (_, end) in complete.items():
        step = family // per_step
        step_done[step] = max(step_done.get(step, 0.0), end)
    ends = [start, *sorted(step_done.values())]
    gaps = [b - a for a, b in itertools.pairwise(ends)]
    result.step_s = round(statistics.median(gaps), 4) if gaps else 0.0
    rollouts = {(i.family, i.seed) for i in items if i.parent is None}
    turns_failed = {i.family for i in items if outcomes[i.index].status != 200}
    accepted = sum(1 for family, _ in rollouts if family not in turns_failed)
    result.samples_per_s = round(accepted / result.wall_s, 3) if result.wall_s else 0.0


def split_groups(families: list[list[int]]) -> int:
    """The groups whose requests more than one replica answered, from each replica's log of
    the families it received (bench/lib/routing_procs.py, `SeedLog`): a group split over
    replicas recomputes its prompt on each, and waits for the slowest."""
    where: dict[int, set[int]] = {}
    for replica, received in enumerate(families):
        for family in received:
            if family >= 0:
                where.setdefault(family, set()).add(replica)
    return sum(1 for replicas in where.values() if len(replicas) > 1)


def slow_share(
    spans: dict[int, tuple[float, float]], families: list[list[int]], slow: frozenset[int]
) -> tuple[int, float | None]:
    """How many complete groups a replica in `slow` answered a request of, and the group p90
    of the rest (None if none is left), from each replica's log of the families it received.

    The rest's p90 is the tail the full-speed replicas set at the load they carried: about what
    the run's p90 would be had the slow replicas' groups been no slower than the others. No
    placement of those groups gets below it without taking load off the full-speed replicas,
    which only the slow replicas can take."""
    touched = {f for replica in slow for f in families[replica] if f >= 0}
    rest = [end - begin for f, (begin, end) in spans.items() if f not in touched]
    return len(touched & spans.keys()), round(quantile(rest, 0.9), 4) if rest else None


async def router_weights(session: aiohttp.ClientSession, url: str) -> tuple[list[float], list[int]]:
    """Each replica's routing weight in lora-router's /router/status and how often it changed,
    in replica order."""
    async with session.get(url + "/router/status", timeout=aiohttp.ClientTimeout(total=10)) as r:
        replicas = (await r.json())["replicas"]
    return [float(rep["weight"]) for rep in replicas], [rep["weight_changes"] for rep in replicas]


def write_adapters(adapters: Path, versions: int) -> None:
    for version in range(1, versions + 1):
        path = adapters / f"trl-policy-v{version}"
        if not path.exists():
            write_adapter(path, rank=1, base_model=MODEL)


async def run_one(
    host: ReplicaHost,
    c: Contender,
    items: list[Item],
    result: ClockResult,
    cap: int,
    per_step: int,
    adapters: Path,
    log: Path,
    deadline_s: float,
    slow: frozenset[int] = frozenset(),
) -> ClockResult:
    """One run: fresh replicas, the router started, v1 live, the rollouts, the figures; `slow`:
    the fleet's replicas below full speed (`slow_share`)."""
    result.requests = len(items)
    await host.command("reset")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = RouterProcess(router_argv(c, port, host.urls, RouterOptions()), log)
    connector = aiohttp.TCPConnector(limit=cap + 16)
    try:
        async with aiohttp.ClientSession(connector=connector) as session:
            await router.wait_ready(session, url)
            rollouts = Rollouts(
                session,
                url,
                host.urls,
                items,
                cap,
                adapters,
                through_router=c.kind == "lora-router",
                sessions=c.sessions,
                deadline_s=deadline_s,
            )
            await rollouts.sync(1)  # v1 is live before the clock starts, as in TRL
            rollouts.syncs = rollouts.sync_failures = 0
            rollouts.sync_max_s = 0.0
            result.wall_s = round(await rollouts.replay(), 3)
            if c.kind == "lora-router":
                result.weights, result.weight_changes = await router_weights(session, url)
            queries, hits = await replica_metrics(session, host.urls)
            received = await host.command("dump")
    except Exception as exc:
        result.status = f"error: {type(exc).__name__}: {exc}"[:300]
        result.failed = len(items)
        return result
    finally:
        router.stop()
    result.hit_rate = round(hits / queries, 4) if queries else 0.0
    result.per_replica_requests = [len(s) for s in received["seeds"]]
    result.split_groups = split_groups(received["families"])
    spans = group_spans(items, rollouts.outcomes)
    if slow:
        result.slow_groups, result.rest_p90_s = slow_share(spans, received["families"], slow)
    failures = [o for o in rollouts.outcomes.values() if o.status != 200]
    result.failed = len(failures)
    result.first_error = failures[0].error[:200] if failures else ""
    result.syncs, result.sync_failures = rollouts.syncs, rollouts.sync_failures
    result.sync_max_s = round(rollouts.sync_max_s, 3)
    if rollouts.sessions:
        result.finished_sessions = rollouts.finished_sessions
    clock_figures(result, spans, items, rollouts.outcomes, per_step)
    return result
