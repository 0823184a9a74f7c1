"""Fast mode: a raw asyncio Protocol over httptools that answers completions from a cache of
pre-rendered HTTP responses, so benchmarks measure the router, not the emulator.

What it keeps of the full emulator: the routes a router needs to start and to sync adapters
(health, server_info, models, load/unload, pause/resume ... all through `control.py`, so with
the same bytes), the API key, unknown-model 404s, engine death, HTTP/1.1 keep-alive and
pipelining. What it drops for speed: the timing model, the prefix cache (so `usage` has no
`prompt_tokens_details`, as without --enable-prompt-tokens-details), per-request ids
(`id` is constant), request recording and the completion faults. A completion costs one JSON
parse of the body and one `transport.write` of bytes rendered once per distinct
(route, model, stream, output length, prompt length, options) and then reused.

Flow control follows uvicorn's httptools protocol: reading pauses while the transport's write
buffer is full, and requests that arrive while a control route is still answering wait in a
backlog so responses keep their order.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, cast
from urllib.parse import parse_qsl

import httptools
import orjson

from lora_router.emulator import completions, control, tokens
from lora_router.emulator.completions import ChoiceState, Renderer
from lora_router.emulator.control import ControlReply, PlainRequest, Replica
from lora_router.emulator.replies import (
    METHOD_NOT_ALLOWED,
    SSE,
    SSE_DONE,
    Reply,
    bad_request,
    engine_dead,
    error_reply,
    model_not_found,
    sse_frame,
)

GENERATION_ROUTES = {b"/v1/completions": False, b"/v1/chat/completions": True}
DEFAULT_OUTPUT_TOKENS = 16
MAX_OUTPUT_TOKENS = 4096  # cap on what one pre-rendered answer holds
MAX_RENDERED = 4096  # distinct pre-rendered answers kept before the cache starts over
_FAST_REQUEST_ID = "fast"


def http_bytes(reply: Reply, keep_alive: bool = True) -> bytes:
    """A complete HTTP/1.1 response for `reply`."""
    try:
        phrase = HTTPStatus(reply.status).phrase
    except ValueError:
        phrase = ""
    lines = [f"HTTP/1.1 {reply.status} {phrase}", "server: uvicorn"]
    if reply.content_type is not None:
        lines.append(f"content-type: {reply.content_type}")
    for name, value in reply.headers.items():
        lines.append(f"{name}: {value}")
    lines.append(f"content-length: {len(reply.body)}")
    if not keep_alive:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + reply.body


def _chunked(frames: list[bytes]) -> bytes:
    parts = [f"{len(frame):x}\r\n".encode() + frame + b"\r\n" for frame in frames]
    return b"".join(parts) + b"0\r\n\r\n"


class Prerendered:
    """The cache of complete completion responses."""

    __slots__ = ("_cache", "_model")

    def __init__(self, model: str) -> None:
        self._model = model
        self._cache: dict[tuple[Any, ...], bytes] = {}

    def get(self, chat: bool, request: dict[str, Any]) -> bytes:
        model = request.get("model") or self._model
        max_tokens = request.get("max_tokens") or request.get("max_completion_tokens")
        output = min(int(max_tokens), MAX_OUTPUT_TOKENS) if max_tokens else DEFAULT_OUTPUT_TOKENS
        prompt = request.get("prompt")
        if isinstance(prompt, str):
            prompt_len = len(prompt.encode("utf-8"))  # the emulator's tokenizer: one id a byte
        else:
            prompt_len = len(prompt) if isinstance(prompt, list) else 0
        key = (
            chat,
            model,
            bool(request.get("stream")),
            output,
            prompt_len,
            bool(request.get("return_token_ids")),
            request.get("logprobs") is not None,
        )
        cached = self._cache.get(key)
        if cached is None:
            if len(self._cache) >= MAX_RENDERED:
                self._cache.clear()
            cached = self._cache[key] = self._render(key)
        return cached

    def _render(self, key: tuple[Any, ...]) -> bytes:
        chat, model, stream, output, prompt_len, token_ids, logprobs = key
        params = completions.GenerationParams(
            chat=chat,
            model=model,
            prompts=[[0] * prompt_len],
            max_tokens=output,
            ignore_eos=True,
            logprobs=0 if logprobs else None,
            return_token_ids=token_ids,
            stream=stream,
        )
        sample = tokens.generate(model, [], seed=0, index=0, max_tokens=output, ignore_eos=True)
        renderer = Renderer(params, _FAST_REQUEST_ID, model)
        choice = ChoiceState(index=0, prompt=params.prompts[0])
        usage = completions.usage(prompt_len, output, None)  # no prefix cache: no details
        if not stream:
            choice.token_ids = sample.token_ids
            choice.logprob_tokens = sample.tokens
            choice.finish_reason = sample.finish_reason
            body = orjson.dumps(renderer.whole([choice], usage))
            return http_bytes(Reply(status=200, body=body))
        frames = [sse_frame(renderer.role_chunk(0))] if chat else []
        for position, sampled in enumerate(sample.tokens):
            last = position == len(sample.tokens) - 1
            finish = sample.finish_reason if last else None
            frames.append(sse_frame(renderer.token_chunk(choice, [sampled], finish, position == 0)))
        frames.append(sse_frame(renderer.usage_chunk(usage)))
        frames.append(SSE_DONE)
        head = (
            "HTTP/1.1 200 OK\r\nserver: uvicorn\r\n"
            f"content-type: {SSE}\r\ntransfer-encoding: chunked\r\n\r\n"
        ).encode("latin-1")
        return head + _chunked(frames)


@dataclass(slots=True)
class _Parsed:
    method: bytes
    url: bytes
    headers: dict[bytes, bytes]
    body: bytes
    keep_alive: bool


@dataclass(slots=True)
class FastServer:
    """The listening socket and its live connections."""

    server: asyncio.Server
    connections: set[FastProtocol] = field(default_factory=set)

    @property
    def port(self) -> int:
        return int(self.server.sockets[0].getsockname()[1])

    async def close(self, abrupt: bool) -> None:
        self.server.close()
        for connection in list(self.connections):
            connection.drop(abrupt)
        await self.server.wait_closed()


class FastProtocol(asyncio.Protocol):
    """One HTTP/1.1 connection."""

    def __init__(
        self,
        replica: Replica,
        table: dict[str, dict[str, control.Handler]],
        rendered: Prerendered,
        connections: set[FastProtocol],
    ) -> None:
        self._replica = replica
        self._table = table
        self._rendered = rendered
        self._connections = connections
        self._transport: asyncio.Transport | None = None
        self._parser = httptools.HttpRequestParser(self)
        self._url = b""
        self._headers: dict[bytes, bytes] = {}
        self._body: list[bytes] = []
        self._backlog: deque[_Parsed] = deque()
        self._busy = False
        self._writing_paused = False
        auth = replica.config.api_key
        self._expected_auth = f"Bearer {auth}".encode() if auth is not None else None

    # asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio.Transport, only compatible.
        self._transport = cast(asyncio.Transport, transport)
        self._connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self._connections.discard(self)
        self._transport = None

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._write(http_bytes(bad_request("Upgrades are not supported"), False), False)
        except httptools.HttpParserError:
            self._write(
                http_bytes(Reply(status=400, body=b'{"detail":"Invalid HTTP request"}'), False),
                False,
            )

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self._transport is not None:
            self._transport.pause_reading()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._transport is not None and not self._busy:
            self._transport.resume_reading()

    def drop(self, abrupt: bool) -> None:
        if self._transport is not None:
            self._transport.abort() if abrupt else self._transport.close()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._url = b""
        self._headers = {}
        self._body = []

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers[name.lower()] = value

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        parsed = _Parsed(
            method=self._parser.get_method(),
            url=self._url,
            headers=self._headers,
            body=b"".join(self._body),
            keep_alive=self._parser.should_keep_alive(),
        )
        if self._busy:
            self._backlog.append(parsed)
        else:
            self._handle(parsed)

    # dispatch

    def _handle(self, request: _Parsed) -> None:
        path, _, query = request.url.partition(b"?")
        chat = GENERATION_ROUTES.get(path)
        if chat is not None:
            self._write(self._generation(request, chat), request.keep_alive)
            return
        self._busy = True
        if self._transport is not None:
            self._transport.pause_reading()
        asyncio.get_running_loop().create_task(self._control(request, path, query))

    def _generation(self, request: _Parsed, chat: bool) -> bytes:
        ka = request.keep_alive
        if (
            self._expected_auth is not None
            and request.headers.get(b"authorization") != self._expected_auth
        ):
            return http_bytes(control.UNAUTHORIZED, ka)
        if request.method != b"POST":
            return http_bytes(METHOD_NOT_ALLOWED, ka)
        try:
            body = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            return http_bytes(bad_request("Request body is not valid JSON."), ka)
        if not isinstance(body, dict):
            return http_bytes(bad_request("Request body must be a JSON object."), ka)
        replica = self._replica
        if control.is_dead(replica):  # first, as in full mode (serving.py)
            return http_bytes(engine_dead(), ka)
        model = body.get("model")
        engine = replica.state
        if model is not None and model != replica.config.model and model not in engine.registry:
            config = replica.config
            return http_bytes(
                model_not_found(model, config.since("0.32"), engine.served_names()), ka
            )
        response = self._rendered.get(chat, body)
        return (
            response if ka else response.replace(b"\r\n\r\n", b"\r\nconnection: close\r\n\r\n", 1)
        )

    async def _control(self, request: _Parsed, path_bytes: bytes, query: bytes) -> None:
        path = path_bytes.decode("latin-1")
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in request.headers.items()}
        method = request.method.decode("latin-1")
        after = None
        try:
            denied = control.unauthorized(self._replica.config, path, headers)
            found = denied if denied is not None else control.lookup(self._table, method, path)
            if isinstance(found, Reply):
                reply = found
            else:
                plain = PlainRequest(
                    method, path, dict(parse_qsl(query.decode("latin-1"))), headers, request.body
                )
                result = await found(self._replica, plain)
                if isinstance(result, ControlReply):
                    reply, after = result.reply, result.after
                else:
                    reply = result
        except Exception as exc:  # a bug must not hang the connection; answer like uvicorn
            reply = error_reply(f"{type(exc).__name__}: {exc}", "InternalServerError", 500)
        self._write(http_bytes(reply, request.keep_alive), request.keep_alive)
        if after is not None:
            await after()
        self._busy = False
        while self._backlog and not self._busy:
            self._handle(self._backlog.popleft())
        if not self._busy and self._transport is not None and not self._writing_paused:
            self._transport.resume_reading()

    def _write(self, data: bytes, keep_alive: bool) -> None:
        transport = self._transport
        if transport is None:
            return
        transport.write(data)
        if not keep_alive:
            transport.close()


async def serve(
    replica: Replica, host: str, port: int, ssl_context: ssl.SSLContext | None
) -> FastServer:
    loop = asyncio.get_running_loop()
    table = control.routes(replica.config)
    rendered = Prerendered(replica.config.model)
    connections: set[FastProtocol] = set()
    server = await loop.create_server(
        lambda: FastProtocol(replica, table, rendered, connections),
        host,
        port,
        ssl=ssl_context,
        reuse_address=True,
        backlog=4096,
    )
    return FastServer(server=server, connections=connections)
