"""What the replica side of one exchange costs in Python, with no I/O: microseconds per exchange.

    python bench/relay_cost.py [--base-tree DIR] [--rounds 5] [--exchanges 30000]
                               [--out bench/results/relay_cost.md]

One `UpstreamConnection` of a real `UpstreamPool`, over a transport that only counts what it is
given, carries exchanges the way THE FAST PATH does (http/upstream.py): `take_now`, `send_now`
with a 3.8 KB request, then `data_received` with a whole answer, which rewrites and relays the
head with the body, finds the end and puts the connection back in the pool. The answer is the
bench replicas' completion (bench/overhead.py's `json_reply`, about 420 bytes) behind two heads:
nginx's (the bench replicas', with a `Connection` line to cut) and uvicorn's (vLLM's, with none).

Each figure is the fastest of 5 repeats, in CPU time of the process (the machine is shared). With
`--base-tree DIR` (a `git archive` of another revision) each round runs one process per tree,
trees alternating, and the table gives the medians over rounds and the per-round ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

BODY_PATH = Path(__file__).resolve().parent


def heads(length: int) -> dict[str, bytes]:
    return {
        "nginx": (
            b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Tue, 01 Dec 2026 19:35:22 GMT\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n"
            b"Last-Modified: Tue, 01 Dec 2026 19:35:00 GMT\r\nConnection: keep-alive\r\n"
            b'ETag: "692dbd84-1a0"\r\nAccept-Ranges: bytes\r\n\r\n' % length
        ),
        "uvicorn": (
            b"HTTP/1.1 200 OK\r\ndate: Tue, 01 Dec 2026 19:35:22 GMT\r\nserver: uvicorn\r\n"
            b"content-length: %d\r\ncontent-type: application/json\r\n\r\n" % length
        ),
    }


class _Transport:
    """Takes writes and flow-control calls, and counts the bytes written."""

    def __init__(self) -> None:
        self.written = 0

    def write(self, data: bytes) -> None:
        self.written += len(data)

    def writelines(self, data: Any) -> None:
        self.written += sum(len(d) for d in data)

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def abort(self) -> None:
        pass


class _Sink:
    """The client side of ResponseSink, writing into a counting transport."""

    keep_alive = True

    def __init__(self) -> None:
        self.out = _Transport()

    def head(self, status: int, data: bytes, body: Any = None) -> None:
        self.out.write(data)
        if body is not None:
            self.out.write(body)

    def write(self, data: bytes) -> None:
        self.out.write(data)

    def on_upstream(self, transport: object) -> None:
        pass


async def _child(exchanges: int) -> dict[str, float]:
    sys.path.insert(0, str(BODY_PATH))
    from lib.overhead_setup import json_reply

    from lora_router.config import ReplicaAddress
    from lora_router.http.upstream import UpstreamConnection, UpstreamPool

    pool = UpstreamPool(
        ReplicaAddress.parse("http://127.0.0.1:9"),
        b"0",
        None,
        connect_timeout=5.0,
        first_byte_timeout=60.0,
        stream_idle_timeout=60.0,
        idle_timeout=30.0,
        max_connections=64,
    )
    conn = UpstreamConnection(pool)
    conn.connection_made(_Transport())  # type: ignore[arg-type]
    pool.release(conn)  # idle, as after an earlier exchange
    request = b"x" * 3800
    body = json_reply().encode()
    ended: list[object] = []
    then = ended.append
    out: dict[str, float] = {}
    for name, head in heads(len(body)).items():
        answer = head + body
        sink = _Sink()
        best = float("inf")
        for _ in range(5):
            began = time.process_time()
            for _ in range(exchanges):
                taken = pool.take_now()
                assert taken is not None
                pool.send_now(taken, request, sink, then, http11=True)  # type: ignore[arg-type]
                taken.data_received(answer)
            best = min(best, (time.process_time() - began) / exchanges)
        if len(ended) != 5 * exchanges or any(e is not None for e in ended):
            raise RuntimeError(f"{name}: an exchange did not end complete")
        if sink.out.written < 5 * exchanges * len(body):
            raise RuntimeError(f"{name}: the client was not sent every body")
        ended.clear()
        out[name] = best * 1e6
    return out


def _run(tree: str | None, exchanges: int) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": tree} if tree else None
    argv = [sys.executable, __file__, "--child", "--exchanges", str(exchanges)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, check=True)
    return dict(json.loads(done.stdout))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base-tree")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--exchanges", type=int, default=30_000)
    p.add_argument("--out", default=str(BODY_PATH / "results" / "relay_cost.md"))
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        import uvloop  # the router's loop

        print(json.dumps(uvloop.run(_child(args.exchanges))))
        return
    trees: dict[str, str | None] = {"this tree": None}
    if args.base_tree:
        trees["base"] = args.base_tree
    rows: dict[str, list[dict[str, float]]] = {t: [] for t in trees}
    load = [os.getloadavg()[0]]
    for rnd in range(args.rounds):
        order = list(trees) if rnd % 2 == 0 else list(reversed(trees))
        for t in order:
            rows[t].append(_run(trees[t], args.exchanges))
        load.append(os.getloadavg()[0])
    command = " ".join(["python", "bench/relay_cost.py", *sys.argv[1:]])
    lines = [
        "# The replica side of one exchange, in Python (no I/O)",
        "",
        f"- command: `{command}`",
        f"- {args.rounds} rounds of {args.exchanges:,} exchanges, each figure the fastest of 5"
        " repeats in process CPU time; trees alternating within a round",
        f"- 1-minute load average: {', '.join(f'{x:.2f}' for x in load)}",
        "",
        "| head | "
        + " | ".join(f"{t} µs [min .. max]" for t in trees)
        + (" | this tree / base, per round |" if args.base_tree else " |"),
        "| --- | " + " | ".join("---:" for _ in trees) + (" | ---: |" if args.base_tree else " |"),
    ]
    for name in heads(0):
        cells = []
        for t in trees:
            v = [r[name] for r in rows[t]]
            cells.append(f"{statistics.median(v):.2f} [{min(v):.2f} .. {max(v):.2f}]")
        if args.base_tree:
            ratio = [
                a[name] / b[name] for a, b in zip(rows["this tree"], rows["base"], strict=True)
            ]
            cells.append(f"{statistics.median(ratio):.3f} [{min(ratio):.3f} .. {max(ratio):.3f}]")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
