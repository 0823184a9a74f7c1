"""The overhead bench's interleaved windows: every contender in every scenario, round by round,
the order rotating, each window's CPU, latency and decision counts."""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from .nginx import wrk
from .overhead_setup import (
    BASE,
    LOAD_CPU,
    PROMPT_TOKENS,
    PROXIES,
    REPLIES,
    TRACES,
    WINDOW_CONTENDERS,
    BenchFailure,
    Instance,
    Payload,
    Start,
    check_trace,
    decisions,
    launch,
    lua_script,
    reply_kind,
)
from .procs import (
    Procs,
    cpu_seconds,
    cpu_split,
)

T = TypeVar("T")


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
    # The window's CPU split (`procs.cpu_split`): user and system µs, minor page faults.
    user_us_per_req: float | None = None
    sys_us_per_req: float | None = None
    minflt_per_req: float | None = None


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
    payload = Payload.make(PROMPT_TOKENS, stream=sc.trace == "sse")
    group = TRACES[sc.trace]
    began, busy0 = time.monotonic(), cpu_seconds(inst.pid) if inst.pid else 0.0
    if warm_up and args.warmup > 0:
        script = lua_script(tmp, payload, group)
        wrk(url, script, connections=sc.connections, seconds=args.warmup, cpus=LOAD_CPU)
    script = lua_script(tmp, payload, group)
    lora = inst.name.startswith("lora-router")
    before = decisions(inst.port) if lora else {}
    split0 = cpu_split(inst.pid) if inst.pid else None
    cpu0 = cpu_seconds(inst.pid) if inst.pid else 0.0
    res = wrk(url, script, connections=sc.connections, seconds=args.seconds, cpus=LOAD_CPU)
    cpu1 = cpu_seconds(inst.pid) if inst.pid else 0.0
    split1 = cpu_split(inst.pid) if inst.pid else None
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
    if split0 and split1:
        n = max(res.requests, 1)
        sample.user_us_per_req = (split1[0] - split0[0]) * 1e6 / n
        sample.sys_us_per_req = (split1[1] - split0[1]) * 1e6 / n
        sample.minflt_per_req = (split1[2] - split0[2]) / n
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
    procs: Procs,
    start: dict[str, Start],
    fleets: dict[str, list[int]],
    args: argparse.Namespace,
) -> tuple[list[Sample], list[Idle], list[float]]:
    """Every scenario against every contender, args.rounds times; returns the samples, the
    proxies' idle CPU and the 1-minute load average before each round.

    Within a round, fleet sizes come one at a time: only the proxies of the size being measured
    run (started for it and stopped after it), so an idle router's health checks of 128
    replicas never take core 0 from another contender's window. The `sse` trace's windows
    have replicas of their own (`fleets["sse"]`), and so proxies of their own."""
    plan = scenarios(args.fleets, (BASE,) if args.base_tree else ())
    samples: list[Sample] = []
    idle: list[Idle] = []
    loads: list[float] = []
    for rnd in range(args.rounds):
        loads.append(os.getloadavg()[0])
        round_began = time.monotonic()
        for n, kind in rotated([(n, k) for n in args.fleets for k in fleets], rnd):
            block = [sc for sc in plan if sc.replicas == n and reply_kind(sc.trace) == kind]
            if not block:
                continue
            fleet, reply = fleets[kind], len(REPLIES[kind][0]())
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
