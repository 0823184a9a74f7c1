"""Routing quality: prefix-cache hit rate, sibling affinity, balance and wall time of routers
in front of N emulated vLLM replicas, on GRPO-shaped traces, against an oracle.

    python bench/routing.py                  # every trace, router and replica count, once
    python bench/routing.py --repeat 3       # the wall-time contenders 3 times, medians
    python bench/routing.py --quick          # a smaller trace, for a smoke test
    python bench/routing.py --traces multi-turn --replicas 8 --routers lr-prefix \\
        --load-factor 0.5 --out /tmp/routing  # an investigation run, results elsewhere

Workload. `bench/grpo_trace.py` generates what TRL 1.16's async GRPO rollout worker sends: S
problems per step, each sent G = 8 times (siblings), token-id prompts that start with a shared
template, a random 63-bit `seed` per request (TRL's `random.getrandbits(63)`), a new adapter
version `trl-policy-vN` every step. Seven traces, each with 2, 3 and 8 replicas: `single-turn`
(a 23-token chat template), `system-300` and `system-1000` (a shared system prompt of 300 /
1,000 tokens), `multi-turn` (3 turns: a sample's next prompt is its previous prompt + its
completion + a tool message, sent only once the previous turn has answered, every turn of a
rollout under one version), and three *pipelined* 3-turn traces, where new rollouts start while
older ones are in later turns and every request names the version current when it is sent (a
new version every round, so each rollout spans three versions and the syncs land during
rollouts, as TRL's `_request_model` does): `multi-turn-sync` (turns appended), `chat-rerender`
(every turn re-rendered through a Qwen3-shaped chat template, as `_generate_one` and the OpenEnv
harness's `_sample_turn` do: the previous prompt's generation-prompt stub is dropped and the
completion re-tokenized) and `long-tail` (re-rendered, completions log-normal up to 3,000
tokens). A trace grows with the fleet (S = 8 N problems per step single-turn, 4 N multi-turn,
2 N pipelined; 3 steps), so every replica count gets the same work and the same number of
families per replica. Requests go out in trace order with at most 64 N in flight: a later turn
becomes eligible when its parent has answered, and the lowest-indexed eligible request goes
first. Each request carries `max_tokens` = the trace's completion length and `ignore_eos`, so
every replica generates the same completion for it; a later turn's prompt carries that very
completion (predicted with the emulator's own deterministic generator, checked against the
answer's `token_ids`, which only multi-turn requests ask for), so its KV is what the next turn
reuses, as on vLLM. Every router in a naming mode receives byte-identical requests.

Two naming modes. *LoRA* (as TRL): requests name `trl-policy-vN`; before the first request of
version N the bench syncs through the router exactly as TRL does: `POST /pause?mode=keep`,
`/v1/load_lora_adapter`, `/resume`, unload `v(N-5)` (v1 is loaded before the clock starts).
Only lora-router and the oracle can do this. *Base*: requests name the base model and there are
no syncs; the peers run only this way (they cannot broadcast adapter loads), and so does a
second lora-router prefix run, for a like-for-like comparison. Hit rates are compared only
within a mode (base mode shares the template across steps; LoRA mode never across versions).

Replicas: N `lora_router.emulator` replicas in one subprocess pinned to core 1, alone; the
router under test and this load generator on core 0 (the load generator costs the same for
every router; pinning it with the replicas made 8-replica runs CPU-bound on core 1). Timing
model: a replica runs one sequence at a time (`max_num_seqs` 1: a replica is a server with a
queue, so its busy time is the sum of its service times and the busiest replica finishes
last), 100 us per *uncached* prompt token, 50 us per generated token, a prefix cache of 4,096
blocks of 16 tokens with LRU eviction. A request whose prefix is cached costs ~4-10 ms; missing
a 1,000-token system prompt adds 100 ms, so cache hits and balance decide the wall time. The
emulator sleeps in steps of at least 2 ms and asyncio timers overshoot by up to 1 ms, which
adds a few ms per request to the measured times (the same for every router). Emulators are
restarted (fresh caches, counters and adapters) before every run. The machine is shared: wall
times vary by about 10 % from run to run, hence `--repeat` (interleaved rounds, medians) and
the noise-free *makespan* (the busiest replica's modeled service time) next to wall time.

The oracle, the theoretical maximum. A tiny proxy in this file (`serve-oracle`, aiohttp, also
on core 0) pins every prompt family — a problem's first-turn prompt, all G samples of it, and
all their later turns — to one replica, the families dealt out evenly: the first request of a
new family (read from the `x-bench-family` header, which the bench sends with every request)
goes to the next replica in round-robin order, and the family stays there. Control routes
(pause, resume, load, unload) are broadcast to every replica. The oracle replays the very same
requests through the same emulators and timing, so every sibling after the first and every
later turn finds its whole prefix cached, and each replica computes each template once per
version: no router does better without loading some replica with more families than others.
(A router could edge past it only through LRU evictions, rare with 4,096 blocks, or by keeping
a template on fewer replicas.) Figures are ratios to the oracle of the same trace, replica
count and mode (its median over repeats).

Measured per run (trace, replicas, router; the oracle's figures are reported beside each):
- hit rate: prefix-cache hits / queries in tokens, summed over the replicas' `/metrics`
  (`vllm:prefix_cache_hits` / `vllm:prefix_cache_queries`), and its fraction of the oracle's;
- siblings on majority: the share of first-turn samples that ran on their group's most used
  replica; turns on parent: the share of later turns that ran where their previous turn ran
  (the targets except one later turn per spill lora-router counted in its /metrics);
- max/mean requests per replica; time-weighted in-flight max/mean (∫ max over replicas of the
  requests in flight / ∫ their mean, from each request's send and answer times here); max/mean
  busy time and makespan (busy time: the replica's modeled service time, uncached prompt
  tokens x prefill cost + generated tokens x decode cost, from each answer's `usage`);
- wall time from the first request to the last answer (LoRA syncs included), failed requests,
  CPU seconds of the router, the replicas and the load generator.
Which replica served a request is read on the replicas: the replica host keeps the `seed` of
every completion each emulator receives (it replaces the emulator's request log,
`Emulator.requests`), so routers that add no header are measured like the others; lora-router's
`x-lora-router-replica` header is checked against it (`header_mismatches`).

Trace seeds: a trace is one draw of problems, samples and completion lengths, and with a
router that places deterministically one draw decides how evenly the work falls (bench/replay.py
moves the makespan by up to ±5 % between seeds). `--seeds 0-4` runs every contender on each
seed (each repeated `--repeat` times), pools the figures and pairs the wall times run by run.
Read wall times at 8 replicas with care: there both cores are 65-80 % busy (the replica host on
core 1; the router and this load generator on core 0), the wall time is about 2.5 times the
makespan, and single runs of one router spread by ±10 %.

Investigation aids: `--load-factor` and `--load-slack` are passed to lora-router; `--lr-source`
runs lora-router from another source tree (the base commit's, to show a trace can fail);
`--alt-source` runs the `lr-prefix-alt` and `lr-prefix-base-alt` contenders from another tree
next to lora-router itself, interleaved in one run (an A/B of two revisions);
`--prefill-us`, `--decode-us`, `--max-num-seqs`, `--cache-blocks` change the timing model.

Outputs: bench/results/routing.json (every run and the summaries), routing.md (tables, the
command, the date), routing.png (hit rate as a fraction of the oracle's, one panel per trace).
Only 127.0.0.1 is used; every child process is stopped on exit; every request has a timeout
(120 s) and every run a deadline (`--deadline`, 600 s).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import heapq
import itertools
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import IO, Any

import aiohttp
import orjson
from aiohttp import web

from lora_router.emulator import EmulatorConfig, start_emulator, write_adapter
from lora_router.emulator.control import RecordedRequest
from lora_router.emulator.tokens import generate as emulator_generate

HERE = Path(__file__).resolve().parent
PEERS_BIN = HERE / ".peers" / "bin"
MODEL = "Qwen/Qwen2.5-Math-1.5B"
REPLICA_HEADER = "x-lora-router-replica"
FAMILY_HEADER = "x-bench-family"
ROUTER_CPUS = "0"  # the router under test (and this load generator)
REPLICA_CPUS = "1"  # the emulated replicas, alone
CLIENT_CPUS = "0"
MAX_STALENESS = 4  # TRL's default: unload v(N-5) after loading vN
REQUEST_TIMEOUT_S = 120.0
START_TIMEOUT_S = 30.0
TARGET_FRACTION = 0.995
TARGET_BALANCE = 1.05  # max/mean requests per replica
TARGET_FOLLOW = 0.99  # later turns on their previous turn's replica (spills excepted)
TARGET_IN_FLIGHT = 1.10  # time-weighted in-flight max/mean, relative to the oracle's
MAX_MODEL_LEN = 16384  # three turns of up to 3,000-token completions fit
_DECISION = re.compile(r'^lora_router_routing_decisions(?:_total)?\{kind="(\w+)"\}\s+(\S+)', re.M)
_SEED = re.compile(rb'"seed"\s*:\s*(\d+)')
_METRIC = re.compile(r"^(vllm:prefix_cache_(?:queries|hits))(?:_total)?\{[^}]*\}\s+(\S+)", re.M)


sys.path.insert(0, str(HERE))  # bench/ modules, run as scripts
import grpo_trace as bench_trace  # noqa: E402
from common import find_binary, free_port, git_revision, pinned  # noqa: E402

# --- settings ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timing:
    """The emulated replicas' engine model (see the module docstring for the choice)."""

    prefill_s_per_token: float = 100e-6
    decode_s_per_token: float = 50e-6
    max_num_seqs: int = 1
    cache_blocks: int = 4096
    block_size: int = 16

    def emulator_config(self) -> EmulatorConfig:
        return EmulatorConfig(
            host="127.0.0.1",
            port=0,
            max_num_seqs=self.max_num_seqs,
            cache_blocks=self.cache_blocks,
            block_size=self.block_size,
            prefill_s_per_token=self.prefill_s_per_token,
            decode_s_per_token=self.decode_s_per_token,
            max_lora_rank=1,
            max_loras=MAX_STALENESS + 2,
            max_model_len=MAX_MODEL_LEN,
        )

    def service_s(self, uncached: int, generated: int) -> float:
        return uncached * self.prefill_s_per_token + generated * self.decode_s_per_token


@dataclass(frozen=True, slots=True)
class Scale:
    """How big each trace is, per replica of the fleet."""

    steps: int = 3
    prompts_per_replica: int = 8  # S = this x N, single-turn traces
    multi_prompts_per_replica: int = 4  # S = this x N, multi-turn
    pipelined_prompts_per_replica: int = 2  # S = this x N, the pipelined multi-turn traces
    long_tail_median: int = 100  # completion tokens, long-tail trace (log-normal, sigma 1)
    group_size: int = 8  # G
    in_flight_per_replica: int = 64  # the trainer's cap on requests in flight, x N
    completion_tokens: tuple[int, int] = (32, 128)
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Shape:
    """A trace's shape (bench/grpo_trace.py's TraceSpec fields that differ between traces)."""

    template: int  # shared template / system prompt tokens
    turns: int
    pipelined: bool = False  # TRL's async worker: turns name the version current when sent
    render: str = "append"  # append | chat (re-rendered through the chat template)
    long_tail: bool = False  # log-normal completion lengths up to LONG_TAIL_MAX

    def describe(self) -> str:
        parts = [
            f"{self.template}-token shared prefix",
            f"{self.turns} turn" + "s" * (self.turns > 1),
        ]
        if self.pipelined:
            parts.append("a weight sync every round, during rollouts")
        if self.render == "chat":
            parts.append("turns re-rendered through a chat template")
        if self.long_tail:
            parts.append(f"long-tailed completions up to {LONG_TAIL_MAX} tokens")
        return ", ".join(parts)


LONG_TAIL_MAX = 3000  # the recipe's max_completion_length
TRACES: dict[str, Shape] = {
    "single-turn": Shape(23, 1),
    "system-300": Shape(300, 1),
    "system-1000": Shape(1000, 1),
    "multi-turn": Shape(23, 3),
    "multi-turn-sync": Shape(23, 3, pipelined=True),
    "chat-rerender": Shape(23, 3, pipelined=True, render="chat"),
    "long-tail": Shape(23, 3, pipelined=True, render="chat", long_tail=True),
}


def trace_spec(name: str, replicas: int, scale: Scale) -> Any:
    shape = TRACES[name]
    per_replica = scale.multi_prompts_per_replica if shape.turns > 1 else scale.prompts_per_replica
    return bench_trace.TraceSpec(
        steps=scale.steps,
        prompts_per_step=per_replica * replicas,
        group_size=scale.group_size,
        template_tokens=shape.template,
        turns=shape.turns,
        completion_tokens=(16, LONG_TAIL_MAX) if shape.long_tail else scale.completion_tokens,
        version_every=1,
        seed=scale.seed,
        pipelined=shape.pipelined,
        render=shape.render,
        long_tail=shape.long_tail,
        long_tail_median=scale.long_tail_median,
    )


@dataclass(frozen=True, slots=True)
class Contender:
    key: str
    label: str
    kind: str  # oracle | lora-router | vllm-router | sglang-router
    policy: str
    base: bool  # requests name the base model (no adapter syncs)
    alt: bool = False  # lora-router run from --alt-source (an A/B of two revisions in one run)


CONTENDERS = (
    Contender("oracle", "oracle (families pinned)", "oracle", "", False),
    Contender("lr-prefix", "lora-router prefix", "lora-router", "prefix", False),
    Contender("lr-round-robin", "lora-router round-robin", "lora-router", "round-robin", False),
    Contender("lr-least-loaded", "lora-router least-loaded", "lora-router", "least-loaded", False),
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


@dataclass(frozen=True, slots=True)
class RouterOptions:
    """lora-router flags under investigation (defaults: the router's own)."""

    load_factor: float | None = None
    load_slack: int | None = None
    source: Path | None = None  # run lora-router from this source tree (another revision)
    alt_source: Path | None = None  # the tree the *-alt contenders run from


# --- workload ------------------------------------------------------------------------------


@dataclass(slots=True)
class Item:
    """One request of a run, its body rendered once."""

    index: int
    seed: int  # the request's `seed` (TRL's random.getrandbits(63)): how replicas name it
    family: int
    turn: int
    parent: int | None
    version: int
    prompt_len: int
    body: bytes
    expected: list[int] | None  # the completion the replicas will generate (multi-turn)


def build_workload(spec: Any, base: bool) -> list[Item]:
    """The trace's requests as sent: later turns carry the completion the replicas generate."""

    def complete(model: str, prompt: list[int], seed: int, max_tokens: int) -> list[int]:
        if spec.turns == 1:
            return []  # no later turn reads it
        # The emulator's generator: a pure function of (model, prompt, seed, index).
        sample = emulator_generate(
            MODEL if base else model,
            prompt,
            seed=seed,
            index=0,
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        return sample.token_ids

    items: list[Item] = []
    for r in bench_trace.generate(spec, complete):
        body = {
            "model": MODEL if base else r.model,
            "prompt": r.tokens,
            "max_tokens": r.completion_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "n": 1,
            "seed": r.seed,
            "ignore_eos": True,
        }
        expected = r.completion if spec.turns > 1 else None
        if expected is not None:
            body["return_token_ids"] = True  # to check that the next turn carries this output
        items.append(
            Item(
                index=r.index,
                seed=r.seed,
                family=r.family,
                turn=r.turn,
                parent=r.parent,
                version=int(r.model.removeprefix(spec.model_prefix)),
                prompt_len=len(r.tokens),
                body=orjson.dumps(body),
                expected=expected,
            )
        )
    if len({item.seed for item in items}) != len(items):
        raise RuntimeError("two requests drew one seed; the replicas could not tell them apart")
    return items


# --- the replica host (a subprocess) -------------------------------------------------------


class SeedLog(list[RecordedRequest]):
    """Stands in for `Emulator.requests`: keeps only the seed of each completion received."""

    def __init__(self) -> None:
        super().__init__()
        self.seeds: list[int] = []

    def append(self, record: RecordedRequest) -> None:
        if record.method == "POST" and record.path.startswith("/v1/completions"):
            found = _SEED.search(record.body)
            self.seeds.append(int(found.group(1)) if found else -1)


async def serve_replicas(count: int, timing: Timing) -> None:
    """`serve-replicas`: N emulators in this process; commands on stdin, answers on stdout
    (one JSON line each): `reset` restarts them all (fresh caches, counters, adapters),
    `dump` returns the seeds each one received since, `quit` stops."""
    emulators = [await start_emulator(timing.emulator_config()) for _ in range(count)]
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
            elif line == "dump":
                answer({"seeds": [log.seeds for log in logs]})
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
            str(Path(__file__).resolve()),
            "serve-replicas",
            str(count),
            json.dumps(asdict(timing)),
        ]
        proc = await asyncio.create_subprocess_exec(
            *pinned(argv, REPLICA_CPUS),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
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


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (all its threads)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peer_binary(name: str) -> str | None:
    return find_binary(name, PEERS_BIN)


def router_argv(c: Contender, port: int, urls: list[str], options: RouterOptions) -> list[str]:
    if c.kind == "oracle":
        return [sys.executable, str(Path(__file__).resolve()), "serve-oracle", str(port), *urls]
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
        return cpu_seconds(self.proc.pid)

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
        """Send every item, in trace order among the eligible ones, at most `in_flight_cap`
        at a time; a later turn becomes eligible when its parent has answered. Returns the
        wall time."""
        children: dict[int, list[int]] = {}
        ready: list[int] = []
        for item in self.items:
            if item.parent is None:
                ready.append(item.index)
            else:
                children.setdefault(item.parent, []).append(item.index)
        heapq.heapify(ready)
        by_index = {item.index: item for item in self.items}
        wake = asyncio.Event()
        running = 0
        tasks: set[asyncio.Task[None]] = set()

        async def one(item: Item) -> None:
            nonlocal running
            try:
                self.outcomes[item.index] = await self.send(item)
            finally:
                running -= 1
                for child in children.get(item.index, ()):
                    heapq.heappush(ready, child)
                wake.set()

        start = time.perf_counter()
        deadline = start + self.deadline_s
        while len(self.outcomes) < len(self.items):
            while ready and running < self.in_flight_cap:
                item = by_index[heapq.heappop(ready)]
                while self.adapters is not None and item.version > self.loaded:
                    await self.sync(self.loaded + 1)
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
        for item in self.items:
            self.outcomes.setdefault(item.index, Outcome(error="not sent before the deadline"))
        return wall


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
                host_cpu, own_cpu = cpu_seconds(host.proc.pid), time.process_time()
                result.wall_s = round(await run.replay(), 3)
                result.router_cpu_s = round(router.cpu_seconds(), 3)
                result.replica_cpu_s = round(cpu_seconds(host.proc.pid) - host_cpu, 3)
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


# --- reporting -----------------------------------------------------------------------------


def fill_oracle_fractions(results: list[RunResult]) -> None:
    """Each run's hit rate over the oracle's (median over its repeats) on the same trace, trace
    seed, replica count and naming mode."""
    oracle: dict[tuple[str, int, str, int], list[float]] = {}
    for r in results:
        if r.contender.startswith("oracle") and r.status == "ok":
            oracle.setdefault((r.trace, r.replicas, r.mode, r.seed), []).append(r.hit_rate)
    for r in results:
        rates = oracle.get((r.trace, r.replicas, r.mode, r.seed))
        if r.status == "ok" and rates:
            r.of_oracle = r.hit_rate / statistics.median(rates)


def aggregate(results: list[RunResult]) -> list[RunResult]:
    """One summary per (trace, replicas, contender), over its repeats and trace seeds: the run
    with the median wall time, with the median hit rate and fraction of the oracle, and the
    worst of each."""
    groups: dict[tuple[str, int, str], list[RunResult]] = {}
    for r in results:
        groups.setdefault((r.trace, r.replicas, r.contender), []).append(r)
    summaries = []
    for runs in groups.values():
        ok = [r for r in runs if r.status == "ok"]
        if not ok:
            summaries.append(replace(runs[0], repeats=len(runs)))
            continue
        middle = sorted(ok, key=lambda r: r.wall_s)[(len(ok) - 1) // 2]
        fractions = [r.of_oracle for r in ok if r.of_oracle is not None]
        summaries.append(
            replace(
                middle,
                hit_rate=statistics.median(r.hit_rate for r in ok),
                of_oracle=statistics.median(fractions) if fractions else None,
                failed=sum(r.failed for r in runs),
                requests=sum(r.requests for r in runs),
                repeats=len(runs),
                wall_range_s=[min(r.wall_s for r in ok), max(r.wall_s for r in ok)],
                worst_of_oracle=min(fractions) if fractions else None,
                worst_max_mean_requests=max(r.max_mean_requests for r in ok),
                worst_in_flight_balance=max(r.in_flight_balance for r in ok),
                worst_follow=min(follows) if (follows := _follows(ok)) else None,
                wall_by_run={f"{r.seed}:{r.round}": r.wall_s for r in ok},
                median_makespan_s=statistics.median(r.makespan_s for r in ok),
            )
        )
    return summaries


def _follows(runs: list[RunResult]) -> list[float]:
    return [f for r in runs if (f := follow_rate(r)) is not None]


def _f(value: float | None, digits: int = 3) -> str:
    if value is None or value != value:  # None or NaN
        return "—"
    return f"{value:.{digits}f}"


def _by(results: list[RunResult]) -> dict[tuple[str, int, str], RunResult]:
    return {(r.trace, r.replicas, r.contender): r for r in results}


TARGET_HEADER = [
    "trace",
    "N",
    "of oracle, LoRA",
    "of oracle, base",
    "turns followed (spills)",
    "max/mean req",
    "in flight: ours / oracle's",
    "wall s, base",
    "best peer wall s",
    "wall: ours / peer's, paired",
    "makespan s: ours / peer's",
    "met",
]


def _wall(r: RunResult) -> str:
    if r.repeats > 1 and r.wall_range_s:
        return f"{r.wall_s:.2f} [{r.wall_range_s[0]:.2f}-{r.wall_range_s[1]:.2f}]"
    return f"{r.wall_s:.2f}"


def paired_wall(ours: RunResult, peer: RunResult) -> list[float]:
    """Our wall time over the peer's, run by run: the same trace seed, the same interleaved
    round (so the same spell of the machine), which the medians of `_wall` do not pair."""
    both = ours.wall_by_run.keys() & peer.wall_by_run.keys()
    return sorted(ours.wall_by_run[k] / peer.wall_by_run[k] for k in both if peer.wall_by_run[k])


def _ratios(ratios: list[float]) -> str:
    if not ratios:
        return "—"
    if len(ratios) == 1:
        return f"{ratios[0]:.3f}"
    return f"{statistics.median(ratios):.3f} [{ratios[0]:.3f}-{ratios[-1]:.3f}]"


def _ok(r: RunResult | None) -> RunResult | None:
    return r if r is not None and r.status == "ok" else None


def targets(summaries: list[RunResult], traces: list[str], counts: list[int]) -> list[list[str]]:
    """One row per (trace, replicas): lora-router prefix against the issue's targets, both
    naming modes. Hit fractions, follow rates and balance are the worst over repeats, wall times
    medians [range] over repeats and trace seeds; a wall time above the best peer's median but
    inside its range is a tie within the noise (≈). Beside them, the paired ratios (`paired_wall`):
    median [range]. In-flight balance: the worst over repeats and trace seeds against the
    oracle's worst of the same mode (the oracle runs every seed, and the seed decides how
    evenly the work falls, so the oracle's run with the median wall time is no yardstick)."""
    by = _by(summaries)
    rows = []
    for trace in traces:
        for n in counts:
            if not any(r.trace == trace and r.replicas == n for r in summaries):
                continue  # a pooled or partial run that has no such cell
            lora, base = (
                _ok(by.get((trace, n, "lr-prefix"))),
                _ok(by.get((trace, n, "lr-prefix-base"))),
            )
            oracles = {
                "lr-prefix": _ok(by.get((trace, n, "oracle"))),
                "lr-prefix-base": _ok(by.get((trace, n, "oracle-base"))),
            }
            ours = [r for r in (lora, base) if r is not None]
            peers = [
                r
                for key in ("vllm-ch", "vllm-ca", "sglang-ca")
                if (r := _ok(by.get((trace, n, key)))) is not None and not r.failed
            ]
            best = min(peers, key=lambda r: r.wall_s) if peers else None
            fracs = [r.worst_of_oracle for r in ours if r.worst_of_oracle is not None]
            balance = [r.worst_max_mean_requests for r in ours]
            follows = [r.worst_follow for r in ours if r.worst_follow is not None]
            spills = sum(r.spills or 0 for r in ours)
            flights = []
            for r in ours:
                oracle = oracles[r.contender]
                if oracle is not None:
                    flights.append((r.worst_in_flight_balance, oracle.worst_in_flight_balance))
            hit = "✓" if fracs and min(fracs) >= TARGET_FRACTION else "✗"
            bal = "✓" if balance and max(balance) <= TARGET_BALANCE else "✗"
            fol = "✓" if not follows or min(follows) >= TARGET_FOLLOW else "✗"
            fly = "✓" if flights and all(o <= TARGET_IN_FLIGHT * b for o, b in flights) else "✗"
            if best is None or base is None:
                wall = "✓" if best is None else "✗"
            elif base.wall_s <= best.wall_s:
                wall = "✓"
            else:
                low = base.wall_range_s[0] if base.wall_range_s else base.wall_s
                high = best.wall_range_s[1] if best.wall_range_s else best.wall_s
                wall = "≈" if low <= high else "✗"
            makespan = f"{base.makespan_s:.2f} / {best.makespan_s:.2f}" if base and best else "—"
            rows.append(
                [
                    trace,
                    str(n),
                    _f(lora.worst_of_oracle if lora else None),
                    _f(base.worst_of_oracle if base else None),
                    f"{_f(min(follows) if follows else None)} ({spills})",
                    _f(max(balance) if balance else None, 2),
                    " · ".join(f"{o:.2f} / {b:.2f}" for o, b in flights) or "—",
                    _wall(base) if base else "—",
                    f"{_wall(best)} ({best.label})" if best else "—",
                    _ratios(paired_wall(base, best)) if base and best else "—",
                    makespan,
                    f"{hit}hits {fol}turns {bal}balance {fly}in-flight {wall}wall",
                ]
            )
    return rows


def md_table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def compact(results: list[RunResult], traces: list[str], counts: list[int]) -> list[list[str]]:
    """The anchors' shape: fraction of the oracle per trace (2/3/8 replicas), worst balance."""
    by = _by(results)
    rows = []
    for c in CONTENDERS:
        runs = [r for r in results if r.contender == c.key]
        if not runs:
            continue
        if all(r.status != "ok" for r in runs):
            label = f"{c.label} ({'base' if c.base else 'LoRA'})"
            rows.append([label, runs[0].status, *[""] * len(traces)])
            continue
        cells = []
        for trace in traces:
            found = [by.get((trace, n, c.key)) for n in counts]
            cells.append(" / ".join(_f(r.of_oracle if r else None, 3) for r in found))
        balance = [r.worst_max_mean_requests for r in runs if r.status == "ok"]
        rows.append(
            [
                f"{c.label} ({'base' if c.base else 'LoRA'})",
                *cells,
                _f(max(balance) if balance else None, 2),
            ]
        )
    return rows


DETAIL_HEADER = [
    "N",
    "router (mode)",
    "runs",
    "hit rate",
    "of oracle",
    "siblings on majority",
    "turns on parent",
    "spills",
    "max/mean req",
    "in flight max/mean",
    "max/mean busy",
    "makespan s",
    "wall s",
    "router CPU s",
    "failed",
]


def detail_rows(summaries: list[RunResult], trace: str) -> list[list[str]]:
    order = [c.key for c in CONTENDERS]
    rows = []
    for r in sorted(
        (r for r in summaries if r.trace == trace),
        key=lambda r: (r.replicas, order.index(r.contender)),
    ):
        head = [str(r.replicas), f"{r.label} ({r.mode})", str(r.repeats)]
        if r.status != "ok":
            rows.append([*head, r.status, *[""] * (len(DETAIL_HEADER) - 4)])
            continue
        rows.append(
            [
                *head,
                _f(r.hit_rate),
                _f(r.of_oracle),
                _f(r.siblings_on_majority),
                _f(r.continuations_on_parent),
                "—" if r.spills is None else str(r.spills),
                _f(r.worst_max_mean_requests, 2),
                _f(r.worst_in_flight_balance, 2),
                _f(r.max_mean_busy, 2),
                _f(r.makespan_s, 2),
                _wall(r),
                _f(r.router_cpu_s, 1),
                f"{r.failed}/{r.requests}",
            ]
        )
    return rows


def write_markdown(
    path: Path,
    summaries: list[RunResult],
    meta: dict[str, Any],
    traces: list[str],
    counts: list[int],
) -> None:
    t = meta["timing"]
    s = meta["scale"]
    parts = [
        "# Routing quality (bench/routing.py)",
        "",
        f"Made {meta['date']} by `{meta['command']}` in {meta['elapsed_s'] / 60:.1f} min "
        f"on {os.cpu_count()} cores (git {meta['git']}).",
        "",
        "Method (details in the docstring of bench/routing.py): GRPO-shaped traces from "
        f"bench/grpo_trace.py (G = {s['group_size']}, S = {s['prompts_per_replica']} N problems "
        "per "
        f"step single-turn, {s['multi_prompts_per_replica']} N multi-turn, "
        f"{s['pipelined_prompts_per_replica']} N on the pipelined traces, {s['steps']} steps, "
        "a new adapter version every step (every round of turns on the pipelined traces, whose "
        "rollouts span versions), a random 63-bit seed per request as TRL draws it, at most "
        f"{s['in_flight_per_replica']} N requests in flight, completions of "
        f"{s['completion_tokens'][0]}-{s['completion_tokens'][1]} tokens, long-tail: "
        f"log-normal, median {s['long_tail_median']}, up to {LONG_TAIL_MAX}) replayed through "
        "each router to N emulated replicas (max_num_seqs "
        f"{t['max_num_seqs']}, {t['prefill_s_per_token'] * 1e6:.0f} µs per uncached prompt "
        f"token, {t['decode_s_per_token'] * 1e6:.0f} µs per generated token, a "
        f"{t['cache_blocks']}-block LRU prefix cache of {t['block_size']}-token blocks). The "
        "replicas run in one subprocess pinned to core 1; the router under test and the load "
        "generator share core 0. *Of oracle* is the prefix-cache hit rate (tokens, from the "
        "replicas' /metrics) divided by the oracle's on the same trace, replica count and naming "
        "mode. The oracle is a proxy that pins every prompt family (a problem's samples and all "
        "their later turns) to one replica, families dealt out round robin in arrival order, "
        "replaying the same requests through the same emulators. *LoRA*: requests name "
        "`trl-policy-vN`, synced through the router as TRL does (pause keep, load, resume, "
        "unload v(N-5)); *base*: requests name the base model (the peers cannot load adapters). "
        f"Runs repeated {meta['repeat']} times (interleaved): "
        f"{', '.join(meta['repeated']) or 'none'}; others once"
        + (
            f"; every contender on each of the trace seeds {meta['seeds'][0]}-{meta['seeds'][-1]}, "
            "the figures pooled over them (the oracle's fraction taken per seed)."
            if len(meta.get("seeds", [0])) > 1
            else "."
        ),
        "",
        "## lora-router (prefix) against the targets",
        "",
        f"Targets: ≥ {TARGET_FRACTION:.1%} of the oracle's hit rate (worst over repeats, both "
        f"modes); ≥ {TARGET_FOLLOW:.0%} of later turns on their previous turn's replica, spills "
        "under the load cap excepted (worst, both modes; in brackets the spills of both modes); "
        f"max/mean requests per replica ≤ {TARGET_BALANCE:.2f} (worst); time-weighted in-flight "
        f"max/mean ≤ {TARGET_IN_FLIGHT:.2f} times the oracle's of the same mode (worst over "
        "repeats and seeds; LoRA · base); "
        "wall time ≤ the best peer's (base-model runs, like for like; median [min-max] over "
        "repeats, ≈: above the peer's median but inside its range; *paired*: ours over the "
        "peer's run by run, same seed and round, median [min-max]). *Makespan* is the busiest "
        "replica's modeled service time, the part of the wall time that routing decides, free "
        "of the machine's noise.",
        "",
        md_table(TARGET_HEADER, targets(summaries, traces, counts)),
        "",
        "## Fraction of the oracle's hit rate, 2 / 3 / 8 replicas (medians)",
        "",
        md_table(["router", *traces, "worst max/mean req"], compact(summaries, traces, counts)),
        "",
        "![hit rate as a fraction of the oracle's](routing.png)",
        "",
    ]
    for trace in traces:
        parts += [
            f"## {trace} ({TRACES[trace].describe()})",
            "",
            md_table(DETAIL_HEADER, detail_rows(summaries, trace)),
            "",
        ]
    parts += [
        "Columns: *siblings on majority* — share of first-turn samples on their group's most "
        "used replica; *turns on parent* — share of later turns sent where their previous turn "
        "ran (all of them; spills not excepted); *spills* — lora-router's spill decisions (a "
        "home over the load cap), from its /metrics; *max/mean req* — worst over repeats; "
        "*in flight max/mean* — ∫ max over replicas of requests in flight dt / ∫ their mean dt "
        "over the run, from each request's send and answer times here, worst over repeats; "
        "*busy* — a replica's modeled service time "
        "(uncached prompt tokens x prefill cost + generated tokens x decode cost, from each "
        "answer's usage); *makespan* — the largest busy time (of several runs: the median); "
        "*wall s* — first request to last "
        "answer, median [min-max] when repeated; *router CPU s* — user + system CPU of the "
        "router process over the run. Every run's raw figures are in routing.json.",
        "",
    ]
    path.write_text("\n".join(parts))


def write_plot(path: Path, results: list[RunResult], traces: list[str], counts: list[int]) -> None:
    """One column per trace: hit rate over the oracle's by router and replica count, on the
    full scale (top) and zoomed on the target (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = _by(results)
    shown = [c for c in CONTENDERS if any(r.contender == c.key for r in results)]
    fig, axes = plt.subplots(
        2,
        len(traces),
        figsize=(4.2 * len(traces), 7.0),
        sharey="row",
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 2]},
    )
    width = 0.8 / max(1, len(counts))
    labels = [f"{c.label} ({'base' if c.base else 'LoRA'})" for c in shown]
    for col, trace in enumerate(traces):
        for row, (low, high) in enumerate(((0.0, 1.05), (0.98, 1.002))):
            ax = axes[row][col]
            for j, n in enumerate(counts):
                xs, values = [], []
                for i, c in enumerate(shown):
                    r = by.get((trace, n, c.key))
                    if r is not None and r.of_oracle is not None:
                        xs.append(i + (j - (len(counts) - 1) / 2) * width)
                        values.append(r.of_oracle)
                ax.bar(xs, values, width, label=f"{n} replicas", color=f"C{j}")
            for i, c in enumerate(shown):
                refused = [
                    r for n in counts if (r := by.get((trace, n, c.key))) and r.status != "ok"
                ]
                if refused and row == 0:
                    ax.text(i, 0.05, refused[0].status, rotation=90, ha="center", fontsize=6)
            ax.axhline(TARGET_FRACTION, color="k", linewidth=0.8, linestyle="--")
            ax.set_ylim(low, high)
            ax.set_xticks(range(len(shown)))
            if row == 0:
                ax.set_title(trace)
                ax.set_xticklabels([])
            else:
                ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=7)
    axes[0][0].set_ylabel("hit rate / oracle's (tokens)")
    axes[1][0].set_ylabel("zoom: 0.98-1.0")
    handles, names = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, names, loc="upper right", fontsize=8, ncol=len(counts))
    fig.suptitle(
        "Prefix-cache hit rate as a fraction of the oracle's (medians; dashed: the 0.995 target)"
    )
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_json(
    path: Path, meta: dict[str, Any], summaries: list[RunResult], runs: list[RunResult]
) -> None:
    """routing.json: the meta, the summaries and every run (what `load_json` reads back)."""
    payload = {
        "meta": meta,
        "summaries": [asdict(r) for r in summaries],
        "runs": [asdict(r) for r in runs],
    }
    path.write_text(json.dumps(payload, indent=1) + "\n")


def load_json(
    paths: Sequence[Path], traces: Sequence[str], counts: Sequence[int], command: str
) -> tuple[dict[str, Any], list[RunResult]]:
    """The meta and runs of earlier runs' routing.json files (for --from-json, which `command`
    is), those of `traces` at `counts` replicas: pooled, as if one run had made them all. Runs
    of one trace, replica count, contender, trace seed and round in two files would be the same
    run twice: refused."""
    metas, runs = [], []
    for path in paths:
        data = json.loads(path.read_text())
        metas.append(data["meta"])
        runs += [
            RunResult(**r) for r in data["runs"] if r["trace"] in traces and r["replicas"] in counts
        ]
    seen = Counter((r.trace, r.replicas, r.contender, r.seed, r.round) for r in runs)
    if twice := [key for key, count in seen.items() if count > 1]:
        raise SystemExit(f"runs in more than one file: {twice[:3]} (run them on other --seeds)")
    meta = metas[0]
    if len(metas) > 1:
        meta = {
            **meta,
            "date": max(m["date"] for m in metas),
            "command": "; ".join(m["command"] for m in metas) + f"` pooled by `{command}",
            "elapsed_s": sum(m["elapsed_s"] for m in metas),
            "git": ", ".join(dict.fromkeys(m["git"] for m in metas)),
            "repeat": max(m["repeat"] for m in metas),
            "repeated": list(dict.fromkeys(c for m in metas for c in m["repeated"])),
            "seeds": sorted({s for m in metas for s in m.get("seeds", [0])}),
        }
    fill_oracle_fractions(runs)
    return meta, runs


# --- main ----------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument(
        "--traces", default=",".join(TRACES), help="comma-separated, of: " + ", ".join(TRACES)
    )
    p.add_argument("--replicas", default="2,3,8", help="comma-separated replica counts")
    p.add_argument(
        "--routers",
        default=",".join(c.key for c in CONTENDERS),
        help="comma-separated, of: " + ", ".join(c.key for c in CONTENDERS),
    )
    p.add_argument("--quick", action="store_true", help="2 steps, half the problems per step")
    p.add_argument("--repeat", type=int, default=1, help="run the --repeat-routers K times")
    p.add_argument(
        "--repeat-routers",
        default="lr-prefix-base,vllm-ch,vllm-ca",
        help="the routers --repeat applies to (default: those the wall-time target compares)",
    )
    p.add_argument("--steps", type=int, default=None)
    p.add_argument(
        "--seeds",
        default="0",
        help="trace seeds, e.g. 0-4: every contender runs every seed (--repeat times for the "
        "--repeat-routers), and the figures pool them",
    )
    p.add_argument("--load-factor", type=float, default=None, help="lora-router --load-factor")
    p.add_argument(
        "--load-slack",
        type=int,
        default=None,
        help="investigation: override the prefix policy's load_slack",
    )
    timing = Timing()
    p.add_argument(
        "--prefill-us",
        type=float,
        default=timing.prefill_s_per_token * 1e6,
        help="replica time per uncached prompt token, microseconds",
    )
    p.add_argument(
        "--decode-us",
        type=float,
        default=timing.decode_s_per_token * 1e6,
        help="replica time per generated token, microseconds",
    )
    p.add_argument("--max-num-seqs", type=int, default=timing.max_num_seqs)
    p.add_argument("--cache-blocks", type=int, default=timing.cache_blocks)
    p.add_argument("--deadline", type=float, default=600.0, help="seconds a run may last")
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="output directory (default: bench/results; with --quick, a temporary directory, so "
        "a smoke run never overwrites the committed results)",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep router and replica logs")
    p.add_argument(
        "--lr-source",
        type=Path,
        default=None,
        help="run lora-router from this source tree (e.g. `git archive` of another revision), "
        "to show how that revision does on these traces",
    )
    p.add_argument(
        "--alt-source",
        type=Path,
        default=None,
        help="the source tree the lr-prefix-alt and lr-prefix-base-alt contenders run from, so "
        "two revisions run interleaved in one run (e.g. `git archive` of the base commit)",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        nargs="+",
        default=None,
        help="only rewrite routing.md and routing.png from the runs of these routing.json files, "
        "those of --traces and --replicas (no runs; several: pooled, e.g. runs on different "
        "--seeds, and written to --out's routing.json too)",
    )
    args = p.parse_args(argv)
    if args.out is None:
        args.out = (
            Path(tempfile.mkdtemp(prefix="routing-quick-")) if args.quick else HERE / "results"
        )
    scale = Scale()
    if args.quick:
        scale = Scale(
            steps=2,
            prompts_per_replica=4,
            multi_prompts_per_replica=2,
            pipelined_prompts_per_replica=1,
        )
    if args.steps is not None:
        scale = Scale(**{**asdict(scale), "steps": args.steps})
    args.scale = scale
    args.timing = Timing(
        prefill_s_per_token=args.prefill_us * 1e-6,
        decode_s_per_token=args.decode_us * 1e-6,
        max_num_seqs=args.max_num_seqs,
        cache_blocks=args.cache_blocks,
    )
    args.trace_list = [t for t in args.traces.split(",") if t]
    args.replica_list = [int(n) for n in args.replicas.split(",") if n]
    args.router_list = [r for r in args.routers.split(",") if r]
    args.repeat_list = [r for r in args.repeat_routers.split(",") if r]
    args.seed_list = seeds_of(args.seeds)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    unknown = set(args.trace_list) - set(TRACES)
    unknown |= set(args.router_list) - {c.key for c in CONTENDERS}
    if unknown:
        p.error(f"unknown trace or router: {', '.join(sorted(unknown))}")
    alt = any(r.endswith("-alt") for r in args.router_list)
    if alt and args.alt_source is None and args.from_json is None:
        p.error("the -alt contenders need --alt-source")
    # Fractions of the oracle need the oracle of the same mode.
    wanted = {c.key: c for c in CONTENDERS if c.key in args.router_list}
    for c in list(wanted.values()):
        oracle = "oracle-base" if c.base else "oracle"
        if oracle not in wanted:
            args.router_list.append(oracle)
    args.router_list = [c.key for c in CONTENDERS if c.key in args.router_list]
    return args


def seeds_of(text: str) -> list[int]:
    """`3` or a range `0-4` (inclusive)."""
    low, _, high = text.partition("-")
    return list(range(int(low), int(high or low) + 1))


def one_line(r: RunResult) -> str:
    if r.status != "ok":
        return r.status
    return (
        f"hit {r.hit_rate:.3f} max/mean {r.max_mean_requests:.2f} "
        f"wall {r.wall_s:.2f}s failed {r.failed}"
    )


async def bench_main(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, {int(CLIENT_CPUS)})
    started = time.perf_counter()
    contenders = [c for c in CONTENDERS if c.key in args.router_list]
    skipped = [c.key for c in contenders if not available(c)]
    contenders = [c for c in contenders if available(c)]
    if skipped:
        print(f"not installed, skipped: {', '.join(skipped)}")
    workdir = Path(tempfile.mkdtemp(prefix="lora-router-routing-"))
    bench = Bench(args, workdir)
    bench.write_adapters(
        max(
            trace_spec(t, n, args.scale).versions
            for t in args.trace_list
            for n in args.replica_list
        )
    )
    results: list[RunResult] = []
    repeated = [c.key for c in contenders if c.key in args.repeat_list and args.repeat > 1]
    per_block = len(contenders) + (args.repeat - 1) * len(repeated)
    total = len(args.replica_list) * len(args.trace_list) * len(args.seed_list) * per_block
    progress = tqdm(total=total, unit="run", dynamic_ncols=True)
    try:
        for n in args.replica_list:
            with open(workdir / f"replicas-{n}.log", "ab") as log:
                host = await ReplicaHost.start(n, args.timing, log)
            try:
                for trace, seed in itertools.product(args.trace_list, args.seed_list):
                    spec = trace_spec(trace, n, replace(args.scale, seed=seed))
                    workloads = {
                        base: build_workload(spec, base) for base in {c.base for c in contenders}
                    }
                    # Repeats are interleaved, so a slow spell of the machine hits every
                    # contender rather than one.
                    for round_ in range(args.repeat):
                        for c in contenders:
                            if round_ and c.key not in repeated:
                                continue
                            tag = f"{c.key} #{round_ + 1}"
                            if len(args.seed_list) > 1:
                                tag += f" seed {seed}"
                            progress.set_description(f"{trace} N={n} {tag}")
                            result = await bench.run(host, c, trace, n, workloads[c.base])
                            result.round, result.seed = round_, seed
                            results.append(result)
                            progress.write(f"{trace:12} N={n} {tag:26} {one_line(result)}")
                            progress.update()
            finally:
                await host.close()
    finally:
        progress.close()
        if args.keep_logs:
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    fill_oracle_fractions(results)
    summaries = aggregate(results)
    elapsed = time.perf_counter() - started
    meta = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "command": "python bench/routing.py " + " ".join(shlex.quote(a) for a in args.argv),
        "elapsed_s": elapsed,
        "git": git_revision(),
        "timing": asdict(args.timing),
        "scale": asdict(args.scale),
        "router_options": {
            **asdict(RouterOptions(args.load_factor, args.load_slack)),
            "source": str(args.lr_source) if args.lr_source else None,
            "alt_source": str(args.alt_source) if args.alt_source else None,
        },
        "targets": {
            "of_oracle": TARGET_FRACTION,
            "follow": TARGET_FOLLOW,
            "max_mean_requests": TARGET_BALANCE,
            "in_flight_vs_oracle": TARGET_IN_FLIGHT,
        },
        "repeat": args.repeat,
        "repeated": repeated,
        "seeds": args.seed_list,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    write_json(args.out / "routing.json", meta, summaries, results)
    write_markdown(args.out / "routing.md", summaries, meta, args.trace_list, args.replica_list)
    write_plot(args.out / "routing.png", summaries, args.trace_list, args.replica_list)

    print()
    print(
        md_table(
            ["router", *args.trace_list, "worst max/mean req"],
            compact(summaries, args.trace_list, args.replica_list),
        )
    )
    print()
    print(md_table(TARGET_HEADER, targets(summaries, args.trace_list, args.replica_list)))
    print(f"\n{len(results)} runs in {elapsed / 60:.1f} min; results in {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    raw = list(sys.argv[1:] if argv is None else argv)
    if raw[:1] == ["serve-replicas"]:
        asyncio.run(serve_replicas(int(raw[1]), Timing(**json.loads(raw[2]))))
        return 0
    if raw[:1] == ["serve-oracle"]:
        asyncio.run(serve_oracle(int(raw[1]), raw[2:]))
        return 0
    args = parse_args(raw)
    args.argv = raw
    if args.from_json is not None:
        command = "python bench/routing.py " + " ".join(shlex.quote(a) for a in raw)
        meta, runs = load_json(args.from_json, args.trace_list, args.replica_list, command)
        summaries = aggregate(runs)
        traces = [t for t in TRACES if any(r.trace == t for r in summaries)]
        counts = sorted({r.replicas for r in summaries})
        args.out.mkdir(parents=True, exist_ok=True)
        out_json = args.out / "routing.json"
        if out_json.resolve() not in {p.resolve() for p in args.from_json}:
            write_json(out_json, meta, summaries, runs)
        write_markdown(args.out / "routing.md", summaries, meta, traces, counts)
        write_plot(args.out / "routing.png", summaries, traces, counts)
        sources = ", ".join(map(str, args.from_json))
        print(f"routing.md and routing.png rewritten in {args.out} from {sources}")
        return 0
    return asyncio.run(bench_main(args))


if __name__ == "__main__":
    sys.exit(main())
