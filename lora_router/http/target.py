"""The one path rule: a request path judged once, the way vLLM's server will read it.

vLLM runs on uvicorn and Starlette: uvicorn percent-decodes the path once
(`urllib.parse.unquote`: UTF-8, invalid escapes kept as text, bad UTF-8 replaced) and
Starlette matches that against its routes exactly: case-sensitive, no normalisation of its
own (`/pause;x` is not `/pause`; `/pause/` is answered by a redirect to `/pause`). Routes are
matched here on the same decoded path, so no spelling reaches a replica that means a route the
router did not apply. The path (the target before its `?`) is judged as follows:

- an escape of an ordinary character is decoded (`/p%61use` is `/pause`, in upper- or lower-
  case hex), once (`%2561` is the text `%61`, as uvicorn reads it);
- refused, 400: an escaped `/` or `\\` (`%2F`, `%5C`: a separator to some servers on the way,
  text to others), an escaped control character (`%00`-`%1F`, `%7F`; raw ones are refused by
  the parser), an invalid escape (`%` not followed by two hex digits), a decoded path that is
  not UTF-8 (uvicorn would replace it, so it cannot name a route), a raw `\\`;
- refused, 400: empty segments (`//`, a trailing `/`) and dot segments (`.`, `..`, escaped or
  not): vLLM resolves neither and servers on the way may, so neither is resolved here;
- kept as written: `;` (an ordinary character to Starlette: `/pause;x` matches no route), case
  (`/PAUSE` matches no route), every other character.
A `#` anywhere in the target (a fragment: never part of a request target) is refused by the
server itself (http/server.py), before any route is looked at.

What is forwarded is what was judged: proxy/dispatch.py matches the judged path and sends the
replica the canonical path of the route it applied (plus the original query), never the
client's spelling.

The hot path pays nothing: a path found as it is in the route table (routes.py) is canonical by
construction; `canonical` runs only on a miss. This module is pure: no I/O, no state.
"""

from __future__ import annotations

from lora_router.http.errors import HTTPError

_HEX = frozenset(b"0123456789abcdefABCDEF")
# Bytes an escape must not produce: a separator, or a control character.
_REFUSED_ESCAPES = frozenset([*range(0x20), 0x7F, ord("/"), ord("\\")])
_DOT_SEGMENTS = (b"", b".", b"..")


def canonical(path: bytes) -> bytes:
    """`path` as vLLM's server will route it (escapes decoded), or a 400 naming what is wrong."""
    if b"\\" in path:
        raise _refused("a backslash, which some servers read as `/`")
    if b"%" in path:
        path = _decoded(path)
        try:
            path.decode("utf-8")
        except UnicodeDecodeError:
            raise _refused("escapes that do not decode to UTF-8") from None
    if path != b"/" and any(s in _DOT_SEGMENTS for s in path.split(b"/")[1:]):
        raise _refused("an empty segment (`//` or a trailing `/`) or a dot segment (`.`, `..`)")
    return path


def _decoded(path: bytes) -> bytes:
    head, *escaped = path.split(b"%")
    out = [head]
    for part in escaped:
        if len(part) < 2 or part[0] not in _HEX or part[1] not in _HEX:
            raise _refused("a `%` that does not start an escape (`%` and two hex digits)")
        byte = int(part[:2], 16)
        if byte in _REFUSED_ESCAPES:
            raise _refused("an escaped `/`, `\\` or control character (such as %2F or %00)")
        out.append(bytes((byte,)))
        out.append(part[2:])
    return b"".join(out)


def _refused(what: str) -> HTTPError:
    return HTTPError(
        400,
        f"The request path has {what}; lora-router routes only plain paths, as vLLM's own "
        "routes are written (e.g. /v1/completions).",
    )
