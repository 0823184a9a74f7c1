"""The routing bench's processes: the emulated replicas (one subprocess), the oracle proxy
and the routers under test, each pinned to its core (bench/routing.py's module docstring)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

import aiohttp
from aiohttp import web

from lora_router.emulator import EmulatorConfig, start_emulator
from lora_router.emulator.control import RecordedRequest

from .procs import find_binary, free_port, pinned, process_cpu_seconds
from .routing_traces import Timing

BENCH = Path(__file__).resolve().parents[1]
ROUTING = BENCH / "routing.py"  # runs `serve-replicas` and `serve-oracle` in a subprocess
PEERS_BIN = BENCH / ".peers" / "bin"
FAMILY_HEADER = "x-bench-family"
ROUTER_CPUS = "0"  # the router under test (and this load generator)
REPLICA_CPUS = "1"  # the emulated replicas, alone
REQUEST_TIMEOUT_S = 120.0
START_TIMEOUT_S = 30.0
# The longest line the replica host may answer (its `dump`: every request's seed, about 20
# bytes each); asyncio's default of 64 KiB ends a run of more than about 3,000 requests.
HOST_LINE_LIMIT = 64 << 20
_SEED = re.compile(rb'"seed"\s*:\s*(\d+)')


@dataclass(frozen=True, slots=True)
class Contender:
    key: str
    label: str
    kind: str  # oracle | lora-router | vllm-router | sglang-router
    policy: str
    base: bool  # requests name the base model (no adapter syncs)
    alt: bool = False  # lora-router run from --alt-source (an A/B of two revisions in one run)
    # Requests carry a session header, released at the group's end (bench/rl_clock.py).
    sessions: bool = False
    flags: tuple[str, ...] = ()  # lora-router's further flags


CONTENDERS = (
    Contender("oracle", "oracle (families pinned)", "oracle", "", False),
    Contender("lr-prefix", "lora-router prefix", "lora-router", "prefix", False),
    Contender("lr-round-robin", "lora-router round-robin", "lora-router", "round-robin", False),
    Contender("lr-least-loaded", "lora-router least-loaded", "lora-router", "least-loaded", False),
    Contender("lr-kv", "lora-router kv", "lora-router", "kv", False),
    Contender("oracle-base", "oracle (families pinned)", "oracle", "", True),
    Contender("lr-prefix-base", "lora-router prefix", "lora-router", "prefix", True),
    Contender(
        "lr-prefix-alt", "lora-router prefix, --alt-source", "lora-router", "prefix", False, True
    ),
    Contender(
        "lr-prefix-base-alt",
        "lora-router prefix, --alt-source",
        "lora-router",
        "prefix",
        True,
        True,
    ),
    Contender("vllm-ch", "vllm-router consistent_hash", "vllm-router", "consistent_hash", True),
    Contender("vllm-ca", "vllm-router cache_aware", "vllm-router", "cache_aware", True),
    Contender("sglang-ca", "sglang-router cache_aware", "sglang-router", "cache_aware", True),
)
PEER_KINDS = ("vllm-router", "sglang-router")
# Run only when named in --routers (an investigation: its replicas publish KV events).
OPT_IN = ("lr-kv",)


@dataclass(frozen=True, slots=True)
class RouterOptions:
    """lora-router flags under investigation (defaults: the router's own)."""

    load_factor: float | None = None
    load_slack: int | None = None
    source: Path | None = None  # run lora-router from this source tree (another revision)
    alt_source: Path | None = None  # the tree the *-alt contenders run from


# --- the replica host (a subprocess) -------------------------------------------------------


class SeedLog(list[RecordedRequest]):
    """Stands in for `Emulator.requests`: keeps only the seed of each completion received,
    and its family (the load generator's FAMILY_HEADER; -1 without one)."""

    def __init__(self) -> None:
        super().__init__()
        self.seeds: list[int] = []
        self.families: list[int] = []

    def append(self, record: RecordedRequest) -> None:
        if record.method == "POST" and record.path.startswith("/v1/completions"):
            found = _SEED.search(record.body)
            self.seeds.append(int(found.group(1)) if found else -1)
            family = record.headers.get(FAMILY_HEADER, "")
            self.families.append(int(family) if family.isdigit() else -1)


async def serve_replicas(count: int, timing: Timing) -> None:
    """`serve-replicas`: N emulators of one timing in this process (`serve_emulators`)."""
    await serve_emulators([timing.emulator_config() for _ in range(count)])


async def serve_emulators(configs: list[EmulatorConfig]) -> None:
    """One emulator per config in this process; commands on stdin, answers on stdout
    (one JSON line each): `reset` restarts them all (fresh caches, counters, adapters),
    `restart I DOWN_S` crashes replica I and brings it back empty DOWN_S later (bench/
    cache_pressure.py), `dump` returns the seeds and families each one received since, `quit`
    stops."""
    emulators = [await start_emulator(config) for config in configs]
    logs = [SeedLog() for _ in emulators]
    for emulator, log in zip(emulators, logs, strict=True):
        emulator.requests = log

    def answer(obj: object) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    answer({"urls": [e.url for e in emulators]})
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    try:
        while line := (await reader.readline()).decode().strip():
            if line == "reset":
                for i, emulator in enumerate(emulators):
                    await emulator.restart()
                    logs[i] = SeedLog()
                    emulator.requests = logs[i]
                answer({"ok": True})
            elif line.startswith("restart "):
                # `restart I DOWN_S`: replica I crashes (connections cut, as a killed process),
                # stays down DOWN_S and comes back on its port empty (cache, counters,
                # adapters); the answer holds the counters it had, which /metrics forgets.
                _, which, down = line.split()
                emulator = emulators[int(which)]
                await emulator.crash()
                cache = emulator.state.cache
                counters = {"queries": cache.queries, "hits": cache.hits}
                await asyncio.sleep(float(down))
                await emulator.restart()
                answer(counters)
            elif line == "dump":
                answer(
                    {
                        "seeds": [log.seeds for log in logs],
                        "families": [log.families for log in logs],
                    }
                )
            elif line == "quit":
                break
            else:
                answer({"error": f"unknown command {line!r}"})
    finally:
        for emulator in emulators:
            await emulator.stop()


class ReplicaHost:
    """The main process's handle on the replica subprocess."""

    def __init__(self, proc: asyncio.subprocess.Process, urls: list[str]) -> None:
        self.proc = proc
        self.urls = urls

    @classmethod
    async def start(cls, count: int, timing: Timing, log: IO[bytes]) -> ReplicaHost:
        argv = [
            sys.executable,
            str(ROUTING),
            "serve-replicas",
            str(count),
            json.dumps(asdict(timing)),
        ]
        proc = await asyncio.create_subprocess_exec(
            *pinned(argv, REPLICA_CPUS),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            limit=HOST_LINE_LIMIT,
        )
        host = cls(proc, [])
        try:
            host.urls = (await host._read())["urls"]
        except BaseException:
            await host.close()
            raise
        return host

    async def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), START_TIMEOUT_S)
        if not line:
            raise RuntimeError("the replica host exited (see its log)")
        answer: dict[str, Any] = json.loads(line)
        return answer

    async def command(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command.encode() + b"\n")
        await self.proc.stdin.drain()
        return await self._read()

    async def close(self) -> None:
        if self.proc.returncode is None:
            with contextlib.suppress(Exception):
                assert self.proc.stdin is not None
                self.proc.stdin.write(b"quit\n")
                await self.proc.stdin.drain()
            try:
                await asyncio.wait_for(self.proc.wait(), 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


# --- the oracle (a subprocess) -------------------------------------------------------------


async def serve_oracle(port: int, urls: list[str]) -> None:
    """`serve-oracle`: pin each family (`x-bench-family`) to one replica, families dealt out
    round robin in arrival order; broadcast every other POST; GETs go to replica 0."""
    session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=0),
        timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S),
    )
    homes: dict[str, int] = {}

    async def forward(i: int, request: web.Request, body: bytes) -> web.Response:
        headers = {"content-type": request.headers.get("content-type", "application/json")}
        async with session.request(
            request.method, urls[i] + request.path_qs, data=body, headers=headers
        ) as resp:
            data = await resp.read()
            reply_headers = {
                "content-type": resp.headers.get("content-type", "application/json"),
                "x-bench-replica": str(i),
            }
            return web.Response(status=resp.status, body=data, headers=reply_headers)

    async def handle(request: web.Request) -> web.Response:
        body = await request.read()
        family = request.headers.get(FAMILY_HEADER)
        if request.method == "POST" and request.path == "/v1/completions" and family:
            home = homes.setdefault(family, len(homes) % len(urls))
            return await forward(home, request, body)
        if request.method == "POST":
            replies = await asyncio.gather(*(forward(i, request, body) for i in range(len(urls))))
            return next((r for r in replies if r.status >= 400), replies[0])
        return await forward(0, request, body)

    app = web.Application(client_max_size=64 * 1024 * 1024)
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
        await session.close()


# --- routers under test --------------------------------------------------------------------


def peer_binary(name: str) -> str | None:
    return find_binary(name, PEERS_BIN)


def router_argv(c: Contender, port: int, urls: list[str], options: RouterOptions) -> list[str]:
    if c.kind == "oracle":
        return [sys.executable, str(ROUTING), "serve-oracle", str(port), *urls]
    if c.kind == "lora-router":
        args = [
            "--replicas",
            ",".join(urls),
            "--no-token",
            "--port",
            str(port),
            "--policy",
            c.policy,
            "--log-level",
            "warning",
        ]
        args += c.flags
        if options.load_factor is not None:
            args += ["--load-factor", str(options.load_factor)]
        if options.load_slack is not None:
            args += ["--load-slack", str(options.load_slack)]
        return [sys.executable, "-m", "lora_router.cli", *args]
    binary = peer_binary(c.kind)
    assert binary is not None
    metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    if c.kind == "vllm-router":
        return [
            binary,
            "--worker-urls",
            *urls,
            "--policy",
            c.policy,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *metrics,
        ]
    return [
        binary,
        "launch",
        "--worker-urls",
        *urls,
        "--policy",
        c.policy,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warn",
        *metrics,
    ]


def available(c: Contender) -> bool:
    return c.kind not in PEER_KINDS or peer_binary(c.kind) is not None


class RouterProcess:
    """One router subprocess, pinned to the router core, its output in a log file."""

    def __init__(self, argv: list[str], log_path: Path, source: Path | None = None) -> None:
        self.log_path = log_path
        # `python -m` looks in its working directory first: a source tree runs from its root.
        env = None if source is None else {**os.environ, "PYTHONPATH": str(source)}
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                pinned(argv, ROUTER_CPUS),
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=source,
                env=env,
            )

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.proc.pid)

    def log_tail(self, lines: int = 15) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    async def wait_ready(self, session: aiohttp.ClientSession, url: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}:\n{self.log_tail()}")
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url + "/health", timeout=aiohttp.ClientTimeout(2)) as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.05)
        raise RuntimeError(f"router not healthy after {START_TIMEOUT_S} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
