"""The soak bench's hostile clients (bench/soak.py): one attack per function, each on its own
connection to the router, each bounded in time, each returning what the client saw.

An outcome is a short label: the status line the router answered, if any ("431"), then how the
connection ended: "closed" (the router closed it), "reset" (it reset it), "open" (still open when
the attack gave up waiting: the router did not end it within the bound), "refused" (no
connection). `AttackStats` keeps, per attack, the outcomes and the seconds the router took to
end the connection. The shapes mirror tests/http/test_smuggling.py, test_stalled_clients.py,
test_back_pressure.py, test_buffer_budget.py, test_lifetimes.py and test_cut_stream.py; here
they only repeat, many at once, for minutes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import orjson

HOST = "127.0.0.1"
PROMPT = list(range(1000, 1064))  # 64 token ids: a completion the emulator accepts
MODEL = "Qwen/Qwen2.5-Math-1.5B"  # the emulator's base model


@dataclass(frozen=True, slots=True)
class Limits:
    """The router's limits the attacks aim at (its flags in bench/soak.py)."""

    header_timeout: float
    body_timeout: float
    keepalive_timeout: float
    idle_timeout: float
    max_body_bytes: int
    max_header_bytes: int
    max_connections: int


@dataclass(slots=True)
class AttackStats:
    runs: int = 0
    outcomes: Counter[str] = field(default_factory=Counter)
    close_s: list[float] = field(default_factory=list)  # connection start -> the router's end

    def add(self, outcome: str, seconds: float | None) -> None:
        self.runs += 1
        self.outcomes[outcome] += 1
        if seconds is not None:
            self.close_s.append(seconds)


def completion_body(stream: bool, max_tokens: int = 16) -> bytes:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": stream}
    return orjson.dumps(body)


def post_head(path: bytes, length: int | None, extra: bytes = b"") -> bytes:
    framing = (
        b"transfer-encoding: chunked\r\n" if length is None else b"content-length: %d\r\n" % length
    )
    return (
        b"POST " + path + b" HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"
        + framing + extra + b"\r\n"
    )  # fmt: skip


async def connect(
    port: int, rcvbuf: int = 0, limit: int = 2**16
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        if rcvbuf:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (HOST, port))
    except BaseException:
        sock.close()
        raise
    return await asyncio.open_connection(sock=sock, limit=limit)


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with SO_LINGER 0: the kernel sends a RST, not a FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def ending(reader: asyncio.StreamReader, began: float, bound: float) -> tuple[str, float]:
    """Read until the router ends the connection or `bound` seconds from `began` pass: the
    status of the first answer ("" if none) plus how it ended, and when."""
    got = b""
    how = "open"
    try:
        while len(got) < 65536:
            left = began + bound - time.monotonic()
            if left <= 0:
                break
            chunk = await asyncio.wait_for(reader.read(65536), left)
            if not chunk:
                how = "closed"
                break
            got += chunk
        else:  # an answer longer than we keep: drain it without keeping it
            while (left := began + bound - time.monotonic()) > 0:
                if not await asyncio.wait_for(reader.read(65536), left):
                    how = "closed"
                    break
    except TimeoutError:
        pass
    except (ConnectionResetError, BrokenPipeError):
        how = "reset"
    status = got[9:12].decode("ascii", "replace") if got.startswith(b"HTTP/1.") else ""
    label = f"{status} {how}".strip()
    return label, time.monotonic() - began


async def _trickle(writer: asyncio.StreamWriter, data: bytes, every: float, until: float) -> bool:
    """Write `data` a byte every `every` seconds until `until`; False once the router is gone."""
    for i in range(len(data)):
        if time.monotonic() >= until:
            return True
        try:
            writer.write(data[i : i + 1])
            await writer.drain()
        except (ConnectionError, OSError):
            return False
        await asyncio.sleep(every)
    return True


class Attacks:
    """Every attack against one router; `run(name)` runs one and records its outcome."""

    def __init__(self, port: int, limits: Limits, seed: int = 0) -> None:
        self.port = port
        self.limits = limits
        self.rng = random.Random(seed)
        self.stats: dict[str, AttackStats] = {}
        self.errors: Counter[str] = Counter()  # attacks that failed on our side (connect ...)
        self.table: dict[str, Callable[[], Awaitable[tuple[str, float | None]]]] = {
            "slowloris head": self.slow_head,
            "trickled body": self.slow_body,
            "oversized head": self.big_head,
            "too many headers": self.many_headers,
            "content-length over cap": self.cl_over_cap,
            "chunked over cap": self.chunked_over_cap,
            "smuggling-shaped": self.smuggling,
            "pipelined, never read": self.pipelined_unread,
            "SSE, disconnect mid-stream": self.sse_disconnect,
            "RST mid-request": self.rst_mid_request,
            "RST mid-stream": self.rst_mid_stream,
            "idle connection": self.idle,
            "garbage bytes": self.garbage,
        }

    async def run(self, name: str) -> None:
        began = time.monotonic()
        stats = self.stats.setdefault(name, AttackStats())
        try:
            outcome, seconds = await asyncio.wait_for(self.table[name](), self.bound(name) + 10)
        except TimeoutError:
            outcome, seconds = "attack timed out", None
        except Exception as exc:  # our side failed (connect ...): counted, the loop goes on
            self.errors[f"{name}: {type(exc).__name__}"] += 1
            outcome, seconds = f"error {type(exc).__name__}", time.monotonic() - began
        stats.add(outcome, seconds)

    def bound(self, name: str) -> float:
        """Longest an attack waits for the router to end its connection."""
        lim = self.limits
        return {
            "slowloris head": lim.header_timeout + 10,
            "trickled body": lim.header_timeout + lim.body_timeout + 10,
            "pipelined, never read": lim.idle_timeout + lim.keepalive_timeout + 15,
            "idle connection": lim.keepalive_timeout + 10,
        }.get(name, 15.0)

    # --- the attacks -----------------------------------------------------------------------

    async def slow_head(self) -> tuple[str, float | None]:
        """A head trickled a byte every 0.2 s, never finished (slowloris)."""
        began = time.monotonic()
        reader, writer = await connect(self.port)
        try:
            head = b"POST /v1/completions HTTP/1.1\r\nhost: soak\r\n" + b"x-slow: " + b"a" * 400
            waiter = asyncio.ensure_future(ending(reader, began, self.bound("slowloris head")))
            await _trickle(writer, head, 0.2, began + self.bound("slowloris head"))
            return await waiter
        finally:
            writer.close()

    async def slow_body(self) -> tuple[str, float | None]:
        """A whole head, then its body a byte every 0.2 s, never finished."""
        began = time.monotonic()
        reader, writer = await connect(self.port)
        try:
            body = completion_body(False)
            writer.write(post_head(b"/v1/completions", len(body) + 5000))
            waiter = asyncio.ensure_future(ending(reader, began, self.bound("trickled body")))
            await _trickle(writer, body + b" " * 5000, 0.2, began + self.bound("trickled body"))
            return await waiter
        finally:
            writer.close()

    async def big_head(self) -> tuple[str, float | None]:
        """A head past --max-header-bytes, sent at once."""
        value = b"b" * 4000
        n = self.limits.max_header_bytes // 4000 + 4
        head = b"GET /v1/models HTTP/1.1\r\nhost: soak\r\n"
        return await self._sent_whole(
            head + b"".join(b"x-big-%d: %s\r\n" % (i, value) for i in range(n)) + b"\r\n"
        )

    async def many_headers(self) -> tuple[str, float | None]:
        head = b"GET /v1/models HTTP/1.1\r\nhost: soak\r\n"
        return await self._sent_whole(
            head + b"".join(b"x-h-%d: 1\r\n" % i for i in range(300)) + b"\r\n"
        )

    async def cl_over_cap(self) -> tuple[str, float | None]:
        """A Content-Length over --max-body-bytes, and the start of such a body."""
        head = post_head(b"/v1/completions", 4 * self.limits.max_body_bytes)
        return await self._sent_whole(head + b"{" + b" " * 65536)

    async def chunked_over_cap(self) -> tuple[str, float | None]:
        """A chunked body sent in 64 KiB chunks until it passes --max-body-bytes (or the
        router stops it)."""
        began = time.monotonic()
        reader, writer = await connect(self.port)
        try:
            chunk = b"10000\r\n" + b" " * 65536 + b"\r\n"
            waiter = asyncio.ensure_future(ending(reader, began, 15))
            with contextlib.suppress(ConnectionError, OSError):
                writer.write(post_head(b"/v1/completions", None))
                for _ in range(self.limits.max_body_bytes // 65536 + 8):
                    if waiter.done():
                        break
                    writer.write(chunk)
                    await asyncio.wait_for(writer.drain(), 5)
            return await waiter
        finally:
            writer.close()

    async def smuggling(self) -> tuple[str, float | None]:
        """One of the malformed or ambiguous heads of tests/http/test_smuggling.py, followed
        by a hidden request that must never be answered."""
        shape = self.rng.choice(SMUGGLING)
        return await self._sent_whole(shape + b"GET /hidden HTTP/1.1\r\nhost: soak\r\n\r\n")

    async def pipelined_unread(self) -> tuple[str, float | None]:
        """64 requests pipelined at once (listings and completions, some streamed) on a
        connection whose receive buffer is 4 KiB and is never read."""
        began = time.monotonic()
        _, writer = await connect(self.port, rcvbuf=4096, limit=1024)
        try:
            listing = b"GET /v1/models HTTP/1.1\r\nhost: soak\r\n\r\n"
            body = completion_body(True, 64)
            stream = post_head(b"/v1/completions", len(body)) + body
            with contextlib.suppress(ConnectionError, OSError):
                writer.write(b"".join(stream if i % 4 == 0 else listing for i in range(64)))
                await writer.drain()
            # Never read: wait for the router to end the connection, seen in the socket's TCP
            # state (its answers stay unread in our buffer, so EOF is never reached).
            bound = self.bound("pipelined, never read")
            while time.monotonic() - began < bound:
                await asyncio.sleep(0.5)
                if _peer_closed(writer, self.port):
                    return "closed", time.monotonic() - began
            return "open", None
        finally:
            writer.close()

    async def sse_disconnect(self) -> tuple[str, float | None]:
        """A streamed completion left after its first frame (FIN)."""
        began = time.monotonic()
        reader, writer = await connect(self.port)
        try:
            status = await _first_frame(reader, writer, completion_body(True, 200))
            return f"{status} left", time.monotonic() - began
        finally:
            writer.close()

    async def rst_mid_request(self) -> tuple[str, float | None]:
        """A head and half its body, then a reset."""
        began = time.monotonic()
        _, writer = await connect(self.port)
        body = completion_body(False)
        writer.write(post_head(b"/v1/completions", len(body)) + body[: len(body) // 2])
        await writer.drain()
        await asyncio.sleep(self.rng.uniform(0.0, 0.5))
        reset(writer)
        return "reset sent", time.monotonic() - began

    async def rst_mid_stream(self) -> tuple[str, float | None]:
        """A streamed completion reset (SO_LINGER 0) after its first frame."""
        began = time.monotonic()
        reader, writer = await connect(self.port)
        try:
            status = await _first_frame(reader, writer, completion_body(True, 200))
        finally:
            reset(writer)
        return f"{status} reset sent", time.monotonic() - began

    async def idle(self) -> tuple[str, float | None]:
        """A connection opened and never written to."""
        began = time.monotonic()
        reader, writer = await connect(self.port)
        try:
            return await ending(reader, began, self.bound("idle connection"))
        finally:
            writer.close()

    async def garbage(self) -> tuple[str, float | None]:
        """Random bytes, 1-16 KiB."""
        return await self._sent_whole(os.urandom(self.rng.randrange(1024, 16384)))

    async def _sent_whole(self, data: bytes) -> tuple[str, float | None]:
        """`data` written on a new connection at once, then how the router ended it (within
        15 s)."""
        began = time.monotonic()
        reader, writer = await connect(self.port)
        try:
            with contextlib.suppress(ConnectionError, OSError):
                writer.write(data)
                await writer.drain()
            return await ending(reader, began, 15)
        finally:
            writer.close()

    # --- many connections at once ----------------------------------------------------------

    async def burst(self, extra: int = 16, hold: float = 3.0) -> dict[str, object]:
        """Open --max-connections connections plus `extra` (the router's own count includes
        the good client's), hold them `hold` s, close them all. Returns what the client saw:
        connections opened, answered 503 (past the cap), left open by the router."""
        began = time.monotonic()
        conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        failed = 0
        gate = asyncio.Semaphore(128)

        async def one() -> None:
            nonlocal failed
            async with gate:
                try:
                    conns.append(await asyncio.wait_for(connect(self.port), 10))
                except (OSError, TimeoutError):
                    failed += 1

        await asyncio.gather(*(one() for _ in range(self.limits.max_connections + extra)))
        opened = time.monotonic() - began
        await asyncio.sleep(hold)
        refused = 0
        for reader, _ in conns:
            # A connection past the cap was answered 503 and closed at once.
            if reader.at_eof() or len(reader._buffer):  # type: ignore[attr-defined]
                with contextlib.suppress(Exception):
                    head = bytes(reader._buffer[:12])  # type: ignore[attr-defined]
                    if head.startswith(b"HTTP/1.1 503"):
                        refused += 1
        for _, writer in conns:
            writer.close()
        await asyncio.sleep(0.5)
        return {
            "asked": self.limits.max_connections + extra,
            "opened": len(conns),
            "connect_failed": failed,
            "answered_503": refused,
            "open_s": round(opened, 2),
        }


async def _first_frame(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, body: bytes
) -> str:
    """Send a streamed completion, read up to its first SSE frame; its status ("200"), or
    what came instead."""
    writer.write(post_head(b"/v1/completions", len(body)) + body)
    try:
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 15)
        status = head[9:12].decode("ascii", "replace")
        if status != "200":
            return status
        await asyncio.wait_for(reader.readuntil(b"\n\n"), 15)
        return status
    except (asyncio.IncompleteReadError, asyncio.LimitOverrunError):
        return "cut"
    except TimeoutError:
        return "no frame in 15 s"


def _peer_closed(writer: asyncio.StreamWriter, router_port: int) -> bool:
    """Whether the router has ended a connection we never read. Our side cannot tell: the
    router's FIN waits behind the answers we do not read. So look at the router's side of it
    in /proc/net/tcp: gone, no longer ESTABLISHED, or an orphan (inode 0: no process holds it).
    """
    sock = writer.get_extra_info("socket")
    if sock is None:
        return True
    ours = f":{sock.getsockname()[1]:04X}"
    theirs = f":{router_port:04X}"
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            parts = line.split()
            if parts[1].endswith(theirs) and parts[2].endswith(ours):
                return parts[3] != "01" or parts[9] == "0"
    return True


SMUGGLING = [
    b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 6\r\n"
    b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n"
    b"content-length: 6\r\n\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 0\r\ncontent-length: 5\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 2, 2\r\n\r\nab",
    b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: +2\r\n\r\nab",
    b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ntransfer-encoding: gzip, chunked\r\n\r\n"
    b"0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n"
    b"transfer-encoding: identity\r\n\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ntransfer-encoding : chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n\r\n"
    b"zz\r\nab\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n\r\n"
    b"fffffffffffffffffff\r\n",
    b"GET /v1/models HTTP/1.1\nhost: r\n\n",
    b"GET /v1/models HTTP/1.1\r\nhost: r\r\nx: a\rb\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nhost: r\r\nx-a: 1\r\n x-b: 2\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nhost: r\r\nx-a: a\x00b\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nhost: r\r\nx a: 1\r\n\r\n",
    b"GET /v1/models\r\n\r\n",
    b"GET /v1/models HTTP/1.1\r\nhost: r\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n",
    b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nhost: r\r\n\r\n",
]
