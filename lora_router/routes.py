"""vLLM 0.32's routes and what lora-router does with each: the one table dispatch reads.

Every path the router acts on is in `TABLE` (or is one of the operator's `--forward-path`s),
with its methods and its kind:

- ROUTED: a completion, routed by prefix affinity behind the adapter fence;
- BROADCAST: sent to every replica, one operation at a time (fleet/broadcast.py);
- FAN_OUT: sent to every replica at once, never queued behind a broadcast: vLLM's aborts
  (fleet/aborts.py);
- LOCAL: answered by the router itself (the fleet's health, its model list, its own metrics
  and status, membership, vllm-router's `/finish_session`);
- FORWARD: read-only, answered by one healthy replica as a single server would;
- CLOSED: a vLLM route the router does not route (other generation and pooling APIs, which
  would reach one replica with neither affinity nor fence): 501, naming `--forward-path`,
  which opens it;
- REFUSED: would change one engine's state (or its weights) while the others keep theirs, with
  no fleet-wide meaning the router could broadcast: 501 (`REFUSED_STATUS`), naming why. A
  `--forward-path` may not name it.
The routes the router reads or broadcasts itself (BROADCAST, FAN_OUT, LOCAL) take a body of at
most `CONTROL_BODY_BYTES` (`body_cap`, which http/server.py applies as the body arrives); the
others take up to `--max-body-bytes`.
A path in no entry is unknown and answered 404 `{"detail":"Not Found"}`, and a known path with
another method 405 `{"detail":"Method Not Allowed"}` with `Allow`: what a vLLM server itself
sends (FastAPI's shape, not vLLM's error object), so a client cannot tell the router from one
server. GET routes do not take HEAD, as in FastAPI. `/router/replicas/{id}` is the one route
with a parameter (`lookup`). A `--forward-path` takes every method.

Keys are canonical paths (http/target.py): a path found here as the client wrote it needs no
decoding. This module is data and lookups only: no I/O, no HTTP objects.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from lora_router.http.errors import HTTPError
from lora_router.http.target import canonical


class Kind(enum.Enum):
    ROUTED = "routed"
    BROADCAST = "broadcast to every replica"
    FAN_OUT = "sent to every replica at once"
    LOCAL = "answered by the router"
    FORWARD = "forwarded to one replica"
    CLOSED = "not forwarded unless --forward-path names it"
    REFUSED = "refused"


REFUSED_STATUS = 501  # CLOSED and REFUSED alike: the router does not implement the call
# The body cap of a control route: about 20,000 request ids; a load, an unload, a pause, a
# session id or a URL takes some hundred bytes.
CONTROL_BODY_BYTES = 1 << 20
_CAPPED = frozenset({Kind.BROADCAST, Kind.FAN_OUT, Kind.LOCAL})


@dataclass(frozen=True, slots=True)
class Route:
    path: bytes  # canonical, as vLLM declares it
    methods: frozenset[bytes] | None  # None: any method (a --forward-path)
    kind: Kind
    why: str = ""  # REFUSED: what the call would do to the one replica that received it

    @property
    def label(self) -> str:
        """The route's `route` label in the metrics: a bounded set, whatever clients send."""
        return self.path.decode()


def _entries(kind: Kind, methods: str, *paths: str, why: str = "") -> list[Route]:
    allowed = frozenset(m.encode() for m in methods.split(","))
    return [Route(p.encode(), allowed, kind, why) for p in paths]


_MERGED = (
    "merged-weight sync reaches only the one replica that receives it, and the others would "
    "keep serving the old weights. Only adapter-only sync (/v1/load_lora_adapter) can reach "
    "every replica. TRL falls back to merged-weight sync when the replicas run without "
    "--enable-lora (or with --data-parallel-size > 1) or when the trainer gets no peft_config: "
    "start every replica with --enable-lora --max-lora-rank R and "
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, and pass a peft LoraConfig as peft_config "
    "(lora-router --check shows what is off)."
)
_ONE = (
    " on the one replica that received it, which the router would go on routing to like the "
    "others, and the router has no fleet-wide meaning for it. Call each replica directly if "
    "that is what you mean."
)

ROUTES: tuple[Route, ...] = (
    *_entries(Kind.ROUTED, "POST", "/v1/completions", "/v1/chat/completions"),
    *_entries(
        Kind.BROADCAST,
        "POST",
        "/v1/load_lora_adapter",
        "/v1/unload_lora_adapter",
        "/pause",
        "/resume",
        "/reset_prefix_cache",
        "/reset_mm_cache",  # caches only: clearing them everywhere means what it says
        "/reset_encoder_cache",
    ),
    # vLLM 0.32: the RLHF dev route (dev mode) and the scale-out route (--enable-scale-out).
    *_entries(Kind.FAN_OUT, "POST", "/abort_requests", "/inference/v1/abort_requests"),
    *_entries(Kind.LOCAL, "GET", "/health", "/v1/models", "/metrics", "/router/status"),
    *_entries(Kind.LOCAL, "GET,POST", "/ping", "/router/replicas"),
    # vllm-router's release of an X-Session-ID session (routing/sessions.py).
    *_entries(Kind.LOCAL, "POST", "/finish_session"),
    *_entries(
        Kind.FORWARD,
        "GET",
        "/server_info",
        "/version",
        "/load",
        "/is_paused",
        "/is_sleeping",
        "/checkpoint/status",  # vLLM 0.34, --enable-sleep-mode: one replica's, read-only
        "/get_world_size",  # TRL calls it
        "/weight_info",
        "/kv_event_sources",
        "/tokenizer_info",
        "/fault_tolerance/status",
        "/openapi.json",
        "/docs",
        "/docs/oauth2-redirect",
        "/redoc",
    ),
    *_entries(
        Kind.FORWARD,
        "POST",
        "/tokenize",
        "/detokenize",
        "/is_scaling_elastic_ep",
        "/v1/completions/render",
        "/v1/chat/completions/render",
        "/v1/messages/render",
        "/v1/responses/render",
        "/v1/completions/derender",
        "/v1/chat/completions/derender",
        "/v1/messages/count_tokens",
    ),
    *_entries(
        Kind.CLOSED,
        "POST",
        "/v1/responses",
        "/v1/messages",
        "/v1/chat/completions/batch",
        "/v1/embeddings",
        "/v2/embed",
        "/pooling",
        "/classify",
        "/score",
        "/v1/score",
        "/rerank",
        "/v1/rerank",
        "/v2/rerank",
        "/v1/audio/transcriptions",
        "/v1/audio/translations",
        "/inference/v1/generate",
        "/invocations",
        "/generative_scoring",
        "/v1/systemone",
        "/cohere/v2/chat",
    ),
    *_entries(
        Kind.REFUSED,
        "POST",
        "/init_weight_transfer_engine",
        "/start_weight_update",
        "/start_draft_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/shutdown_weight_transfer_engine",
        "/update_weight_version",
        why=_MERGED,
    ),
    *_entries(Kind.REFUSED, "POST", "/collective_rpc", why="it runs a method on workers" + _ONE),
    *_entries(
        Kind.REFUSED,
        "POST",
        "/sleep",
        "/wake_up",
        "/release_kv_cache_memory",
        why="it puts an engine to sleep, wakes it or frees its KV cache" + _ONE,
    ),
    *_entries(
        Kind.REFUSED,
        "POST",
        "/checkpoint/prepare",  # vLLM 0.34, --enable-sleep-mode (not dev-mode gated)
        "/checkpoint/restore",
        why="it pauses an engine and frees its KV cache for a checkpoint, or restores it" + _ONE,
    ),
    *_entries(
        Kind.REFUSED,
        "POST",
        "/weight_checker",
        why="its `reset` action resets the model's weights" + _ONE,
    ),
    *_entries(
        Kind.REFUSED, "POST", "/start_profile", "/stop_profile", why="it runs the profiler" + _ONE
    ),
    *_entries(
        Kind.REFUSED, "POST", "/scale_elastic_ep", why="it changes the data-parallel size" + _ONE
    ),
    *_entries(
        Kind.REFUSED, "POST", "/fault_tolerance/apply", why="it runs a fault-recovery step" + _ONE
    ),
)
TABLE: Mapping[bytes, Route] = {r.path: r for r in ROUTES}
REPLICA = Route(b"/router/replicas/{id}", frozenset({b"DELETE"}), Kind.LOCAL)
_REPLICA_PREFIX = b"/router/replicas/"


def lookup(path: bytes, table: Mapping[bytes, Route] = TABLE) -> Route | None:
    """The route of a canonical path: an entry of `table`, `REPLICA`, or None (unknown)."""
    route = table.get(path)
    if route is None and path.startswith(_REPLICA_PREFIX):
        tail = path[len(_REPLICA_PREFIX) :]
        return REPLICA if tail and b"/" not in tail else None
    return route


def body_cap(path: bytes, table: Mapping[bytes, Route] = TABLE) -> int | None:
    """The cap on the body of a request for `path` (as the client wrote it, canonical or not):
    `CONTROL_BODY_BYTES` on a route the router reads or broadcasts itself (module docstring),
    None (`--max-body-bytes` alone) on any other, and on a path that names no route or that
    http/target.py refuses (dispatch answers it)."""
    route = table.get(path)
    if route is None:
        try:
            route = lookup(canonical(path), table)
        except HTTPError:
            return None
    return CONTROL_BODY_BYTES if route is not None and route.kind in _CAPPED else None


def with_forward_paths(paths: Iterable[str]) -> dict[bytes, Route]:
    """`TABLE` with the operator's `--forward-path`s opened (checked by `forward_path_error`)."""
    table = dict(TABLE)
    for path in paths:
        table[path.encode()] = Route(path.encode(), None, Kind.FORWARD)
    return table


_PATH_CHARS = frozenset(
    "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-._~!$&'()*+,;=:@/"
)


def forward_path_error(path: str) -> str | None:
    """Why `--forward-path path` cannot be opened, or None if it can."""
    if not path.startswith("/") or not set(path) <= _PATH_CHARS:
        return (
            f"--forward-path {path!r}: give a plain path as vLLM declares it, such as /v1/foo "
            "(no scheme, host, query or escapes)"
        )
    try:
        canonical(path.encode())
    except HTTPError:
        return f"--forward-path {path}: no empty or dot segments (`//`, `/./`, a trailing `/`)"
    route = lookup(path.encode())
    if path.startswith("/router/") or (route is not None and route.kind is Kind.LOCAL):
        return f"--forward-path {path}: the router answers that path itself"
    if route is not None and route.kind in (
        Kind.ROUTED,
        Kind.BROADCAST,
        Kind.FAN_OUT,
        Kind.REFUSED,
    ):
        return f"--forward-path {path}: that route is {route.kind.value}, never forwarded as is"
    return None
