"""HTTP answers as vLLM shapes them, independent of the server that sends them.

A `Reply` is a status, a body and headers; `app.py` (aiohttp) and `fast.py` (raw protocol)
both send the same `Reply` objects, so the exact bytes of every control answer are decided
here once. The shapes (contract §2):
- OpenAI-style errors `{"error":{"message","type","param","code"}}` with status = code;
- request-validation failures are 400 with type "Bad Request" (vLLM remaps FastAPI's 422);
- FastAPI's own `{"detail":"Not Found"}` / `{"detail":"Method Not Allowed"}` for routes;
- dev-mode endpoints' flat `{"error":"<string>"}`;
- adapter load/unload success: plain text with **no** Content-Type.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import orjson

JSON = "application/json"
SSE = "text/event-stream; charset=utf-8"


@dataclass(slots=True)
class Reply:
    """One complete HTTP answer. `content_type` None means the header is not sent at all."""

    status: int
    body: bytes = b""
    content_type: str | None = JSON
    headers: dict[str, str] = field(default_factory=dict)


def json_reply(payload: Any, status: int = 200) -> Reply:
    return Reply(status=status, body=orjson.dumps(payload))


def untyped_text(text: str, status: int = 200) -> Reply:
    """Starlette's bare `Response(content=...)`: text body, no Content-Type header."""
    return Reply(status=status, body=text.encode("utf-8"), content_type=None)


def empty(status: int = 200) -> Reply:
    """Starlette's `Response(status_code=...)`: no body, no Content-Type (/health, /ping)."""
    return Reply(status=status, body=b"", content_type=None)


def error_body(message: str, err_type: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def error_reply(message: str, err_type: str, code: int, param: str | None = None) -> Reply:
    return json_reply(error_body(message, err_type, code, param), status=code)


PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


def engine_dead() -> Reply:
    return error_reply(DEAD_MESSAGE, "InternalServerError", 500)


def model_not_found(model: str | None, vllm_version: str, served: Iterable[str]) -> Reply:
    """vLLM's 404 for a model it does not serve; 0.33 lists the names it does."""
    message = f"The model `{model}` does not exist."
    if vllm_version == "0.33":
        message += f" Valid aliases: {', '.join(served)}"
    return error_reply(message, "NotFoundError", 404, param="model")


def bad_request(message: str, param: str | None = None) -> Reply:
    """vLLM's BadRequestError (a ValueError raised while serving a request)."""
    return error_reply(message, "BadRequestError", 400, param)


def validation_error(errors: list[Any]) -> Reply:
    """A FastAPI RequestValidationError as vLLM's handler reports it: 400 "Bad Request"."""
    return error_reply(str(errors), "Bad Request", 400)


def missing_field(location: str, name: str, given: Any) -> Reply:
    return validation_error(
        [{"type": "missing", "loc": (location, name), "msg": "Field required", "input": given}]
    )


def wrong_type(location: str, name: str, expected: str, given: Any) -> Reply:
    return validation_error(
        [
            {
                "type": f"{expected}_type",
                "loc": (location, name),
                "msg": f"Input should be a valid {expected}",
                "input": given,
            }
        ]
    )


def unsupported_media_type() -> Reply:
    """vLLM's `validate_json_request`: any media type but application/json is refused."""
    return validation_error(["Unsupported Media Type: Only 'application/json' is allowed"])


def json_decode_error(exc: ValueError) -> Reply:
    return validation_error(
        [
            {
                "type": "json_invalid",
                "loc": ("body", 0),
                "msg": "JSON decode error",
                "input": {},
                "ctx": {"error": str(exc)},
            }
        ]
    )


def flat_error(message: str, status: int) -> Reply:
    """Dev-mode endpoints answer their own errors as `{"error": "<string>"}`."""
    return json_reply({"error": message}, status=status)


ROUTE_NOT_FOUND = Reply(status=404, body=b'{"detail":"Not Found"}')
METHOD_NOT_ALLOWED = Reply(status=405, body=b'{"detail":"Method Not Allowed"}')
UNAUTHORIZED = Reply(status=401, body=b'{"error":"Unauthorized"}')


def sse_frame(payload: Any) -> bytes:
    """One data frame: `data: <compact json>\\n\\n`."""
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def sse_error_frame(message: str, err_type: str, code: int) -> bytes:
    """An error inside a 200 stream. vLLM renders this one with `json.dumps` (", " and ": "
    separators), unlike the compact data frames, and the emulator keeps that difference."""
    return b"data: " + json.dumps(error_body(message, err_type, code)).encode("utf-8") + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"
SSE_KEEPALIVE = b": keep-alive\n\n"


def is_json_media_type(content_type: str | None) -> bool:
    return (content_type or "").split(";", 1)[0].strip().lower() == JSON
