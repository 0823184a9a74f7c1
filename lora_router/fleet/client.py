"""The replica client: every control request the router (or `--check`) sends a replica.

One aiohttp session (the bearer token in its default headers, the router's TLS context),
`call` (one request, transport failures as `status` 0 with a readable reason and its cause,
never an exception), the answer type (`Answer.failure` names what went wrong, failure.py),
and the one parser of what a replica says about itself:
`/v1/models` and `/server_info?config_format=json` become a frozen `Facts`, read by discovery
and replays (replay.py), the restart check (health.py), load reconciliation (broadcast.py) and
`lora-router --check` (tools/check.py) alike. `AGREEMENT` lists the facts every replica must share.

Health checks, broadcasts, replays and the `/metrics` scrapes (telemetry.py) all go through
`call`; the routed path does not (http/upstream.py, its own pools). **Every call has a
deadline**: the caller's `timeout`, else `--control-timeout`; none waits without limit, so a
replica that hangs (a stopped process, a wedged engine) costs a broadcast at most that long,
and the caller ejects it like any replica that gave no answer. **Every body has a bound**: one
kept is refused past `ANSWER_CAP`, before it is parsed; one given to a reader (`call`'s
`body_to`: the `/metrics` scrapes) is never kept, reaches the reader in pieces with the loop
free between two, and the reader bounds it. A kept answer is parsed whole on the event loop
(as JSON, once: `Answer.parsed`), so the cap is what bounds that parse: the larger of 1 MiB and
16 times the largest answer vLLM gives on any path the router asks
(docs/design/fleet.md#control-answers). An answer over it is refused as not vLLM's
(`Cause.NOT_VLLM`), naming the path, its size and the cap.

The control plane's retry rule is stated in proxy/dispatch.py's module docstring, the data
plane's in proxy/routed.py's; `call`'s own part of it is the one resend of a request that met a
pooled connection the replica had closed while idle.

Redirects are never followed: the token goes only to the replica's own URL. A 3xx is an
answer like any other non-200 (a failed check, a failed broadcast, a `--check` finding) whose
`error` names the host it pointed to; that host is never contacted. Each (replica, redirect)
is logged once; the pairs remembered for that are at most `REDIRECTS_KEPT`, then forgotten
(a repeat is then logged again): a replica naming a new host at every call grows nothing.

This module knows HTTP and nothing of the fleet's state: it must never change a replica's
state, and the token must never appear in a message or a log line.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar

import aiohttp
import orjson
from yarl import URL

from lora_router.config import Config, shown_name
from lora_router.fleet.failure import Cause, Failure, classify

log = logging.getLogger(__name__)

_JSON_REQUEST = {"Content-Type": "application/json"}
# The largest control answer kept (module docstring); what vLLM's weigh:
# docs/design/fleet.md#control-answers.
ANSWER_CAP = 1 << 20
# Why a vLLM server's answer could pass the cap, where one could: said with the refusal.
_OVERSIZE_HINT = {
    "/v1/models": (
        " (a vLLM server lists each adapter loaded and not unloaded in about 620 bytes: "
        "if this one holds over a thousand, unload those no longer used)"
    )
}
# A body given to a reader goes to it in pieces of at most this size, the loop free between two.
READ_PIECE_BYTES = 64 << 10
# The (replica, redirect) pairs remembered to log each once (module docstring).
REDIRECTS_KEPT = 256

# The facts every replica of a fleet must agree on, as (attribute of `Facts`, how a person
# calls it): the router warns and shows it (`disagreement`), `--check` fails.
AGREEMENT = (
    ("base_model", "base model"),
    ("max_lora_rank", "max_lora_rank"),
    ("max_loras", "max_loras"),
    ("block_size", "block size"),
)
# The fix of any disagreement on `AGREEMENT`'s facts.
AGREE_FIX = "start every replica with the same model and LoRA flags"


def disagreement(label: str, values: Mapping[str, object]) -> str | None:
    """What replicas that disagree on one fact (`label`) say: `values` maps each replica (as
    the message names it) to its value, None for "did not say" (never a disagreement). The
    replicas of one value are listed together; None when they agree."""
    by_value: dict[object, list[str]] = {}
    for who, value in values.items():
        if value is not None:
            by_value.setdefault(value, []).append(who)
    if len(by_value) < 2:
        return None
    parts = "; ".join(f"{value} on {', '.join(who)}" for value, who in by_value.items())
    return f"the replicas disagree on {label}: {parts}"


class Named(Protocol):
    """Anything with a replica's base URL (a fleet `Replica`, a configured `ReplicaAddress`)."""

    @property
    def name(self) -> str: ...


T = TypeVar("T", bound=Named)
_UNPARSED = object()  # `Answer.parsed` has not run yet


@dataclass(slots=True)
class Answer(Generic[T]):
    """One replica's answer to one control request; `status` 0 means no HTTP answer at all."""

    replica: T
    status: int
    body: bytes = b""
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    error: str = ""  # the transport failure when status is 0; where a 3xx pointed
    transport: Cause | None = None  # the transport failure's cause when status is 0
    token_from: str | None = None  # the variable whose token went ("" none; None unknown)
    _doc: Any = field(default=_UNPARSED, repr=False, compare=False)  # `parsed`'s

    def summary(self) -> str:
        """What went wrong in a few words: the transport failure, or the status."""
        return self.error or f"HTTP {self.status}"

    def failure(self, path: str) -> Failure:
        """This answer to a request on `path` as a named failure (failure.py)."""
        doc = self.parsed() if self.status else None
        listed = parse_models(doc) if self.status == 200 else None
        return classify(
            self.replica.name,
            path,
            self.status,
            transport=self.transport,
            error=self.error,
            message=self.message() if self.status else "",
            route_missing=isinstance(doc, dict) and doc.get("detail") == "Not Found",
            model_list=listed is not None and bool(listed.bases),
            token_from=self.token_from,
        )

    def parsed(self) -> Any:
        """The body as JSON (None when it is not), parsed at the first call only: callers may
        change the document, which later calls return as changed."""
        if self._doc is _UNPARSED:
            try:
                self._doc = orjson.loads(self.body)
            except orjson.JSONDecodeError:
                self._doc = None
        return self._doc

    def message(self) -> str:
        """The error text, whichever of vLLM's shapes it came in."""
        if self.error:
            return self.error
        doc = self.parsed()
        if isinstance(doc, dict):
            err = doc.get("error")
            if isinstance(err, dict) and isinstance(err.get("message"), str):
                return str(err["message"])
            if isinstance(err, str):
                return err  # dev-mode routes answer {"error": "<string>"}
            if isinstance(doc.get("detail"), str):
                return str(doc["detail"])  # FastAPI's own 404/405
        text = self.body.decode("utf-8", "replace").strip()
        return text[:500] or f"HTTP {self.status}"

    def error_type(self) -> str | None:
        doc = self.parsed()
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            kind = doc["error"].get("type")
            return kind if isinstance(kind, str) else None
        return None


@dataclass(frozen=True, slots=True)
class Facts:
    """What a replica says about itself. `None`: it did not say (or that probe was not made)."""

    bases: tuple[str, ...] = ()  # /v1/models cards without a parent: the base model first
    adapters: Mapping[str, str] = field(default_factory=dict)  # adapter name -> its root
    max_model_len: int | None = None  # of the base card
    lora: bool | None = None  # vllm_config.lora_config present
    max_lora_rank: int | None = None
    max_loras: int | None = None
    block_size: int | None = None  # cache_config.block_size
    data_parallel_size: int | None = None
    config_model: str | None = None  # model_config.model, when no listing names it
    runtime_loading: bool | None = None  # vllm_env's VLLM_ALLOW_RUNTIME_LORA_UPDATING

    @property
    def base_model(self) -> str | None:
        return self.bases[0] if self.bases else self.config_model


def parse_models(doc: Any) -> Facts | None:
    """A `/v1/models` answer as facts, or None when it is not a model list."""
    data = doc.get("data") if isinstance(doc, dict) else None
    if not isinstance(data, list):
        return None
    bases: list[str] = []
    adapters: dict[str, str] = {}
    max_model_len = None
    for card in data:
        if not isinstance(card, dict) or not isinstance(card.get("id"), str):
            continue
        if card.get("parent"):
            adapters[card["id"]] = str(card.get("root") or "")
            continue
        if not bases:
            max_model_len = _int(card.get("max_model_len"))
        bases.append(card["id"])  # the base model and its aliases
    return Facts(tuple(bases), adapters, max_model_len)


def parse_server_info(doc: Any, listed: Facts | None = None) -> Facts | None:
    """A `/server_info?config_format=json` answer added to `listed`, or None when it carries
    no `vllm_config` (not the JSON form, or not vLLM)."""
    config = doc.get("vllm_config") if isinstance(doc, dict) else None
    if not isinstance(config, dict):
        return None
    lora = config.get("lora_config")
    cache = config.get("cache_config")
    parallel = config.get("parallel_config")
    model = config.get("model_config")
    env = doc.get("vllm_env")
    runtime = env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") if isinstance(env, dict) else None
    return replace(
        listed or Facts(),
        lora=isinstance(lora, dict),
        max_lora_rank=_int(lora.get("max_lora_rank")) if isinstance(lora, dict) else None,
        max_loras=_int(lora.get("max_loras")) if isinstance(lora, dict) else None,
        block_size=_int(cache.get("block_size")) if isinstance(cache, dict) else None,
        data_parallel_size=(
            _int(parallel.get("data_parallel_size")) if isinstance(parallel, dict) else None
        ),
        config_model=(
            str(model["model"]) if isinstance(model, dict) and model.get("model") else None
        ),
        runtime_loading=_flag(runtime),
    )


def _flag(value: object) -> bool | None:
    """An environment flag as vLLM reports it (a bool, or its text), or None when unknown."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("1", "true", "0", "false", ""):
        return value.strip().lower() in ("1", "true")
    return None


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class ReplicaClient:
    """One session for every control request (module docstring)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.session: aiohttp.ClientSession | None = None
        self._redirects: set[tuple[str, str]] = set()  # (replica, redirect) pairs logged
        # What a rejected token's message may say of it: the variable it came from, shown
        # only when named like one (HF_TOKEN), never the value.
        self.token_from: str | None = ""
        if config.token:
            self.token_from = config.token_env if shown_name(config.token_env) else None

    async def open(self) -> None:
        config = self.config
        token = config.token.reveal()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=0, limit_per_host=config.control_connections, ssl=config.tls_context()
            ),
            headers=headers,
            # Bodies are passed on as the replica sent them, never re-encoded.
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),  # replicas set none; skip the per-request work
            timeout=aiohttp.ClientTimeout(
                total=None, connect=config.connect_timeout, sock_read=config.first_byte_timeout
            ),
        )

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    async def __aenter__(self) -> ReplicaClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def call(
        self,
        replica: T,
        method: str,
        path: str,
        *,
        body: bytes | None = None,
        query: str = "",
        timeout: float | None = None,
        headers: Mapping[str, str] | None = None,
        body_to: Callable[[Answer[T]], Callable[[bytes], None] | None] | None = None,
    ) -> Answer[T]:
        """One request to one replica, answered within `timeout` seconds (None:
        `--control-timeout`); transport failures and timeouts come back as `status` 0.

        `body_to`, given the answer's head (`body` empty), may name a reader of its body: the
        body then goes to it as it arrives, in pieces of at most READ_PIECE_BYTES with the loop
        free between two, and is not kept (`body` stays empty). An exception the reader raises
        ends the call, the connection closed, and reaches the caller; the deadline covers the
        reading."""
        assert self.session is not None, "ReplicaClient.open() was not called"
        url = URL(replica.name + path + (f"?{query}" if query else ""), encoded=True)
        if body is not None:
            headers = {**_JSON_REQUEST, **(headers or {})}
        if timeout is None:
            timeout = self.config.control_timeout
        try:
            async with asyncio.timeout(timeout):  # both attempts: the deadline is the call's
                return await self._request(replica, method, url, path, body, headers, body_to)
        except TimeoutError:
            error = f"no answer within {timeout:g} s"
            return Answer(replica, 0, error=error, transport=Cause.TIMEOUT)

    async def _request(
        self,
        replica: T,
        method: str,
        url: URL,
        path: str,
        body: bytes | None,
        headers: Mapping[str, str] | None,
        body_to: Callable[[Answer[T]], Callable[[bytes], None] | None] | None,
    ) -> Answer[T]:
        assert self.session is not None
        # One resend, only when the request never got an answer on a pooled connection the
        # replica had closed while idle. Every control request is safe to send twice: a load
        # sent twice reads as "already loaded" with our root, an unload as 404, the rest are
        # idempotent in vLLM. Never once the body was given to a reader.
        for attempt in (0, 1):
            reader = None
            try:
                async with self.session.request(
                    method, url, data=body, headers=headers, allow_redirects=False
                ) as resp:
                    answer = Answer(replica, resp.status, b"", list(resp.raw_headers))
                    answer.token_from = self.token_from
                    reader = body_to(answer) if body_to is not None else None
                    if reader is not None:
                        await _read_into(resp, reader)
                        return answer
                    data = await _read_capped(resp)
                    if data is None:
                        resp.close()  # the rest is never read: the connection is not reused
                        size = resp.content_length
                        shown = f"{size:,} bytes, over" if size else "larger than"
                        error = (
                            f"its answer to {path} is {shown} the {ANSWER_CAP >> 20} MiB cap "
                            f"of a control answer{_OVERSIZE_HINT.get(path, '')}"
                        )
                        return Answer(replica, 0, error=error, transport=Cause.NOT_VLLM)
                    answer.body = data
                    if 300 <= resp.status < 400:
                        answer.error = _redirected(url, resp.headers.get("Location"), resp.status)
                        if (replica.name, answer.error) not in self._redirects:  # once each
                            if len(self._redirects) >= REDIRECTS_KEPT:
                                self._redirects.clear()  # bounded (module docstring)
                            self._redirects.add((replica.name, answer.error))
                            log.warning("%s: %s", replica.name, answer.failure(path))
                    return answer
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as exc:
                if attempt or reader is not None or isinstance(exc, aiohttp.ClientConnectorError):
                    cause, error = transport_error(exc, url.scheme)
                    return Answer(replica, 0, error=error, transport=cause)
            except (aiohttp.ClientError, OSError) as exc:
                cause, error = transport_error(exc, url.scheme)
                return Answer(replica, 0, error=error, transport=cause)
        raise AssertionError("unreachable")

    async def listing(self, replica: T) -> Facts | Failure:
        """What a replica's `/v1/models` says it serves, or why it did not say."""
        answer = await self.call(
            replica, "GET", "/v1/models", timeout=max(self.config.health_timeout, 1.0)
        )
        listed = parse_models(answer.parsed()) if answer.status == 200 else None
        return listed if listed is not None else answer.failure("/v1/models")

    async def server_info(self, replica: T, listed: Facts | None = None) -> Facts | Failure:
        """`listed` completed with the replica's `/server_info`, or why there is none."""
        answer = await self.call(
            replica,
            "GET",
            "/server_info",
            query="config_format=json",
            timeout=max(self.config.health_timeout, 1.0),
        )
        info = parse_server_info(answer.parsed(), listed) if answer.status == 200 else None
        return info if info is not None else answer.failure("/server_info")


async def _read_capped(resp: aiohttp.ClientResponse) -> bytes | None:
    """The whole body, or None when it is (or once it grows) larger than `ANSWER_CAP`."""
    if (resp.content_length or 0) > ANSWER_CAP:
        return None
    data = bytearray()
    async for chunk in resp.content.iter_any():
        data += chunk
        if len(data) > ANSWER_CAP:
            return None
    return bytes(data)


async def _read_into(resp: aiohttp.ClientResponse, reader: Callable[[bytes], None]) -> None:
    """The whole body, piece by piece, to `reader`, yielding to the loop after each piece (a
    piece already received is returned without one). If `reader` raises, the connection closes
    (the rest is never read)."""
    try:
        async for piece in resp.content.iter_chunked(READ_PIECE_BYTES):
            reader(piece)
            await asyncio.sleep(0)
    except BaseException:
        resp.close()
        raise


def _redirected(url: URL, location: str | None, status: int) -> str:
    """A 3xx in words: where it pointed (scheme, host and port only), never followed."""
    try:
        target = url.join(URL(location)) if location else None
    except ValueError:
        target = None
    where = f"{target.scheme}://{target.host_port_subcomponent}" if target and target.host else "?"
    return (
        f"HTTP {status}, a redirect to {where} (not followed: the token goes only to the "
        "replica's own URL)"
    )


def transport_error(exc: BaseException, scheme: str) -> tuple[Cause, str]:
    """Why a request got no HTTP answer on a URL of `scheme`: its cause (failure.py), and the
    reason in words an operator acts on (the fix is the cause's)."""
    if isinstance(exc, TimeoutError):  # aiohttp's connect or read timeout
        return Cause.TIMEOUT, "timed out"
    if isinstance(exc, aiohttp.ClientConnectorCertificateError):
        return Cause.TLS, f"TLS certificate not trusted ({exc.certificate_error})"
    if isinstance(exc, aiohttp.ClientConnectorSSLError):
        # Its errno is OpenSSL's, not the OS's: strerror would say "Operation not permitted".
        reason = getattr(exc.os_error, "reason", None) or str(exc.os_error)
        return Cause.TLS, f"TLS handshake failed ({reason})"
    if isinstance(exc, aiohttp.ClientConnectorError) and isinstance(exc.os_error, socket.gaierror):
        # Its errno is getaddrinfo's, not the OS's: strerror would say "Unknown error -2".
        return Cause.REFUSED, f"cannot resolve the host {exc.host} ({exc.os_error.strerror})"
    if isinstance(exc, aiohttp.ClientConnectorError):
        errno = exc.os_error.errno
        reason = os.strerror(errno) if errno else exc.os_error.__class__.__name__
        return Cause.REFUSED, f"cannot connect ({reason})"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        if scheme == "http":  # what an HTTPS server does with a plain request
            return Cause.REFUSED, (
                "the replica closed the connection without an answer (if it serves HTTPS, "
                "give its URL as https://)"
            )
        return Cause.REFUSED, "the replica closed the connection"
    if isinstance(exc, aiohttp.ClientPayloadError):  # a body that broke off or lied its length
        return Cause.OTHER, f"its answer's body broke off ({_first_line(exc)})"
    if isinstance(exc, aiohttp.ClientResponseError):  # the parser's: no valid HTTP answer
        return Cause.NOT_VLLM, f"its answer is not valid HTTP ({_first_line(exc)})"
    return Cause.REFUSED, exc.__class__.__name__


def _first_line(exc: BaseException) -> str:
    """An exception's message, its first line and at most 200 characters (aiohttp's parser
    errors quote the bytes they stopped at, which come from the replica)."""
    text = str(getattr(exc, "message", "") or exc)
    return text.splitlines()[0][:200] if text else exc.__class__.__name__
