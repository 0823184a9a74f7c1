"""CPU per request of lora-router source trees side by side, by time, under wrk: a quick A/B.

    python bench/probes/cork_ab.py TRACE ROUNDS NAME=TREE [NAME=TREE ...]
    CONNS=1 python bench/probes/cork_ab.py siblings 8 new=. base=/tmp/base-d21257b

bench/overhead.py's replicas (one nginx on 2 ports, core 1), requests (TRL's 512-token payload,
a seed each; TRACE fresh, siblings or sse) and wrk (one thread, core 1), and each tree's router
pinned to core 0 (PYTHONPATH on the tree, `.` for this checkout). All routers run at once; each
round measures each one in a 4-second window, the order reversed every other round. Per window:
(user + system CPU of the router) / requests answered, wrk's p50, and the router's minor page
faults a request. Printed: the per-round ratio of each tree to the first (median [min .. max]),
and each tree's medians. A probe for finding a cause in minutes; bench/overhead.py makes the
figures the README quotes.
"""

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))

from lib.nginx import wrk  # noqa: E402
from lib.overhead_setup import PROMPT_TOKENS, Payload, lora_router_from, lua_script, start_fleet  # noqa: E402
from lib.procs import Procs, cpu_split, free_port, wait_port  # noqa: E402


def main() -> None:
    trace, rounds = sys.argv[1], int(sys.argv[2])
    trees = dict(a.split("=", 1) for a in sys.argv[3:])
    conns = int(os.environ.get("CONNS", "64"))
    tmp = Path(tempfile.mkdtemp())
    procs = Procs()
    cpu: dict[str, list[float]] = {n: [] for n in trees}
    p50: dict[str, list[int]] = {n: [] for n in trees}
    faults: dict[str, list[float]] = {n: [] for n in trees}
    try:
        fleet = start_fleet(procs, 2, "sse" if trace == "sse" else "json")
        group = 1 if trace == "fresh" else 8
        payload = Payload.make(PROMPT_TOKENS, stream=trace == "sse")
        urls = {}
        for name, tree in trees.items():
            port = free_port()
            proc = lora_router_from(None if tree == "." else tree)(procs, port, fleet)
            wait_port(port)
            urls[name] = (f"http://127.0.0.1:{port}/v1/completions", proc)
        time.sleep(1)
        for url, _ in urls.values():  # warm-up
            wrk(url, lua_script(tmp, payload, group), connections=conns, seconds=2, cpus="1")
        names = list(trees)
        for r in range(rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                url, proc = urls[name]
                u0, s0, f0 = cpu_split(proc.pid)
                res = wrk(
                    url, lua_script(tmp, payload, group), connections=conns, seconds=4, cpus="1"
                )
                u1, s1, f1 = cpu_split(proc.pid)
                if res.errors:
                    raise SystemExit(f"{name}: {res.errors} errors")
                cpu[name].append((u1 - u0 + s1 - s0) * 1e6 / res.requests)
                p50[name].append(res.p50_us)
                faults[name].append((f1 - f0) / res.requests)
            print(r, {n: round(v[-1], 1) for n, v in cpu.items()}, flush=True)
        ref = names[0]
        for n in names[1:]:
            ratios = [a / b for a, b in zip(cpu[n], cpu[ref], strict=True)]
            print(
                f"{trace} c={conns}: {n}/{ref} median {statistics.median(ratios):.3f} "
                f"[{min(ratios):.3f} .. {max(ratios):.3f}]"
            )
        for n in names:
            print(
                f"{n} median us/req {statistics.median(cpu[n]):.1f} "
                f"p50 us {statistics.median(p50[n])} "
                f"minor faults/req {statistics.median(faults[n]):.3f}"
            )
    finally:
        procs.close()


if __name__ == "__main__":
    main()
