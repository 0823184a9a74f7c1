"""bench/instructions.py's measurement with callgrind's cache and branch simulation: every event
per fresh request (idle rate taken out), for each tree, at 2 replicas.

    python bench/results/fresh-2/cachesim.py --tree 47a45f3=/tmp/base-47a45f3 \
        --tree d21257b=/tmp/base-d21257b \
        --extra "--cache-sim=yes --branch-sim=yes --I1=32768,8,64 --D1=49152,12,64 \
                 --LL=2097152,16,64"

`--LL` is set to this machine's L2 (2 MiB a core): its L3 is shared with other tenants.
Events: Ir instructions; Dr/Dw data reads/writes; I1mr/D1mr/D1mw first-level misses; ILmr,
DLmr, DLmw last-level (here L2) misses; Bc/Bcm conditional branches and their mispredictions,
Bi/Bim indirect ones (callgrind's simple predictor, not the CPU's).
"""

import argparse
import asyncio
import glob
import os
import random
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import instructions
from lib.overhead_setup import REPLIES, check_trace, decisions, start_fleet, urls
from lib.procs import Procs, free_port, wait_port


def start(procs: Procs, name: str, tree: str, fleet: list[int], extra: list[str]):
    port = free_port()
    out = str(procs.tmp / f"callgrind-{port}")
    argv = ["valgrind", "--tool=callgrind", *extra, f"--callgrind-out-file={out}.%p"]
    argv += [sys.executable, "-m", "lora_router.cli", "--replicas", ",".join(urls(fleet))]
    argv += ["--no-token", "--port", str(port), "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": tree}
    proc = procs.start(argv, env=env, cwd=tree)
    wait_port(port, 300)
    return instructions.Router(name, proc, port, out)


def dump(router: instructions.Router) -> dict[str, int]:
    before = set(glob.glob(router.out + ".*"))
    router.control("-d")
    for _ in range(600):
        new = set(glob.glob(router.out + ".*")) - before
        if new:
            text = Path(new.pop()).read_text()
            events = re.search(r"^events: (.*)$", text, re.M)
            total = re.search(r"^(?:summary|totals): (.*)$", text, re.M)
            if events and total:
                return dict(
                    zip(events.group(1).split(), map(int, total.group(1).split()), strict=True)
                )
        time.sleep(0.1)
    raise RuntimeError("callgrind wrote no dump")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", action="append", required=True, help="NAME=DIR, repeatable")
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--warm-up", type=int, default=600)
    p.add_argument("--idle", type=float, default=5.0)
    p.add_argument("--trace", default="fresh")
    p.add_argument("--extra", default="--cache-sim=yes --branch-sim=yes")
    args = p.parse_args()
    procs = Procs()
    try:
        fleet = start_fleet(procs, 2, "json")
        reply = len(REPLIES["json"][0]())
        nonce = random.randrange(1000, 100000)
        for name, tree in (t.split("=", 1) for t in args.tree):
            router = start(procs, name, str(Path(tree).resolve()), fleet, args.extra.split())
            nonce += 3
            warm = instructions.requests_of(args.trace, args.warm_up, nonce)
            asyncio.run(instructions.send(router.port, warm, 64, reply))
            router.zero()
            began = time.monotonic()
            time.sleep(args.idle)
            idle, idle_s = dump(router), time.monotonic() - began
            bodies = instructions.requests_of(args.trace, args.requests, nonce + 1)
            made = decisions(router.port)
            router.zero()
            began = time.monotonic()
            asyncio.run(instructions.send(router.port, bodies, 64, reply))
            total, window = dump(router), time.monotonic() - began
            check_trace(args.trace, made, decisions(router.port))
            n = args.requests
            per = {k: (v - idle[k] / idle_s * window) / n for k, v in total.items()}
            print(name, " ".join(f"{k}={v:,.1f}" for k, v in per.items()), flush=True)
            procs.stop(router.proc)
    finally:
        procs.close()


if __name__ == "__main__":
    main()
