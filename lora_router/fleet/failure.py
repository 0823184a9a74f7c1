"""Why a replica failed, named once: the cause of a failed control request and its fix.

Every place that reports a replica's failure says it in these words: the router's log (start-up
discovery, health checks, replays), `last_error` in `/router/replicas` and `/router/status`,
the text of `/health`'s 503, `lora-router top`'s replica table, and `lora-router --check`.
A failure is one `Cause`, a `what` (the cause with its detail: the status and the path, or the
transport's reason) and a `fix`, the one line that removes it; `str(failure)` is both.

The rules (`classify`), for one answer to a request on `path`:

| answer | cause |
| --- | --- |
| no connection: refused, reset, unknown host | refused |
| an answer that is not HTTP (the parser's error) | not vLLM |
| a body that broke off | other |
| a redirect (never followed: the token goes only to the replica's URL) | wrong path |
| no answer in time | timeout |
| a TLS failure (untrusted certificate, failed handshake) | TLS, with the reason |
| 401 or 403 (vLLM's `--api-key` guards `/v1/*` only) | rejected token, by case (none sent?) |
| 404 on `/health` or `/v1/models`, the URL has a path (`http://host:8000/v1`) | wrong path |
| 404 on `/health` or `/v1/models` at a root URL; `/v1/models` not a model list | not vLLM |
| FastAPI's 404 on a dev-mode route (`/pause`, `/resume`, `/server_info`, ...) | no dev mode |
| FastAPI's 404 on `/v1/load_lora_adapter` | no runtime loading |
| 503 on `/health` | dead engine |
| anything else | other (the status and the replica's message) |

Pure: no I/O. The transport's cause is told by the replica client (client.py), which alone
knows the exceptions; this module never sees a token, so no message it builds can hold one.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from urllib.parse import urlsplit


class Cause(enum.Enum):
    TOKEN = "rejected token"
    TLS = "TLS"
    REFUSED = "refused"
    TIMEOUT = "timeout"
    PATH = "wrong path"
    NOT_VLLM = "not a vLLM server"
    DEV_MODE = "no dev mode"
    RUNTIME_LOADING = "no runtime loading"
    NO_LORA = "no LoRA"
    DEAD = "dead engine"
    OTHER = "other"


# The fix of each cause, in the words `lora-router --check` prints after "fix:".
FIX = {
    Cause.TOKEN: "give --token-env NAME holding its token",
    Cause.TLS: "give --ca-file for a private CA; if the replica serves plain HTTP, give its URL "
    "as http://",
    Cause.REFUSED: "check the URL and that `vllm serve` is running there",
    Cause.TIMEOUT: "check that `vllm serve` there is not stuck or overloaded "
    "(--health-timeout and --control-timeout set how long the router waits)",
    Cause.PATH: "give the server's root URL (http://host:port, without /v1)",
    Cause.NOT_VLLM: "give the URL `vllm serve` listens on",
    Cause.DEV_MODE: "start it with VLLM_SERVER_DEV_MODE=1",
    Cause.RUNTIME_LOADING: "start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1",
    Cause.NO_LORA: "start it with --enable-lora --max-lora-rank R --max-loras N",
    Cause.DEAD: "restart the replica",
    Cause.OTHER: "see the replica's log",
}

_PROBES = ("/health", "/v1/models")
_LOAD_ROUTES = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_DEV_ROUTES = (
    "/pause",
    "/resume",
    "/is_paused",
    "/server_info",
    "/reset_prefix_cache",
    "/abort_requests",
)


@dataclass(frozen=True, slots=True)
class Failure:
    """One named failure: its cause, what was seen, and the fix."""

    cause: Cause
    what: str
    fix: str

    def __str__(self) -> str:
        return f"{self.what}; fix: {self.fix}"


def named(cause: Cause, what: str) -> Failure:
    return Failure(cause, what, FIX[cause])


def classify(
    url: str,
    path: str,
    status: int,
    *,
    transport: Cause | None = None,
    error: str = "",
    message: str = "",
    route_missing: bool = False,
    model_list: bool = True,
    token_from: str | None = None,
) -> Failure:
    """The failure of one answer (the module's table). `url`: the replica's; `status` 0 with
    `transport` and `error`: no HTTP answer; `message`: the replica's error text;
    `route_missing`: the body is FastAPI's `{"detail": "Not Found"}`; `model_list`: a 200 on
    `/v1/models` was one; `token_from`: the variable whose token was sent ("" none was sent,
    None unknown)."""
    if status == 0:
        return named(transport or Cause.REFUSED, error or "no answer")  # whatever the path
    if 300 <= status < 400:  # never followed (client.py): `error` says where it pointed
        return Failure(
            Cause.PATH, f"{path}: {error or f'HTTP {status}'}", "give the URL it redirects to"
        )
    if status in (401, 403):
        return _rejected(f"HTTP {status} on {path}", token_from)
    if status == 404 and path in _PROBES:
        if urlsplit(url).path.strip("/"):
            return named(Cause.PATH, f"HTTP 404 on {path}: {url} is not a vLLM server's root URL")
        return named(Cause.NOT_VLLM, f"HTTP 404 on {path}: no vLLM server answers at {url}")
    if status == 404 and route_missing and path in _LOAD_ROUTES:
        what = f"runtime adapter loading is off: {path} does not exist"
        return named(Cause.RUNTIME_LOADING, what)
    if status == 404 and route_missing and path in _DEV_ROUTES:
        return named(Cause.DEV_MODE, f"dev mode is off: {path} does not exist")
    if status == 503 and path == "/health":
        return named(Cause.DEAD, "/health answers 503: the engine is dead")
    if status == 200 and path == "/v1/models" and not model_list:
        return named(Cause.NOT_VLLM, f"/v1/models answered no model list: {url} is not vLLM")
    shown = f": {message}" if message else ""
    return named(Cause.OTHER, f"HTTP {status} on {path}{shown}")


def _rejected(seen: str, token_from: str | None) -> Failure:
    """A 401/403 in the words of its case: no token sent, or which variable's was rejected."""
    if token_from == "":
        return named(
            Cause.TOKEN, f"{seen}: the replica needs a token and none was sent (--no-token)"
        )
    if token_from:
        return Failure(
            Cause.TOKEN,
            f"{seen}: the token in {token_from} was rejected",
            f"export in {token_from} the one token every replica accepts",
        )
    return named(Cause.TOKEN, f"{seen}: the token was rejected")
