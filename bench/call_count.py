"""Python calls per routed request: how much interpreted work lora-router does for one request.

On this machine a Python-level call (with the work in its body) costs about as much as the
whole floor proxy's request (bench/floor.py, bench/overhead.py) spends in the interpreter, so
the count of calls per request is the figure the request path's CPU follows. This counts them
exactly, with `sys.setprofile`, instead of sampling:

- a router runs in this process (from this checkout, or from `--tree DIR`, an A/B with a
  `git archive` of another revision), in front of two instant nginx replicas;
- one keep-alive client in the same process sends the siblings trace of bench/overhead.py
  (TRL's 512-token payload, a prompt per G = 8 requests, a seed per request), one request at a
  time, `--warm-up` requests first;
- for `--requests` requests, every call into or out of router code is counted: Python calls
  (a router function, or any Python function a router function calls), C calls made from
  router code, and the entries from C into router code (the protocol callbacks the event loop
  makes); then the Python calls by module and the callees, most called first.
The client's own calls (asyncio streams) are not counted.

    python bench/call_count.py
    python bench/call_count.py --tree /tmp/base   # the same for another source tree
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import re
import sys
from pathlib import Path
from types import FrameType

parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
parser.add_argument("--tree", help="run lora_router from this source tree")
parser.add_argument("--requests", type=int, default=800)
parser.add_argument("--warm-up", type=int, default=300)
parser.add_argument("--top", type=int, default=60, help="callees listed")
parser.add_argument(
    "--trace", choices=("siblings", "fresh"), default="siblings", help="fresh: a new prompt each"
)
ARGS = parser.parse_args()
if ARGS.tree:
    sys.path.insert(0, str(Path(ARGS.tree).resolve()))
sys.path.insert(1, str(Path(__file__).resolve().parent))

import uvloop  # noqa: E402
from lib.nginx import nginx_fleet  # noqa: E402
from lib.overhead_setup import GROUP, MODEL, Payload, json_reply, replica_metrics  # noqa: E402
from lib.procs import Procs, free_port  # noqa: E402

import lora_router  # noqa: E402
from lora_router.cli import build_config, build_parser  # noqa: E402
from lora_router.runtime import RouterRuntime  # noqa: E402

ROUTER_CODE = str(Path(lora_router.__file__).resolve().parent)


class Counts:
    """The calls seen while a profile function is set."""

    def __init__(self) -> None:
        self.python = self.c = self.entries = 0
        self.callees: collections.Counter[str] = collections.Counter()
        self.files: collections.Counter[str] = collections.Counter()  # Python calls by module

    @staticmethod
    def ours(frame: FrameType | None) -> bool:
        return frame is not None and frame.f_code.co_filename.startswith(ROUTER_CODE)

    def profile(self, frame: FrameType, event: str, arg: object) -> None:
        if event == "call":
            caller = frame.f_back
            if self.ours(frame) or self.ours(caller):
                self.python += 1
                code = frame.f_code
                self.callees[f"{code.co_name} ({os.path.basename(code.co_filename)})"] += 1
                where = code.co_filename
                self.files[where[len(ROUTER_CODE) + 1 :] if self.ours(frame) else where] += 1
                if self.ours(frame) and not self.ours(caller):
                    self.entries += 1
        elif event == "c_call" and self.ours(frame):
            self.c += 1
            self.callees[f"C {getattr(arg, '__qualname__', arg)}"] += 1


async def run(replicas: list[int], counts: Counts) -> None:
    port = free_port()
    argv = ["--replicas", ",".join(f"http://127.0.0.1:{p}" for p in replicas)]
    argv += ["--no-token", "--port", str(port), "--log-level", "warning"]
    runtime = RouterRuntime(build_config(build_parser().parse_args(argv), os.environ))
    await runtime.start()
    payload = Payload.make(512)
    group = 1 if ARGS.trace == "fresh" else GROUP
    reader, writer = await asyncio.open_connection("127.0.0.1", port)

    async def one(i: int) -> None:
        body = payload.body(1, i // group, random.getrandbits(63))
        head = f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body)
        answer = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", answer)
        assert answer.startswith(b"HTTP/1.1 200") and length, answer
        await reader.readexactly(int(length.group(1)))

    try:
        for i in range(ARGS.warm_up):
            await one(i)
        sys.setprofile(counts.profile)
        for i in range(ARGS.warm_up, ARGS.warm_up + ARGS.requests):
            await one(i)
        sys.setprofile(None)
    finally:
        writer.close()
        await runtime.stop()


def main() -> None:
    procs = Procs()
    counts = Counts()
    try:
        replicas = [free_port(), free_port()]
        nginx_fleet(
            procs, replicas, MODEL, json_reply(), "application/json", "1", replica_metrics()
        )
        uvloop.run(run(replicas, counts))
    finally:
        procs.close()
    n = ARGS.requests
    print(f"lora_router from {ROUTER_CODE}; {n} requests of the {ARGS.trace} trace, one at a time")
    print(
        f"per request: {counts.python / n:.1f} Python calls, {counts.c / n:.1f} C calls from "
        f"router code, {counts.entries / n:.1f} entries from C into router code"
    )
    print("Python calls by module:")
    for name, k in counts.files.most_common():
        print(f"{k / n:7.2f}  {name}")
    print("callees:")
    for name, k in counts.callees.most_common(ARGS.top):
        print(f"{k / n:7.2f}  {name}")


if __name__ == "__main__":
    main()
