"""CPU per request of lora-router trees on one trace, exactly N requests each, rounds alternating.

    python bench/probes/fresh.py --tree new=. --tree base=/tmp/base-d21257b \
        --requests 20000 --chunks 2 --rounds 6 [--router-args "--policy round-robin"]

Two nginx replicas (bench/overhead.py's), the router pinned to core 0 (bench/probes/launch.py, run
from each tree with PYTHONPATH on it), a client on core 1 sending bench/instructions.py's
requests (TRL's 512-token payload, a seed each) over 64 keep-alive connections: a warm-up,
then `--chunks` chunks of `--requests / --chunks`. Per chunk, from the router's own getrusage:
user and system µs per request, minor faults, collections of the cycle collector; the router's
decision counts are checked. A count of requests rather than a timed window: the same work for
every tree, whatever the machine's neighbours do to the time it takes.
"""

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

from instructions import requests_of, send  # noqa: E402
from lib.overhead_setup import REPLIES, decisions, start_fleet, urls  # noqa: E402
from lib.procs import Procs, free_port, wait_port  # noqa: E402

LAUNCH = Path(__file__).resolve().parent / "launch.py"


def snapshot(pid: int, out: Path) -> dict:
    before = len(out.read_text().splitlines()) if out.exists() else 0
    os.kill(pid, signal.SIGUSR1)
    for _ in range(500):
        lines = out.read_text().splitlines() if out.exists() else []
        if len(lines) > before:
            return json.loads(lines[-1])
        time.sleep(0.02)
    raise RuntimeError("the router wrote no counters")


def per_request(a: dict, b: dict, n: int) -> dict:
    return {
        "user_us": (b["utime"] - a["utime"]) * 1e6 / n,
        "sys_us": (b["stime"] - a["stime"]) * 1e6 / n,
        "minflt": (b["minflt"] - a["minflt"]) / n,
        "gc": [b["gc"]["n"][g] - a["gc"]["n"][g] for g in range(3)],
        "gc_us": [(b["gc"]["ns"][g] - a["gc"]["ns"][g]) / 1e3 / n for g in range(3)],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, help="NAME=DIR, repeatable")
    p.add_argument("--trace", default="fresh")
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--warm-up", type=int, default=600)
    p.add_argument("--router-args", default="")
    args = p.parse_args()
    trees = dict(t.split("=", 1) for t in args.tree)
    os.sched_setaffinity(0, {1})
    procs = Procs()
    found: dict[tuple[str, int], list[dict]] = {}
    try:
        fleet = start_fleet(procs, 2, "json")
        reply = len(REPLIES["json"][0]())
        nonce = random.randrange(1000, 100000)
        for rnd in range(args.rounds):
            names = list(trees) if rnd % 2 == 0 else list(reversed(trees))
            for name in names:
                tree = str(Path(trees[name]).resolve())
                out = procs.tmp / f"probe-{name}-{rnd}.jsonl"
                port = free_port()
                argv = [sys.executable, str(LAUNCH), "--replicas", ",".join(urls(fleet))]
                argv += ["--no-token", "--port", str(port), "--log-level", "warning"]
                env = {**os.environ, "PROBE_OUT": str(out), "PYTHONPATH": tree}
                proc = procs.start([*argv, *args.router_args.split()], cpus="0", env=env, cwd=tree)
                wait_port(port, 60)
                nonce += 3
                warm = requests_of(args.trace, args.warm_up, nonce)
                asyncio.run(send(port, warm, 64, reply))
                each = args.requests // args.chunks
                last = snapshot(proc.pid, out)
                for chunk in range(args.chunks):
                    nonce += 1
                    bodies = requests_of(args.trace, each, nonce)
                    made0 = decisions(port)
                    asyncio.run(send(port, bodies, 64, reply))
                    now = snapshot(proc.pid, out)
                    made = {k: int(v - made0.get(k, 0)) for k, v in decisions(port).items()}
                    got = per_request(last, now, each)
                    got["decisions"] = {k: v for k, v in made.items() if v}
                    print(f"round {rnd} {name} chunk {chunk}: {json.dumps(got)}", flush=True)
                    found.setdefault((name, chunk), []).append(got)
                    last = now
                procs.stop(proc)
    finally:
        procs.close()
    print(f"\n{args.requests // args.chunks} {args.trace} requests a chunk, {args.rounds} rounds")
    print("tree chunk: CPU µs/req median [min .. max]; user; system; minor faults/req")
    for (name, chunk), got in sorted(found.items(), key=lambda x: (x[0][1], x[0][0])):
        cpu = [g["user_us"] + g["sys_us"] for g in got]
        user = statistics.median(g["user_us"] for g in got)
        system = statistics.median(g["sys_us"] for g in got)
        faults = statistics.median(g["minflt"] for g in got)
        print(
            f"{name} {chunk}: {statistics.median(cpu):.1f} [{min(cpu):.1f} .. {max(cpu):.1f}]; "
            f"{user:.1f}; {system:.1f}; {faults:.3f}"
        )


if __name__ == "__main__":
    main()
