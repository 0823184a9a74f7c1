"""HTTP answers as vLLM shapes them, independent of the server that sends them.

A `Reply` is a status, a body and headers; `app.py` (aiohttp) and `fast.py` (raw protocol)
both send the same `Reply` objects, so the exact bytes of every control answer are decided
here once. The shapes (contract §2):
- OpenAI-style errors `{"error":{"message","type","param","code"}}` with status = code;
- request-validation failures are 400 with type "Bad Request" (vLLM remaps FastAPI's 422),
  the message "N validation error(s):" then one line per error with a dotted `loc` and the
  input summarised, `param` the first error's dotted `loc` (as a real 0.32 server answers);
- error messages pass vLLM's `sanitize_message`: absolute paths under /tmp, /root, /home ...
  read `<path>` (a real 0.32 server: "No adapter found for <path>");
- FastAPI's own `{"detail":"Not Found"}` / `{"detail":"Method Not Allowed"}` for routes;
- dev-mode endpoints' flat `{"error":"<string>"}`;
- adapter load/unload success: plain text with **no** Content-Type.
"""

from __future__ import annotations

import json
import re
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


def sanitize_message(message: str) -> str:
    """vLLM's `sanitize_message`: no memory addresses, tracebacks or file paths in errors."""
    message = re.sub(r" at 0x[0-9a-fA-F]+>", ">", message)
    message = re.sub(r'\n?\s*File "[^"]+", line \d+, in \S+(\n\s+.*)?', "", message)
    message = re.sub(r"/(?:home|usr|opt|var|tmp|root|lib|mnt|srv)(?:/[\w.\-]+)+", "<path>", message)
    message = re.sub(r"(?:/[\w\-]+)+/[\w\-]+\.\w+", "<path>", message)
    return message.strip()


def error_reply(message: str, err_type: str, code: int, param: str | None = None) -> Reply:
    return json_reply(error_body(sanitize_message(message), err_type, code, param), status=code)


PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."
DEAD_MESSAGE = "EngineCore encountered an issue. See stack trace (above) for the root cause."


def engine_dead() -> Reply:
    return error_reply(DEAD_MESSAGE, "InternalServerError", 500)


def model_not_found(model: str | None, aliases: bool, served: Iterable[str]) -> Reply:
    """vLLM's 404 for a model it does not serve; from 0.32 on (`aliases`) it lists the names
    it does."""
    message = f"The model `{model}` does not exist."
    if aliases:
        # The base model's names only, adapters not (a real 0.32 server).
        message += f" Valid aliases: {', '.join(served)}."
    return error_reply(message, "NotFoundError", 404, param="model")


def bad_request(message: str, param: str | None = None) -> Reply:
    """vLLM's BadRequestError (a ValueError raised while serving a request)."""
    return error_reply(message, "BadRequestError", 400, param)


def validation_error(errors: list[Any]) -> Reply:
    """A FastAPI RequestValidationError as vLLM's `validation_exception_handler` reports it:
    400 "Bad Request", one line per error (at most 10), `param` the first error's `loc`."""
    count = len(errors)
    label = "error" if count == 1 else "errors"
    message = f"{count} validation {label}:\n" + "".join(
        f"  {_format_error(e)}\n" for e in errors[:10]
    )
    if count > 10:
        message += f"  ...and {count - 10} more {label}\n"
    first = errors[0] if errors else None
    param = ".".join(map(str, first["loc"])) if isinstance(first, dict) else None
    return error_reply(message.rstrip(), "Bad Request", 400, param)


def _format_error(error: Any) -> str:
    if not isinstance(error, dict):
        return str(error)
    shown = dict(error)
    shown["loc"] = ".".join(map(str, error["loc"]))
    if "input" in shown:
        shown["input"] = _summarize_input(shown["input"])
    return str(shown)


def _summarize_input(value: Any) -> str:
    """vLLM echoes containers by size only, everything else as text (at most 200 chars)."""
    if isinstance(value, (list, tuple, set, frozenset, dict)):
        return f"<{type(value).__name__} of {len(value)} items>"
    text = value if isinstance(value, str) else str(value)
    return text[:200] + "...[truncated]" if len(text) > 200 else text


def missing(location: str, name: str, given: Any) -> dict[str, Any]:
    """One "Field required" entry of a validation error."""
    return {"type": "missing", "loc": (location, name), "msg": "Field required", "input": given}


def not_of_type(location: str, name: str, expected: str, given: Any) -> dict[str, Any]:
    """One "Input should be a valid ..." entry of a validation error."""
    return {
        "type": f"{expected}_type",
        "loc": (location, name),
        "msg": f"Input should be a valid {expected}",
        "input": given,
    }


def missing_field(location: str, name: str, given: Any) -> Reply:
    return validation_error([missing(location, name, given)])


def wrong_type(location: str, name: str, expected: str, given: Any) -> Reply:
    return validation_error([not_of_type(location, name, expected, given)])


def unsupported_media_type() -> Reply:
    """vLLM's `validate_json_request`: any media type but application/json is refused."""
    return validation_error(["Unsupported Media Type: Only 'application/json' is allowed"])


def json_decode_error(exc: ValueError) -> Reply:
    return validation_error(
        [
            {
                "type": "json_invalid",
                "loc": ("body", getattr(exc, "pos", 0)),  # FastAPI's: the offending offset
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
