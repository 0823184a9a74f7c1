"""The rules a request head must obey before its body is read: which methods are served,
which bytes a header value may hold, and how the body is framed (RFC 9112 §6). Pure: the
client connection (http/server.py) applies them and answers the error they raise.

Rules:
- methods: the seven of METHODS; any other is 501;
- a header value holds no control character but tab (llhttp refuses them in strict mode too:
  this is the second lock);
- framing: one Content-Length, or one `Transfer-Encoding: chunked` on HTTP/1.1, never both and
  never two of either (400): only a plain `chunked` means the same to every parser on the way,
  so nothing else is accepted (request smuggling);
- `Expect`: only `100-continue` (else 417), honoured on HTTP/1.1 when a body is announced.
Never: read a body, hold state between requests, or write to a connection.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from lora_router.http.errors import HTTPError

METHODS = frozenset({b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"OPTIONS", b"PATCH"})
CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
# Request headers that frame the body, judged together once the head is complete.
FRAMING = frozenset({b"content-length", b"transfer-encoding", b"expect"})


class Framing(NamedTuple):
    chunked: bool
    length: bytes | None  # the Content-Length value (digits, checked by llhttp)
    expect_continue: bool  # a `100 Continue` is owed before the body


def body_framing(framing: list[tuple[bytes, bytes]], version: str) -> Framing:
    """The framing of a request from its FRAMING headers, in order (raises the 4xx)."""
    lengths = [v for k, v in framing if k == b"content-length"]
    codings = [v for k, v in framing if k == b"transfer-encoding"]
    if len(lengths) > 1 or (lengths and codings):
        raise HTTPError(400, "Conflicting Content-Length / Transfer-Encoding headers.")
    if codings and (
        version == "1.0" or len(codings) > 1 or codings[0].strip().lower() != b"chunked"
    ):
        raise HTTPError(400, "Only `Transfer-Encoding: chunked` (HTTP/1.1) is accepted.")
    expect = [v.lower() for k, v in framing if k == b"expect"]
    if expect and expect != [b"100-continue"]:
        raise HTTPError(417, "Only `Expect: 100-continue` is supported.")
    announced = bool(lengths or codings)
    return Framing(
        bool(codings),
        lengths[0] if lengths else None,
        bool(expect) and version == "1.1" and announced,
    )


def over_budget() -> HTTPError:
    return HTTPError(
        503,
        "The router holds as many request bodies as --max-buffered-bytes allows; retry.",
        headers=[(b"content-type", b"application/json"), (b"retry-after", b"1")],
    )


def body_too_big(limit: int) -> HTTPError:
    return HTTPError(413, f"Request body over {limit} bytes.")


def headers_too_big(limit: int) -> HTTPError:
    return HTTPError(431, f"Request headers over {limit} bytes.")
