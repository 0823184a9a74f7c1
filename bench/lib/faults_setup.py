"""The fault bench's set-up: its constants, the replica process (the emulator plus an access
log), the episodes and settings, the cluster of processes it kills and restarts, and the prober
that watches the router (bench/faults.py's module docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from .procs import Procs, free_port, wait_port

FAULTS = Path(__file__).resolve().parents[1] / "faults.py"  # runs `replica` in a subprocess
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
            sys.executable, str(FAULTS), "replica", "--port", str(port),
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
