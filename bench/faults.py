"""Fault tolerance under training load: replicas killed and restarted empty, a replica answering
500, an unload with its rollouts in flight and a replica whose listing hides its adapters, in
the middle of a GRPO-shaped run through the router.

    python bench/faults.py                      # five episodes, ~2 min in all
    python bench/faults.py --episodes rollout   # one kill, mid-rollout
    python bench/faults.py --keep-logs /tmp/f   # also keep the router's and replicas' logs

Set-up. Three emulated vLLM replicas, each its own process (so a kill is a real process death:
SIGKILL, every socket reset by the kernel), with a modest timing model: 8 sequences at once, 4
ms per generated token (~24 tokens a completion), 20 us per uncached prompt token, and a 0.3 s
adapter load (`--load-delay`; loads of different names run concurrently). Each replica is the
emulator's own code started through this file (`faults.py replica ...`, which takes every
`lora-router-emulator` flag) with one addition: an access log, one line per answered request
(arrival, end, method, path, status, model or adapter name), written with one unbuffered `write`
so a SIGKILL loses nothing already answered. The emulator exposes no count of its 404s; this log
is where "a request for an adapter reached a replica that did not hold it" shows. The router is
the real command, `python -m lora_router.cli --replicas ... --no-token --port P
--health-interval 0.5 --health-timeout 1 --health-failures 2 --health-successes 2 --retries 2
--max-upstream-connections 8 --load-retry-interval 0.1 --load-deadline 20 --fence-timeout 30
--log-level info` (the thresholds are the router's defaults; the interval is short enough for a
run of seconds; 8 upstream connections per replica, as many as it runs sequences, so the rest
queue in the router between the fence and the replica: the window of the unload race).
`--port-base P` puts every process on P, P+1... A fourth, spare replica (never in the fleet) is
used at the end to time one replay by hand. Nothing is pinned to a core.

Workload, driven like TRL's AsyncGRPOTrainer (bench/grpo_trace.py prompts: a 23-token template,
problems of 40-400 token ids): each step N, `POST /pause?mode=keep` -> write trl-policy-vN
(atomic rename) -> `POST /v1/load_lora_adapter` -> `POST /resume` -> unload v(N-3) without
waiting for its rollouts -> rollouts name vN, as TRL does (three or four versions live); then
S = 16 prompts x G = 8 separate `/v1/completions` requests, each with its own seed and naming the
version current when it is sent, as TRL's rollout worker reads it (token-id prompts, 48 max
tokens, logprobs; every fourth group streamed). As in an asynchronous trainer, step N+1's sync
starts once half of step N's groups are done. A rollout attempt that fails (non-2xx, a
connection error, a body cut short) is retried by the client as TRL's client does, after 1, 2,
4 s, at most 3 times; a failed load ends the run (TRL would die of it) and is reported.

Faults. Episodes start at 10, 26, 42 ... s, on replicas 1, 2, 1 ... (default: `rollout`,
`load`, `5xx`, `unload`, `listing`). A kill SIGKILLs one replica — `rollout`: while rollouts
are in flight and no sync is under way; `load`: 0.1 s into an adapter load broadcast, so the
victim dies in the middle of a load — waits `--down` s, and starts it again, empty, on the same
port. `5xx`: the replica answers 500 to every completion for `--down` s while its /health
stays 200 (`POST /emulator/faults {"error_rate": 1}`). `unload`: the next sync, just before it
names vN, sends a last burst of 48 rollouts naming v(N-1) (the worker names the current
version until the trainer moves on), names vN, and 50 ms later unloads v(N-1) while its
rollouts are in flight and queued in the router. `listing`: for 10 s every other /v1/models
answer of the replica lists no adapter and it accepts loads of names it holds (a load balancer
over two vLLM servers: `{"hide_adapters": 2}`); the episode lasts until it serves again.
`/router/replicas` is polled every 10 ms around each fault (50 ms otherwise); the router's log
is read at the end.

Measured, per episode:
- time to eject: kill -> first poll showing the victim out of service (the previous poll's
  sending time is the lower bound), and kill -> the router's "ejecting" log line (ms stamps);
- time to re-admit: the new process listening -> first poll showing it admitted (and the
  router's "back in service" line); split, from the new process's access log, into the health
  wait (listening -> the /health answer that completed `--health-successes`) and the replay
  (-> admitted), with the replay's rounds of loads (a round: loads that overlap in time);
  against one replay of the live adapters done by hand on the spare replica (its /v1/models,
  the K live adapters loaded concurrently, /v1/models again, /resume: the calls of the
  router's replay), median of 3;
- the slowest trainer call (other than loads) that overlapped the re-admission: a replay's
  last pass holds the broadcast lock, so trainer broadcasts can wait behind it;
- that every live adapter was on the restarted replica before its first completion, and that
  no completion reached it before the router admitted it;
- throughput (successful rollouts per second, by completion time) `--window` s before the
  kill, from kill to re-admission, and `--window` s after; the victim's share after.
Over the whole run: failed attempts by kind — *status* (answered non-2xx: only a status line
and an error body reached the client, so another replica could have taken it if one was live),
*cut* (a 200 whose body broke off: bytes had reached the client, which the router must never
retry; how many had no SSE data frame yet is counted), *transport* (no answer from the router
at all) — client retries, rollouts lost after all retries, trainer calls not answered 200,
404s and 5xx answered by the replicas, and ejections of replicas that were not killed.

Soft episodes report: attempts and client-visible 5xx during the `5xx` window against the
replica's own 500s; the unloaded version's rollouts in flight when the unload was sent and how
each was answered, and the unload's duration; the listing victim's ejections during the
episode against the bound an exponential back-off allows (2 + log2(10 s / interval)), the
flaps the router counted, the fewest replicas serving and the time back in service.

Targets (issue 14): client-visible 5xx: 0 (every rollout attempt over the run); no 404 after an
unload (no attempt answered 404, and every rollout of the unloaded version in flight when its
unload was sent answered 200); the listing flap bounded (ejections within the bound, never an
empty fleet, back in service once the fault is lifted). Targets (issue 6): no failed rollout
that a retry to another replica could have saved (no *status* or *transport* failure while
another replica was live, no failed trainer call); ejection within 2 health intervals;
re-admission within one replay of the live adapters, read as: listening -> admitted within the
wait the health flags impose on a replica that comes back (`--health-successes` intervals) plus
one replay by hand. The literal reading (listening -> admitted within one replay, health checks
included) cannot be met by an interval-based check and is reported alongside.

Writes bench/results/faults.json and faults.md (with the command and date); exits 1 when a
target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpo_trace as bench_trace
from common import Procs, free_port, git_revision, wait_port

from lora_router.demo import check_answer
from lora_router.emulator import write_adapter

HERE = Path(__file__).resolve().parent
REPLICA_HEADER = "x-lora-router-replica"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
ADAPTER_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
BACKOFF_S = (1.0, 2.0, 4.0)  # TRL's client: 1, 2, 4 s between attempts, 3 retries at most
ATTEMPT_TIMEOUT_S = 30.0
CONTROL_TIMEOUT_S = 60.0
START_TIMEOUT_S = 30.0
KEEP_VERSIONS = 3  # trl-policy-v(N-2) .. vN live: max_staleness 2
# Per replica, as many as it runs sequences: the rest queue in the router, between the fence and
# the replica (the window of the unload race).
UPSTREAM_CONNECTIONS = 8
LISTING_S = 10.0  # `listing` episodes: how long the victim's listing hides adapters
EARLY_BURST = 48  # `unload` episodes: rollouts naming v(N-1) sent just before vN is named
EARLY_UNLOAD_DELAY_S = 0.05  # `unload` episodes: v(N-1) is unloaded this long after vN is named
LOAD_KILL_OFFSET_S = 0.1  # `load` episodes: the kill lands this long into the broadcast
PHASE_WAIT_S = 10.0  # longest an episode waits for its phase past its set time
FAST_POLL_S = 0.01
SLOW_POLL_S = 0.05
_EJECT = re.compile(r"^(\S+ \S+) WARNING \S+: ejecting Replica (\d+) \(([^)]*)\): (.*)$")
_BACK = re.compile(
    r"^(\S+ \S+) INFO \S+: Replica (\d+) \([^)]*\) is back in service "
    r"\((\d+) adapters replayed in ([\d.]+) s\)$"
)


# --- the replica process: the emulator plus an access log -----------------------------------


def serve_replica(argv: Sequence[str]) -> int:
    """`faults.py replica --access-log FILE [lora-router-emulator flags]`."""
    import uvloop
    from aiohttp import web

    from lora_router.emulator import cli as emulator_cli
    from lora_router.emulator import server as emulator_server

    parser = emulator_cli.build_parser()
    parser.add_argument("--access-log", required=True, help="one line per answered request")
    args = parser.parse_args(list(argv))
    fd = os.open(args.access_log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    build_app = emulator_server.build_app

    @web.middleware
    async def access(request: web.Request, handler: Any) -> web.StreamResponse:
        arrived = time.time()
        name = ""
        if request.method == "POST" and request.path in (*GENERATION_PATHS, *ADAPTER_PATHS):
            body = await request.read()  # cached: the emulator's dispatch reads it again
            with contextlib.suppress(orjson.JSONDecodeError, AttributeError):
                doc = orjson.loads(body)
                name = str(doc.get("model") or doc.get("lora_name") or "")
        status = -1  # the handler was cancelled (its client went away)
        try:
            response = await handler(request)
            status = response.status
            return response
        finally:
            line = f"{arrived:.6f} {time.time():.6f} {request.method} {request.path} {status}"
            os.write(fd, f"{line} {name}\n".encode())

    def build_logged_app(replica: Any) -> web.Application:
        app = build_app(replica)
        app.middlewares.append(access)
        return app

    emulator_server.build_app = build_logged_app
    config = emulator_cli.config_from_args(args)
    uvloop.run(emulator_cli.run(config, args.restart_every))
    return 0


@dataclass(frozen=True, slots=True)
class Access:
    """One line of a replica's access log."""

    arrived: float
    ended: float
    method: str
    path: str
    status: int
    name: str


def read_access_log(path: Path) -> list[Access]:
    out: list[Access] = []
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        parts = line.split(" ", 5)
        if len(parts) >= 5:
            name = parts[5] if len(parts) == 6 else ""
            out.append(
                Access(float(parts[0]), float(parts[1]), parts[2], parts[3], int(parts[4]), name)
            )
    return out


# --- settings -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Episode:
    phase: str  # rollout | load
    victim: int  # replica index
    at: float  # seconds after the first step


@dataclass(slots=True)
class Settings:
    replicas: int
    prompts: int
    group: int
    max_tokens: int
    episodes: list[Episode]
    down: float
    window: float
    max_run: float
    health_interval: float
    health_timeout: float
    health_failures: int
    health_successes: int
    retries: int
    load_delay: float
    seed: int
    port_base: int = 0  # 0: free ports

    def replica_flags(self, index: int) -> list[str]:
        return [
            "--max-num-seqs", "8", "--decode-s-per-token", "0.004", "--prefill-s-per-token",
            "2e-5", "--mean-output-tokens", "24", "--max-loras", "6", "--max-lora-rank", "8",
            "--load-delay", str(self.load_delay), "--seed", str(self.seed + index),
        ]  # fmt: skip

    def router_flags(self) -> list[str]:
        return [
            "--health-interval", str(self.health_interval),
            "--health-timeout", str(self.health_timeout),
            "--health-failures", str(self.health_failures),
            "--health-successes", str(self.health_successes),
            "--retries", str(self.retries),
            "--max-upstream-connections", str(UPSTREAM_CONNECTIONS),
            "--load-retry-interval", "0.1", "--load-deadline", "20", "--fence-timeout", "30",
            "--log-level", "info", "--status-interval", "0",
        ]  # fmt: skip


# --- the cluster: processes we start, kill and restart --------------------------------------


class Cluster:
    """The replicas, the spare and the router, as child processes of this benchmark."""

    def __init__(self, settings: Settings, procs: Procs) -> None:
        self.settings = settings
        self.procs = procs
        base, n = settings.port_base, settings.replicas
        ports = list(range(base, base + n + 2)) if base else [free_port() for _ in range(n + 2)]
        self.ports = ports[:n]
        self.spare_port, self.router_port = ports[n], ports[n + 1]
        self.replica_procs: list[subprocess.Popen[bytes]] = []
        self.incarnations = [0] * settings.replicas
        self.router: subprocess.Popen[bytes] | None = None

    def access_log(self, index: int, incarnation: int) -> Path:
        return self.procs.tmp / f"replica-{index}.{incarnation}.access"

    def _replica_argv(self, port: int, index: int, log: Path) -> list[str]:
        return [
            sys.executable, str(Path(__file__).resolve()), "replica", "--port", str(port),
            "--access-log", str(log), *self.settings.replica_flags(index),
        ]  # fmt: skip

    def start(self) -> None:
        for i, port in enumerate(self.ports):
            argv = self._replica_argv(port, i, self.access_log(i, 0))
            self.replica_procs.append(self.procs.start(argv))
        spare_log = self.procs.tmp / "spare.access"
        self.procs.start(self._replica_argv(self.spare_port, len(self.ports), spare_log))
        for port in (*self.ports, self.spare_port):
            wait_port(port, START_TIMEOUT_S)
        urls = ",".join(self.url(i) for i in range(len(self.ports)))
        self.router = self.procs.start(
            [
                sys.executable, "-m", "lora_router.cli", "--replicas", urls, "--no-token",
                "--port", str(self.router_port), *self.settings.router_flags(),
            ]
        )  # fmt: skip
        wait_port(self.router_port, START_TIMEOUT_S)

    def url(self, index: int) -> str:
        return f"http://127.0.0.1:{self.ports[index]}"

    @property
    def router_url(self) -> str:
        return f"http://127.0.0.1:{self.router_port}"

    def kill(self, index: int) -> float:
        """SIGKILL a replica; returns the time of the kill."""
        proc = self.replica_procs[index]
        killed_at = time.time()
        proc.kill()
        proc.wait()
        # Left in `procs.procs` (close() skips the dead): Procs names a log after the number
        # of processes it holds, so forgetting this one would hand its log name to the next.
        return killed_at

    def restart(self, index: int) -> float:
        """Start the replica again, empty, on its port; returns the time of the spawn."""
        self.incarnations[index] += 1
        log = self.access_log(index, self.incarnations[index])
        spawned = time.time()
        self.replica_procs[index] = self.procs.start(
            self._replica_argv(self.ports[index], index, log)
        )
        return spawned

    def router_log(self) -> str:
        assert self.router is not None
        return Path(self.procs.logs[self.router.pid]).read_text(errors="replace")


async def wait_listening(port: int, timeout: float = START_TIMEOUT_S) -> float:
    """Poll a port every 10 ms until it accepts; returns when it did."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.01)
            continue
        at = time.time()
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()
        return at
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout} s")


# --- watching the router --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica in one `/router/replicas` answer."""

    previous: float  # when the poll before this one was sent
    seen: float  # when its answer arrived
    rid: int
    live: bool  # healthy and admitted and not draining
    adapters: tuple[str, ...]


class Prober:
    """Polls `GET /router/replicas` and keeps every change of a replica's state."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http = http
        self.url = url + "/router/replicas"
        self.interval = SLOW_POLL_S
        self.changes: list[ReplicaView] = []
        self.polls = 0
        self.errors = 0
        self._last: dict[int, ReplicaView] = {}
        self._previous = 0.0
        self._stop = asyncio.Event()

    async def run(self) -> None:
        while not self._stop.is_set():
            sent = time.time()
            try:
                async with self.http.get(self.url) as resp:
                    doc = await resp.json()
            except (aiohttp.ClientError, TimeoutError, ValueError):
                self.errors += 1
            else:
                self._record(sent, time.time(), doc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.interval)

    def stop(self) -> None:
        self._stop.set()

    def _record(self, sent: float, seen: float, doc: dict[str, Any]) -> None:
        self.polls += 1
        previous, self._previous = self._previous or sent, sent
        for r in doc["replicas"]:
            view = ReplicaView(
                previous,
                seen,
                int(r["id"]),
                bool(r["healthy"] and r["admitted"] and not r["draining"]),
                tuple(r["adapters"]),
            )
            last = self._last.get(view.rid)
            if last is None or (last.live, last.adapters) != (view.live, view.adapters):
                self.changes.append(view)
            self._last[view.rid] = view

    def live_at(self, rid: int, t: float) -> bool:
        """Whether the last poll answered before `t` showed the replica live."""
        state = True
        for view in self.changes:
            if view.seen > t:
                break
            if view.rid == rid:
                state = view.live
        return state

    def first(self, rid: int, live: bool, after: float) -> tuple[float, float] | None:
        """(lower, upper) bounds of when the replica's liveness became `live` after `after`:
        when the poll before the one that showed it was sent, and when that one arrived."""
        for view in self.changes:
            if view.rid == rid and view.seen > after and view.live == live:
                return max(view.previous, after), view.seen
        return None


# --- the trainer ----------------------------------------------------------------------------


@dataclass(slots=True)
class Attempt:
    started: float
    ended: float
    status: int  # 0: no status line reached the client
    replica: str  # the x-lora-router-replica header, "" if none
    kind: str  # ok | status | cut | transport
    detail: str = ""
    frames: int = 0  # SSE data frames received (streams)
    model: str = ""  # the adapter the attempt named (the version read when it was sent)


@dataclass(slots=True)
class Rollout:
    step: int
    stream: bool
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].kind == "ok"


@dataclass(slots=True)
class ControlCall:
    started: float
    ended: float
    what: str
    status: int
    detail: str = ""


class TrainingStopped(Exception):
    """A load TRL would treat as fatal."""


class Trainer:
    """Syncs adapters and sends rollouts through the router the way TRL does."""

    def __init__(self, settings: Settings, url: str, adapters: Path) -> None:
        self.settings = settings
        self.url = url
        self.adapters = adapters
        self.rng = random.Random(settings.seed)
        self.rollouts: list[Rollout] = []
        self.controls: list[ControlCall] = []
        self.client_retries = 0
        self.stopped = ""  # why the run stopped early, if it did
        self.loading = asyncio.Event()  # set while a load broadcast is in flight
        self.load_started = 0.0
        self.syncing = False
        self.step = 0
        self.version = 0  # the version rollouts name, read at each request (TRL's worker)
        # An `unload` episode asks the next sync to also unload the version it supersedes,
        # while that version's rollouts are still in flight; the sync reports it here.
        self.early_unload: asyncio.Future[tuple[str, ControlCall]] | None = None
        self.unloaded: set[int] = set()
        self.extra: list[asyncio.Task[None]] = []  # rollouts outside the steps (`unload`)
        spec = bench_trace.TraceSpec(
            steps=10_000,  # generated lazily, one step at a time
            prompts_per_step=settings.prompts,
            group_size=settings.group,
            seed=settings.seed,
        )
        self._trace = bench_trace.generate(spec)
        self._http: aiohttp.ClientSession | None = None

    async def drive(self, http: aiohttp.ClientSession, stop: Callable[[], bool]) -> None:
        self._http = http
        tasks: dict[int, asyncio.Task[None]] = {}
        halves: dict[int, asyncio.Event] = {}
        try:
            n = 0
            while not stop():
                n += 1
                if n > 1:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(halves[n - 1].wait(), CONTROL_TIMEOUT_S)
                    if stop():
                        break
                try:
                    await self.sync(n, tasks)
                except TrainingStopped as exc:
                    self.stopped = str(exc)  # what TRL would die of; reported, run ends
                    break
                halves[n] = asyncio.Event()
                tasks[n] = asyncio.create_task(self.step_rollouts(n, halves[n]))
            await asyncio.gather(*tasks.values(), *self.extra)
        finally:
            for task in (*tasks.values(), *self.extra):
                task.cancel()
            await asyncio.gather(*tasks.values(), *self.extra, return_exceptions=True)

    async def sync(self, n: int, tasks: dict[int, asyncio.Task[None]]) -> None:
        """pause(keep) -> write vN -> load vN -> resume -> unload v(N-3) -> rollouts name vN,
        as TRL's trainer does (it does not wait for the old version's rollouts)."""
        self.syncing = True
        try:
            await self.control("/pause?mode=keep")
            name = f"trl-policy-v{n}"
            final = self.adapters / name
            staging = self.adapters / f".{name}.tmp"
            write_adapter(staging, rank=1)
            os.replace(staging, final)  # atomic rename, as TRL saves
            self.load_started = time.time()
            self.loading.set()
            try:
                ok = await self.control(
                    "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(final)}
                )
            finally:
                self.loading.clear()
            if not ok:
                raise TrainingStopped(f"loading {name} failed: {self.controls[-1].detail}")
            await self.control("/resume")
            self.step = n
            old = n - KEEP_VERSIONS
            if old >= 1 and old not in self.unloaded:
                self.unloaded.add(old)
                await self.control("/v1/unload_lora_adapter", {"lora_name": f"trl-policy-v{old}"})
            early = self.early_unload
            if early is not None and not early.done() and n >= 2:
                # The worker goes on naming v(N-1) until the trainer moves on: a last burst of
                # its rollouts, which queue in the router behind the others.
                prompt = next(self._trace).tokens
                for _ in range(EARLY_BURST):
                    seed = self.rng.randrange(2**31)
                    self.extra.append(asyncio.create_task(self.rollout(n - 1, prompt, seed, False)))
                await asyncio.sleep(0)  # each has read v(N-1) and is on its way
            self.version = n
            if early is not None and not early.done() and n >= 2:
                self.unloaded.add(n - 1)
                # Requests read the version as they are sent: give the ones already reading
                # v(N-1) a moment to reach the router, so every later one names vN.
                await asyncio.sleep(EARLY_UNLOAD_DELAY_S)
                await self.control("/v1/unload_lora_adapter", {"lora_name": f"trl-policy-v{n - 1}"})
                early.set_result((f"trl-policy-v{n - 1}", self.controls[-1]))
        finally:
            self.syncing = False

    async def control(self, path: str, body: object = None) -> bool:
        assert self._http is not None
        started = time.time()
        status, detail = 0, ""
        try:
            async with self._http.post(
                self.url + path, json=body, timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S)
            ) as resp:
                status = resp.status
                text = await resp.text()
                if status != 200:
                    detail = text.strip()[:300]
        except (aiohttp.ClientError, TimeoutError) as exc:
            detail = f"{type(exc).__name__}: {exc}"
        self.controls.append(ControlCall(started, time.time(), path, status, detail))
        return status == 200

    async def step_rollouts(self, n: int, half: asyncio.Event) -> None:
        """S prompts x G samples naming vN, every sample its own request."""
        prompts: list[list[int]] = []
        for _ in range(self.settings.prompts * self.settings.group):
            request = next(self._trace)
            if request.sample == 0:
                prompts.append(request.tokens)
        done = 0

        async def group(index: int, prompt: list[int]) -> None:
            nonlocal done
            stream = index % 4 == 0
            await asyncio.gather(
                *(
                    self.rollout(n, prompt, self.rng.randrange(2**31), stream)
                    for _ in range(self.settings.group)
                )
            )
            done += 1
            if 2 * done >= len(prompts):
                half.set()

        await asyncio.gather(*(group(i, p) for i, p in enumerate(prompts)))
        half.set()

    async def rollout(self, n: int, prompt: list[int], seed: int, stream: bool) -> None:
        record = Rollout(n, stream)
        self.rollouts.append(record)
        for attempt in range(len(BACKOFF_S) + 1):
            # The version is read at each request, as TRL's rollout worker does.
            result = await self.attempt(self.body(prompt, seed, stream), stream)
            record.attempts.append(result)
            if result.kind == "ok" or attempt == len(BACKOFF_S):
                return
            self.client_retries += 1
            await asyncio.sleep(BACKOFF_S[attempt])

    def body(self, prompt: list[int], seed: int, stream: bool) -> bytes:
        body: dict[str, Any] = {
            "model": f"trl-policy-v{self.version}",
            "prompt": prompt,
            "max_tokens": self.settings.max_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "n": 1,
            "return_token_ids": True,
            "logprobs": 0,
            "seed": seed,
        }
        if stream:
            body["stream"] = True
        return orjson.dumps(body)

    async def attempt(self, data: bytes, stream: bool) -> Attempt:
        assert self._http is not None
        model = f"trl-policy-v{self.version}"
        started = time.time()
        status, replica = 0, ""
        chunks: list[bytes] = []
        try:
            async with self._http.post(
                self.url + "/v1/completions",
                data=data,
                headers={"content-type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=ATTEMPT_TIMEOUT_S),
            ) as resp:
                status = resp.status
                replica = resp.headers.get(REPLICA_HEADER, "")
                async for chunk in resp.content.iter_any():
                    chunks.append(chunk)
        except (aiohttp.ClientError, TimeoutError) as exc:
            kind = "cut" if status else "transport"
            frames = b"".join(chunks).count(b"data: ")
            return Attempt(
                started, time.time(), status, replica, kind, type(exc).__name__, frames, model
            )
        ended = time.time()
        raw = b"".join(chunks)
        if status != 200:
            return Attempt(started, ended, status, replica, "status", _error_message(raw), 0, model)
        problem = check_answer(status, raw, stream)
        kind = "ok" if problem is None else "cut"
        return Attempt(started, ended, status, replica, kind, problem or "", 0, model)


def _error_message(raw: bytes) -> str:
    with contextlib.suppress(orjson.JSONDecodeError, TypeError, KeyError, AttributeError):
        return str(orjson.loads(raw)["error"]["message"])[:300]
    return raw[:300].decode("utf-8", "replace")


# --- faults ---------------------------------------------------------------------------------


@dataclass(slots=True)
class EpisodeRun:
    episode: Episode
    rid: int
    phase_met: bool = False
    killed: float = 0.0
    spawned: float = 0.0
    listening: float = 0.0
    admitted: float = 0.0  # first poll showing it admitted again (0: never)
    incarnation: int = 0  # which access log the restarted process writes
    # Soft faults (5xx, unload, listing): `killed` is when the fault began, `ended` when it
    # was lifted, `admitted` when the episode was over.
    ended: float = 0.0
    unloaded: str = ""  # `unload`: the version unloaded early
    unload_call: ControlCall | None = None


KILLS = ("rollout", "load")
SOFT = ("5xx", "unload", "listing")


async def inject(
    episodes: Sequence[Episode],
    cluster: Cluster,
    trainer: Trainer,
    prober: Prober,
    t0: float,
    down: float,
) -> list[EpisodeRun]:
    """Run the episodes in order: wait for the set time and phase, kill, wait, restart, wait
    for the router to admit the replica again."""
    runs = []
    for episode in episodes:
        run = EpisodeRun(episode, episode.victim)
        runs.append(run)
        await _sleep_until(t0 + episode.at - 0.3)
        prober.interval = FAST_POLL_S
        await _sleep_until(t0 + episode.at)
        if episode.phase in SOFT:
            await soft_fault(run, cluster, trainer, prober, down)
            prober.interval = SLOW_POLL_S
            continue
        run.phase_met = await _wait_phase(episode.phase, trainer)
        run.killed = cluster.kill(episode.victim)
        await _sleep_until(run.killed + down)
        run.spawned = cluster.restart(episode.victim)
        run.incarnation = cluster.incarnations[episode.victim]
        run.listening = await wait_listening(cluster.ports[episode.victim])
        deadline = time.time() + 30.0
        while time.time() < deadline:
            found = prober.first(run.rid, True, run.listening)
            if found is not None:
                run.admitted = found[1]
                break
            await asyncio.sleep(FAST_POLL_S)
        await asyncio.sleep(0.5)
        prober.interval = SLOW_POLL_S
    return runs


async def soft_fault(
    run: EpisodeRun, cluster: Cluster, trainer: Trainer, prober: Prober, down: float
) -> None:
    """`5xx`: the victim answers 500 to every completion (its /health stays 200) for `down` s.
    `unload`: the next sync also unloads the version it supersedes, with its rollouts in
    flight. `listing`: every other /v1/models answer of the victim lists no adapter (a load
    balancer over two servers) for LISTING_S, then the episode lasts until it serves again."""
    phase, url = run.episode.phase, cluster.url(run.rid)
    run.phase_met = True
    run.killed = time.time()
    if phase == "unload":
        done: asyncio.Future[tuple[str, ControlCall]] = asyncio.get_running_loop().create_future()
        trainer.early_unload = done
        try:
            run.unloaded, run.unload_call = await asyncio.wait_for(done, CONTROL_TIMEOUT_S)
        except TimeoutError:  # no sync came (the run stopped): reported as a missed phase
            run.phase_met = False
            run.ended = run.admitted = time.time()
            return
        run.ended = run.admitted = run.unload_call.ended
        return
    switch, value = ("error_rate", 1.0) if phase == "5xx" else ("hide_adapters", 2)
    await set_fault(prober.http, url, {switch: value})
    await asyncio.sleep(down if phase == "5xx" else LISTING_S)
    await set_fault(prober.http, url, {switch: 0 if phase == "listing" else 0.0})
    run.ended = time.time()
    if phase == "5xx":
        run.admitted = run.ended
        return
    deadline = run.ended + 60.0
    while time.time() < deadline:
        found = prober.first(run.rid, True, run.ended)
        if found is not None:
            run.admitted = found[1]
            return
        await asyncio.sleep(FAST_POLL_S)


async def set_fault(http: aiohttp.ClientSession, url: str, changes: dict[str, Any]) -> None:
    async with http.post(url + "/emulator/faults", json=changes) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: /emulator/faults answered {resp.status}")


async def _sleep_until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        await asyncio.sleep(delay)


async def _wait_phase(phase: str, trainer: Trainer) -> bool:
    """Wait (bounded) for the moment the episode wants; returns whether it came."""
    deadline = time.time() + PHASE_WAIT_S
    while time.time() < deadline:
        # A load that has just started, so the kill lands inside it.
        fresh = time.time() - trainer.load_started < LOAD_KILL_OFFSET_S / 2
        if phase == "load" and trainer.loading.is_set() and fresh:
            await _sleep_until(trainer.load_started + LOAD_KILL_OFFSET_S)
            return trainer.loading.is_set()
        if phase == "rollout" and not trainer.syncing:
            return True
        await asyncio.sleep(0.002)
    return False


async def reference_replay(url: str, adapters: Path, count: int, repeat: int = 3) -> list[float]:
    """One replay of `count` adapters done by hand on an empty replica: what readmit sends
    (its /v1/models, the loads concurrently, /v1/models again, /resume), timed."""
    times = []
    async with aiohttp.ClientSession() as http:

        async def call(method: str, path: str, body: object = None) -> None:
            async with http.request(method, url + path, json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"spare replica: {method} {path} answered {resp.status}")

        for r in range(repeat):
            names = [f"replay-{r}-{k}" for k in range(count)]
            for name in names:
                write_adapter(adapters / name, rank=1)
            started = time.perf_counter()
            await call("GET", "/v1/models")
            await asyncio.gather(
                *(
                    call(
                        "POST",
                        "/v1/load_lora_adapter",
                        {"lora_name": n, "lora_path": str(adapters / n)},
                    )
                    for n in names
                )
            )
            await call("GET", "/v1/models")
            await call("POST", "/resume")
            times.append(time.perf_counter() - started)
            for name in names:
                await call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
    return times


# --- analysis -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LogEvent:
    at: float
    rid: int
    kind: str  # eject | back
    detail: str
    adapters: int = 0
    replay_s: float = 0.0


def parse_router_log(text: str) -> list[LogEvent]:
    events = []
    for line in text.splitlines():
        m = _EJECT.match(line)
        if m:
            events.append(LogEvent(_log_time(m[1]), int(m[2]), "eject", m[4]))
            continue
        m = _BACK.match(line)
        if m:
            events.append(LogEvent(_log_time(m[1]), int(m[2]), "back", "", int(m[3]), float(m[4])))
    return events


def _log_time(stamp: str) -> float:
    return datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def throughput(rollouts: Sequence[Rollout], start: float, end: float) -> dict[str, float]:
    done = [r.attempts[-1] for r in rollouts if r.ok and start <= r.attempts[-1].ended < end]
    seconds = max(end - start, 1e-9)
    latencies = sorted(a.ended - a.started for a in done)
    return {
        "seconds": round(seconds, 3),
        "rollouts": len(done),
        "per_s": round(len(done) / seconds, 1),
        "p50_latency_s": round(statistics.median(latencies), 3) if latencies else 0.0,
    }


def analyse_episode(
    run: EpisodeRun,
    settings: Settings,
    cluster: Cluster,
    trainer: Trainer,
    prober: Prober,
    log_events: Sequence[LogEvent],
    replay_ref_s: float,
    t0: float,
) -> dict[str, Any]:
    rid, interval = run.rid, settings.health_interval
    out: dict[str, Any] = {
        "phase": run.episode.phase,
        "phase_met": run.phase_met,
        "victim": rid,
        "killed_at_s": round(run.killed - t0, 3),
        "down_s": round(run.spawned - run.killed, 3),
        "restart_to_listening_s": round(run.listening - run.spawned, 3),
    }
    ejected = prober.first(rid, False, run.killed)
    eject_log = next(
        (e for e in log_events if e.rid == rid and e.kind == "eject" and e.at >= run.killed - 0.01),
        None,
    )
    out["eject_s"] = round(ejected[1] - run.killed, 4) if ejected else None
    out["eject_s_lower_bound"] = round(ejected[0] - run.killed, 4) if ejected else None
    out["eject_s_router_log"] = round(eject_log.at - run.killed, 4) if eject_log else None
    out["eject_reason"] = eject_log.detail if eject_log else None
    out["eject_target_s"] = 2 * interval
    out["eject_met"] = ejected is not None and ejected[1] - run.killed <= 2 * interval

    back = next(
        (
            e
            for e in log_events
            if e.rid == rid and e.kind == "back" and e.at >= run.listening - 0.01
        ),
        None,
    )
    admitted = run.admitted or None
    out["readmit_s"] = round(admitted - run.listening, 4) if admitted else None
    out["readmit_s_router_log"] = round(back.at - run.listening, 4) if back else None
    out["router_replay_s"] = back.replay_s if back else None
    out["adapters_replayed"] = back.adapters if back else None

    # The new incarnation's own view: health checks, the replay, the first completion.
    log = read_access_log(cluster.access_log(rid, run.incarnation))
    checks = [a for a in log if a.path == "/health" and a.status == 200]
    needed = settings.health_successes
    admitting = checks[needed - 1] if len(checks) >= needed else None
    completions = [a for a in log if a.path in GENERATION_PATHS]
    first_completion = min((a.arrived for a in completions), default=None)
    admitted_at = back.at if back else admitted
    loaded = [
        a
        for a in log
        if a.path == "/v1/load_lora_adapter" and a.status == 200 and a.ended <= (admitted_at or 0)
    ]
    before_admission = [
        a for a in completions if admitted_at is not None and a.arrived < admitted_at
    ]
    held_before_first = {
        a.name for a in loaded if first_completion is None or a.ended <= first_completion
    }
    live_at_admission = _live_adapters(prober, rid, admitted or 0.0)
    out["replica_side"] = {
        "listening_to_admitting_health_check_s": (
            round(admitting.ended - run.listening, 4) if admitting else None
        ),
        "admitting_check_to_admitted_s": (
            round(admitted_at - admitting.ended, 4) if admitting and admitted_at else None
        ),
        "replay_loads": len(loaded),
        "replay_load_rounds": _rounds(loaded),
        "first_completion_after_admission_s": (
            round(first_completion - admitted_at, 4) if first_completion and admitted_at else None
        ),
        "completions_before_admission": len(before_admission),
        "live_adapters_at_admission": sorted(live_at_admission),
        "all_live_adapters_loaded_before_first_completion": live_at_admission <= held_before_first,
        "404s": sum(a.status == 404 for a in completions),
    }
    out["replay_reference_s"] = round(replay_ref_s, 4)
    budget = needed * interval + replay_ref_s
    out["readmit_budget_s"] = round(budget, 4)
    out["readmit_met"] = admitted is not None and admitted - run.listening <= budget
    out["readmit_met_literal"] = admitted is not None and admitted - run.listening <= replay_ref_s

    # A replay's last pass holds the broadcast lock: trainer calls (other than loads, which
    # take a load time anyway) that overlapped the re-admission, against the whole run.
    quick = [c for c in trainer.controls if c.what != "/v1/load_lora_adapter"]
    overlapping = [c for c in quick if c.ended >= run.listening and c.started <= (admitted or 0)]
    slowest = max(overlapping, key=lambda c: c.ended - c.started, default=None)
    out["trainer_calls_during_readmission"] = {
        "median_s_whole_run": round(statistics.median(c.ended - c.started for c in quick), 4)
        if quick
        else None,
        "slowest_s": round(slowest.ended - slowest.started, 4) if slowest else None,
        "slowest": slowest.what if slowest else None,
    }
    w = settings.window
    end_after = admitted + w if admitted else run.killed + w
    out["throughput"] = {
        "before": throughput(trainer.rollouts, run.killed - w, run.killed),
        "during": throughput(trainer.rollouts, run.killed, admitted or run.killed + w),
        "after": throughput(trainer.rollouts, admitted or run.killed, end_after),
    }
    served_after = Counter(
        r.attempts[-1].replica
        for r in trainer.rollouts
        if r.ok and admitted and admitted <= r.attempts[-1].ended < end_after
    )
    out["victim_share_after"] = round(
        served_after.get(str(rid), 0) / max(1, sum(served_after.values())), 3
    )
    return out


def _rounds(loads: Sequence[Access]) -> int:
    """Rounds of loads: a load that arrives after every earlier one ended starts a new one
    (a replay loads what is missing concurrently; a second round is its final pass)."""
    rounds, busy_until = 0, 0.0
    for a in sorted(loads, key=lambda a: a.arrived):
        if a.arrived >= busy_until:
            rounds += 1
        busy_until = max(busy_until, a.ended)
    return rounds


def _live_adapters(prober: Prober, rid: int, at: float) -> set[str]:
    """The adapters a live replica other than `rid` held at the poll that showed `rid` back."""
    views: dict[int, ReplicaView] = {}
    for view in prober.changes:
        if view.seen > at + 1e-6:
            break
        views[view.rid] = view
    others = [v for r, v in views.items() if r != rid and v.live]
    return set(others[0].adapters) if others else set()


def analyse_failures(trainer: Trainer, prober: Prober, replicas: int) -> dict[str, Any]:
    attempts = [a for r in trainer.rollouts for a in r.attempts]
    failed = [a for a in attempts if a.kind != "ok"]
    saveable = []
    for a in failed:
        if a.kind not in ("status", "transport"):
            continue
        named = int(a.replica) if a.replica.isdigit() else None
        others = [rid for rid in range(replicas) if rid != named and prober.live_at(rid, a.started)]
        if others:
            saveable.append(a)
    cut = [a for a in failed if a.kind == "cut"]
    return {
        "rollouts": len(trainer.rollouts),
        "attempts": len(attempts),
        "failed_attempts": dict(Counter(a.kind for a in failed)),
        "failed_non_2xx": sum(a.kind == "status" for a in failed),
        "failed_by_replica": dict(Counter(a.replica or "-" for a in failed)),
        "cut_before_any_data_frame": sum(a.frames == 0 for a in cut),
        "saveable_by_another_replica": len(saveable),
        "client_retries": trainer.client_retries,
        "rollouts_lost_after_retries": sum(not r.ok for r in trainer.rollouts),
        "examples": [asdict(a) for a in failed[:8]],
    }


def analyse_replicas(cluster: Cluster) -> dict[str, Any]:
    by_replica = []
    for i in range(len(cluster.ports)):
        counts: Counter[int] = Counter()
        for inc in range(cluster.incarnations[i] + 1):
            for a in read_access_log(cluster.access_log(i, inc)):
                if a.path in GENERATION_PATHS:
                    counts[a.status] += 1
        by_replica.append({
            "replica": i,
            "completions": sum(counts.values()),
            "404": counts.get(404, 0),
            "5xx": sum(v for k, v in counts.items() if k >= 500),
            "cancelled": counts.get(-1, 0),
        })  # fmt: skip
    return {
        "completion_404s": sum(r["404"] for r in by_replica),
        "completion_5xx": sum(r["5xx"] for r in by_replica),
        "by_replica": by_replica,
    }


# --- the run --------------------------------------------------------------------------------


def analyse_soft(
    run: EpisodeRun,
    settings: Settings,
    cluster: Cluster,
    trainer: Trainer,
    prober: Prober,
    events: Sequence[LogEvent],
    status: dict[str, Any],
    t0: float,
) -> dict[str, Any]:
    """A 5xx, unload or listing episode, from the trainer's attempts, the router's log and
    status, and the victim's access log."""
    rid, phase = run.rid, run.episode.phase
    attempts = [a for r in trainer.rollouts for a in r.attempts]
    out: dict[str, Any] = {
        "phase": phase,
        "victim": rid,
        "started_at_s": round(run.killed - t0, 3),
        "lasted_s": round(run.ended - run.killed, 3),
    }
    if phase == "5xx":
        window = [a for a in attempts if run.killed <= a.started <= run.ended]
        answered = [
            a
            for inc in range(cluster.incarnations[rid] + 1)
            for a in read_access_log(cluster.access_log(rid, inc))
            if a.path in GENERATION_PATHS and run.killed <= a.arrived <= run.ended
        ]
        out |= {
            "attempts_during": len(window),
            "victim_answered_5xx": sum(a.status >= 500 for a in answered),
            "client_visible_5xx_during": sum(a.status >= 500 for a in window),
            "failed_attempts_during": sum(a.kind != "ok" for a in window),
        }
    elif phase == "unload":
        call = run.unload_call
        if call is None:
            return out | {"unloaded": "", "missed": "no sync came to carry the unload"}
        named = [a for a in attempts if a.model == run.unloaded]
        in_flight = [a for a in named if a.started < call.started < a.ended]
        out |= {
            "unloaded": run.unloaded,
            "unload_status": call.status,
            "unload_s": round(call.ended - call.started, 4),
            "its_rollouts_in_flight_when_it_arrived": len(in_flight),
            "of_them_answered_200": sum(a.status == 200 for a in in_flight),
            "the_others_answered": dict(Counter(a.status for a in in_flight if a.status != 200)),
            "404s_naming_it": sum(a.status == 404 for a in named),
        }
    else:
        end = run.admitted or run.ended
        ejections = [
            e for e in events if e.rid == rid and e.kind == "eject" and run.killed <= e.at <= end
        ]
        # Without a back-off: one ejection every few health checks for the whole episode.
        # With it: the waits double, so at most log2(episode / interval) + 2.
        bound = 2 + math.ceil(math.log2(max(1.0, LISTING_S / settings.health_interval)))
        live = [
            sum(prober.live_at(r, t) for r in range(settings.replicas))
            for t in _poll_times(prober, run.killed, end)
        ]
        flaps = status.get("health", {}).get("listing_flaps", {})
        out |= {
            "ejections": len(ejections),
            "ejection_bound": bound,
            "listing_flaps_counted": flaps.get(str(rid), 0),
            "fewest_replicas_serving": min(live, default=settings.replicas),
            "back_in_service_after_fault_s": (
                round(run.admitted - run.ended, 3) if run.admitted else None
            ),
            "bounded": len(ejections) <= bound and bool(run.admitted) and min(live, default=1) > 0,
        }
    return out


def _poll_times(prober: Prober, start: float, end: float) -> list[float]:
    return [v.seen for v in prober.changes if start <= v.seen <= end] + [start, end]


async def measure(settings: Settings, cluster: Cluster, adapters: Path) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        await _wait_router(http, cluster.router_url)
        trainer = Trainer(settings, cluster.router_url, adapters)
        prober = Prober(http, cluster.router_url)
        probe_task = asyncio.create_task(prober.run())
        t0 = time.time()
        runs: list[EpisodeRun] = []
        done = asyncio.Event()

        async def faults() -> None:
            try:
                runs.extend(
                    await inject(settings.episodes, cluster, trainer, prober, t0, settings.down)
                )
            finally:
                done.set()

        def stop() -> bool:
            now = time.time()
            if now - t0 > settings.max_run:
                return True
            if not done.is_set():
                return False
            last = max((r.admitted or r.killed for r in runs), default=t0)
            return now >= last + settings.window

        fault_task = asyncio.create_task(faults())
        try:
            await trainer.drive(http, stop)
            await fault_task
        finally:
            fault_task.cancel()
            prober.stop()
            await asyncio.gather(fault_task, probe_task, return_exceptions=True)
        wall = time.time() - t0
        async with http.get(cluster.router_url + "/router/status") as resp:
            router_status = await resp.json()
    router_log = cluster.router_log()
    events = parse_router_log(router_log)
    replayed = max((e.adapters for e in events if e.kind == "back"), default=KEEP_VERSIONS)
    ref = await reference_replay(
        f"http://127.0.0.1:{cluster.spare_port}", adapters, max(1, replayed)
    )
    replay_ref = statistics.median(ref)
    kills = [r for r in runs if r.episode.phase in KILLS]
    episodes = [
        analyse_episode(r, settings, cluster, trainer, prober, events, replay_ref, t0)
        for r in kills
    ]
    soft = [
        analyse_soft(r, settings, cluster, trainer, prober, events, router_status, t0)
        for r in runs
        if r.episode.phase in SOFT
    ]
    # An ejection is expected only of a kill's victim shortly after the kill, or of a listing
    # episode's victim while it lasts.
    listing = [r for r in runs if r.episode.phase == "listing"]
    unexpected = [
        asdict(e)
        for e in events
        if e.kind == "eject"
        and not any(
            r.rid == e.rid and -0.01 <= e.at - r.killed <= 2 * settings.health_interval + 1
            for r in kills
        )
        and not any(r.rid == e.rid and r.killed <= e.at <= (r.admitted or r.ended) for r in listing)
    ]
    attempts = [a for r in trainer.rollouts for a in r.attempts]
    failures = analyse_failures(trainer, prober, settings.replicas)
    replicas = analyse_replicas(cluster)
    controls = [asdict(c) for c in trainer.controls if c.status != 200]
    return {
        "wall_s": round(wall, 1),
        "steps": trainer.step,
        "replay_reference_s": [round(t, 4) for t in ref],
        "episodes": episodes,
        "soft_episodes": soft,
        "client_visible_5xx": sum(a.status >= 500 for a in attempts),
        "client_404s": sum(a.status == 404 for a in attempts),
        "router_retries": router_status.get("retries", {}),
        "failures": failures,
        "replicas": replicas,
        "control_failures": controls,
        "training_stopped": trainer.stopped,
        "unexpected_ejections": unexpected,
        "prober": {"polls": prober.polls, "errors": prober.errors},
        "router_log_events": [asdict(e) for e in events],
    }


async def _wait_router(http: aiohttp.ClientSession, url: str) -> None:
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the router at {url} did not become healthy")


def targets(result: dict[str, Any]) -> dict[str, Any]:
    episodes = result["episodes"]
    failures = result["failures"]
    soft = result["soft_episodes"]
    listing = [e for e in soft if e["phase"] == "listing"]
    unloads = [e for e in soft if e["phase"] == "unload"]
    return {
        "client_visible_5xx": {
            "met": result["client_visible_5xx"] == 0,
            "figure": f"{result['client_visible_5xx']} rollout attempts answered 5xx; the "
            f"replicas answered {result['replicas']['completion_5xx']} completions 5xx; router "
            f"retries {result['router_retries']}",
        },
        "no_404_after_an_unload": {
            "met": result["client_404s"] == 0
            and any(e["unloaded"] for e in unloads)
            and all(
                e["of_them_answered_200"] == e["its_rollouts_in_flight_when_it_arrived"]
                for e in unloads
                if e["unloaded"]
            ),
            "figure": f"{result['client_404s']} rollout attempts answered 404; "
            + "; ".join(
                f"{e['unloaded']} unloaded with {e['its_rollouts_in_flight_when_it_arrived']} of "
                f"its rollouts in flight ({e['of_them_answered_200']} answered 200), in "
                f"{e['unload_s']} s"
                for e in unloads
                if e["unloaded"]
            ),
        },
        "listing_flap_bounded": {
            "met": bool(listing) and all(e["bounded"] for e in listing),
            "figure": "; ".join(
                f"replica {e['victim']}: {e['ejections']} ejections in {e['lasted_s']} s "
                f"(bound {e['ejection_bound']}), {e['listing_flaps_counted']} flaps counted, "
                f"never fewer than {e['fewest_replicas_serving']} replicas serving, back "
                f"{e['back_in_service_after_fault_s']} s after the fault was lifted"
                for e in listing
            ),
        },
        "no_saveable_failures": {
            "met": failures["saveable_by_another_replica"] == 0
            and not result["control_failures"]
            and not result["training_stopped"],
            "figure": f"{failures['saveable_by_another_replica']} saveable of "
            f"{sum(failures['failed_attempts'].values())} failed rollout attempts; trainer "
            f"calls not answered 200: {len(result['control_failures'])}",
        },
        "eject_within_2_intervals": {
            "met": all(e["eject_met"] for e in episodes) and bool(episodes),
            "figure": ", ".join(f"{e['eject_s']} s" for e in episodes)
            + f" (target {episodes[0]['eject_target_s'] if episodes else '?'} s)",
        },
        "readmit_within_one_replay": {
            "met": all(e["readmit_met"] for e in episodes) and bool(episodes),
            "met_literal": all(e["readmit_met_literal"] for e in episodes) and bool(episodes),
            "figure": ", ".join(
                f"{e['readmit_s']} s (budget {e['readmit_budget_s']} s, one replay "
                f"{e['replay_reference_s']} s)"
                for e in episodes
            ),
        },
        "no_request_for_an_adapter_reached_a_replica_without_it": {
            "met": result["replicas"]["completion_404s"] == 0
            and all(
                e["replica_side"]["completions_before_admission"] == 0
                and e["replica_side"]["all_live_adapters_loaded_before_first_completion"]
                for e in episodes
            ),
            "figure": f"{result['replicas']['completion_404s']} completion 404s at the replicas",
        },
    }


def markdown(report: dict[str, Any]) -> str:
    s = report["settings"]
    lines = [
        "# Fault tolerance under a GRPO-shaped run (bench/faults.py)",
        "",
        f"Made {report['date']} by `{report['command']}`: {report['wall_s']} s of run "
        f"({report['steps']} steps), {report['total_s']} s in all, on "
        f"{report['machine']['cpus']} cores (git {report['git']}).",
        "",
        f"3 emulated replicas, each a process (8 seqs, 4 ms/token, {s['load_delay']} s per "
        f"adapter load); router `{' '.join(report['router_flags'])}`; S={s['prompts']} x "
        f"G={s['group']} rollouts per step (each request with its own seed, naming the version "
        "current when it is sent), pause(keep) -> load vN -> resume -> unload v(N-3) without "
        "waiting for its rollouts, as TRL; the client retries a failed rollout after 1, 2, "
        f"4 s. Kill episodes SIGKILL one replica and restart it empty {s['down']} s later on "
        f"the same port; `5xx`: a replica answers 500 to every completion for {s['down']} s, "
        "its /health 200; `unload`: a sync also unloads the version it supersedes while that "
        f"version's rollouts are in flight; `listing`: for {LISTING_S:g} s every other "
        "/v1/models answer of a replica lists no adapter (a balancer over two servers). "
        "Method: the module docstring.",
        "",
        "## Targets",
        "",
        "| target | met | figures |",
        "|---|---|---|",
    ]
    for name, t in report["targets"].items():
        met = "yes" if t["met"] else "**no**"
        if "met_literal" in t:
            met += f" (literal reading: {'yes' if t['met_literal'] else 'no'})"
        lines.append(f"| {name.replace('_', ' ')} | {met} | {t['figure']} |")
    lines += [
        "",
        "## Episodes",
        "",
        "Eject: kill -> first poll of `/router/replicas` showing the victim out (10 ms polls) "
        "/ the router's log line. Re-admit: the new process listening -> first poll showing it "
        "admitted / log line; split into the health wait (-> the /health answer that completed "
        "`--health-successes`) and the replay (-> admitted), with the replay's rounds of loads. "
        "One replay by hand: the same calls on an empty spare replica.",
        "",
        "| kill | victim | eject s (poll / log) | restart -> listening s | re-admit s (poll / "
        "log) | health wait s | replay s: router (load rounds) / by hand | slowest trainer "
        "call during it s | rollouts/s before / during / after | victim share after |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for e in report["episodes"]:
        t = e["throughput"]
        rs = e["replica_side"]
        calls = e["trainer_calls_during_readmission"]
        lines.append(
            f"| {e['phase']} at {e['killed_at_s']} s{'' if e['phase_met'] else ' (phase missed)'}"
            f" | {e['victim']} | {e['eject_s']} / {e['eject_s_router_log']} | "
            f"{e['restart_to_listening_s']} | {e['readmit_s']} / {e['readmit_s_router_log']} | "
            f"{rs['listening_to_admitting_health_check_s']} | {e['router_replay_s']} "
            f"({rs['replay_load_rounds']}) / {e['replay_reference_s']} | "
            f"{calls['slowest_s']} ({calls['slowest']}; median {calls['median_s_whole_run']}) | "
            f"{t['before']['per_s']} / {t['during']['per_s']} / {t['after']['per_s']} | "
            f"{e['victim_share_after']} |"
        )
    f = report["failures"]
    r = report["replicas"]
    lines += [
        "",
        "## Requests",
        "",
        f"- rollouts {f['rollouts']}, attempts {f['attempts']}, failed attempts "
        f"{f['failed_attempts'] or 0}, by replica {f['failed_by_replica'] or 0} (status: "
        "answered non-2xx; cut: a 200 whose body broke off after bytes had reached the client, "
        "which the router must not retry; transport: no answer from the router)",
        f"- of the cut streams, {f['cut_before_any_data_frame']} had received no SSE data frame "
        "(only the 200 head, which vLLM sends before generating)",
        f"- failed before any response byte while another replica was live (saveable): "
        f"{f['saveable_by_another_replica']}",
        f"- client retries {f['client_retries']}; rollouts lost after all retries "
        f"{f['rollouts_lost_after_retries']}",
        f"- completions answered 404 by a replica (its access log): {r['completion_404s']}; "
        f"5xx: {r['completion_5xx']}; completions reaching a restarted replica before its "
        "admission: "
        + str(sum(e["replica_side"]["completions_before_admission"] for e in report["episodes"])),
        f"- trainer control calls not answered 200: {len(report['control_failures'])}; "
        f"ejections of replicas that were not killed: {len(report['unexpected_ejections'])}",
        "",
    ]
    doubled = [e for e in report["episodes"] if (e["replica_side"]["replay_load_rounds"] or 0) > 1]
    soft = report["soft_episodes"]
    if soft:
        lines += ["## Soft faults", ""]
    for e in soft:
        shown = {k: v for k, v in e.items() if k not in ("phase", "victim")}
        fields_text = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in shown.items())
        lines.append(f"- `{e['phase']}` on replica {e['victim']}: {fields_text}")
    if soft:
        lines.append("")
    if doubled:
        lines += [
            "## Note",
            "",
            f"In {len(doubled)} of {len(report['episodes'])} episodes the replica loaded in two "
            "rounds: the trainer's load of a new version started while it replayed, and load "
            "broadcasts ride along to a replaying replica, so it had one more adapter to load "
            "before it could serve. The trainer's calls do not wait for it (the slowest trainer "
            "call during each re-admission is in the table above).",
            "",
        ]
    return "\n".join(lines)


def parse_episodes(text: str, replicas: int) -> list[Episode]:
    """`rollout,load` -> kills at 10 s and 26 s, on replicas 1 and 2 (then 1 again ...)."""
    out = []
    for i, phase in enumerate(p.strip() for p in text.split(",") if p.strip()):
        if phase not in (*KILLS, *SOFT):
            known = ", ".join((*KILLS, *SOFT))
            raise argparse.ArgumentTypeError(f"unknown episode {phase!r} ({known})")
        out.append(Episode(phase, 1 + i % max(1, replicas - 1), 10.0 + 16.0 * i))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["replica"]:
        return serve_replica(args_list[1:])
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--episodes",
        default="rollout,load,5xx,unload,listing",
        help="in order: rollout, load (kills), 5xx, unload, listing",
    )
    p.add_argument("--down", type=float, default=4.0, help="seconds a killed replica stays down")
    p.add_argument("--window", type=float, default=6.0, help="throughput window before/after")
    p.add_argument("--max-run", type=float, default=130.0, help="hard cap on the run (s)")
    p.add_argument(
        "--port-base", type=int, default=0, help="ports from here (replicas, spare, router)"
    )
    p.add_argument("--prompts", type=int, default=16, help="S: prompts per step")
    p.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--load-delay", type=float, default=0.3, help="each adapter load (s)")
    p.add_argument("--health-interval", type=float, default=0.5)
    p.add_argument("--health-timeout", type=float, default=1.0)
    p.add_argument("--health-failures", type=int, default=2)
    p.add_argument("--health-successes", type=int, default=2)
    p.add_argument("--retries", type=int, default=2, help="the router's --retries")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--keep-logs", metavar="DIR", help="copy the router and replica logs here")
    args = p.parse_args(args_list)
    replicas = 3
    settings = Settings(
        replicas=replicas,
        prompts=args.prompts,
        group=args.group,
        max_tokens=args.max_tokens,
        episodes=parse_episodes(args.episodes, replicas),
        down=args.down,
        window=args.window,
        max_run=args.max_run,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        health_failures=args.health_failures,
        health_successes=args.health_successes,
        retries=args.retries,
        load_delay=args.load_delay,
        seed=args.seed,
        port_base=args.port_base,
    )
    procs = Procs()
    adapters = Path(tempfile.mkdtemp(prefix="faults-bench-", dir=procs.tmp))
    started = time.time()
    try:
        cluster = Cluster(settings, procs)
        cluster.start()
        result = asyncio.run(measure(settings, cluster, adapters))
    except BaseException:
        for proc in procs.procs:
            print(f"--- {proc.args!r}\n{procs.log_tail(proc.pid)}", file=sys.stderr)
        raise
    finally:
        if args.keep_logs:
            shutil.copytree(procs.tmp, args.keep_logs, dirs_exist_ok=True)
        procs.close()
    report: dict[str, Any] = {
        "command": " ".join(["python bench/faults.py", *args_list]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git": git_revision(),
        "machine": {"cpus": os.cpu_count()},
        "total_s": round(time.time() - started, 1),
        "settings": {
            **{k: v for k, v in asdict(settings).items() if k != "episodes"},
            "episodes": [asdict(e) for e in settings.episodes],
        },
        "router_flags": settings.router_flags(),
        "replica_flags": settings.replica_flags(0),
        **result,
    }
    report["targets"] = targets(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "faults.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all(t["met"] for t in report["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
