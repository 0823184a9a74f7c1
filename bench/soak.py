"""Soak: does a router under hostile clients and a misbehaving replica grow (memory, file
descriptors, tasks) or wedge, while good GRPO-shaped traffic goes on without a lost request?

    python bench/soak.py                 # 60 s warm-up, 10 min hostile, 60 s cool-down, 60 s idle
    python bench/soak.py --quick         # about 2 minutes in all
    python bench/soak.py --minutes 30 --out /tmp/soak

Set-up. Three emulated replicas, each its own process (`python -m lora_router.emulator`: 8
sequences at once, 4 ms per generated token, 0.3 s adapter loads), and the router, this
checkout's `lora_router.cli`, started through this file (`soak.py router FILE -- FLAGS`: the
real command plus one daemon thread that writes to FILE, every second, the number of asyncio
tasks alive and, every sample interval, of objects the garbage collector tracks; counting the
objects holds the GIL for some milliseconds). The router's limits are lowered so an attack
ends in seconds, not minutes: `--header-timeout 5 --body-timeout 10 --keepalive-timeout 20
--idle-timeout 20 --max-body-bytes 1048576 --max-buffered-bytes 67108864 --max-connections
1024` (others at their defaults; health every 1 s). Everything on 127.0.0.1; nothing pinned
to a core.

Phases. *warm-up* (good traffic only, `--warmup` s), *hostile* (good traffic plus the hostile
clients plus the faulty replica, `--minutes`), *cool-down* (good only, `--cooldown` s), *idle*
(no traffic at all, `--idle` s, longer than the router's keep-alive timeout).

Good traffic (bench/lib/soak_good.py): a TRL-shaped trainer syncing every 10 s (pause(keep),
load trl-policy-vN, resume, unload v(N-3)) and `--concurrency` requests in flight, G = 8 samples
of a prompt at once, every fourth group streamed; a failed attempt is retried after 1, 2, 4 s;
a request is lost if its last attempt failed.

Hostile clients (bench/lib/soak_hostile.py), during the hostile phase: `--hostile-workers`
loops, each running the attacks in turn (slowloris heads, trickled bodies, oversized heads, too
many headers, Content-Length and chunked bodies over --max-body-bytes, smuggling-shaped heads,
64 pipelined requests never read, SSE left mid-stream, RSTs mid-request and mid-stream, idle
connections, garbage bytes), each attack bounded; and every `--burst-every` s a burst of
--max-connections + 16 connections at once, held 3 s. Replica 2 meanwhile misbehaves in turn,
5 s on and 10 s off (`POST /emulator/faults`): half its completions answered 500; its streams
cut after 2 frames (its non-streamed answers cut before the head); its completions stalled;
every route hung (its /health too: ejected, then re-admitted). The emulator offers no slow
trickle of an answer. `--no-faults` keeps replica 2 well.

Sampled every `--sample` s: the router's VmRSS and VmHWM, open fds (sockets among them) and
threads (/proc/PID), asyncio tasks and gc-tracked objects (the thread above), its accepted TCP
connections by state and its connections to the replicas (/proc/net/tcp), in-flight requests
and replicas serving (/router/status), the time /router/status takes (answered by the router
alone: a wedge shows there; /health is timed too, but it asks the replicas, so a hung replica
holds it up to --health-timeout), and the good requests ended in the window (p50, p99 latency,
failures). Reported: each figure at the
end of each phase; the least-squares slope of RSS (MiB per minute), fds and tasks over the
hostile phase's samples after its first minute (its first third when it is shorter than 3
minutes); fds after the idle phase against before the first request; good requests
sent/ok/lost per phase; what each attack saw; the faulty replica's episodes; the router's log
(tracebacks, errors) and its exit on SIGTERM.

Writes soak.json and soak.md under `--out` (bench/results/soak/; with --quick, a temporary
directory).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib.procs import Procs, free_port, git_revision, wait_port
from lib.soak_good import GoodClient
from lib.soak_hostile import Attacks, Limits
from lib.soak_report import markdown, summarise

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REPLICA_FLAGS = [
    "--max-num-seqs", "8", "--decode-s-per-token", "0.004", "--prefill-s-per-token", "2e-5",
    "--mean-output-tokens", "24", "--max-loras", "6", "--max-lora-rank", "8",
    "--load-delay", "0.3",
]  # fmt: skip
LIMITS = Limits(
    header_timeout=5.0,
    body_timeout=10.0,
    keepalive_timeout=20.0,
    idle_timeout=20.0,
    max_body_bytes=1 << 20,
    max_header_bytes=65536,
    max_connections=1024,
)
FAULTY = 2  # the replica that misbehaves
FAULT_CYCLE: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    ("half 500s", {"error_rate": 0.5}, {"error_rate": 0.0}),
    ("streams cut", {"crash_after_frames": 2}, {"crash_after_frames": None}),
    ("completions stalled", {"stall": True}, {"stall": False}),
    ("every route hung", {"hang": "/"}, {"hang": None}),
]
FAULT_ON_S, FAULT_OFF_S = 5.0, 10.0


def router_flags(limits: Limits) -> list[str]:
    return [
        "--no-token", "--header-timeout", str(limits.header_timeout),
        "--body-timeout", str(limits.body_timeout),
        "--keepalive-timeout", str(limits.keepalive_timeout),
        "--idle-timeout", str(limits.idle_timeout),
        "--max-body-bytes", str(limits.max_body_bytes),
        "--max-buffered-bytes", str(64 << 20),
        "--max-connections", str(limits.max_connections),
        "--health-interval", "1", "--health-timeout", "1",
        "--log-level", "info", "--status-interval", "30",
    ]  # fmt: skip


# --- the router, with its task count --------------------------------------------------------


def serve_router(argv: Sequence[str]) -> int:
    """`soak.py router FILE INTERVAL -- FLAGS`: the router's own command, plus a daemon thread
    appending `time tasks gc_objects` to FILE every second, the objects counted every INTERVAL
    s (the last count repeated between)."""
    import gc
    import threading

    out, interval = argv[0], float(argv[1])
    flags = list(argv[3:]) if argv[2:3] == ["--"] else list(argv[2:])

    def watch() -> None:
        objects, counted = 0, 0.0
        while True:
            # Python 3.11: every Task, C or not, is in this WeakSet while it lives.
            tasks = len(asyncio.tasks._all_tasks)  # type: ignore[attr-defined]
            if time.monotonic() - counted >= interval:
                objects, counted = len(gc.get_objects()), time.monotonic()
            with open(out, "a") as f:
                f.write(f"{time.time():.3f} {tasks} {objects}\n")
            time.sleep(1.0)

    threading.Thread(target=watch, daemon=True, name="soak-watch").start()
    from lora_router.cli import main as router_main

    return router_main(flags)


# --- sampling -------------------------------------------------------------------------------


def proc_figures(pid: int) -> dict[str, Any]:
    status = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        status[key] = value.split()
    fds = os.listdir(f"/proc/{pid}/fd")
    sockets = 0
    for fd in fds:
        with contextlib.suppress(OSError):
            sockets += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
    return {
        "rss_mib": int(status["VmRSS"][0]) / 1024,
        "hwm_mib": int(status["VmHWM"][0]) / 1024,
        "threads": int(status["Threads"][0]),
        "fds": len(fds),
        "sockets": sockets,
    }


TCP_STATES = {"01": "established", "06": "time_wait", "07": "close", "08": "close_wait",
              "09": "last_ack", "0B": "closing", "04": "fin_wait1", "05": "fin_wait2"}  # fmt: skip


def accepted(port: int) -> dict[str, int]:
    """The router's accepted connections (local port = its port) by TCP state."""
    out: dict[str, int] = {}
    want = f":{port:04X}"
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        if parts[1].endswith(want) and parts[3] != "0A":  # 0A: the listening socket
            state = TCP_STATES.get(parts[3], parts[3])
            out[state] = out.get(state, 0) + 1
    return out


def upstream(ports: Sequence[int]) -> int:
    """Open connections to the replicas' ports (the router's pooled ones, and this bench's
    rare fault switches)."""
    wanted = {f":{p:04X}" for p in ports}
    n = 0
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        parts = line.split()
        n += parts[2][-5:] in wanted and parts[3] == "01"
    return n


def last_watch(path: Path) -> tuple[int, int] | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        lines = path.read_text().splitlines()
        _, tasks, objects = lines[-1].split()
        return int(tasks), int(objects)
    return None


class Sampler:
    def __init__(
        self, pid: int, port: int, replicas: list[int], watch: Path, good: GoodClient, every: float
    ) -> None:
        self.pid, self.port, self.watch, self.good, self.every = pid, port, watch, good, every
        self.replica_ports = replicas
        self.url = f"http://127.0.0.1:{port}"
        self.samples: list[dict[str, Any]] = []
        self.phase = "start"
        self.status: dict[str, Any] = {}  # the last /router/status: its counts
        self.t0 = time.time()
        self._last = time.time()

    async def sample(self, http: aiohttp.ClientSession) -> dict[str, Any]:
        now = time.time()
        s: dict[str, Any] = {"t": round(now - self.t0, 2), "phase": self.phase}
        s.update(proc_figures(self.pid))
        watched = last_watch(self.watch)
        s["tasks"], s["gc_objects"] = watched if watched else (None, None)
        s["accepted"] = accepted(self.port)
        s["upstream"] = upstream(self.replica_ports)
        began = time.monotonic()
        try:
            async with http.get(self.url + "/health", timeout=aiohttp.ClientTimeout(10)) as r:
                await r.read()
                s["health_status"] = r.status
            s["health_ms"] = round((time.monotonic() - began) * 1e3, 1)
            began = time.monotonic()
            async with http.get(
                self.url + "/router/status", timeout=aiohttp.ClientTimeout(10)
            ) as r:
                doc = await r.json()
            s["status_ms"] = round((time.monotonic() - began) * 1e3, 1)
            self.status = {k: doc.get(k) for k in ("requests", "retries", "health")}
            s["in_flight"] = sum(x["in_flight"] for x in doc["replicas"])
            s["serving"] = sum(
                bool(x["healthy"] and x["admitted"] and not x["draining"]) for x in doc["replicas"]
            )
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            s["health_status"], s["health_ms"], s["status_ms"] = 0, None, None
            s["probe_error"] = f"{type(exc).__name__}: {exc}"
        ended = [d for d in self.good.done if self._last < d.ended <= now]
        lat = sorted(d.ended - d.started for d in ended if d.ok)
        s["good_ended"] = len(ended)
        s["good_failed"] = sum(not d.ok for d in ended)
        s["good_p50_ms"] = round(pct(lat, 0.5) * 1e3, 1) if lat else None
        s["good_p99_ms"] = round(pct(lat, 0.99) * 1e3, 1) if lat else None
        self._last = now
        self.samples.append(s)
        return s

    async def run(self, stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as http:
            while not stop.is_set():
                s = await self.sample(http)
                print(
                    f"  {s['t']:7.1f}s {s['phase']:9} rss {s['rss_mib']:6.1f} MiB fds {s['fds']:4}"
                    f" tasks {s['tasks']} conns {sum(s['accepted'].values()):4} status "
                    f"{s.get('status_ms')} ms good {s['good_ended']:4} ok-failed {s['good_failed']}"
                    f" p99 {s['good_p99_ms']}",
                    flush=True,
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), self.every)


def pct(values: Sequence[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))]


# --- the run --------------------------------------------------------------------------------


async def faulty_replica(url: str, stop: asyncio.Event, episodes: list[dict[str, Any]]) -> None:
    """Replica `FAULTY`'s faults in turn, `FAULT_ON_S` on, `FAULT_OFF_S` off, until `stop`."""
    async with aiohttp.ClientSession() as http:
        i = 0
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), FAULT_OFF_S)
            if stop.is_set():
                break
            name, on, off = FAULT_CYCLE[i % len(FAULT_CYCLE)]
            i += 1
            began = time.time()
            try:
                await set_fault(http, url, on)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), FAULT_ON_S)
            finally:
                await set_fault(http, url, off)
            episodes.append({"fault": name, "at": began, "s": round(time.time() - began, 2)})


async def set_fault(http: aiohttp.ClientSession, url: str, changes: dict[str, Any]) -> None:
    async with http.post(url + "/emulator/faults", json=changes) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: /emulator/faults answered {resp.status}")


async def hostile(attacks: Attacks, workers: int, burst_every: float, bursts: list[Any]) -> None:
    """`workers` loops through every attack in turn (each starting at its own), and a burst of
    connections every `burst_every` s; runs until cancelled."""
    names = list(attacks.table)

    async def loop(k: int) -> None:
        n = k
        while True:
            await attacks.run(names[n % len(names)])
            n += 1
            await asyncio.sleep(0.05)

    async def bursting() -> None:
        while True:
            await asyncio.sleep(burst_every)
            got = await attacks.burst()
            got["at"] = time.time()
            bursts.append(got)

    await asyncio.gather(bursting(), *(loop(k) for k in range(workers)))


async def soak(args: argparse.Namespace, procs: Procs, ports: list[int]) -> dict[str, Any]:
    router_port = ports[-1]
    url = f"http://127.0.0.1:{router_port}"
    router = procs.start(
        [
            sys.executable, str(Path(__file__).resolve()), "router", str(args.watch),
            str(args.sample), "--", "--replicas",
            ",".join(f"http://127.0.0.1:{p}" for p in ports[:3]), "--port", str(router_port),
            *router_flags(LIMITS),
        ],
        cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    wait_port(router_port, 30)
    await asyncio.sleep(2.0)  # the first health rounds
    adapters = Path(tempfile.mkdtemp(prefix="soak-adapters-", dir=procs.tmp))
    good = GoodClient(url, adapters, concurrency=args.concurrency, seed=args.seed)
    sampler = Sampler(router.pid, router_port, ports[:3], args.watch, good, args.sample)
    stop_sampling = asyncio.Event()
    marks: dict[str, float] = {}
    episodes: list[dict[str, Any]] = []
    bursts: list[dict[str, Any]] = []
    attacks = Attacks(router_port, LIMITS, args.seed)
    async with aiohttp.ClientSession() as http:
        await sampler.sample(http)  # before any request
    sampling = asyncio.create_task(sampler.run(stop_sampling))
    good_task = asyncio.create_task(good.run())

    async def phase(name: str, seconds: float) -> None:
        sampler.phase = name
        marks[name] = time.time()
        print(f"--- {name}: {seconds:g} s", flush=True)
        await asyncio.sleep(seconds)
        if good_task.done():
            good_task.result()  # the good client died: raise its error

    try:
        await phase("warm-up", args.warmup)
        async with aiohttp.ClientSession() as http:
            end_warm = await sampler.sample(http)
        fault_stop = asyncio.Event()
        faults = (
            asyncio.create_task(
                faulty_replica(f"http://127.0.0.1:{ports[FAULTY]}", fault_stop, episodes)
            )
            if args.faults
            else None
        )
        attackers = asyncio.create_task(
            hostile(attacks, args.hostile_workers, args.burst_every, bursts)
        )
        try:
            await phase("hostile", args.minutes * 60)
        finally:
            attackers.cancel()
            fault_stop.set()
            await asyncio.gather(attackers, return_exceptions=True)
            if faults is not None:
                await asyncio.gather(faults)
        await phase("cool-down", args.cooldown)
        good.stop()
        await asyncio.wait_for(good_task, 120)
        await phase("idle", args.idle)
        async with aiohttp.ClientSession() as http:
            end_idle = await sampler.sample(http)
    finally:
        stop_sampling.set()
        await sampling
        good.stop()
        good_task.cancel()
        with contextlib.suppress(BaseException):
            await good_task
    # The router's stop: SIGTERM, as an operator's.
    router.send_signal(signal.SIGTERM)
    try:
        exit_code = router.wait(60)
    except Exception:
        exit_code = None
    log = Path(procs.logs[router.pid]).read_text(errors="replace")
    return summarise(
        sampler.samples, marks, good, attacks, bursts, episodes, log, exit_code,
        end_warm, end_idle, args.minutes * 60, sampler.status,
    )  # fmt: skip


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["router"]:
        return serve_router(args_list[1:])
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--minutes", type=float, default=10.0, help="the hostile phase's length")
    p.add_argument("--warmup", type=float, default=60.0, help="seconds of good traffic first")
    p.add_argument("--cooldown", type=float, default=60.0, help="seconds of good traffic after")
    p.add_argument("--idle", type=float, default=60.0, help="seconds of no traffic at the end")
    p.add_argument("--quick", action="store_true", help="about 2 minutes in all")
    p.add_argument("--sample", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--concurrency", type=int, default=24, help="good requests in flight")
    p.add_argument("--hostile-workers", type=int, default=12)
    p.add_argument("--burst-every", type=float, default=60.0, help="seconds between bursts")
    p.add_argument("--no-faults", dest="faults", action="store_false")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="default bench/results/soak; --quick: a temp dir")
    p.add_argument("--keep-logs", metavar="DIR", help="copy the processes' logs here")
    args = p.parse_args(args_list)
    if args.quick:
        args.warmup, args.minutes, args.cooldown, args.idle = 15.0, 1.25, 10.0, 25.0
        args.sample, args.burst_every = 2.0, 30.0
    if args.out is None:  # a quick run never overwrites the committed results
        committed = str(HERE / "results" / "soak")
        args.out = tempfile.mkdtemp(prefix="soak-quick-") if args.quick else committed
    load_before = os.getloadavg()
    started = time.time()
    procs = Procs()
    args.watch = procs.tmp / "router-watch.txt"
    with procs.run(args.keep_logs):
        ports = [free_port() for _ in range(4)]
        for i, port in enumerate(ports[:3]):
            procs.start(
                [sys.executable, "-m", "lora_router.emulator", "--port", str(port),
                 *REPLICA_FLAGS, "--seed", str(i)],
                cwd=str(ROOT), env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
        for port in ports[:3]:
            wait_port(port, 30)
        result = asyncio.run(soak(args, procs, ports))
    report: dict[str, Any] = {
        "command": " ".join(["python bench/soak.py", *args_list]),
        "revision": git_revision(),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(started)),
        "seconds": round(time.time() - started, 1),
        "load_before": [round(x, 2) for x in load_before],
        "load_end": [round(x, 2) for x in os.getloadavg()],
        "settings": {
            k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "watch"
        },
        "router_flags": router_flags(LIMITS),
        "replica_flags": REPLICA_FLAGS,
        "fault_cycle": [name for name, _, _ in FAULT_CYCLE] if args.faults else [],
        **result,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report)
    (out / "soak.md").write_text(text)
    print(text)
    print(f"written: {out / 'soak.md'}, {out / 'soak.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
