"""Instructions per routed request: the router's CPU cost as a count, for A/Bs of a few percent.

    python bench/instructions.py --base e1b7b64 --base d21257b
    python bench/instructions.py --quick          # one scenario, small counts (a smoke run)

Why a count: on this shared 2-core machine the CPU time per request that bench/overhead.py
reads from /proc moves by about 3 % between two runs of the same tree (its A/A), so a 3 %
target needs dozens of rounds on a quiet machine. Valgrind's callgrind counts the instructions
the router process executes instead; for the same requests the count repeats to within a few
tenths of a percent whatever else the machine runs, because it does not depend on time. It is
not time: kernel work (the syscalls, which are the same per request in every revision measured:
two reads and two writes) and cache misses are not in it, and an instruction of the
interpreter's loop counts as much as one of a C library's. Use it to compare revisions of the
same code; bench/overhead.py stays the figure against other proxies.

Method: the replicas are bench/overhead.py's (one nginx on every replica port answering at
once: its JSON completion, or an SSE reply of 200 events for the `sse` trace). The router runs
under `valgrind --tool=callgrind`, from this checkout and from each `--base REV` (a `git
archive` of the revision, unpacked into a temporary directory, run with PYTHONPATH on it),
trees alternating. A client process (this script, asyncio) sends TRL 1.16's request bodies
(bench/lib/overhead_setup.py's `Payload`: a 512-token prompt, a seed of its own on every
request) over `--connections` keep-alive connections, exactly `--requests` of them per
measurement, after `--warm-up` requests. Traces: `fresh` (every prompt new), `siblings` (each
prompt G = 8 times in a row), `sse` (siblings, `"stream": true`, an event-stream reply).

Per measurement: zero the counters, stay idle `--idle` seconds and dump (the idle rate: health
checks and replica scrapes, which cost per second, not per request, and under valgrind's
slowdown would otherwise be charged to the requests); zero again, send the requests, dump. The
figure is (counted instructions - idle rate x the window) / requests. Every answer must be a
200 with the reply's length, and the router's `/metrics` must show the trace's decisions (one
in eight `fresh` for siblings), or the run fails and writes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.overhead_setup import (
    PROMPT_TOKENS,
    REPLIES,
    TRACES,
    BenchFailure,
    Payload,
    check_trace,
    decisions,
    reply_kind,
    start_fleet,
    urls,
)
from lib.procs import Procs, free_port, git_revision, source_tree, wait_port

THIS = "lora-router"


@dataclass
class Router:
    """A router under callgrind, its counters read through `callgrind_control`."""

    name: str
    proc: subprocess.Popen[bytes]
    port: int
    out: str  # callgrind's output file prefix

    def control(self, flag: str) -> None:
        quiet = subprocess.DEVNULL
        argv = ["callgrind_control", flag, str(self.proc.pid)]
        subprocess.run(argv, check=True, stdout=quiet, stderr=quiet)

    def zero(self) -> None:
        self.control("-z")

    def dump(self) -> int:
        """Dump the counters and return the instructions since the last zero."""
        before = set(glob.glob(self.out + ".*"))
        self.control("-d")
        for _ in range(600):  # bounded: a dump appears within seconds
            new = set(glob.glob(self.out + ".*")) - before
            if new:
                text = Path(new.pop()).read_text()
                found = re.search(r"^(?:summary|totals): (\d+)", text, re.M)
                if found:
                    return int(found.group(1))
            time.sleep(0.1)
        raise BenchFailure(f"{self.name}: callgrind wrote no dump")


def start_router(procs: Procs, name: str, tree: Path | None, fleet: list[int]) -> Router:
    port = free_port()
    out = str(procs.tmp / f"callgrind-{port}")
    argv = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}.%p"]
    argv += [sys.executable, "-m", "lora_router.cli", "--replicas", ",".join(urls(fleet))]
    argv += ["--no-token", "--port", str(port), "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(tree)} if tree else None
    proc = procs.start(argv, env=env, cwd=str(tree) if tree else None)
    wait_port(port, 300)
    return Router(name, proc, port, out)


async def send(port: int, bodies: list[bytes], connections: int, reply: int) -> None:
    """Every body once, over `connections` keep-alive connections, each answer checked."""
    queue = iter(bodies)

    async def client() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for body in queue:
                head = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
                writer.write(head.encode() + body)
                answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 120)
                length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", answer)
                if not answer.startswith(b"HTTP/1.1 200") or not length:
                    raise BenchFailure(f"an answer was not a framed 200: {answer[:200]!r}")
                if int(length.group(1)) != reply:
                    raise BenchFailure(f"an answer of {int(length.group(1))} bytes, not {reply}")
                await reader.readexactly(reply)
        finally:
            writer.close()

    await asyncio.gather(*(client() for _ in range(connections)))


def requests_of(trace: str, count: int, nonce: int) -> list[bytes]:
    payload = Payload.make(PROMPT_TOKENS, stream=trace == "sse")
    group = TRACES[trace]
    return [payload.body(nonce, i // group, random.getrandbits(63)) for i in range(count)]


def measure(router: Router, trace: str, args: argparse.Namespace, nonce: int, reply: int) -> float:
    """Instructions per request of one trace on `router` (the module docstring's method)."""
    asyncio.run(send(router.port, requests_of(trace, args.warm_up, nonce), args.connections, reply))
    router.zero()
    began = time.monotonic()
    time.sleep(args.idle)
    idle_rate = router.dump() / (time.monotonic() - began)
    bodies = requests_of(trace, args.requests, nonce + 1)
    before = decisions(router.port)
    router.zero()
    began = time.monotonic()
    asyncio.run(send(router.port, bodies, args.connections, reply))
    counted, window = router.dump(), time.monotonic() - began
    check_trace(trace, before, decisions(router.port))
    return (counted - idle_rate * window) / args.requests


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base", action="append", default=[], metavar="REV", help="repeatable")
    p.add_argument("--traces", default="fresh,siblings,sse")
    p.add_argument("--fleets", default="2,128")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--warm-up", type=int, default=600)
    p.add_argument("--connections", type=int, default=64)
    p.add_argument("--idle", type=float, default=5.0)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "instructions"))
    args = p.parse_args()
    if args.quick:
        args.traces, args.fleets, args.rounds = "fresh", "2", 1
        args.requests, args.warm_up = 400, 100
    traces, fleets = args.traces.split(","), [int(n) for n in args.fleets.split(",")]
    command = " ".join(["python", "bench/instructions.py", *sys.argv[1:]])
    procs = Procs()
    results: dict[str, dict[str, list[float]]] = {}
    began = time.monotonic()
    try:
        trees: dict[str, Path | None] = {THIS: None}
        for rev in args.base:
            trees[f"{THIS}@{rev}"] = source_tree(rev, Path(tempfile.mkdtemp()) / rev)
        nonce = 1
        for size in fleets:
            kinds = {reply_kind(t) for t in traces}
            fleet = {kind: start_fleet(procs, size, kind) for kind in kinds}
            for rnd in range(args.rounds):
                names = list(trees) if rnd % 2 == 0 else list(reversed(trees))
                for name, kind in ((name, kind) for name in names for kind in sorted(kinds)):
                    router = start_router(procs, name, trees[name], fleet[kind])
                    reply = len(REPLIES[kind][0]())
                    for trace in (t for t in traces if reply_kind(t) == kind):
                        nonce += 2
                        ir = measure(router, trace, args, nonce, reply)
                        scenario = f"{size} replicas, {trace}, c={args.connections}"
                        results.setdefault(scenario, {}).setdefault(name, []).append(ir)
                        print(f"round {rnd + 1} {scenario} {name}: {ir / 1e3:,.1f} kIr/req")
                    procs.stop(router.proc)
    except BenchFailure as e:
        sys.exit(f"bench/instructions.py FAILED, no results written: {e}")
    finally:
        procs.close()
    write(results, list(trees), command, args, time.monotonic() - began)


def write(
    results: dict[str, dict[str, list[float]]],
    names: list[str],
    command: str,
    args: argparse.Namespace,
    seconds: float,
) -> None:
    lines = [
        "# Instructions per routed request (callgrind)",
        "",
        f"Command: `{command}`  ",
        f"Revision: {git_revision()}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{args.requests} requests a measurement after {args.warm_up}, {args.rounds} rounds, "
        f"{seconds / 60:.0f} minutes. Method: bench/instructions.py's docstring.",
        "",
        "Thousands of instructions per request, median of the rounds (min-max); the ratio is "
        f"to {THIS}@REV's median.",
        "",
        "| scenario | " + " | ".join(names) + " |",
        "| --- |" + " --- |" * len(names),
    ]
    for scenario, by_name in results.items():
        cells = []
        mine = statistics.median(by_name[THIS])
        for name in names:
            v = by_name[name]
            cell = f"{statistics.median(v) / 1e3:,.1f} ({min(v) / 1e3:,.1f}-{max(v) / 1e3:,.1f})"
            if name != THIS:
                cell += f", {THIS} {mine / statistics.median(v):.3f}x"
            cells.append(cell)
        lines.append(f"| {scenario} | " + " | ".join(cells) + " |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = "instructions-quick" if args.quick else "instructions"
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps({"command": command, "results": results}) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
