"""The overhead bench's memory phases: RSS per open stream (replicas that hold their streams)
and the affinity table's plateau after many distinct prompts."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .nginx import WRK_REPORT, models_json, server_info_json
from .overhead_setup import (
    GROUP,
    LOAD_CPU,
    MODEL,
    PROXIES,
    STREAM_REPLICAS,
    STREAM_TOKENS,
    TABLE_LIMIT_S,
    TABLE_TOKENS,
    BenchFailure,
    Payload,
    Start,
    check_trace,
    decisions,
    fmt,
    launch,
    lora_router_from,
    new_script,
    nonces,
    replica_metrics,
    spread,
)
from .overhead_windows import (
    rotated,
)
from .procs import (
    Procs,
    free_port,
    pinned,
    rss_kib,
    source_tree,
    wait_port,
)

OVERHEAD = Path(__file__).resolve().parents[1] / "overhead.py"  # runs `--hold-replica`

# --- open streams -----------------------------------------------------------------------------


class HoldReplica(asyncio.Protocol):
    """A replica that answers a completion with an SSE head and one chunk, then holds the
    stream until the client goes; GETs get what a router reads at start."""

    GETS = {
        b"/health": ("application/json", "{}"),
        b"/v1/models": ("application/json", models_json(MODEL)),
        b"/server_info": ("application/json", server_info_json()),
        b"/metrics": ("text/plain", replica_metrics().decode()),
    }
    CHUNK = (
        b'data: {"id":"cmpl-bench","object":"text_completion","model":"'
        + MODEL.encode()
        + b'","choices":[{"index":0,"text":" The","logprobs":null,"finish_reason":null}]}\n\n'
    )
    HOLD = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
        b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(CHUNK), CHUNK)
    )

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.buf = bytearray()
        self.need: int | None = None
        self.line: list[bytes] = []

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            if self.need is None:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self.buf[:end])
                self.line = head.split(b"\r\n", 1)[0].split(b" ")
                length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
                self.need = end + 4 + (int(length.group(1)) if length else 0)
            if len(self.buf) < self.need:
                return
            del self.buf[: self.need]
            self.need = None
            self.answer(self.line[0], self.line[1].split(b"?")[0])

    def answer(self, method: bytes, path: bytes) -> None:
        if method == b"POST" and path == b"/v1/completions":
            self.transport.write(self.HOLD)
            return
        ctype, text = self.GETS.get(path, ("text/plain", ""))
        status = b"200 OK" if path in self.GETS else b"404 Not Found"
        body = text.encode()
        self.transport.write(
            b"HTTP/1.1 %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (status, ctype.encode(), len(body), body)
        )


async def serve_hold(ports: list[int]) -> None:
    loop = asyncio.get_running_loop()
    for port in ports:
        await loop.create_server(HoldReplica, "127.0.0.1", port, backlog=4096)
    await asyncio.Event().wait()


async def open_streams(
    port: int, payload: Payload, first: int, count: int, conns: list[asyncio.StreamWriter]
) -> None:
    """Open `count` more streams through the proxy on `port` (prompts in groups of G, a seed
    each), each held once its first SSE chunk has arrived."""
    nonce = next(nonces)
    gate = asyncio.Semaphore(64)

    async def one(i: int) -> None:
        body = payload.body(nonce, (first + i) // GROUP, random.getrandbits(63))
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        ).encode()
        async with gate:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            conns.append(writer)
            writer.write(head + body)
            await reader.readuntil(b"data: ")

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(count))), timeout=120)


@dataclass
class StreamSample:
    contender: str
    round: int
    before_kib: int
    with_open_kib: dict[int, int]  # open streams: RSS
    after_close_kib: int

    def per_stream_kib(self, n: int) -> float:
        return (self.with_open_kib[n] - self.before_kib) / n


async def hold_streams(port: int, pid: int, counts: Sequence[int]) -> tuple[int, dict[int, int]]:
    payload = Payload.make(STREAM_TOKENS, stream=True)
    conns: list[asyncio.StreamWriter] = []
    await open_streams(port, payload, 0, 64, conns)  # warm-up: pools, buffers, code paths
    for w in conns:
        w.close()
    conns.clear()
    await asyncio.sleep(1.0)  # let the proxy notice the closes before the baseline
    before = rss_kib(pid)
    open_kib: dict[int, int] = {}
    try:
        for n in counts:
            await open_streams(port, payload, len(conns), n - len(conns), conns)
            open_kib[n] = rss_kib(pid)
            print(f"    {n} streams open: {open_kib[n] / 1024:.1f} MiB", flush=True)
    finally:
        for w in conns:
            w.close()
    return before, open_kib


def streams(procs: Procs, start: dict[str, Start], args: argparse.Namespace) -> list[StreamSample]:
    ports = [free_port() for _ in range(STREAM_REPLICAS)]
    hold = procs.start(
        [sys.executable, str(OVERHEAD), "--hold-replica", ",".join(map(str, ports))], cpus=LOAD_CPU
    )
    for port in ports:
        wait_port(port)
    out = []
    for rnd in range(args.stream_rounds):
        for name in rotated(PROXIES, rnd):
            print(f"  streams r{rnd} {name}", flush=True)
            port = free_port()
            proc = start[name](procs, port, ports)
            assert proc is not None
            try:
                wait_port(port, timeout=90)
                before, open_kib = asyncio.run(hold_streams(port, proc.pid, args.streams))
            except (RuntimeError, OSError, TimeoutError, asyncio.IncompleteReadError) as e:
                raise BenchFailure(
                    f"{name} did not hold the streams: {e!r}\n{procs.log_tail(proc.pid)}"
                ) from e
            time.sleep(2.0)  # the closes reach the proxy and its upstreams
            out.append(StreamSample(name, rnd, before, open_kib, rss_kib(proc.pid)))
            procs.stop(proc)
    procs.stop(hold)
    return out


# --- the affinity table's plateau -------------------------------------------------------------


@dataclass
class TableSample:
    contender: str
    prompts: int  # distinct prompts answered so far (0: started, one request)
    rss_kib: int
    rps: float  # while filling up to `prompts`


def fill_script(tmp: Path, payload: Payload, count: int) -> Path:
    """A wrk script sending `count` distinct prompts (under a nonce no other script uses), each
    once, that stops sending and writes `<script>.done` once `count` were answered (wrk itself
    then waits out its duration: the caller interrupts it)."""
    nonce, path, head = new_script(tmp, payload, "fill")
    path.write_text(
        head
        + f"""local sent, answered = 0, 0
request = function()
  local n = sent
  sent = sent + 1
  local body = prefix .. "{nonce}, " .. (n % 100000) .. ", " .. math.floor(n / 100000)
    .. rest .. sent .. suffix
  return wrk.format("POST", nil, headers, body)
end
response = function(status, headers, body)
  answered = answered + 1
  if answered == {count} then
    local marker = io.open("{path}.done", "w")
    marker:write(answered)
    marker:close()
    wrk.thread:stop()
  end
end
{WRK_REPORT}
"""
    )
    return path


def table_contenders(
    procs: Procs, start: dict[str, Start], args: argparse.Namespace
) -> dict[str, Start]:
    """The plateau's contenders: lora-router of this tree, of `--table-base` if given (its
    `git archive`, run with PYTHONPATH on it), and vllm-router."""
    out = {"lora-router": start["lora-router"]}
    if args.table_base:
        tree = source_tree(args.table_base, procs.tmp / f"tree-{args.table_base}")
        out[f"lora-router {args.table_base}"] = lora_router_from(str(tree))
    out["vllm-router"] = start["vllm-router"]
    return out


def table(
    procs: Procs, start: dict[str, Start], fleet: list[int], args: argparse.Namespace
) -> list[TableSample]:
    """Each contender's RSS, idle, after `args.table` distinct prompts of TABLE_TOKENS tokens
    (every prompt new: they differ from their first token). The contenders run side by side
    and are filled step by step in turn, so each step of each is measured on the same machine
    load; a lora-router must count every prompt as fresh."""
    contenders = table_contenders(procs, start, args)
    running = {name: launch(procs, s, name, fleet[:2]) for name, s in contenders.items()}
    out = [TableSample(name, 0, rss_kib(inst.pid or 0), 0.0) for name, inst in running.items()]
    payload = Payload.make(TABLE_TOKENS)
    done = 0
    for target in args.table:
        for name, inst in running.items():
            script = fill_script(procs.tmp, payload, target - done)
            url = f"http://127.0.0.1:{inst.port}/v1/completions"
            argv = ["wrk", "-t1", "-c64", f"-d{TABLE_LIMIT_S}s", "--timeout", "10s"]
            argv = pinned([*argv, "-s", str(script), url], LOAD_CPU)
            counts = decisions(inst.port) if name.startswith("lora-router") else None
            began = time.monotonic()
            runner = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True)
            try:
                while not Path(f"{script}.done").exists():
                    if runner.poll() is not None:
                        raise BenchFailure(f"{name} did not answer {target:,} prompts in time")
                    time.sleep(0.25)
            finally:
                runner.send_signal(signal.SIGINT)  # wrk prints its summary and exits
                printed, _ = runner.communicate(timeout=30)
            took = time.monotonic() - began
            line = next((ln for ln in printed.splitlines() if ln.startswith("WRKJSON ")), "")
            res = json.loads(line[len("WRKJSON ") :] or "{}")
            if res.get("status_errors", 1) or res.get("requests", 0) < target - done:
                raise BenchFailure(f"{name} did not answer {target:,} prompts:\n{printed}")
            if counts is not None:
                check_trace("fresh", counts, decisions(inst.port))  # every prompt was new
            time.sleep(1.0)  # the requests cut off by wrk's stop reach the proxy and go
            out.append(TableSample(name, target, rss_kib(inst.pid or 0), res["requests"] / took))
            print(f"  {name}, {target:,} prompts: {out[-1].rss_kib / 1024:.1f} MiB", flush=True)
        done = target
    for inst in running.values():
        if inst.proc is not None:
            procs.stop(inst.proc)
    return out


def streams_markdown(streams: Sequence[StreamSample]) -> list[str]:
    out = [
        f"## RSS per open stream ({STREAM_TOKENS:,}-token prompts, "
        f"{STREAM_REPLICAS} holding replicas)",
        "",
    ]
    counts = sorted({n for s in streams for n in s.with_open_kib})
    out += [
        "| contender | RSS before MiB | "
        + " | ".join(f"RSS with {n:,} MiB | KiB/stream at {n:,}" for n in counts)
        + " | RSS after close MiB |",
        "| --- | ---: |" + " ---: | ---: |" * len(counts) + " ---: |",
    ]
    for name in PROXIES:
        mine = [s for s in streams if s.contender == name]
        if not mine:
            continue
        cells = [fmt(spread([s.before_kib / 1024 for s in mine]), ".1f")]
        for n in counts:
            cells.append(fmt(spread([s.with_open_kib[n] / 1024 for s in mine]), ".1f"))
            cells.append(fmt(spread([s.per_stream_kib(n) for s in mine]), ".1f"))
        cells.append(fmt(spread([s.after_close_kib / 1024 for s in mine]), ".1f"))
        out.append(f"| {name} | " + " | ".join(cells) + " |")
    return out


def table_markdown(samples: Sequence[TableSample]) -> list[str]:
    names = list(dict.fromkeys(t.contender for t in samples))
    steps = sorted({t.prompts for t in samples})
    at = {(t.contender, t.prompts): t for t in samples}
    out = [
        f"## RSS with distinct {TABLE_TOKENS:,}-token prompts (default affinity table)",
        "",
        "RSS MiB after that many distinct prompts answered (req/s while filling up to it).",
        "",
        "| distinct prompts | " + " | ".join(names) + " |",
        "| ---: |" + " ---: |" * len(names),
    ]
    for n in steps:
        label = "0 (started, one request)" if n == 0 else f"{n:,}"
        cells = [
            f"{at[name, n].rss_kib / 1024:.1f}"
            + ("" if n == 0 else f" ({at[name, n].rps:,.0f} req/s)")
            for name in names
        ]
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return out
