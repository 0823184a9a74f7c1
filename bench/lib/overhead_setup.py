"""The overhead bench's set-up: its constants and targets, TRL's rollout payload and the wrk
scripts that send it, the instant nginx replicas, and how each contender starts (bench/overhead.py's
module docstring)."""

from __future__ import annotations

import itertools
import json
import os
import random
import re
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from lora_router.emulator.config import EmulatorConfig
from lora_router.emulator.engine import Engine
from lora_router.emulator.metrics import render

from .nginx import WRK_REPORT, nginx_fleet, nginx_proxy
from .procs import (
    Procs,
    free_port,
    wait_port,
)

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
FLOOR = Path(__file__).resolve().parents[1] / "floor.py"
PROXIES = WINDOW_CONTENDERS[1:]
BASE = "lora-router@base"  # --base-tree: lora-router from another source tree
# trace: requests per prompt; `sse` is siblings with `"stream": true`, answered by an event stream
TRACES = {"fresh": 1, "siblings": GROUP, "sse": GROUP}
SSE_EVENTS = 200  # events in the `sse` trace's reply, one a token as vLLM sends them
VARYING = 3  # leading prompt tokens that make a prompt new: the run's nonce, then its number

# The targets.
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


nonces = itertools.count(1)


def new_script(tmp: Path, payload: Payload, kind: str) -> tuple[int, Path, str]:
    """A nonce no other script uses (its prompts are numbered under it), the script's path, and
    the Lua lines every script starts with: the payload's parts around the prompt and seed."""
    nonce = next(nonces)
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
    nonce, path, head = new_script(tmp, payload, "trl")
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


def sse_reply() -> str:
    """A completion as vLLM streams it: an event a token (`SSE_EVENTS`), then `[DONE]`."""
    event = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [{"index": 0, "text": " 4", "logprobs": None, "finish_reason": None}],
    }
    line = "data: " + json.dumps(event, separators=(",", ":")) + "\n\n"
    return line * SSE_EVENTS + "data: [DONE]\n\n"


# A fleet's kind: its reply and content type. `sse` answers the `sse` trace, `json` the others.
REPLIES = {"json": (json_reply, "application/json"), "sse": (sse_reply, "text/event-stream")}


def reply_kind(trace: str) -> str:
    return "sse" if trace == "sse" else "json"


def start_fleet(procs: Procs, size: int, kind: str = "json") -> list[int]:
    """The instant replicas: one nginx on `size` free ports, answering `kind`'s reply. A port
    found free can be taken before nginx binds it (by any outgoing connection on this busy
    machine): try again."""
    reply, content_type = REPLIES[kind]
    for attempt in range(3):
        ports = distinct_free_ports(size)
        try:
            nginx_fleet(procs, ports, MODEL, reply(), content_type, LOAD_CPU, replica_metrics())
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
    expected = 1 / TRACES[trace]  # sse: siblings
    if total == 0 or abs(fresh - expected) > 0.05:
        raise BenchFailure(
            f"lora-router on the {trace} trace made {made}: {fresh:.3f} fresh, "
            f"{expected:.3f} expected"
        )
    return made


# --- figures ---------------------------------------------------------------------------------


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def fmt(s: dict[str, float] | None, spec: str = ",.0f") -> str:
    if s is None:
        return "—"
    return f"{format(s['median'], spec)} [{format(s['min'], spec)} .. {format(s['max'], spec)}]"
