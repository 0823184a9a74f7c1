"""Test harness of the data-plane tests: a fake replica whose every write the test controls, a
raw-socket client, router configs with short timeouts, and the capture behind the token scan."""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httptools

from lora_router.config import Secret

TOKEN = "hf_tok3n-NEVER-LEAK-7d1c"
API_KEY = "client-key-5b2e"


# -- a fake replica ---------------------------------------------------------------------------


@dataclass
class Received:
    """One well-formed request a replica parsed."""

    method: bytes
    target: bytes
    headers: list[tuple[bytes, bytes]]  # names lower-cased
    body: bytes
    conn: int  # which replica connection it came on (0, 1, ...)

    def header(self, name: bytes) -> bytes | None:
        values = self.all(name)
        return values[0] if values else None

    def all(self, name: bytes) -> list[bytes]:
        return [v for k, v in self.headers if k == name]


class _RequestParser:
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.done: list[tuple[bytes, bytes, list[tuple[bytes, bytes]], bytes]] = []
        self._url = b""
        self._headers: list[tuple[bytes, bytes]] = []
        self._body = b""

    def on_message_begin(self) -> None:
        self._url, self._headers, self._body = b"", [], b""

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_body(self, body: bytes) -> None:
        self._body += body

    def on_message_complete(self) -> None:
        self.done.append((self.parser.get_method(), self._url, self._headers, self._body))


class ReplicaConn:
    """The replica's side of one connection from the router; a responder writes through it."""

    def __init__(self, index: int, writer: asyncio.StreamWriter) -> None:
        self.index = index
        self.writer = writer
        self.closed = asyncio.Event()  # set when the router closed (or reset) the connection
        self.control = False

    async def write(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    def abort(self) -> None:
        self.writer.transport.abort()


Responder = Callable[[Received, ReplicaConn], Awaitable[None]]


def json_response(
    body: bytes = b'{"ok":true}', status: bytes = b"200 OK", extra: bytes = b""
) -> bytes:
    return (
        b"HTTP/1.1 "
        + status
        + b"\r\ncontent-type: application/json\r\n"
        + extra
        + b"content-length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


async def ok_responder(req: Received, conn: ReplicaConn) -> None:
    await conn.write(json_response())


MODELS = b'{"object":"list","data":[{"id":"base","root":"base","max_model_len":4096}]}'
SERVER_INFO = (
    b'{"vllm_config":{"lora_config":{"max_lora_rank":16,"max_loras":6,"max_cpu_loras":6},'
    b'"cache_config":{"block_size":16},"parallel_config":{"data_parallel_size":1}}}'
)


async def control_responder(req: Received, conn: ReplicaConn) -> None:
    """What the router's control plane asks at start and in health checks: a healthy vLLM."""
    path = req.target.partition(b"?")[0]  # may carry the replica URL's path prefix
    body = MODELS if path.endswith(b"/v1/models") else b""
    body = SERVER_INFO if path.endswith(b"/server_info") else body
    await conn.write(json_response(body))


class FakeReplica:
    """A raw asyncio HTTP server standing in for vLLM: records exactly what it received and lets
    the test decide every byte (and every split and delay) of the answer."""

    def __init__(
        self, responder: Responder = ok_responder, ssl_context: ssl.SSLContext | None = None
    ):
        self.responder = responder
        self.ssl_context = ssl_context
        self.requests: list[Received] = []
        self.conns: list[ReplicaConn] = []
        self.malformed: list[bytes] = []  # raw input of connections the replica could not parse
        self.control_requests: list[Received] = []  # discovery and health checks (aiohttp)
        self.control_conns: list[ReplicaConn] = []
        self.request_arrived = asyncio.Event()
        self.active = 0  # requests being answered right now
        self.peak_active = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> FakeReplica:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.ssl_context)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        scheme = "https" if self.ssl_context else "http"
        host = "localhost" if self.ssl_context else "127.0.0.1"
        return f"{scheme}://{host}:{self.port}"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in self.conns:
            conn.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # Reading and answering run side by side, so the replica sees the router close the
        # connection even while it is "generating".
        conn = ReplicaConn(-1, writer)
        queue: asyncio.Queue[Received] = asyncio.Queue()
        answering = asyncio.create_task(self._answer(conn, queue))
        parser = _RequestParser()
        raw = b""
        try:
            while True:
                data = await reader.read(65536)
                if not data:
                    break
                raw += data
                try:
                    parser.parser.feed_data(data)
                except httptools.HttpParserError:
                    self.malformed.append(raw)
                    break
                while parser.done:
                    method, url, headers, body = parser.done.pop(0)
                    if conn.index < 0:
                        # The router's control plane (aiohttp: discovery, health) or its data
                        # plane; tests look at the data plane only.
                        agent = dict(headers).get(b"user-agent", b"")
                        conn.control = b"aiohttp" in agent
                        conns = self.control_conns if conn.control else self.conns
                        conn.index = len(conns)
                        conns.append(conn)
                    req = Received(method, url, headers, body, conn.index)
                    if conn.control:
                        self.control_requests.append(req)
                    else:
                        self.requests.append(req)
                        self.request_arrived.set()
                    queue.put_nowait(req)
        except (ConnectionError, ssl.SSLError):
            pass
        finally:
            conn.closed.set()
            answering.cancel()
            writer.close()

    async def _answer(self, conn: ReplicaConn, queue: asyncio.Queue[Received]) -> None:
        while True:
            req = await queue.get()
            self.active += 1
            self.peak_active = max(self.peak_active, self.active)
            try:
                await (control_responder if conn.control else self.responder)(req, conn)
            except (ConnectionError, ssl.SSLError):
                return
            finally:
                self.active -= 1

    async def wait_requests(self, n: int, timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while len(self.requests) < n:
                self.request_arrived.clear()
                await self.request_arrived.wait()


# -- routers ----------------------------------------------------------------------------------

FORWARDED_NAMES = (
    *("", "a", "alive", "anything", "b", "big", "c", "d", "e", "fast", "first", "hidden"),
    *("last", "next", "one", "second", "slow", "stream", "two", "x"),
)
# Short deadlines so every timeout path finishes within a test's budget.
TEST_CONFIG = dict(
    token=Secret(TOKEN),
    port=0,
    connect_timeout=2.0,
    first_byte_timeout=5.0,
    idle_timeout=5.0,
    header_timeout=5.0,
    body_timeout=5.0,
    keepalive_timeout=10.0,
    upstream_idle_timeout=10.0,
    shutdown_grace=1.0,
    health_interval=3600.0,
    status_interval=0.0,
    policy="round-robin",
    # The paths these tests send through the forwarding path (any method, one replica), opened
    # as an operator would with --forward-path: vLLM has no such routes, so unopened they
    # answer 404 (tests/http/test_routes.py).
    forward_paths=tuple(f"/{name}" for name in FORWARDED_NAMES),
)


# -- a raw client -----------------------------------------------------------------------------


@dataclass
class Response:
    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    raw: bytes
    keep_alive: bool

    def header(self, name: bytes) -> bytes | None:
        for k, v in self.headers:
            if k == name:
                return v
        return None

    def json(self) -> Any:
        import orjson

        return orjson.loads(self.body)


class _ResponseParser:
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.head_done = False
        self.complete = False

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self.head_done = True

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


RECEIVED: list[bytes] = []  # every byte any RawClient of the running test read


class RawClient:
    """A client on a bare socket: sends exactly the bytes given, parses what comes back."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self._pending = b""

    @classmethod
    async def connect(cls, url_or_port: str | int) -> RawClient:
        port = url_or_port if isinstance(url_or_port, int) else int(url_or_port.rsplit(":", 1)[1])
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def _read(self) -> bytes:
        if self._pending:
            data, self._pending = self._pending, b""
            return data
        data = await self.reader.read(65536)
        RECEIVED.append(data)
        return data

    async def response(self, timeout: float = 10.0, head: bool = False) -> Response:
        """Read one whole response (`head`: to a HEAD request). Raises EOFError on a close."""
        async with asyncio.timeout(timeout):
            while True:
                parsed = _ResponseParser()
                raw = b""
                while not parsed.complete:
                    data = await self._read()
                    if not data:
                        if parsed.head_done and not _framed(parsed.headers):
                            parsed.complete = True  # close-delimited body
                            break
                        raise EOFError(f"connection closed after {raw!r}")
                    raw += data
                    try:
                        parsed.parser.feed_data(data)
                    except httptools.HttpParserUpgrade:
                        break
                    if head and parsed.head_done:
                        parsed.complete = True
                status = parsed.parser.get_status_code()
                end = _message_end(raw, parsed, head)
                self._pending = raw[end:]
                if 100 <= status < 200:
                    continue  # an interim response; the final one follows
                return Response(
                    status=status,
                    headers=parsed.headers,
                    body=parsed.body,
                    raw=raw[:end],
                    keep_alive=parsed.parser.should_keep_alive(),
                )

    async def read_all(self, timeout: float = 10.0) -> bytes:
        """Everything until the router closes the connection."""
        out = self._pending
        self._pending = b""
        async with asyncio.timeout(timeout):
            while True:
                try:
                    data = await self.reader.read(65536)
                except ConnectionResetError:
                    return out
                RECEIVED.append(data)
                if not data:
                    return out
                out += data

    async def closed(self, timeout: float = 10.0) -> bool:
        """Whether the router closes the connection (EOF or reset) within `timeout`."""
        try:
            await self.read_all(timeout)
        except TimeoutError:
            return False
        return True

    def close(self) -> None:
        self.writer.close()


def _framed(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(k in (b"content-length", b"transfer-encoding") for k, _ in headers)


def _message_end(raw: bytes, parsed: _ResponseParser, head: bool) -> int:
    """Where the first response in `raw` ends (responses here are tests' own, so simple)."""
    head_end = raw.find(b"\r\n\r\n") + 4
    if head or parsed.parser.get_status_code() < 200:
        return head_end
    for k, v in parsed.headers:
        if k == b"content-length":
            return head_end + int(v)
    if any(k == b"transfer-encoding" for k, _ in parsed.headers):
        return raw.find(b"0\r\n\r\n", head_end) + 5
    return len(raw)


async def request(
    url: str,
    method: str = "GET",
    path: str = "/version",
    body: bytes = b"",
    headers: dict[str, str] | None = None,
) -> Response:
    """One request on a fresh connection."""
    client = await RawClient.connect(url)
    try:
        lines = [f"{method} {path} HTTP/1.1", "host: router"]
        lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
        if body or method == "POST":
            lines.append(f"content-length: {len(body)}")
        await client.send(("\r\n".join(lines) + "\r\n\r\n").encode() + body)
        return await client.response(head=method == "HEAD")
    finally:
        client.close()


def post_completion(body: bytes) -> bytes:
    """The raw bytes of a POST /v1/completions carrying `body`."""
    return (
        b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (len(body), body)
    )


def chunk(data: bytes) -> bytes:
    """`data` as one chunk of a chunked body."""
    return b"%x\r\n%s\r\n" % (len(data), data)


def completion(prompt: Any = (1, 2, 3), **fields: Any) -> bytes:
    """A completion body for the base model (no `model`: no adapter fence involved)."""
    import orjson

    return orjson.dumps({"prompt": list(prompt) if isinstance(prompt, tuple) else prompt, **fields})


# -- the token scan ---------------------------------------------------------------------------


@dataclass
class LogCapture(logging.Handler):
    records: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        logging.Handler.__init__(self, level=logging.DEBUG)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(self.format(record))

    __hash__ = logging.Handler.__hash__
