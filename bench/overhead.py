"""Proxy overhead: lora-router against direct, nginx proxy_pass and vllm-router, in one run.

Method (the one vllm-router documents, and shared/docs/anchors.md uses): replicas that answer
at once (one nginx listening on every replica port, returning a fixed completion), closed loops
at concurrency 1 and 64 (wrk, one thread), a warm-up then a timed window. Every contender is
measured in the same run, interleaved round by round (the order of scenarios and contenders
rotates each round), and the report quotes medians over rounds with their min-max, and ratios
taken within a round. Each proxy is pinned to core 0; the replicas, wrk and this script share
core 1. The machine is shared: the report records its load average.

The requests are TRL 1.16's (`trl/experimental/async_grpo/async_rollout_worker.py`,
`_generate_one_turn`), byte for byte as aiohttp's `json=` writes them: a token-id prompt,
`max_tokens`, sampling fields, `return_token_ids`, `logprobs: 0` and a `seed` of its own on
every request. wrk builds each body in a Lua script this bench generates. Two traces:
- fresh: every request a prompt nobody has seen (its first tokens count up);
- siblings: each prompt sent as G = 8 requests in a row (a GRPO group), each with its own seed;
  one request in eight is a new prompt.
lora-router's own decision counts (`/metrics`) must show the trace it was given (nearly all
`fresh` on the fresh trace; one in eight `fresh` on the siblings trace), or the run fails.

Measured:
1. Latency and CPU, 2 replicas, siblings, concurrency 1 and 64, all five contenders: req/s,
   p50/p99, p50 added over direct (same round), proxy CPU µs per request (/proc, the whole
   process tree, during the timed window only).
2. Fleet sweep, 2/8/32/128 replicas, fresh and siblings, concurrency 64, the four proxies:
   CPU µs per request and req/s, and per round the ratio of 128 replicas to 2.
3. RSS per open stream: 500, 1,000 and 2,000 SSE streams of 4,096-token prompts held open
   through each proxy to 4 replicas that send a head and a first chunk and then hold (a small
   asyncio server this script starts); RSS before and with the streams open.
4. RSS of lora-router and vllm-router after 100k, 300k and 500k distinct 1,000-token prompts
   (lora-router's default affinity table holds 200,000), the contenders side by side, filled
   step by step in turn; `--table-base REV` adds lora-router at git revision REV, and
   `--table-only` runs this part alone and writes bench/results/table_memory.md.
Then the issue-16 targets, each marked met or not.

Contenders: direct (wrk to a replica), nginx proxy_pass (keep-alive upstreams), the floor
(bench/floor.py: the least a Python proxy on lora-router's runtime, uvloop + httptools, does per
request: pooled keep-alive upstreams, round robin, the response relayed as raw bytes; no routing,
JSON or metrics: what the runtime costs before any of lora-router's work), lora-router at
its defaults (policy prefix), vllm-router at its default policy, cache_aware, with
`--log-level warning` (its per-request INFO line costs it about a quarter of its throughput).
sglang-router is not a contender: it rejects token-id prompts on /v1/completions.

    pip install -e '.[bench]' && apt-get install nginx wrk
    python bench/overhead.py            # the full run (12 minutes before the floor joined)
    python bench/overhead.py --quick    # a smoke run, about 2 minutes (not for the record)

An A/B of two revisions: `--base-tree DIR` adds `lora-router@base`, lora-router run from the
source tree DIR (PYTHONPATH), to every window, interleaved with the others; the report then
has a per-round ratio of the two and is written as overhead-ab.md/.json. With `--fleets 2` and
`--windows-only` it is the latency and CPU windows alone:

    git archive f8cdf5c | tar -x -C /tmp/base
    python bench/overhead.py --base-tree /tmp/base --fleets 2 --windows-only

A contender that fails to start, answers an error, or is shown a trace it does not route as
such stops the run with a non-zero exit: no figure is written from a broken measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    WRK_REPORT,
    Procs,
    cpu_seconds,
    find_binary,
    free_port,
    git_revision,
    models_json,
    nginx_fleet,
    nginx_proxy,
    pinned,
    rss_kib,
    server_info_json,
    source_tree,
    wait_port,
    wrk,
)

from lora_router.emulator.config import EmulatorConfig
from lora_router.emulator.engine import Engine
from lora_router.emulator.metrics import render

T = TypeVar("T")
MODEL = "Qwen/Qwen2.5-Math-1.5B"
PROXY_CPU, LOAD_CPU = "0", "1"
GROUP = 8  # G: the requests of one prompt in the siblings trace
FLEETS = (2, 8, 32, 128)
PROMPT_TOKENS = 512
STREAM_TOKENS = 4096
STREAM_COUNTS = (500, 1000, 2000)
STREAM_REPLICAS = 4
TABLE_TOKENS = 1000
TABLE_PROMPTS = (100_000, 300_000, 500_000)
TABLE_LIMIT_S = 600  # per step: a router slower than this fails the run
WINDOW_CONTENDERS = ("direct", "nginx", "floor", "lora-router", "vllm-router")
FLOOR = Path(__file__).resolve().parent / "floor.py"
PROXIES = WINDOW_CONTENDERS[1:]
BASE = "lora-router@base"  # --base-tree: lora-router from another source tree
TRACES = {"fresh": 1, "siblings": GROUP}  # trace: requests per prompt
VARYING = 3  # leading prompt tokens that make a prompt new: the run's nonce, then its number

# The issue's targets.
FLEET_CPU_TOLERANCE = 1.10
ADDED_P50_SLACK_US = 40.0
CPU_VS_NGINX = 2.0
RPS_VS_VLLM_ROUTER = 2.0
STREAMS_RSS_MIB = 150.0


class BenchFailure(RuntimeError):
    """A contender did not serve what it was sent: the run must not report figures."""


# --- the requests -----------------------------------------------------------------------------


def trl_payload(prompt: list[int], seed: int, stream: bool) -> dict[str, object]:
    """TRL 1.16's `_generate_one_turn` payload (defaults of AsyncGRPOConfig), in its key order;
    `stream` added for the open-stream phase (TRL itself never streams)."""
    payload: dict[str, object] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "repetition_penalty": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
    }
    if stream:
        payload["stream"] = True
    payload["seed"] = seed
    return payload


@dataclass(frozen=True)
class Payload:
    """A TRL request body cut where it varies, so wrk's Lua and Python build the same bytes:
    prefix, the VARYING leading tokens, rest (the fixed tokens and the sampling fields), the
    seed, suffix."""

    tokens: int
    prefix: str
    rest: str
    suffix: str

    @classmethod
    def make(cls, tokens: int, stream: bool = False) -> Payload:
        text = json.dumps(trl_payload(["<P>"], 0, stream))  # type: ignore[list-item]
        before, after = text.split('["<P>"]')
        middle, suffix = after.rsplit("0", 1)  # the seed is the last field
        fixed = ", ".join(str((i * 7919) % 151_000) for i in range(VARYING, tokens))
        return cls(tokens, before + "[", ", " + fixed + "]" + middle, suffix)

    def prompt(self, nonce: int, number: int) -> list[int]:
        lead = [nonce, number % 100_000, number // 100_000]
        return lead + [(i * 7919) % 151_000 for i in range(VARYING, self.tokens)]

    def body(self, nonce: int, number: int, seed: int) -> bytes:
        lead = f"{nonce}, {number % 100_000}, {number // 100_000}"
        return (self.prefix + lead + self.rest + str(seed) + self.suffix).encode()


def check_payload() -> None:
    """The cut payload must be TRL's bytes exactly, or every figure is about another request."""
    for stream in (False, True):
        payload = Payload.make(40, stream)
        seed = random.getrandbits(63)
        wanted = json.dumps(trl_payload(payload.prompt(7, 123_456), seed, stream)).encode()
        if payload.body(7, 123_456, seed) != wanted:
            raise BenchFailure("the bench's request body is not TRL's payload")


_nonces = itertools.count(1)


def _new_script(tmp: Path, payload: Payload, kind: str) -> tuple[int, Path, str]:
    """A nonce no other script uses (its prompts are numbered under it), the script's path, and
    the Lua lines every script starts with: the payload's parts around the prompt and seed."""
    nonce = next(_nonces)
    if nonce >= 151_000:
        raise BenchFailure("out of nonces for distinct prompts")
    head = f"""
local prefix = [==[{payload.prefix}]==]
local rest = [==[{payload.rest}]==]
local suffix = [==[{payload.suffix}]==]
local headers = {{["Content-Type"] = "application/json"}}
"""
    return nonce, tmp / f"{kind}-{nonce}.lua", head


def lua_script(tmp: Path, payload: Payload, group: int) -> Path:
    """A wrk script sending `payload` with a new prompt every `group` requests and a new 63-bit
    seed on every request; prompts are numbered from 0 under a nonce no other script uses."""
    nonce, path, head = _new_script(tmp, payload, "trl")
    path.write_text(
        head
        + f"""local sent = 0
init = function(args) math.randomseed({nonce}) end
request = function()
  local n = math.floor(sent / {group})
  sent = sent + 1
  -- 18 digits: below 2^63, like random.getrandbits(63) mostly is.
  local seed = string.format("%d%09d", math.random(1, 999999999), math.random(0, 999999999))
  local body = prefix .. "{nonce}, " .. (n % 100000) .. ", " .. math.floor(n / 100000)
    .. rest .. seed .. suffix
  return wrk.format("POST", nil, headers, body)
end
{WRK_REPORT}
"""
    )
    return path


def replica_metrics() -> bytes:
    """A replica's `/metrics` (vLLM's names, as the project's emulator renders them): what
    lora-router scrapes from every replica every health interval."""
    return render(Engine(EmulatorConfig(model=MODEL)))


def json_reply() -> str:
    """A vLLM completion with what TRL reads: choices[0].token_ids and logprobs."""
    ids = [576, 4226, 374, 220, 19, 17, 13, 151643, 576, 4226, 374, 220, 19, 17, 13, 0]
    choice = {
        "index": 0,
        "text": " The answer is 42.",
        "logprobs": {"token_logprobs": [-0.5] * len(ids)},
        "finish_reason": "length",
        "token_ids": ids,
    }
    reply = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [choice],
        "usage": {"prompt_tokens": 512, "completion_tokens": 16, "total_tokens": 528},
    }
    return json.dumps(reply, separators=(",", ":"))


def distinct_free_ports(count: int) -> list[int]:
    """`count` different free ports: a port freed by `free_port` can come back from the next
    call (a duplicate among 128 is likely), and nginx refuses to listen twice on one."""
    ports: dict[int, None] = {}
    for _ in range(count * 10):  # bounded: a duplicate is rare per draw
        ports[free_port()] = None
        if len(ports) == count:
            return list(ports)
    raise BenchFailure(f"found only {len(ports)} distinct free ports of {count}")


def start_fleet(procs: Procs, size: int) -> list[int]:
    """The instant replicas: one nginx on `size` free ports. A port found free can be taken
    before nginx binds it (by any outgoing connection on this busy machine): try again."""
    for attempt in range(3):
        ports = distinct_free_ports(size)
        try:
            nginx_fleet(
                procs, ports, MODEL, json_reply(), "application/json", LOAD_CPU, replica_metrics()
            )
            return ports
        except RuntimeError as e:
            print(f"replica fleet did not start (attempt {attempt + 1}): {e}", flush=True)
    raise BenchFailure("the nginx replica fleet did not start")


# --- contenders -------------------------------------------------------------------------------

Start = Callable[[Procs, int, Sequence[int]], "subprocess.Popen[bytes] | None"]


def urls(replicas: Sequence[int]) -> list[str]:
    return [f"http://127.0.0.1:{p}" for p in replicas]


def lora_router_from(tree: str | None) -> Start:
    """How lora-router starts: from this checkout (None), or from another source `tree` (an
    A/B: `--base-tree`, `--table-base`), with PYTHONPATH on it."""
    env = {**os.environ, "PYTHONPATH": tree} if tree else None

    def lora_router(procs: Procs, port: int, replicas: Sequence[int]) -> subprocess.Popen[bytes]:
        argv = [sys.executable, "-m", "lora_router.cli", "--replicas", ",".join(urls(replicas))]
        argv += ["--no-token", "--port", str(port), "--log-level", "warning"]
        return procs.start(argv, cpus=PROXY_CPU, env=env, cwd=tree)

    return lora_router


def starters(vllm_router: str, base_tree: str | None = None) -> dict[str, Start]:
    """How each contender starts on a port in front of replica ports; direct starts nothing.
    `base_tree`: the source tree `BASE` runs from."""

    def direct(procs: Procs, port: int, replicas: Sequence[int]) -> None:
        return None

    def nginx(procs: Procs, port: int, replicas: Sequence[int]) -> subprocess.Popen[bytes]:
        return nginx_proxy(procs, port, replicas, PROXY_CPU)

    def floor(procs: Procs, port: int, replicas: Sequence[int]) -> subprocess.Popen[bytes]:
        argv = [
            sys.executable,
            str(FLOOR),
            "--port",
            str(port),
            "--replicas",
            ",".join(urls(replicas)),
        ]
        return procs.start(argv, cpus=PROXY_CPU)

    def vllm(procs: Procs, port: int, replicas: Sequence[int]) -> subprocess.Popen[bytes]:
        argv = [vllm_router, "--worker-urls", *urls(replicas), "--port", str(port)]
        argv += ["--host", "127.0.0.1", "--log-level", "warning"]
        argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
        return procs.start(argv, cpus=PROXY_CPU)

    out: dict[str, Start] = {"direct": direct, "nginx": nginx, "floor": floor}
    out["lora-router"] = lora_router_from(None)
    out["vllm-router"] = vllm
    if base_tree:
        out[BASE] = lora_router_from(base_tree)
    return out


@dataclass
class Instance:
    """A contender serving on `port` in front of `replicas` ports."""

    name: str
    port: int
    proc: subprocess.Popen[bytes] | None
    busy_cpu: float = 0.0  # since it started: CPU seconds and wall seconds of its windows
    busy_wall: float = 0.0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None


def launch(
    procs: Procs, start: Start, name: str, replicas: Sequence[int], timeout: float = 90.0
) -> Instance:
    """Start a contender and wait until it answers a completion (not just listens)."""
    port = replicas[0] if name == "direct" else free_port()
    proc = start(procs, port, replicas)
    try:
        wait_port(port, timeout=timeout)
    except RuntimeError:
        log = procs.log_tail(proc.pid if proc else 0)
        raise BenchFailure(f"{name} did not listen:\n{log}") from None
    body = Payload.make(PROMPT_TOKENS).body(0, 0, 1)
    deadline = time.monotonic() + timeout
    while True:
        status, detail = post(port, body)
        if status == 200:
            return Instance(name, port, proc)
        if time.monotonic() > deadline or (proc and proc.poll() is not None):
            log = procs.log_tail(proc.pid) if proc else ""
            raise BenchFailure(f"{name} on {len(replicas)} replicas answered {detail}\n{log}")
        time.sleep(0.2)


def post(port: int, body: bytes) -> tuple[int, str]:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            reply = r.read()
            return (r.status if b"cmpl-bench" in reply else 0), f"{r.status} {reply[:200]!r}"
    except OSError as e:
        return -1, repr(e)


def decisions(port: int) -> dict[str, float]:
    """lora-router's routing decisions by kind, from its /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.findall(r'^lora_router_routing_decisions_total\{kind="(\w+)"\} (\S+)$', text, re.M)
    return {kind: float(n) for kind, n in found}


def check_trace(trace: str, before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """The decision mix of a window must be the trace's, or the trace is not what it claims."""
    made = {k: int(after.get(k, 0) - before.get(k, 0)) for k in after}
    made = {k: n for k, n in made.items() if n}
    total = sum(made.values())
    fresh = made.get("fresh", 0) / max(total, 1)
    expected = 1 / TRACES[trace]
    if total == 0 or abs(fresh - expected) > 0.05:
        raise BenchFailure(
            f"lora-router on the {trace} trace made {made}: {fresh:.3f} fresh, "
            f"{expected:.3f} expected"
        )
    return made


# --- the interleaved windows ------------------------------------------------------------------


@dataclass(frozen=True)
class Scenario:
    replicas: int
    trace: str
    connections: int
    contenders: tuple[str, ...]

    @property
    def name(self) -> str:
        return f"{self.replicas} replicas, {self.trace}, c={self.connections}"


def scenarios(fleets: Sequence[int], extra: tuple[str, ...] = ()) -> list[Scenario]:
    """Every window of a round; `extra` contenders (BASE) join every one."""
    window, proxies = (*WINDOW_CONTENDERS, *extra), (*PROXIES, *extra)
    out = [Scenario(2, "siblings", 1, window)]
    out.append(Scenario(2, "siblings", 64, window))
    for n in fleets:
        for trace in TRACES:
            if (n, trace) != (2, "siblings"):
                out.append(Scenario(n, trace, 64, proxies))
    return out


@dataclass
class Sample:
    scenario: str
    contender: str
    round: int
    rps: float
    p50_us: int
    p99_us: int
    cpu_us_per_req: float | None
    added_p50_us: float | None = None
    decisions: dict[str, int] | None = None
    window_s: float = 0.0
    net_cpu_us_per_req: float | None = None  # less the proxy's idle CPU rate of that round


def measure(
    inst: Instance,
    sc: Scenario,
    rnd: int,
    args: argparse.Namespace,
    tmp: Path,
    reply: int,
    warm_up: bool,
) -> Sample:
    """A timed wrk window of a scenario against one contender, after a warm-up if this is the
    contender's first window since it started."""
    url = f"http://127.0.0.1:{inst.port}/v1/completions"
    payload = Payload.make(PROMPT_TOKENS)
    group = TRACES[sc.trace]
    began, busy0 = time.monotonic(), cpu_seconds(inst.pid) if inst.pid else 0.0
    if warm_up and args.warmup > 0:
        script = lua_script(tmp, payload, group)
        wrk(url, script, connections=sc.connections, seconds=args.warmup, cpus=LOAD_CPU)
    script = lua_script(tmp, payload, group)
    lora = inst.name.startswith("lora-router")
    before = decisions(inst.port) if lora else {}
    cpu0 = cpu_seconds(inst.pid) if inst.pid else 0.0
    res = wrk(url, script, connections=sc.connections, seconds=args.seconds, cpus=LOAD_CPU)
    cpu1 = cpu_seconds(inst.pid) if inst.pid else 0.0
    cpu = (cpu1 - cpu0) * 1e6 / max(res.requests, 1) if inst.pid else None
    if res.requests == 0 or res.errors or res.bytes < res.requests * reply:
        raise BenchFailure(
            f"{inst.name} in {sc.name}: {res.requests} requests, {res.errors} errors "
            f"({res.timeouts} timeouts of 10 s), "
            f"{res.bytes} bytes (a reply is {reply} bytes of body alone)"
        )
    made = check_trace(sc.trace, before, decisions(inst.port)) if lora else None
    if inst.pid:
        inst.busy_cpu += cpu_seconds(inst.pid) - busy0
    inst.busy_wall += time.monotonic() - began
    sample = Sample(sc.name, inst.name, rnd, res.rps, res.p50_us, res.p99_us, cpu)
    sample.window_s, sample.decisions = res.seconds, made
    return sample


def rotated(items: Sequence[T], k: int) -> list[T]:
    k %= len(items)
    return [*items[k:], *items[:k]]


@dataclass
class Idle:
    """A proxy's CPU while the others of its fleet size were measured (its health checks
    and scrapes of the replicas)."""

    contender: str
    replicas: int
    round: int
    cpu_us_per_s: float


def windows(
    procs: Procs, start: dict[str, Start], fleet: list[int], args: argparse.Namespace
) -> tuple[list[Sample], list[Idle], list[float]]:
    """Every scenario against every contender, args.rounds times; returns the samples, the
    proxies' idle CPU and the 1-minute load average before each round.

    Within a round, fleet sizes come one at a time: only the proxies of the size being measured
    run (started for it and stopped after it), so an idle router's health checks of 128
    replicas never take core 0 from another contender's window."""
    plan = scenarios(args.fleets, (BASE,) if args.base_tree else ())
    reply = len(json_reply())
    samples: list[Sample] = []
    idle: list[Idle] = []
    loads: list[float] = []
    for rnd in range(args.rounds):
        loads.append(os.getloadavg()[0])
        round_began = time.monotonic()
        for n in rotated(args.fleets, rnd):
            block = [sc for sc in plan if sc.replicas == n]
            names = list(dict.fromkeys(name for sc in block for name in sc.contenders))
            instances = {name: launch(procs, start[name], name, fleet[:n]) for name in names}
            cpu_at = {name: cpu_seconds(i.pid) for name, i in instances.items() if i.pid}
            began = time.monotonic()
            for sc in rotated(block, rnd):
                done = []
                for name in rotated(sc.contenders, rnd):
                    inst = instances[name]
                    done.append(measure(inst, sc, rnd, args, procs.tmp, reply, inst.busy_wall == 0))
                direct = next((s.p50_us for s in done if s.contender == "direct"), None)
                for s in done:
                    if direct is not None:
                        s.added_p50_us = s.p50_us - direct
                    line = f"  r{rnd} {sc.name:30} {s.contender:12} {s.rps:8.0f} req/s"
                    line += f" p50 {s.p50_us:5d} us p99 {s.p99_us:6d} us"
                    if s.cpu_us_per_req is not None:
                        line += f" cpu {s.cpu_us_per_req:6.1f} us/req"
                    print(line, flush=True)
                samples += done
            took = time.monotonic() - began
            for name, inst in instances.items():
                if inst.pid:
                    spent = cpu_seconds(inst.pid) - cpu_at[name] - inst.busy_cpu
                    rate = spent * 1e6 / max(took - inst.busy_wall, 1e-3)
                    idle.append(Idle(name, n, rnd, rate))
                    for sample in done_by(samples, rnd, name, block):
                        assert sample.cpu_us_per_req is not None
                        sample.net_cpu_us_per_req = sample.cpu_us_per_req - rate / sample.rps
                if inst.proc:
                    procs.stop(inst.proc)
        print(f"round {rnd} took {time.monotonic() - round_began:.0f} s", flush=True)
    return samples, idle, loads


def done_by(samples: list[Sample], rnd: int, name: str, block: list[Scenario]) -> list[Sample]:
    names = {sc.name for sc in block}
    return [s for s in samples if s.round == rnd and s.contender == name and s.scenario in names]


# --- open streams -----------------------------------------------------------------------------


class HoldReplica(asyncio.Protocol):
    """A replica that answers a completion with an SSE head and one chunk, then holds the
    stream until the client goes; GETs get what a router reads at start."""

    GETS = {
        b"/health": ("application/json", "{}"),
        b"/v1/models": ("application/json", models_json(MODEL)),
        b"/server_info": ("application/json", server_info_json()),
        b"/metrics": ("text/plain", replica_metrics().decode()),
    }
    CHUNK = (
        b'data: {"id":"cmpl-bench","object":"text_completion","model":"'
        + MODEL.encode()
        + b'","choices":[{"index":0,"text":" The","logprobs":null,"finish_reason":null}]}\n\n'
    )
    HOLD = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(CHUNK), CHUNK)
    )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.buf = bytearray()
        self.need: int | None = None
        self.line: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            if self.need is None:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self.buf[:end])
                self.line = head.split(b"\r\n", 1)[0].split(b" ")
                length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
                self.need = end + 4 + (int(length.group(1)) if length else 0)
            if len(self.buf) < self.need:
                return
            del self.buf[: self.need]
            self.need = None
            self.answer(self.line[0], self.line[1].split(b"?")[0])

    def answer(self, method: bytes, path: bytes) -> None:
        if method == b"POST" and path == b"/v1/completions":
            self.transport.write(self.HOLD)
            return
        ctype, text = self.GETS.get(path, ("text/plain", ""))
        status = b"200 OK" if path in self.GETS else b"404 Not Found"
        body = text.encode()
        self.transport.write(
            b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (status, ctype.encode(), len(body), body)
        )


async def serve_hold(ports: list[int]) -> None:
    loop = asyncio.get_running_loop()
    for port in ports:
        await loop.create_server(HoldReplica, "127.0.0.1", port, backlog=4096)
    await asyncio.Event().wait()


async def open_streams(
    port: int, payload: Payload, first: int, count: int, conns: list[asyncio.StreamWriter]
) -> None:
    """Open `count` more streams through the proxy on `port` (prompts in groups of G, a seed
    each), each held once its first SSE chunk has arrived."""
    nonce = next(_nonces)
    gate = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        body = payload.body(nonce, (first + i) // GROUP, random.getrandbits(63))
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        async with gate:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            conns.append(writer)
            writer.write(head + body)
            await reader.readuntil(b"data: ")

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(count))), timeout=120)


@dataclass
class StreamSample:
    contender: str
    round: int
    before_kib: int
    with_open_kib: dict[int, int]  # open streams: RSS
    after_close_kib: int

    def per_stream_kib(self, n: int) -> float:
        return (self.with_open_kib[n] - self.before_kib) / n


async def hold_streams(port: int, pid: int, counts: Sequence[int]) -> tuple[int, dict[int, int]]:
    payload = Payload.make(STREAM_TOKENS, stream=True)
    conns: list[asyncio.StreamWriter] = []
    await open_streams(port, payload, 0, 64, conns)  # warm-up: pools, buffers, code paths
    for w in conns:
        w.close()
    conns.clear()
    await asyncio.sleep(1.0)  # let the proxy notice the closes before the baseline
    before = rss_kib(pid)
    open_kib: dict[int, int] = {}
    try:
        for n in counts:
            await open_streams(port, payload, len(conns), n - len(conns), conns)
            open_kib[n] = rss_kib(pid)
            print(f"    {n} streams open: {open_kib[n] / 1024:.1f} MiB", flush=True)
    finally:
        for w in conns:
            w.close()
    return before, open_kib


def streams(procs: Procs, start: dict[str, Start], args: argparse.Namespace) -> list[StreamSample]:
    ports = [free_port() for _ in range(STREAM_REPLICAS)]
    hold = procs.start(
        [sys.executable, __file__, "--hold-replica", ",".join(map(str, ports))], cpus=LOAD_CPU
    )
    for port in ports:
        wait_port(port)
    out = []
    for rnd in range(args.stream_rounds):
        for name in rotated(PROXIES, rnd):
            print(f"  streams r{rnd} {name}", flush=True)
            port = free_port()
            proc = start[name](procs, port, ports)
            assert proc is not None
            try:
                wait_port(port, timeout=90)
                before, open_kib = asyncio.run(hold_streams(port, proc.pid, args.streams))
            except (RuntimeError, OSError, TimeoutError, asyncio.IncompleteReadError) as e:
                raise BenchFailure(
                    f"{name} did not hold the streams: {e!r}\n{procs.log_tail(proc.pid)}"
                ) from e
            time.sleep(2.0)  # the closes reach the proxy and its upstreams
            out.append(StreamSample(name, rnd, before, open_kib, rss_kib(proc.pid)))
            procs.stop(proc)
    procs.stop(hold)
    return out


# --- the affinity table's plateau -------------------------------------------------------------


@dataclass
class TableSample:
    contender: str
    prompts: int  # distinct prompts answered so far (0: started, one request)
    rss_kib: int
    rps: float  # while filling up to `prompts`


def fill_script(tmp: Path, payload: Payload, count: int) -> Path:
    """A wrk script sending `count` distinct prompts (under a nonce no other script uses), each
    once, that stops sending and writes `<script>.done` once `count` were answered (wrk itself
    then waits out its duration: the caller interrupts it)."""
    nonce, path, head = _new_script(tmp, payload, "fill")
    path.write_text(
        head
        + f"""local sent, answered = 0, 0
request = function()
  local n = sent
  sent = sent + 1
  local body = prefix .. "{nonce}, " .. (n % 100000) .. ", " .. math.floor(n / 100000)
    .. rest .. sent .. suffix
  return wrk.format("POST", nil, headers, body)
end
response = function(status, headers, body)
  answered = answered + 1
  if answered == {count} then
    local marker = io.open("{path}.done", "w")
    marker:write(answered)
    marker:close()
    wrk.thread:stop()
  end
end
{WRK_REPORT}
"""
    )
    return path


def table_contenders(
    procs: Procs, start: dict[str, Start], args: argparse.Namespace
) -> dict[str, Start]:
    """The plateau's contenders: lora-router of this tree, of `--table-base` if given (its
    `git archive`, run with PYTHONPATH on it), and vllm-router."""
    out = {"lora-router": start["lora-router"]}
    if args.table_base:
        tree = source_tree(args.table_base, procs.tmp / f"tree-{args.table_base}")
        out[f"lora-router {args.table_base}"] = lora_router_from(str(tree))
    out["vllm-router"] = start["vllm-router"]
    return out


def table(
    procs: Procs, start: dict[str, Start], fleet: list[int], args: argparse.Namespace
) -> list[TableSample]:
    """Each contender's RSS, idle, after `args.table` distinct prompts of TABLE_TOKENS tokens
    (every prompt new: they differ from their first token). The contenders run side by side
    and are filled step by step in turn, so each step of each is measured on the same machine
    load; a lora-router must count every prompt as fresh."""
    contenders = table_contenders(procs, start, args)
    running = {name: launch(procs, s, name, fleet[:2]) for name, s in contenders.items()}
    out = [TableSample(name, 0, rss_kib(inst.pid or 0), 0.0) for name, inst in running.items()]
    payload = Payload.make(TABLE_TOKENS)
    done = 0
    for target in args.table:
        for name, inst in running.items():
            script = fill_script(procs.tmp, payload, target - done)
            url = f"http://127.0.0.1:{inst.port}/v1/completions"
            argv = ["wrk", "-t1", "-c64", f"-d{TABLE_LIMIT_S}s", "--timeout", "10s"]
            argv = pinned([*argv, "-s", str(script), url], LOAD_CPU)
            counts = decisions(inst.port) if name.startswith("lora-router") else None
            began = time.monotonic()
            runner = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
            try:
                while not Path(f"{script}.done").exists():
                    if runner.poll() is not None:
                        raise BenchFailure(f"{name} did not answer {target:,} prompts in time")
                    time.sleep(0.25)
            finally:
                runner.send_signal(signal.SIGINT)  # wrk prints its summary and exits
                printed, _ = runner.communicate(timeout=30)
            took = time.monotonic() - began
            line = next((ln for ln in printed.splitlines() if ln.startswith("WRKJSON ")), "")
            res = json.loads(line[len("WRKJSON ") :] or "{}")
            if res.get("status_errors", 1) or res.get("requests", 0) < target - done:
                raise BenchFailure(f"{name} did not answer {target:,} prompts:\n{printed}")
            if counts is not None:
                check_trace("fresh", counts, decisions(inst.port))  # every prompt was new
            time.sleep(1.0)  # the requests cut off by wrk's stop reach the proxy and go
            out.append(TableSample(name, target, rss_kib(inst.pid or 0), res["requests"] / took))
            print(f"  {name}, {target:,} prompts: {out[-1].rss_kib / 1024:.1f} MiB", flush=True)
        done = target
    for inst in running.values():
        if inst.proc is not None:
            procs.stop(inst.proc)
    return out


def streams_markdown(streams: Sequence[StreamSample]) -> list[str]:
    out = [
        f"## RSS per open stream ({STREAM_TOKENS:,}-token prompts, "
        f"{STREAM_REPLICAS} holding replicas)",
        "",
    ]
    counts = sorted({n for s in streams for n in s.with_open_kib})
    out += [
        "| contender | RSS before MiB | "
        + " | ".join(f"RSS with {n:,} MiB | KiB/stream at {n:,}" for n in counts)
        + " | RSS after close MiB |",
        "| --- | ---: |" + " ---: | ---: |" * len(counts) + " ---: |",
    ]
    for name in PROXIES:
        mine = [s for s in streams if s.contender == name]
        if not mine:
            continue
        cells = [fmt(spread([s.before_kib / 1024 for s in mine]), ".1f")]
        for n in counts:
            cells.append(fmt(spread([s.with_open_kib[n] / 1024 for s in mine]), ".1f"))
            cells.append(fmt(spread([s.per_stream_kib(n) for s in mine]), ".1f"))
        cells.append(fmt(spread([s.after_close_kib / 1024 for s in mine]), ".1f"))
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def table_markdown(samples: Sequence[TableSample]) -> list[str]:
    names = list(dict.fromkeys(t.contender for t in samples))
    steps = sorted({t.prompts for t in samples})
    at = {(t.contender, t.prompts): t for t in samples}
    out = [
        f"## RSS with distinct {TABLE_TOKENS:,}-token prompts (default affinity table)",
        "",
        "RSS MiB after that many distinct prompts answered (req/s while filling up to it).",
        "",
        "| distinct prompts | " + " | ".join(names) + " |",
        "| ---: |" + " ---: |" * len(names),
    ]
    for n in steps:
        label = "0 (started, one request)" if n == 0 else f"{n:,}"
        cells = [
            f"{at[name, n].rss_kib / 1024:.1f}"
            + ("" if n == 0 else f" ({at[name, n].rps:,.0f} req/s)")
            for name in names
        ]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out


# --- the report ---------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(s: dict[str, float] | None, spec: str = ",.0f") -> str:
    if s is None:
        return "—"
    return f"{format(s['median'], spec)} [{format(s['min'], spec)} .. {format(s['max'], spec)}]"


@dataclass
class Report:
    command: str
    revision: str
    date: str
    seconds: float = 0.0
    load_before_rounds: list[float] = field(default_factory=list)
    load_end: float = 0.0
    samples: list[Sample] = field(default_factory=list)
    idle: list[Idle] = field(default_factory=list)
    streams: list[StreamSample] = field(default_factory=list)
    table: list[TableSample] = field(default_factory=list)
    contenders: list[str] = field(default_factory=lambda: list(WINDOW_CONTENDERS))
    base_tree: str | None = None

    @property
    def proxies(self) -> list[str]:
        return self.contenders[1:]

    def versus(self, scenario: str, a: str, b: str, attr: str) -> dict[str, float] | None:
        """Per round, `attr` of contender a over contender b in one scenario."""
        mine = {
            (s.contender, s.round): getattr(s, attr) for s in self.samples if s.scenario == scenario
        }
        ratios = [
            mine[a, r] / mine[b, r]
            for r in {s.round for s in self.samples}
            if mine.get((a, r)) and mine.get((b, r))
        ]
        return spread(ratios) if ratios else None

    def values(self, scenario: str, name: str, attr: str) -> list[float]:
        got = [
            getattr(s, attr) for s in self.samples if s.scenario == scenario and s.contender == name
        ]
        return [float(v) for v in got if v is not None]

    def stat(self, scenario: str, name: str, attr: str) -> dict[str, float] | None:
        values = self.values(scenario, name, attr)
        return spread(values) if values else None

    def paired(self, name: str, a: str, b: str, attr: str) -> dict[str, float] | None:
        """Per round, `attr` in scenario a over scenario b."""
        mine = {
            (s.scenario, s.round): getattr(s, attr) for s in self.samples if s.contender == name
        }
        ratios = [
            mine[a, r] / mine[b, r]
            for r in {s.round for s in self.samples}
            if (a, r) in mine and (b, r) in mine
        ]
        return spread(ratios) if ratios else None


def targets(report: Report, fleets: Sequence[int]) -> list[dict[str, object]]:
    c1, c64 = "2 replicas, siblings, c=1", "2 replicas, siblings, c=64"
    out: list[dict[str, object]] = []
    small, large = min(fleets), max(fleets)
    for trace in TRACES if large > small else ():  # one fleet size (--fleets 2): no sweep
        ratio = report.paired(
            "lora-router",
            f"{large} replicas, {trace}, c=64",
            f"{small} replicas, {trace}, c=64",
            "cpu_us_per_req",
        )
        net = report.paired(
            "lora-router",
            f"{large} replicas, {trace}, c=64",
            f"{small} replicas, {trace}, c=64",
            "net_cpu_us_per_req",
        )
        assert ratio is not None and net is not None
        out.append(
            {
                "target": f"CPU/request at {large} replicas within 10 % of {small} ({trace})",
                "figure": f"{fmt(ratio, '.3f')} x, per-round ratio ({fmt(net, '.3f')} x less "
                "idle CPU)",
                "met": ratio["median"] <= FLEET_CPU_TOLERANCE,
            }
        )
    mine = report.stat(c1, "lora-router", "added_p50_us")
    nginx = report.stat(c1, "nginx", "added_p50_us")
    assert mine and nginx
    out.append(
        {
            "target": "added p50 at c=1 within nginx's + 40 µs",
            "figure": f"{mine['median']:.0f} µs against nginx's {nginx['median']:.0f} + 40",
            "met": mine["median"] <= nginx["median"] + ADDED_P50_SLACK_US,
        }
    )
    mine = report.stat(c64, "lora-router", "cpu_us_per_req")
    nginx = report.stat(c64, "nginx", "cpu_us_per_req")
    assert mine and nginx
    out.append(
        {
            "target": "CPU/request at c=64 ≤ 2x nginx's",
            "figure": f"{mine['median']:.1f} µs against 2 x {nginx['median']:.1f}",
            "met": mine["median"] <= CPU_VS_NGINX * nginx["median"],
        }
    )
    scenarios_64 = sorted({s.scenario for s in report.samples if s.scenario.endswith("c=64")})
    worst = min(
        statistics.median(report.values(sc, "lora-router", "rps"))
        / statistics.median(report.values(sc, "vllm-router", "rps"))
        for sc in scenarios_64
    )
    here = statistics.median(report.values(c64, "lora-router", "rps")) / statistics.median(
        report.values(c64, "vllm-router", "rps")
    )
    out.append(
        {
            "target": "≥ 2x vllm-router's req/s",
            "figure": f"{here:.2f}x at 2 replicas, siblings, c=64; {worst:.2f}x in the worst "
            "scenario at c=64",
            "met": worst >= RPS_VS_VLLM_ROUTER,
        }
    )
    most = max(STREAM_COUNTS)
    rss = [
        s.with_open_kib[most] / 1024
        for s in report.streams
        if s.contender == "lora-router" and most in s.with_open_kib
    ]
    if rss:
        out.append(
            {
                "target": f"{most:,} open streams of {STREAM_TOKENS:,}-token prompts < 150 MiB RSS",
                "figure": f"{statistics.median(rss):.0f} MiB",
                "met": statistics.median(rss) < STREAMS_RSS_MIB,
            }
        )
    return out


def floor_markdown(report: Report) -> list[str]:
    """How the targets read against the floor (bench/floor.py): the runtime's own cost per
    request, and lora-router's above it, per round in the same scenario."""
    out = [
        "## The floor: what the runtime costs before lora-router's work",
        "",
        "Per round, in the same scenario (2 replicas, siblings): CPU per request and added p50 "
        "of one contender over another's. Added p50 only at c=1: at c=64 wrk and the replicas "
        "share a core, and direct's own p50 there is no baseline.",
        "",
        "| figure | c=1 | c=64 |",
        "| --- | ---: | ---: |",
    ]
    pairs = [("floor", "nginx"), ("lora-router", "floor"), ("lora-router", "nginx")]
    for attr, label, levels in (
        ("cpu_us_per_req", "CPU µs/req", (1, 64)),
        ("added_p50_us", "added p50", (1,)),
    ):
        for a, b in pairs:
            cells = [
                fmt(report.versus(f"2 replicas, siblings, c={c}", a, b, attr), ".2f")
                if c in levels
                else "—"
                for c in (1, 64)
            ]
            out.append(f"| {label}, {a} / {b} | " + " | ".join(cells) + " |")
    return out


def markdown(report: Report, fleets: Sequence[int], goals: list[dict[str, object]]) -> str:
    loads = ", ".join(f"{x:.2f}" for x in report.load_before_rounds)
    out = [
        "# Proxy overhead (issue 16)",
        "",
        f"- command: `{report.command}`",
        f"- revision: `{report.revision}`; {report.date}; "
        f"the run took {report.seconds / 60:.1f} min",
        f"- machine: {os.cpu_count()} cores shared with other work; 1-minute load average before "
        f"each round: {loads}; at the end: {report.load_end:.2f}",
        "- proxies pinned to core 0; nginx replicas, wrk (one thread) and the bench on core 1",
        f"- requests: TRL 1.16's rollout payload, {PROMPT_TOKENS}-token token-id prompts, a "
        "seed per request; figures are medians over rounds with [min .. max]",
        "",
        "## Targets",
        "",
        "| target | figure | met |",
        "| --- | --- | --- |",
    ]
    out += [f"| {g['target']} | {g['figure']} | {'yes' if g['met'] else '**no**'} |" for g in goals]
    out += ["", *floor_markdown(report)]
    if BASE in report.contenders:
        out += ["", f"## A/B: lora-router over {BASE} (`{report.base_tree}`)", ""]
        out += [
            f"Per round, lora-router's figure over {BASE}'s in the same scenario (below 1: "
            "lora-router uses less CPU, or waits less; above 1: it serves more req/s).",
            "",
            "| scenario | CPU µs/req | req/s | p50 µs | added p50 µs |",
            "| --- | ---: | ---: | ---: | ---: |",
        ]
        for sc in dict.fromkeys(s.scenario for s in report.samples):
            attrs = ("cpu_us_per_req", "rps", "p50_us", "added_p50_us")
            cells = [fmt(report.versus(sc, "lora-router", BASE, a), ".3f") for a in attrs]
            out.append(f"| {sc} | " + " | ".join(cells) + " |")
    out += ["", "## Latency and CPU, 2 replicas, siblings trace", ""]
    out += [
        "| concurrency | contender | req/s | p50 µs | added p50 µs | p99 µs | CPU µs/req |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for c in (1, 64):
        sc = f"2 replicas, siblings, c={c}"
        for name in report.contenders:
            attrs = ("rps", "p50_us", "added_p50_us", "p99_us")
            cells = [fmt(report.stat(sc, name, a)) for a in attrs]
            cells.append(fmt(report.stat(sc, name, "cpu_us_per_req"), ".1f"))
            out.append(f"| {c} | {name} | " + " | ".join(cells) + " |")
    out += ["", "## Fleet sweep, concurrency 64", ""]
    out += [
        "CPU µs per request (req/s below); the last rows are the per-round ratio to 2 replicas.",
        "",
    ]
    for trace in TRACES:
        out += [f"### {trace} ({TRACES[trace]} request(s) per prompt)", ""]
        proxies = report.proxies
        out += ["| replicas | " + " | ".join(proxies) + " |", "| ---: |" + " ---: |" * len(proxies)]
        for n in fleets:
            sc = f"{n} replicas, {trace}, c=64"
            cells = [
                fmt(report.stat(sc, name, "cpu_us_per_req"), ".1f")
                + f"<br>{fmt(report.stat(sc, name, 'rps'))} req/s"
                for name in proxies
            ]
            out.append(f"| {n} | " + " | ".join(cells) + " |")
        for figure, label in (("cpu_us_per_req", ""), ("net_cpu_us_per_req", ", less idle CPU")):
            for n in fleets[1:]:
                pair = (f"{n} replicas, {trace}, c=64", f"{fleets[0]} replicas, {trace}, c=64")
                cells = [fmt(report.paired(name, *pair, figure), ".3f") for name in proxies]
                out.append(f"| CPU {n} / {fleets[0]}{label} | " + " | ".join(cells) + " |")
        out.append("")
    out += [
        "Idle CPU (µs per second) of each proxy while the others of its fleet size were measured: "
        "health checks "
        'and replica scrapes, included in the figures above (the "less idle CPU" rows take '
        "each proxy's idle rate of that round out of its windows).",
        "",
        "| replicas | " + " | ".join(report.proxies) + " |",
        "| ---: |" + " ---: |" * len(report.proxies),
    ]
    for n in fleets:
        cells = []
        for name in report.proxies:
            rates = [i.cpu_us_per_s for i in report.idle if i.contender == name and i.replicas == n]
            cells.append(fmt(spread(rates), ",.0f") if rates else "—")
        out.append(f"| {n} | " + " | ".join(cells) + " |")
    out.append("")
    out += ["### lora-router's routing decisions (the trace check), summed over rounds", ""]
    out += ["| scenario | decisions |", "| --- | --- |"]
    mix: dict[str, dict[str, int]] = {}
    for s in report.samples:
        if s.decisions:
            tally = mix.setdefault(s.scenario, {})
            for k, n in s.decisions.items():
                tally[k] = tally.get(k, 0) + n
    out += [
        f"| {sc} | " + ", ".join(f"{k} {n:,}" for k, n in sorted(t.items())) + " |"
        for sc, t in mix.items()
    ]
    # --windows-only measures neither of these: no empty tables.
    if report.streams:
        out += ["", *streams_markdown(report.streams)]
    if report.table:
        out += ["", *table_markdown(report.table)]
    out += [
        "",
        "## Not measured here",
        "",
        "- sglang-router: it rejects token-id prompts on /v1/completions, which is all TRL sends.",
        "- the routing figures of bench/routing.py (the issue's last target): run that bench.",
        "",
    ]
    return "\n".join(out)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a 2-minute smoke run")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seconds", type=float, default=2.0, help="timed window per contender")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up before each window")
    p.add_argument("--stream-rounds", type=int, default=1)
    p.add_argument(
        "--base-tree", help=f"a source tree to run {BASE} from, beside lora-router (an A/B)"
    )
    p.add_argument(
        "--fleets",
        type=lambda v: tuple(int(n) for n in v.split(",")),
        default=FLEETS,
        help="fleet sizes of the sweep (default 2,8,32,128)",
    )
    p.add_argument(
        "--windows-only", action="store_true", help="skip the open-stream and table phases"
    )
    p.add_argument("--peers-bin", default=str(Path(__file__).parent / ".peers" / "bin"))
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--table-only", action="store_true", help="only the RSS plateau (part 4)")
    p.add_argument("--table-base", metavar="REV", help="part 4 also measures lora-router at REV")
    p.add_argument("--hold-replica", help=argparse.SUPPRESS)  # internal: the holding replica
    args = p.parse_args()
    if args.hold_replica:
        asyncio.run(serve_hold([int(x) for x in args.hold_replica.split(",")]))
        return
    args.streams, args.table = STREAM_COUNTS, TABLE_PROMPTS
    if args.base_tree:
        args.base_tree = str(Path(args.base_tree).resolve())
    if args.quick:
        args.rounds, args.seconds, args.warmup, args.stream_rounds = 1, 1.0, 0.0, 1
        args.table = (5_000, 15_000)
    vllm_router = find_binary("vllm-router", Path(args.peers_bin))
    missing = [n for n in ("nginx", "wrk", "taskset") if not shutil.which(n)]
    if missing or not vllm_router:
        sys.exit(
            f"bench/overhead.py needs nginx, wrk, taskset and vllm-router; missing: "
            f"{', '.join(missing + ([] if vllm_router else ['vllm-router']))} "
            "(apt-get install nginx wrk; pip install -e '.[bench]')"
        )
    os.sched_setaffinity(0, {int(LOAD_CPU)})
    report = Report(
        command=" ".join(["python", "bench/overhead.py", *sys.argv[1:]]),
        revision=git_revision(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        base_tree=args.base_tree,
    )
    if args.base_tree:
        report.contenders.append(BASE)
    began = time.monotonic()
    procs = Procs()
    try:
        check_payload()
        start = starters(vllm_router, args.base_tree)
        fleet = start_fleet(procs, 2 if args.table_only else max(args.fleets))
        if args.table_only:
            report.table = table(procs, start, fleet, args)
            return write_table(report, began, Path(args.out), args.quick)
        report.samples, report.idle, report.load_before_rounds = windows(procs, start, fleet, args)
        if not args.windows_only:
            print("open streams", flush=True)
            report.streams = streams(procs, start, args)
            print("affinity table", flush=True)
            report.table = table(procs, start, fleet, args)
    except BenchFailure as e:
        sys.exit(f"bench/overhead.py FAILED, no results written: {e}")
    finally:
        procs.close()
    report.seconds = time.monotonic() - began
    report.load_end = os.getloadavg()[0]
    goals = targets(report, args.fleets)
    text = markdown(report, args.fleets, goals)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "overhead-ab" if args.base_tree else "overhead-quick" if args.quick else "overhead"
    (out / f"{name}.json").write_text(
        json.dumps({**asdict(report), "targets": goals}, indent=1) + "\n"
    )
    (out / f"{name}.md").write_text(text)
    print(text)


def write_table(report: Report, began: float, out: Path, quick: bool) -> None:
    """The report of `--table-only`: bench/results/table_memory.md (and .json)."""
    report.seconds = time.monotonic() - began
    report.load_end = os.getloadavg()[0]
    text = "\n".join(
        [
            "# Memory after many distinct prompts (issue 16)",
            "",
            f"- command: `{report.command}`",
            f"- revision: `{report.revision}`; {report.date}; the run took "
            f"{report.seconds / 60:.1f} min; 1-minute load average at the end: "
            f"{report.load_end:.2f}",
            "- proxies pinned to core 0; nginx replicas (2), wrk (one thread, 64 connections) and "
            "the bench on core 1",
            "",
            *table_markdown(report.table),
            "",
        ]
    )
    out.mkdir(parents=True, exist_ok=True)
    name = "table_memory-quick" if quick else "table_memory"
    (out / f"{name}.json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    (out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
