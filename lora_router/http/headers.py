"""Header rules at the two borders of the proxy: client → replica and replica → client.

Headers are kept as raw `(name, value)` byte pairs, names lower-cased, values verbatim: the
router never splits, joins or re-encodes a value, so a header cannot turn into two (no
response splitting, no smuggling through re-serialisation).

What this module must never do: put the client's `Authorization` on an upstream request, or
put the replica token anywhere but the `Authorization` header of a request to a replica.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable

# Hop-by-hop headers, RFC 9110 §7.6.1 (and RFC 2616 §13.5.1 for the older names): they
# describe one connection, not the message, so a proxy must not forward them.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)

# Request headers the router replaces with its own: framing (the body is re-sent with an
# exact Content-Length), the target host, the credential, and `Expect` (answered locally).
_REQUEST_REPLACED = HOP_BY_HOP | {
    b"host",
    b"content-length",
    b"authorization",
    b"expect",
    b"x-forwarded-for",
}

# Response headers dropped before the client sees them. Transfer-Encoding is kept: the body is
# forwarded byte for byte, so its framing (chunked) must stay as the replica wrote it.
_RESPONSE_DROPPED = (HOP_BY_HOP - {b"transfer-encoding"}) | {b"x-lora-router-replica"}
_RESPONSE_DROPPED_DECHUNKED = _RESPONSE_DROPPED | {b"transfer-encoding"}

REPLICA_HEADER = b"x-lora-router-replica"

# A response header line whose name is dropped, to the end of its value. llhttp rejects
# whitespace before the colon, so `\r\nname:` finds every such line. Both patterns are matched
# against the lower-cased head (bytes.lower() keeps every offset), where a case-sensitive
# pattern is about twice as fast as re.IGNORECASE on the raw one.
_DROPPED_LINES = re.compile(
    rb"\r\n(?:" + b"|".join(re.escape(n) for n in sorted(_RESPONSE_DROPPED)) + rb"):[^\r\n]*"
)
# A `Connection` line that names other headers (anything but a lone keep-alive or close).
_NAMING_CONNECTION = re.compile(rb"\r\nconnection:(?![ \t]*(?:keep-alive|close)?[ \t]*(?:\r\n|\Z))")
_KEEP_ALIVE_TAIL = b"\r\nconnection: keep-alive\r\n\r\n"
_CLOSE_TAIL = b"\r\nconnection: close\r\n\r\n"


def connection_tokens(headers: Iterable[tuple[bytes, bytes]]) -> frozenset[bytes]:
    """Header names listed in `Connection` (they are hop-by-hop too, RFC 9110 §7.6.1)."""
    named: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            named.update(t.strip().lower() for t in value.split(b","))
    return frozenset(named)


def upstream_request_head(
    method: bytes,
    target: bytes,
    headers: list[tuple[bytes, bytes]],
    *,
    host: bytes,
    authorization: bytes | None,
    client_ip: bytes,
    new_request_id: Callable[[], bytes],
    body_length: int,
) -> bytes:
    """The request head sent to a replica (HTTP/1.1, keep-alive, exact Content-Length).

    `new_request_id` is called only when the client sent no `X-Request-Id`.
    """
    lines = [method, b" ", target, b" HTTP/1.1\r\nhost: ", host, b"\r\n"]
    forwarded_for = b""
    has_request_id = False
    listed: list[bytes] = []  # values of `Connection`
    for name, value in headers:
        if name in _REQUEST_REPLACED:
            if name == b"x-forwarded-for":
                forwarded_for += value + b", "  # several fields are one list (RFC 9110 §5.3)
            elif name == b"connection":
                listed.append(value)
            continue
        if name == b"x-request-id":
            has_request_id = True
        lines += (name, b": ", value, b"\r\n")
    if listed:
        named = connection_tokens((b"connection", v) for v in listed) - HOP_BY_HOP
        if named:
            # Rare: `Connection` names end-to-end headers, which are hop-by-hop for this
            # request (RFC 9110 §7.6.1). Build the head again without them.
            kept = [(n, v) for n, v in headers if n not in named and n != b"connection"]
            return upstream_request_head(
                method,
                target,
                kept,
                host=host,
                authorization=authorization,
                client_ip=client_ip,
                new_request_id=new_request_id,
                body_length=body_length,
            )
    if not has_request_id:
        lines += (b"x-request-id: ", new_request_id(), b"\r\n")
    if authorization is not None:
        lines += (b"authorization: ", authorization, b"\r\n")
    lines += (b"x-forwarded-for: ", forwarded_for, client_ip, b"\r\n")
    if body_length or method not in (b"GET", b"HEAD", b"DELETE", b"OPTIONS"):
        lines += (b"content-length: ", str(body_length).encode(), b"\r\n")
    lines.append(b"\r\n")
    return b"".join(lines)


def client_response_head(
    raw_head: bytes, replica: bytes, keep_alive: bool, dechunked: bool, body: bytes = b""
) -> bytes:
    """Rewrite a replica's response head for the client, followed by `body` (the first body
    bytes, copied in the same join: the client gets head and body in one write).

    `raw_head` is the head exactly as received, up to and excluding the blank line. The status
    line and every end-to-end header pass verbatim; hop-by-hop headers are dropped; the router
    adds which replica answered (an index, never its URL) and its own `Connection`. When the body
    is `dechunked` for an HTTP/1.0 client, `Transfer-Encoding` goes too (the close ends it).
    """
    tail = _KEEP_ALIVE_TAIL if keep_alive else _CLOSE_TAIL
    if not dechunked:
        # vLLM's heads (uvicorn's) carry no hop-by-hop line: one scan, one join. nginx's carry
        # `Connection: keep-alive`, cut by offsets found in the lower-cased copy. Right unless
        # `Connection` names other headers too (then the careful path below).
        lowered = raw_head.lower()
        found = _DROPPED_LINES.search(lowered)
        if found is None:
            return b"".join((raw_head, b"\r\n", REPLICA_HEADER, b": ", replica, tail, body))
        if _NAMING_CONNECTION.search(lowered, found.start()) is None:
            parts = []
            at = 0
            while found is not None:
                parts.append(raw_head[at : found.start()])
                at = found.end()
                found = _DROPPED_LINES.search(lowered, at)
            parts += (raw_head[at:], b"\r\n", REPLICA_HEADER, b": ", replica, tail, body)
            return b"".join(parts)
    status_line, *lines = raw_head.split(b"\r\n")
    fields = [(line.partition(b":")[0].strip().lower(), line) for line in lines]
    named = connection_tokens((name, line.partition(b":")[2]) for name, line in fields)
    dropped = _RESPONSE_DROPPED_DECHUNKED if dechunked else _RESPONSE_DROPPED
    out = [status_line]
    out += (line for name, line in fields if name not in dropped and name not in named)
    out.append(REPLICA_HEADER + b": " + replica)
    return b"\r\n".join(out) + tail + body


def response_head(
    status: int,
    reason: bytes,
    headers: Iterable[tuple[bytes, bytes]],
    body_length: int | None,
    keep_alive: bool,
) -> bytes:
    """The head of a response the router writes itself (errors, broadcasts, status pages)."""
    parts = [b"HTTP/1.1 ", str(status).encode(), b" ", reason, b"\r\n"]
    for name, value in headers:
        parts += (name, b": ", value, b"\r\n")
    if body_length is not None:
        parts += (b"content-length: ", str(body_length).encode(), b"\r\n")
    parts.append(b"connection: keep-alive\r\n\r\n" if keep_alive else b"connection: close\r\n\r\n")
    return b"".join(parts)
