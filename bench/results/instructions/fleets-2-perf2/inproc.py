"""Instructions per fresh (or sse) request with the router and its client in one process, under
callgrind, the background work off: a count that repeats to 0.1 % on a loaded machine.

    valgrind --tool=callgrind --callgrind-out-file=OUT.%p python inproc.py --trace fresh
    # the dump after the zeroing: summary / --requests = instructions a request

With PYTHONPATH=TREE for another tree. The client (asyncio streams) is counted too, the same in
every tree. Health checks and the status line are off (--health-interval 600, --status-interval
0): they cost per second, not per request, and bench/instructions.py's idle subtraction is what
otherwise removes them. Requests go one at a time on each of `--conns` keep-alive connections.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3]
sys.path.insert(1, str(BENCH))

import uvloop  # noqa: E402
from lib.nginx import nginx_fleet  # noqa: E402
from lib.overhead_setup import GROUP, MODEL, REPLIES, Payload, replica_metrics  # noqa: E402
from lib.procs import Procs, free_port  # noqa: E402

from lora_router.cli import build_config, build_parser  # noqa: E402
from lora_router.runtime import RouterRuntime  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--trace", choices=("fresh", "sse"), default="fresh")
p.add_argument("--requests", type=int, default=2000)
p.add_argument("--warm-up", type=int, default=400)
p.add_argument("--conns", type=int, default=4)
ARGS = p.parse_args()


def control(flag: str) -> None:
    subprocess.run(["callgrind_control", flag, str(os.getpid())], stdout=subprocess.DEVNULL)


async def run(replicas: list[int]) -> None:
    port = free_port()
    argv = ["--replicas", ",".join(f"http://127.0.0.1:{p}" for p in replicas), "--no-token"]
    argv += ["--port", str(port), "--log-level", "warning"]
    argv += ["--health-interval", "600", "--status-interval", "0"]
    runtime = RouterRuntime(build_config(build_parser().parse_args(argv), os.environ))
    await runtime.start()
    payload = Payload.make(512, ARGS.trace == "sse")
    group = 1 if ARGS.trace == "fresh" else GROUP
    rng = random.Random(7)
    numbers = iter(range(10**9))

    async def client(n: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(n):
            body = payload.body(1, next(numbers) // group, rng.getrandbits(63))
            head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
            writer.write(head.encode() + body)
            answer = await reader.readuntil(b"\r\n\r\n")
            length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", answer)
            assert answer.startswith(b"HTTP/1.1 200") and length, answer
            await reader.readexactly(int(length.group(1)))
        writer.close()

    await asyncio.gather(*(client(ARGS.warm_up // ARGS.conns) for _ in range(ARGS.conns)))
    control("-z")
    await asyncio.gather(*(client(ARGS.requests // ARGS.conns) for _ in range(ARGS.conns)))
    control("-d")
    await runtime.stop()


def main() -> None:
    procs = Procs()
    try:
        reply, content_type = REPLIES["sse" if ARGS.trace == "sse" else "json"]
        replicas = [free_port(), free_port()]
        nginx_fleet(procs, replicas, MODEL, reply(), content_type, "1", replica_metrics())
        uvloop.run(run(replicas))
    finally:
        procs.close()


if __name__ == "__main__":
    main()
