"""Error answers in vLLM's shape, so a client cannot tell the router's errors from a replica's.

vLLM answers `{"error": {"message", "type", "param", "code"}}` with HTTP status = `code`
(vLLM 0.32: vllm/entrypoints/serve/exception_handling/error_response.py). A path it has no
route for, or a route asked with another method, gets FastAPI's own `{"detail": ...}` instead
(`not_found`, `method_not_allowed`). Messages may name a replica by index or URL, never a
credential: nothing in this module ever sees the token.
"""

from __future__ import annotations

import math
from http import HTTPStatus

import orjson

# The `type` vLLM uses for each status it produces; other statuses get the HTTP reason.
_TYPES = {
    400: "BadRequestError",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    408: "RequestTimeout",
    413: "RequestEntityTooLarge",
    417: "ExpectationFailed",
    429: "TooManyRequests",
    431: "RequestHeaderFieldsTooLarge",
    500: "InternalServerError",
    501: "NotImplemented",
    502: "BadGateway",
    503: "ServiceUnavailableError",
    504: "GatewayTimeout",
    505: "HTTPVersionNotSupported",
}

# Reason phrases for every status the router may write (413 keeps RFC 7231's name, as vLLM).
REASONS = {s.value: s.phrase.encode() for s in HTTPStatus} | {413: b"Payload Too Large"}


class HTTPError(Exception):
    """An answer the router gives itself, raised anywhere below a request handler; `headers`
    replace the default `content-type: application/json`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str | None = None,
        param: str | None = None,
        headers: list[tuple[bytes, bytes]] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "Error")
        self.param = param
        self.headers = headers

    def body(self) -> bytes:
        return error_body(self.status, self.message, type=self.type, param=self.param)


class _FastAPIError(HTTPError):
    """FastAPI's `{"detail": message}`, as vLLM's server sends it for routing failures."""

    def body(self) -> bytes:
        return orjson.dumps({"detail": self.message})


def not_found() -> HTTPError:
    """What vLLM answers for a path it has no route for."""
    return _FastAPIError(404, "Not Found")


def method_not_allowed(methods: frozenset[bytes]) -> HTTPError:
    """What vLLM answers for a known path asked with another method."""
    headers = [(b"content-type", b"application/json"), (b"allow", b", ".join(sorted(methods)))]
    return _FastAPIError(405, "Method Not Allowed", headers=headers)


def error_body(
    status: int, message: str, *, type: str | None = None, param: str | None = None
) -> bytes:
    """The JSON body vLLM sends with an error status."""
    error = {
        "message": message,
        "type": type or _TYPES.get(status, "Error"),
        "param": param,
        "code": status,
    }
    return orjson.dumps({"error": error})


def bad_request(message: str, param: str | None = None) -> HTTPError:
    """vLLM's request-validation failure: 400, type "Bad Request" (not FastAPI's 422)."""
    return HTTPError(400, message, type="Bad Request", param=param)


def unavailable(message: str, retry_after: float) -> HTTPError:
    """vLLM's 503 with `Retry-After` (whole seconds, at least 1): try again, it may pass then."""
    seconds = str(max(1, math.ceil(retry_after))).encode()
    return HTTPError(
        503, message, headers=[(b"content-type", b"application/json"), (b"retry-after", seconds)]
    )


def model_not_found(model: str, why: str = "") -> HTTPError:
    """vLLM's answer for a model name the fleet does not serve, before any stream starts;
    `why`, a sentence after vLLM's words (which clients match the start of), when the router
    knows more than vLLM would say."""
    said = f" {why}" if why else ""
    return HTTPError(404, f"The model `{model}` does not exist.{said}", param="model")
