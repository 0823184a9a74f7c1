"""No spelling of a guarded route reaches a replica as anything but that route: hypothesis writes
spellings of every route the router does not simply forward (percent-escapes in either case,
dot and empty segments, `;`, trailing slashes, case changes, escaped and raw separators), sends
each over a raw socket to one router in front of two emulated vLLM replicas, and reads what the
replicas received (the emulator records every request as it arrived)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import unquote

import httptools
import orjson
import pytest
from emulated_fleet import StartEmulators, StartRouter
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_router.emulator import Emulator
from lora_router.routes import REPLICA, ROUTES, Kind, Route
from lora_router.runtime import RouterRuntime

GUARDED = [r for r in ROUTES if r.kind is not Kind.FORWARD] + [REPLICA]
CANONICAL = {r.path for r in ROUTES}
# What the router's own answers ask a replica on the way (the fleet's health, its models).
CONTROL = {b"/health", b"/v1/models"}
BODIES = {
    b"/v1/completions": orjson.dumps({"prompt": [1, 2, 3], "max_tokens": 1}),
    b"/v1/chat/completions": orjson.dumps(
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    ),
    b"/v1/unload_lora_adapter": b'{"lora_name": "never-loaded"}',
}


@dataclass
class Fleet:
    router: RouterRuntime
    emulators: list[Emulator]


@pytest.fixture
async def fleet(emulators: StartEmulators, router: StartRouter) -> AsyncIterator[Fleet]:
    emus = await emulators(2)
    yield Fleet(await router(emus), emus)


def _path_of(route: Route) -> bytes:
    return b"/router/replicas/99" if route is REPLICA else route.path  # no such replica


@st.composite
def spellings(draw: st.DrawFn) -> tuple[Route, bytes]:
    route = draw(st.sampled_from(GUARDED))
    out = b""
    for segment in _path_of(route).split(b"/")[1:]:
        out += draw(st.sampled_from([b"/"] * 6 + [b"//", b"/./", b"/x/../", b"%2F", b"%2f", b"\\"]))
        for char in segment:
            how = draw(st.sampled_from(["keep"] * 5 + ["lower", "upper", "case", "double"]))
            if how == "lower":
                out += b"%%%02x" % char
            elif how == "upper":
                out += b"%%%02X" % char
            elif how == "case":
                out += bytes([char]).swapcase()
            elif how == "double":
                out += b"%%25%02X" % char
            else:
                out += bytes([char])
    out += draw(st.sampled_from([b""] * 6 + [b"/", b";x", b";", b"/.", b"%3B", b"%00", b"%2F"]))
    return route, out


async def send(url: str, method: bytes, target: bytes, body: bytes) -> tuple[int, bytes]:
    """One request as raw bytes (no client library re-spells the target): status and body."""
    host, port = url.rsplit("/", 1)[1].split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    head = b"%s %s HTTP/1.1\r\nhost: r\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
    writer.write(head % (method, target, len(body)) + body)
    got = {"body": b""}

    class Answer:
        def on_body(self, data: bytes) -> None:
            got["body"] += data

    parser = httptools.HttpResponseParser(Answer())
    async with asyncio.timeout(10):
        while data := await reader.read(65536):
            parser.feed_data(data)
    writer.close()
    return parser.get_status_code(), got["body"]


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=spellings())
async def test_no_spelling_of_a_guarded_route_reaches_a_replica_as_anything_else(
    fleet: Fleet, case: tuple[Route, bytes]
) -> None:
    route, target = case
    emus = fleet.emulators
    marks = [len(e.requests) for e in emus]
    method = sorted(route.methods or {b"POST"})[-1]  # POST where a route takes GET and POST
    query = b"?mode=keep" if route.path == b"/pause" else b""
    status, body = await send(
        fleet.router.url, method, target + query, BODIES.get(route.path, b"{}")
    )
    got = [[r.path.encode() for r in e.requests[m:]] for e, m in zip(emus, marks, strict=True)]
    paths = [t.partition(b"?")[0] for received in got for t in received]
    # Nothing but canonical paths ever arrives, and only the route the router applied.
    assert set(paths) <= {route.path} | CONTROL, (target, paths)
    if route.kind in (Kind.REFUSED, Kind.CLOSED):
        assert route.path not in paths, target
    if route.kind is Kind.BROADCAST:  # every replica, or none: never one of them
        assert len({received.count(route.path + query) for received in got}) == 1, (target, got)
    # A spelling vLLM would read as the route is handled as that route, or refused 400.
    if unquote(target.decode()) == _path_of(route).decode():
        assert status == 400 or body != b'{"detail":"Not Found"}', (target, status)
    if route.path == b"/pause" and status == 200:
        assert (await send(fleet.router.url, b"POST", b"/resume", b""))[0] == 200
