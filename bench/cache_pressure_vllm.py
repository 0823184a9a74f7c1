"""Routing under cache pressure on real vLLM: `--policy prefix`, `--policy kv` and vllm-router's
cache_aware, side by side on real vLLM 0.32 CPU replicas whose KV cache is forced small, with one
replica SIGKILLed and started again mid-run.

    tests/vllm/install.sh && PATH=.venv/bin:$PATH \\
        .venv-vllm/bin/python bench/cache_pressure_vllm.py          # bench/README.md
    .venv-vllm/bin/python bench/cache_pressure_vllm.py --quick      # a smoke run, into /tmp

This is bench/cache_pressure.py's question asked of real caches (that bench models the replicas
with the emulator; this one has vLLM's own scheduler, eviction, preemption and restart time).

Workload, as TRL 1.16's async rollout worker sends it with tools: every request is built and posted
by TRL's own `_AsyncRolloutLoop._generate_one_turn` (lora_router/testbed/trl_client.py: token-id
prompt, its own seed, `return_token_ids`, naming `trl-policy-v1`). A rollout is one sample's
conversation: the shared system prompt (`--system` tokens, the tools' schemas every rollout shares),
its problem (`--problem` tokens, shared by the G = `--group` samples), then `--turns` turns, each
turn's prompt the previous prompt + the completion vLLM really generated (`--max-tokens`,
`ignore_eos` is not set: lengths vary) + a tool result (`--tool` tokens, seeded per sample and
turn). `--slots` rollouts at once (TRL's `max_inflight_tasks`), started in dataset order as slots
free, so new families arrive all through the run onto caches already full.

Cache pressure: each cell starts the replicas with `--num-gpu-blocks-override B` (128-token
blocks on the CPU build; `--max-model-len` 2048 needs 16). The working set per replica (the
distinct blocks the rollouts in flight hold at their last turn: the system prompt on every
replica, the families and samples split over N) is stated beside it, and pressure = working set
/ B. vLLM runs a request only when its blocks fit, so a small cache also queues: that is real.

The restart: when `--restart-at` of the requests have answered, replica `--restart-replica` is
SIGKILLed (its engine too) and started at once on its port; it answers /health after ~15 s and
its first completion takes seconds more. lora-router replays the adapter itself (it adopted it:
every replica held it at one path at start); for vllm-router, which cannot, the bench loads it
on the replica once it answers /health, as an operator's restart hook would. The counters the
replica had (read just before the kill) are added back to the run's totals.

Contenders, in an order rotated each round, on the same requests (the same seeds) and the same
replicas (prefix caches reset between runs): `lr-prefix` (lora-router `--policy prefix`, the
default), `lr-kv` (`--policy kv`: every replica publishes KV events, `--kv-events-config`, for
every contender; only kv subscribes), `vllm-ca` (vllm-router cache_aware, when installed).

Measured per run: hit rate from the replicas' own `vllm:prefix_cache_hits_total /
vllm:prefix_cache_queries_total`, also in `--windows` windows of answered requests (before and
after the restart), with the restarted replica's share of each window's requests and its own hit
rate (its counters); the busiest replica's computed prompt tokens (queries - hits: the prefill
work, free of timing noise) and requests; wall time (the machine is shared: medians); requests
that failed (TRL raises on any non-2xx); lora-router's decisions and `routing_accuracy`.
Writes `--out` (bench/results/cache-pressure-vllm): cache_pressure_vllm.json and README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import itertools
import json
import math
import os
import random
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from lib.cache_pressure_run import router_status, wait_kv_subscribed  # noqa: E402
from lib.procs import find_binary, free_port, git_revision  # noqa: E402
from real_vllm import load_adapter, reset_caches  # noqa: E402

from lora_router.testbed.tiny_model import adapter_dir, model_dir  # noqa: E402
from lora_router.testbed.trl_client import LORA_NAME, Rollouts  # noqa: E402
from lora_router.testbed.vllm_harness import BIN, Replica, http, start_replicas, wait_for  # noqa: E402

BLOCK = 128  # vLLM's CPU build
MAX_MODEL_LEN = 2048
VOCAB = range(3, 480)  # the tiny tokenizer's ordinary tokens
ADAPTER = f"{LORA_NAME}-v1"
CONTENDERS = ("lr-prefix", "lr-kv", "vllm-ca")
REFERENCE = "lr-prefix"
COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "request_success")


@dataclass(frozen=True, slots=True)
class Shape:
    system: int
    problem: int
    group: int
    turns: int
    tool: int
    max_tokens: int
    families: int
    slots: int
    seed: int

    def working_set(self, replicas: int) -> int:
        """Blocks the rollouts in flight hold at their last turn, per replica."""
        own = (self.turns - 1) * (self.max_tokens + self.tool) + self.max_tokens
        families = math.ceil(self.slots / self.group / replicas)
        return (
            self.system // BLOCK
            + families * math.ceil(self.problem / BLOCK)
            + math.ceil(self.slots / replicas) * math.ceil(own / BLOCK)
        )


@dataclass(slots=True)
class Snapshot:
    answered: int
    queries: list[float]  # per replica, since the run began (a restart's loss added back)
    hits: list[float]
    requests: list[float]


@dataclass(slots=True)
class RunResult:
    contender: str
    cache_blocks: int
    round: int
    status: str = "ok"
    requests: int = 0
    answered: int = 0
    failed: int = 0
    first_error: str = ""
    transport_retries: float = 0.0
    hit_rate: float = 0.0
    queries: float = 0.0
    hits: float = 0.0
    computed_per_replica: list[float] = field(default_factory=list)
    requests_per_replica: list[float] = field(default_factory=list)
    busiest_computed: float = 0.0
    wall_s: float = 0.0
    restart_answered: int | None = None
    back_after_s: float | None = None  # kill to /health
    window_hit_rate: list[float | None] = field(default_factory=list)
    window_restarted_share: list[float | None] = field(default_factory=list)
    window_restarted_hit_rate: list[float | None] = field(default_factory=list)
    snapshots: list[dict[str, Any]] = field(default_factory=list)  # the counters, as read
    routing: dict[str, int] | None = None
    accuracy: dict[str, Any] | None = None
    kv_events: dict[str, Any] | None = None


def rollouts(shape: Shape) -> list[tuple[list[int], list[list[int]]]]:
    """Per rollout, in dataset order: its first prompt and its tool results, one per later
    turn. Siblings share the first prompt; every rollout shares the system prompt."""
    rng = random.Random(shape.seed)
    system = rng.choices(VOCAB, k=shape.system)
    out = []
    for _ in range(shape.families):
        first = system + rng.choices(VOCAB, k=shape.problem)
        for _ in range(shape.group):
            tools = [rng.choices(VOCAB, k=shape.tool) for _ in range(shape.turns - 1)]
            out.append((first, tools))
    return out


def counters(replicas: list[Replica]) -> tuple[list[float], list[float], list[float]]:
    """(queries, hits, requests) per replica; zeros for one not answering (a killed one:
    what it had is added back as the run's loss)."""
    q, h, n = [], [], []
    for r in replicas:
        try:
            values = [r.metric(f"vllm:{name}_total") for name in COUNTERS]
        except OSError:
            values = [0.0, 0.0, 0.0]
        for column, value in zip((q, h, n), values, strict=True):
            column.append(value)
    return q, h, n


def router_command(key: str, urls: list[str], port: int, vllm_router: str | None) -> list[str]:
    if key.startswith("lr-"):
        policy = key.removeprefix("lr-")
        lr = [str(BIN / "lora-router"), "--no-token", "--log-level", "warning"]
        return [*lr, "--policy", policy, "--replicas", ",".join(urls), "--port", str(port)]
    assert vllm_router is not None
    metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return [
        *(vllm_router, "--policy", "cache_aware", "--log-level", "warning"),
        *("--worker-urls", *urls, "--host", "127.0.0.1", "--port", str(port), *metrics),
    ]


class Run:
    """One contender over the workload: the rollouts, the counter windows and the restart."""

    def __init__(self, url: str, replicas: list[Replica], shape: Shape, args: Any) -> None:
        self.url, self.replicas, self.shape, self.args = url, replicas, shape, args
        self.work = rollouts(shape)
        self.total = len(self.work) * shape.turns
        self.client = Rollouts(
            url, str(model_dir() / "model"), version=1, max_tokens=shape.max_tokens
        )
        self.answered = self.failed = 0
        self.errors: list[str] = []
        self.snapshots: list[Snapshot] = []
        self.lost = [[0.0] * len(replicas) for _ in range(3)]  # queries, hits, requests
        self.bounds = [round(self.total * (k + 1) / args.windows) for k in range(args.windows)]
        self.restart_at = round(self.total * args.restart_at) if args.restart_at else None
        self.restart_answered: int | None = None
        self.back_after_s: float | None = None
        self.tick = asyncio.Event()
        self.restarted: asyncio.Task[None] | None = None
        self.counting = asyncio.Lock()  # a snapshot never falls between a kill and its loss

    async def snapshot(self) -> None:
        async with self.counting:
            answered = self.answered
            q, h, n = await asyncio.to_thread(counters, self.replicas)
            self._file(answered, q, h, n)

    def _file(self, answered: int, q: list[float], h: list[float], n: list[float]) -> None:
        lq, lh, ln = self.lost
        self.snapshots.append(
            Snapshot(
                answered,
                [a + b for a, b in zip(q, lq, strict=True)],
                [a + b for a, b in zip(h, lh, strict=True)],
                [a + b for a, b in zip(n, ln, strict=True)],
            )
        )

    async def rollout(self, session: aiohttp.ClientSession, index: int) -> None:
        prompt, tools = self.work[index]
        for turn in range(self.shape.turns):
            try:
                completion = await self.client.one(session, prompt)
            except Exception as exc:  # TRL raises on any non-2xx answer: the rollout ends
                self.failed += self.shape.turns - turn
                self.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                return
            finally:
                self.tick.set()
            self.answered += 1
            if turn + 1 < self.shape.turns:
                prompt = prompt + completion + tools[turn]

    async def watch(self, vllm_router: bool, adapter: Path) -> None:
        await self.snapshot()
        next_bound = 0
        while next_bound < len(self.bounds) and self.answered + self.failed < self.total:
            await self.tick.wait()
            self.tick.clear()
            due = self.restart_at is not None and self.answered >= self.restart_at
            if due and self.restart_answered is None:
                self.restarted = asyncio.create_task(self.restart(vllm_router, adapter))
                await asyncio.sleep(0)
            while next_bound < len(self.bounds) and self.answered >= self.bounds[next_bound]:
                next_bound += 1
                await self.snapshot()

    async def restart(self, vllm_router: bool, adapter: Path) -> None:
        i = self.args.restart_replica
        victim = self.replicas[i]
        self.restart_answered = self.answered
        async with self.counting:
            q, h, n = await asyncio.to_thread(counters, self.replicas)
            killed = time.monotonic()
            await asyncio.to_thread(victim.kill)
            for lost, now in zip(self.lost, (q, h, n), strict=True):
                lost[i] += now[i]
        victim.start()
        await asyncio.to_thread(victim.wait_healthy)
        self.back_after_s = round(time.monotonic() - killed, 1)
        if vllm_router:
            await asyncio.to_thread(load_adapter, victim, ADAPTER, adapter)

    async def play(self, vllm_router: bool, adapter: Path) -> float:
        slots = asyncio.Semaphore(self.shape.slots)  # FIFO: rollouts start in dataset order
        timeout = aiohttp.ClientTimeout(total=self.args.deadline)
        connector = aiohttp.TCPConnector(limit=self.shape.slots + 8)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

            async def gated(index: int) -> None:
                async with slots:
                    await self.rollout(session, index)

            watcher = asyncio.create_task(self.watch(vllm_router, adapter))
            started = time.monotonic()
            await asyncio.wait_for(
                asyncio.gather(*(gated(i) for i in range(len(self.work)))), self.args.deadline
            )
            wall = time.monotonic() - started
            self.tick.set()
            await asyncio.wait_for(watcher, 60)
            if self.restarted is not None:
                await asyncio.wait_for(self.restarted, 300)
            await self.snapshot()
        return wall


def windows(run: Run, restarted: int) -> tuple[list[float | None], ...]:
    """Per window of answers: the fleet's hit rate, the restarted replica's share of the
    requests and its own hit rate, from the counters at the window's two ends."""
    ends = [run.snapshots[0]]
    for bound in run.bounds:
        later = [s for s in run.snapshots if s.answered >= bound]
        ends.append(later[0] if later else run.snapshots[-1])
    fleet, share, own = [], [], []
    for a, b in itertools.pairwise(ends):
        q = [y - x for x, y in zip(a.queries, b.queries, strict=True)]
        h = [y - x for x, y in zip(a.hits, b.hits, strict=True)]
        n = [y - x for x, y in zip(a.requests, b.requests, strict=True)]
        fleet.append(round(sum(h) / sum(q), 4) if sum(q) > 0 else None)
        share.append(round(n[restarted] / sum(n), 4) if sum(n) > 0 else None)
        own.append(round(h[restarted] / q[restarted], 4) if q[restarted] > 0 else None)
    return fleet, share, own


async def run_one(
    key: str,
    replicas: list[Replica],
    shape: Shape,
    args: Any,
    adapter: Path,
    result: RunResult,
    logs: Path,
) -> None:
    await asyncio.to_thread(reset_caches, replicas)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = router_command(key, [r.url for r in replicas], port, args.vllm_router)
    log = logs / f"router-{key}-{result.cache_blocks}-{result.round}.log"
    with log.open("ab") as out:
        router = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    run = Run(url, replicas, shape, args)
    result.requests = run.total
    try:
        await asyncio.to_thread(
            wait_for,
            f"{key} /health",
            lambda: http("GET", url + "/health").status == 200,
            60,
            [log],
        )
        async with aiohttp.ClientSession() as session:
            if key == "lr-kv":
                problem = await wait_kv_subscribed(session, url, len(replicas))
                if problem:
                    result.status = problem
                    return
            result.wall_s = round(await run.play(key == "vllm-ca", adapter), 2)
            if key.startswith("lr-"):
                doc = await router_status(session, url) or {}
                result.routing = doc.get("routing")
                result.accuracy = doc.get("routing_accuracy")
                result.kv_events = doc.get("kv_events")
    except Exception as exc:
        result.status = f"error: {type(exc).__name__}: {exc}"[:300]
        return
    finally:
        router.terminate()
        router.wait(timeout=30)
        # The next run starts with the adapter on every replica (the router may not have
        # replayed it yet if the run ended first).
        # It also starts warm: a restarted replica's first completions take seconds.
        for r in replicas:
            if r.died() is None and ADAPTER not in await asyncio.to_thread(held, r):
                await asyncio.to_thread(load_adapter, r, ADAPTER, adapter)
        if run.restarted is not None:
            await warm([replicas[args.restart_replica]], str(model_dir() / "model"))
    last, first = run.snapshots[-1], run.snapshots[0]
    q = [b - a for a, b in zip(first.queries, last.queries, strict=True)]
    h = [b - a for a, b in zip(first.hits, last.hits, strict=True)]
    result.queries, result.hits = sum(q), sum(h)
    result.hit_rate = round(result.hits / result.queries, 4) if result.queries else 0.0
    result.computed_per_replica = [a - b for a, b in zip(q, h, strict=True)]
    result.busiest_computed = max(result.computed_per_replica)
    result.requests_per_replica = [
        b - a for a, b in zip(first.requests, last.requests, strict=True)
    ]
    result.answered, result.failed = run.answered, run.failed
    result.first_error = run.errors[0] if run.errors else ""
    result.transport_retries = run.client.retries
    result.restart_answered, result.back_after_s = run.restart_answered, run.back_after_s
    fleet, share, own = windows(run, args.restart_replica)
    result.window_hit_rate, result.window_restarted_share = fleet, share
    result.window_restarted_hit_rate = own
    result.snapshots = [asdict(s) for s in run.snapshots]


def held(replica: Replica) -> dict[str, str]:
    cards = http("GET", replica.url + "/v1/models").json()["data"]
    return {c["id"]: c["root"] for c in cards[1:]}


def replica_set(root: Path, logs: Path, blocks: int, n: int) -> list[Replica]:
    replicas = []
    for i in range(n):
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{free_port()}",
            "replay_endpoint": f"tcp://*:{free_port()}",
            "topic": "kv",
        }
        extra = (
            *("--num-gpu-blocks-override", str(blocks), "--max-model-len", str(MAX_MODEL_LEN)),
            *("--kv-events-config", json.dumps(events)),
        )
        log = logs / f"replica-{i}-{blocks}.log"
        replicas.append(Replica(model=root / "model", log=log, api_key=None, extra=extra))
    return replicas


async def warm(replicas: list[Replica], base: str) -> None:
    """A replica's first completions take seconds (compilation): outside every measurement."""
    async with aiohttp.ClientSession() as session:
        for r in replicas:
            client = Rollouts(r.url, base, version=1, max_tokens=8)
            for k in range(2):
                await client.one(session, random.Random(k).choices(VOCAB, k=600))


def _median(values: list[float]) -> str:
    if not values:
        return "-"
    m = statistics.median(values)
    return f"{m:.3f} [{min(values):.3f} .. {max(values):.3f}]" if len(values) > 1 else f"{m:.3f}"


def _ratio(runs: list[RunResult], ref: list[RunResult], figure: str) -> list[float]:
    """Per round, this contender's figure over the reference's."""
    base = {r.round: getattr(r, figure) for r in ref}
    return [getattr(r, figure) / base[r.round] for r in runs if base.get(r.round)]


def _accuracy(r: RunResult) -> float | None:
    a = r.accuracy or {}
    predicted = a.get("predicted_cached_tokens") or 0
    return a.get("reported_cached_tokens", 0) / predicted if predicted else None


def write_report(out: Path, meta: dict[str, Any], results: list[RunResult]) -> None:
    lines = [
        "# Routing under cache pressure on real vLLM",
        "",
        f"Command: `{meta['command']}`  ",
        f"Revision: {meta['git']}; {meta['date']}; {meta['elapsed_s']:.0f} s; 1-minute load "
        f"average at the end {meta['load_average'][0]:.2f}. Method: bench/cache_pressure_vllm.py's "
        "docstring.",
        "",
        f"Shape: {json.dumps(meta['shape'])}; {meta['replicas']} replicas; "
        f"restart of replica {meta['restart_replica']} at {meta['restart_at']} of the requests "
        "answered. Figures are medians over rounds [min .. max]; ratios are to lr-prefix "
        "within a round.",
        "",
    ]
    for cell in meta["cells"]:
        blocks = cell["cache_blocks"]
        runs = [r for r in results if r.cache_blocks == blocks]
        ok = [r for r in runs if r.status == "ok"]
        ref = [r for r in ok if r.contender == REFERENCE]
        lines += [
            f"## {blocks} blocks a replica (working set {cell['working_set']}, pressure "
            f"{cell['pressure']:.2f})",
            "",
            "| router | runs | hit rate | hit rate / prefix | busiest replica's computed "
            "tokens / prefix | wall s | failed | reported / predicted cached | kv decisions |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for key in meta["contenders"]:
            mine = [r for r in ok if r.contender == key]
            bad = [r.status for r in runs if r.contender == key and r.status != "ok"]
            acc = [a for a in map(_accuracy, mine) if a is not None]
            kv = [float((r.routing or {}).get("kv", 0)) for r in mine if r.routing]
            lines.append(
                f"| {key} | {len(mine)}{' (' + str(len(bad)) + ' failed)' if bad else ''} | "
                f"{_median([r.hit_rate for r in mine])} | "
                f"{_median(_ratio(mine, ref, 'hit_rate'))} | "
                f"{_median(_ratio(mine, ref, 'busiest_computed'))} | "
                f"{_median([r.wall_s for r in mine])} | "
                f"{_median([float(r.failed) for r in mine])} | {_median(acc)} | "
                f"{_median(kv) if kv else '-'} |"
            )
        lines += ["", "The restart, per window of answered requests (medians over rounds):", ""]
        width = meta["windows"]
        lines += [
            "| router | figure | " + " | ".join(str(k + 1) for k in range(width)) + " |",
            "| --- | --- | " + " | ".join("---:" for _ in range(width)) + " |",
        ]
        for key in meta["contenders"]:
            mine = [r for r in ok if r.contender == key]
            for label, attr in (
                ("fleet hit rate", "window_hit_rate"),
                ("restarted replica's share", "window_restarted_share"),
                ("restarted replica's hit rate", "window_restarted_hit_rate"),
            ):
                cols = []
                for k in range(width):
                    vals = [getattr(r, attr)[k] for r in mine if len(getattr(r, attr)) > k]
                    vals = [v for v in vals if v is not None]
                    cols.append(f"{statistics.median(vals):.2f}" if vals else "-")
                lines.append(f"| {key} | {label} | " + " | ".join(cols) + " |")
        back = [r.back_after_s for r in ok if r.back_after_s is not None]
        at = [r.restart_answered for r in ok if r.restart_answered is not None]
        lines += [
            "",
            f"Restart at {at[0] if at else '-'} answered; the replica answered /health again "
            f"{_median(back)} s after the kill.",
            "",
        ]
        for r in runs:
            if r.status != "ok" or r.first_error:
                lines.append(f"- {r.contender} round {r.round}: {r.status}; {r.first_error}")
        lines.append("")
    notes = out / "notes.md"
    if notes.exists():
        lines += [notes.read_text()]
    (out / "README.md").write_text("\n".join(lines))
    print("\n".join(lines))


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--cache-blocks", default="24,400", help="one cell each (400: no pressure)")
    p.add_argument("--routers", default=",".join(CONTENDERS))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--system", type=int, default=1024)
    p.add_argument("--problem", type=int, default=256)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--tool", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--families", type=int, default=45)
    p.add_argument("--slots", type=int, default=16, help="rollouts at once (max_inflight_tasks)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restart-at", type=float, default=0.15, help="0: no restart")
    p.add_argument("--restart-replica", type=int, default=1)
    p.add_argument("--windows", type=int, default=10)
    p.add_argument("--deadline", type=float, default=900.0, help="seconds a run may last")
    p.add_argument("--vllm-router", default=None, help="path of a vllm-router binary")
    p.add_argument("--quick", action="store_true", help="one small cell, one round")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--render", action="store_true", help="only rewrite README.md from the JSON")
    args = p.parse_args(argv)
    if args.quick:
        args.cache_blocks, args.rounds, args.families, args.turns = "24", 1, 4, 3
    if args.out is None:
        quick = Path(tempfile.mkdtemp(prefix="cache-pressure-vllm-"))
        args.out = quick if args.quick else HERE / "results" / "cache-pressure-vllm"
    args.vllm_router = args.vllm_router or find_binary("vllm-router", HERE / ".peers" / "bin")
    wanted = [k for k in args.routers.split(",") if k]
    unknown = set(wanted) - set(CONTENDERS)
    if unknown:
        p.error(f"unknown router: {', '.join(sorted(unknown))}")
    args.contenders = [k for k in wanted if k != "vllm-ca" or args.vllm_router]
    args.block_list = [int(b) for b in args.cache_blocks.split(",") if b]
    if min(args.block_list) < MAX_MODEL_LEN // BLOCK:
        p.error(f"--cache-blocks below {MAX_MODEL_LEN // BLOCK}: vLLM refuses to start")
    return args


def meta(
    args: argparse.Namespace, shape: Shape, started: float, cells: list[Any]
) -> dict[str, Any]:
    return {
        "command": "PATH=.venv/bin:$PATH .venv-vllm/bin/python bench/cache_pressure_vllm.py "
        + " ".join(shlex.quote(a) for a in args.argv),
        "git": git_revision(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "elapsed_s": time.monotonic() - started,
        "load_average": os.getloadavg(),
        "replicas": args.replicas,
        "shape": asdict(shape),
        "restart_at": args.restart_at or None,
        "restart_replica": args.restart_replica,
        "windows": args.windows,
        "contenders": args.contenders,
        "vllm_router": args.vllm_router or "not found (pip install -e '.[bench]')",
        "cells": cells,
    }


def save(out: Path, doc: dict[str, Any], results: list[RunResult]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    body = {"meta": doc, "runs": [asdict(r) for r in results]}
    (out / "cache_pressure_vllm.json").write_text(json.dumps(body, indent=1) + "\n")


async def bench(args: argparse.Namespace) -> int:
    from accelerate import PartialState

    PartialState()  # TRL logs a failed request through accelerate, which insists on a state
    started = time.monotonic()
    shape = Shape(
        args.system,
        args.problem,
        args.group,
        args.turns,
        args.tool,
        args.max_tokens,
        args.families,
        args.slots,
        args.seed,
    )
    if shape.system + shape.problem + shape.turns * (shape.tool + shape.max_tokens) > MAX_MODEL_LEN:
        raise SystemExit(f"a rollout's last turn would not fit --max-model-len {MAX_MODEL_LEN}")
    root = model_dir()
    base = str(root / "model")
    logs = Path(tempfile.mkdtemp(prefix="cache-pressure-vllm-logs-"))
    adapter = Path(shutil.copytree(adapter_dir(root, 0), logs / ".vllm_lora" / ADAPTER))
    results: list[RunResult] = []
    cells: list[dict[str, Any]] = []
    ws = shape.working_set(args.replicas)
    for blocks in args.block_list:
        cells.append({"cache_blocks": blocks, "working_set": ws, "pressure": ws / blocks})
        replicas = replica_set(root, logs, blocks, args.replicas)
        try:
            await asyncio.to_thread(start_replicas, replicas)
            for r in replicas:  # every contender serves it; lora-router adopts it
                await asyncio.to_thread(load_adapter, r, ADAPTER, adapter)
            await warm(replicas, base)
            for round_ in range(args.rounds):
                k = round_ % len(args.contenders)
                for key in args.contenders[k:] + args.contenders[:k]:
                    result = RunResult(key, blocks, round_)
                    await run_one(key, replicas, shape, args, adapter, result, logs)
                    results.append(result)
                    save(args.out, meta(args, shape, started, cells), results)
                    print(
                        f"{blocks} blocks #{round_ + 1} {key}: {result.status} hit "
                        f"{result.hit_rate:.3f} busiest {result.busiest_computed:.0f} wall "
                        f"{result.wall_s:.1f}s failed {result.failed} windows "
                        f"{result.window_hit_rate} share {result.window_restarted_share}",
                        flush=True,
                    )
        finally:
            for r in replicas:
                r.stop()
    doc = meta(args, shape, started, cells)
    save(args.out, doc, results)
    write_report(args.out, doc, results)
    print(f"logs in {logs}; results in {args.out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(raw)
    args.argv = raw
    if args.render:
        doc = json.loads((args.out / "cache_pressure_vllm.json").read_text())
        known = set(RunResult.__dataclass_fields__)
        runs = [RunResult(**{k: v for k, v in r.items() if k in known}) for r in doc["runs"]]
        write_report(args.out, doc["meta"], runs)
        return 0
    return asyncio.run(bench(args))


if __name__ == "__main__":
    sys.exit(main())
