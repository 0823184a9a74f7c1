"""Processes of the real-vLLM tier: vLLM CPU replicas, the `lora-router` command, the emulator.

Everything is started as a user would start it (a command line, the token in an environment
variable), its output goes to a log file, and every wait polls a condition against a deadline;
a wait that runs out raises with the tail of the process's log. Nothing here sleeps for a fixed
time to let something happen.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lora_router.testbed.net import free_port

BIN = Path(sys.executable).parent
HERE = Path(__file__).parent
TOKEN = "vllm-tier-secret-token"  # the replicas' --api-key; the router reads it from TOKEN_ENV
TOKEN_ENV = "LORA_ROUTER_TIER_TOKEN"
REPLICA_START_S = 240.0  # a replica answers /health 25-40 s after start on an idle machine
POLL_S = 0.1

# vLLM's CPU build, as the experiments ran it, one thread each (two replicas share two
# cores). The seed bug: a seeded request whose prefill is split across steps kills the engine,
# so a step's token budget stays above any batch's prompt tokens.
#
# Their logs are the tests' evidence (replica_log.py): replica_logging.json stamps every line
# (vLLM's and the access log) with the time in microseconds, and logs each request's adapter
# and, at debug level, its first `--max-log-len` prompt tokens.
REPLICA_ENV = {
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1",
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    "OMP_NUM_THREADS": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_LOGGING_CONFIG_PATH": str(HERE / "replica_logging.json"),
    "PYTHONUNBUFFERED": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
}
REPLICA_FLAGS = (
    "--enable-lora",
    "--max-lora-rank",
    "1",
    "--enable-prefix-caching",
    "--max-num-batched-tokens",
    "32768",
    "--max-model-len",
    "4096",
    "--enable-log-requests",
    "--max-log-len",
    "100",
    "--enable-prompt-tokens-details",  # usage.prompt_tokens_details.cached_tokens
)


RAISED = re.compile(r"^[\w.]*(?:Error|Exception): ")


def tail(path: Path, lines: int = 40) -> str:
    """The last `lines` of a log, after the exceptions raised above them (a process's root cause
    is often a screen of tracebacks before its last line)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return f"({path} does not exist)"
    every = text.splitlines()
    last = every[-lines:]
    raised = list(dict.fromkeys(line for line in every[:-lines] if RAISED.match(line)))
    if not raised:
        return "\n".join(last)
    return "\n".join(["raised earlier:", *raised[:5], "last lines:", *last])


@dataclass(slots=True)
class Answer:
    status: int
    body: bytes
    headers: dict[str, str]

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


def http(
    method: str,
    url: str,
    body: Any = None,
    token: str | None = None,
    timeout: float = 60.0,
    raw: bytes | None = None,
    headers: dict[str, str] | None = None,
) -> Answer:
    """One blocking request; any status is an answer (only a transport failure raises)."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    request = urllib.request.Request(url, data=data, method=method)
    if data is not None and raw is None:
        request.add_header("Content-Type", "application/json")
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    for name, value in (headers or {}).items():
        request.add_header(name, value)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return Answer(response.status, response.read(), _lower(response.headers.items()))
    except urllib.error.HTTPError as exc:
        return Answer(exc.code, exc.read(), _lower(exc.headers.items()))


def _lower(items: Iterable[tuple[str, str]]) -> dict[str, str]:
    return {k.lower(): v for k, v in items}


def wait_for(
    what: str,
    condition: Callable[[], bool],
    timeout: float,
    logs: Iterable[Path] = (),
    alive: Callable[[], str | None] = lambda: None,
) -> None:
    """Poll `condition` until it holds; past `timeout` (or when `alive` names a dead process)
    raise with the tails of `logs`."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            if condition():
                return
        except OSError:
            pass  # not listening yet
        died = alive()
        if died is not None or time.monotonic() > deadline:
            reason = died or f"not within {timeout:.0f} s"
            tails = "\n".join(f"--- {p} ---\n{tail(p)}" for p in logs)
            raise AssertionError(f"{what}: {reason}\n{tails}")
        time.sleep(POLL_S)


@dataclass(slots=True)
class Replica:
    """One `python -m vllm.entrypoints.openai.api_server` process on a fixed port."""

    model: Path
    log: Path
    port: int = field(default_factory=free_port)
    max_loras: int = 3
    api_key: str | None = TOKEN  # None: no --api-key (the routing bench's peers send none)
    extra: tuple[str, ...] = ()
    process: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Start the server (again, on the same port, after a kill); returns at once."""
        assert self.process is None or self.process.poll() is not None, "already running"
        self.starts += 1
        command = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *(("--api-key", self.api_key) if self.api_key else ()),
            "--max-loras",
            str(self.max_loras),
            *REPLICA_FLAGS,
            *self.extra,
        ]
        with self.log.open("ab") as out:
            out.write(f"\n=== start {self.starts}: {' '.join(command)}\n".encode())
            out.flush()
            self.process = subprocess.Popen(
                command,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **REPLICA_ENV},
                start_new_session=True,  # its engine core is a child: kill the whole group
            )

    def died(self) -> str | None:
        if self.process is not None and self.process.poll() is not None:
            return f"replica on port {self.port} exited with {self.process.returncode}"
        return None

    def healthy(self) -> bool:
        return http("GET", self.url + "/health", timeout=5).status == 200

    def wait_healthy(self, timeout: float = REPLICA_START_S) -> None:
        wait_for(f"replica {self.url} /health", self.healthy, timeout, [self.log], self.died)

    def kill(self) -> None:
        """SIGKILL the server and its engine process (a crash, not a shutdown)."""
        if self.process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.kill()

    # Direct calls, bypassing the router (what a replica itself holds).
    def get(self, path: str) -> Answer:
        return http("GET", self.url + path, token=TOKEN)

    def post(self, path: str, body: Any = None) -> Answer:
        return http("POST", self.url + path, body, token=TOKEN)

    def log_size(self) -> int:
        """Where its log ends now: what a test reads from to see only its own time."""
        return self.log.stat().st_size if self.log.exists() else 0

    def adapters(self) -> dict[str, str]:
        """Adapter name -> root (lora_path), from the replica's own /v1/models."""
        cards = self.get("/v1/models").json()["data"]
        return {c["id"]: c["root"] for c in cards[1:]}

    def metric(self, name: str) -> float:
        """The sum of a Prometheus counter's samples on this replica's /metrics."""
        text = http("GET", self.url + "/metrics", token=TOKEN).text
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total


def start_replicas(replicas: list[Replica]) -> None:
    """Start every replica at once and wait until all answer /health (bounded)."""
    for replica in replicas:
        replica.start()
    for replica in replicas:
        replica.wait_healthy()


LISTENING = re.compile(r"lora-router listening on [^:\s]+:(\d+)")


@dataclass(slots=True)
class Router:
    """The `lora-router` command in front of replicas, token from the environment."""

    log: Path
    process: subprocess.Popen[bytes]
    port: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> Answer:
        return http("GET", self.url + path)

    def post(self, path: str, body: Any = None, timeout: float = 120.0) -> Answer:
        return http("POST", self.url + path, body, timeout=timeout)

    def replicas(self) -> list[dict[str, Any]]:
        answer: list[dict[str, Any]] = self.get("/router/replicas").json()["replicas"]
        return answer

    def kill(self) -> None:
        """SIGKILL: the router dies with no chance to clean up (a preemption)."""
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)


def router_command(replicas: Iterable[Replica], *flags: str) -> list[str]:
    urls = ",".join(r.url for r in replicas)
    return [str(BIN / "lora-router"), "--replicas", urls, "--token-env", TOKEN_ENV, *flags]


def start_router(replicas: list[Replica], log: Path, *flags: str) -> Router:
    """`lora-router --replicas ... --token-env ... --port 0 FLAGS`, waited on until /health."""
    return _launch(router_command(replicas, "--port", "0", "--log-level", "info", *flags), log)


def start_router_as_user(replicas: list[Replica], log: Path, port: int, *flags: str) -> Router:
    """The command the guide gives, on a fixed port (a restarted router is found where the
    trainer expects it): `python -m lora_router --replicas ... --token-env ... --port P`."""
    urls = ",".join(r.url for r in replicas)
    command = [sys.executable, "-m", "lora_router", "--replicas", urls, "--token-env", TOKEN_ENV]
    return _launch([*command, "--port", str(port), *flags], log)


def _launch(command: list[str], log: Path) -> Router:
    """Start the router, its output appended to `log`, and wait until it listens and its
    /health answers 200. Its port is read from what this process wrote: a log that already
    holds an earlier router's "listening" line names a port no longer served."""
    out = log.open("ab")
    start = out.tell()  # appending: the end of what earlier processes wrote
    process = subprocess.Popen(
        command, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, TOKEN_ENV: TOKEN}
    )
    out.close()
    router = Router(log=log, process=process)

    def listening() -> bool:
        with log.open("rb") as written:
            written.seek(start)
            match = LISTENING.search(written.read().decode(errors="replace"))
        if match:
            router.port = int(match.group(1))
        return match is not None

    def died() -> str | None:
        code = process.poll()
        return None if code is None else f"lora-router exited with {code}"

    try:
        wait_for("lora-router listening", listening, 30, [log], died)
        wait_for("lora-router /health", lambda: router.get("/health").status == 200, 60, [log])
    except AssertionError:
        router.stop()
        raise
    return router


def run_check(replicas: Iterable[Replica], *flags: str) -> subprocess.CompletedProcess[str]:
    """`lora-router --check` against the replicas, as a user runs it."""
    return subprocess.run(
        router_command(replicas, "--check", *flags),
        env={**os.environ, TOKEN_ENV: TOKEN},
        capture_output=True,
        text=True,
        timeout=120,
    )
