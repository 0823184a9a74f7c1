"""The routes the router reads or broadcasts itself (adapter loads and unloads, `/pause`,
`/resume`, the cache resets, aborts, `/finish_session`, `POST /router/replicas`, ...) take at
most `CONTROL_BODY_BYTES` of body, a 413 in vLLM's shape beyond, which no replica sees
(routes.py's `body_cap`, applied by http/server.py as the body arrives): a Content-Length over
the cap is answered before a byte of the body is sent, a chunked body as soon as it passes the
cap. A completion's body is not capped so. A replica id of any length is looked up, an unknown
one a 404 (before, 4,301 digits were a 500). Over real sockets, to emulated replicas.
"""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import call
from http_harness import RawClient, chunk

from lora_router.routes import CONTROL_BODY_BYTES, ROUTES, Kind

# Every route the router reads or broadcasts itself that takes a POST.
CONTROL = tuple(
    r.path.decode()
    for r in ROUTES
    if r.kind in (Kind.BROADCAST, Kind.FAN_OUT, Kind.LOCAL) and b"POST" in (r.methods or ())
)
TOO_BIG = {
    "error": {
        "message": f"Request body over {CONTROL_BODY_BYTES} bytes.",
        "type": "RequestEntityTooLarge",
        "param": None,
        "code": 413,
    }
}
# Far longer than any answer below may take: waiting for a body the client never sends ends in
# a 408 only at this deadline.
BODY_TIMEOUT = 60.0


def test_the_control_routes_are_the_ones_the_router_reads_or_broadcasts() -> None:
    assert {"/v1/load_lora_adapter", "/pause", "/resume", "/reset_prefix_cache"} <= set(CONTROL)
    assert {"/abort_requests", "/finish_session", "/router/replicas"} <= set(CONTROL)
    assert "/v1/completions" not in CONTROL


@pytest.mark.parametrize("path", CONTROL)
async def test_a_control_body_over_its_cap_is_a_413_no_replica_sees(
    path: str, emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    over = b'{"x": [%s]}' % b",".join([b"{}"] * (CONTROL_BODY_BYTES // 3))
    status, data, _ = await call(client, "POST", rt.url + path, data=over)
    assert status == 413, data
    assert orjson.loads(data) == TOO_BIG
    assert not [r for e in emus for r in e.requests if r.path == path]
    # At the cap, the body is read and judged (what it lacks is named, or it is broadcast).
    at = b'{"x": "%s"}' % (b"a" * (CONTROL_BODY_BYTES - 9))
    assert len(at) == CONTROL_BODY_BYTES
    status, data, _ = await call(client, "POST", rt.url + path + "?session_id=s", data=at)
    assert status != 413 and status < 500, data


async def test_a_content_length_over_the_cap_is_answered_before_the_body_is_sent(
    emulators: StartEmulators, router: StartRouter
) -> None:
    emus = await emulators(1)
    rt = await router(emus, body_timeout=BODY_TIMEOUT)
    # Every control route, and one spelled with an escape (`/p%61use` is `/pause`).
    for path in (*CONTROL, "/p%61use"):
        conn = await RawClient.connect(rt.url)
        try:
            await conn.send(
                b"POST %s HTTP/1.1\r\nhost: r\r\ncontent-length: 60000000\r\n\r\n" % path.encode()
            )
            # Not a byte of the body sent: on the code before, the router waited for all of it.
            answer = await conn.response(timeout=5.0)
            assert answer.status == 413, (path, answer.raw)
            assert answer.json() == TOO_BIG
            assert await conn.closed(timeout=5.0)
        finally:
            conn.close()
    assert not [r for r in emus[0].requests if r.path in (*CONTROL, "/pause")]


@pytest.mark.parametrize("path", ["/v1/load_lora_adapter", "/reset_prefix_cache"])
async def test_a_chunked_control_body_is_cut_at_the_cap(
    path: str, emulators: StartEmulators, router: StartRouter
) -> None:
    emus = await emulators(1)
    rt = await router(emus, body_timeout=BODY_TIMEOUT)
    conn = await RawClient.connect(rt.url)
    try:
        piece = b"x" * (64 << 10)
        pieces = CONTROL_BODY_BYTES // len(piece) + 1  # one past the cap, and no last chunk
        await conn.send(
            b"POST %s HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n\r\n" % path.encode()
            + chunk(piece) * pieces
        )
        answer = await conn.response(timeout=5.0)
        assert answer.status == 413, answer.raw
        assert answer.json() == TOO_BIG
        assert await conn.closed(timeout=5.0)
    finally:
        conn.close()
    assert not [r for r in emus[0].requests if r.path == path]


async def test_a_completion_body_over_the_control_cap_is_forwarded(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(1)
    rt = await router(emus)
    body = orjson.dumps({"prompt": "a" * CONTROL_BODY_BYTES, "max_tokens": 1})
    status, data, _ = await call(client, "POST", rt.url + "/v1/completions", data=body)
    assert status != 413, data
    assert [len(r.body) for r in emus[0].requests if r.path == "/v1/completions"] == [len(body)]


@pytest.mark.parametrize("digits", [1, 21, 4300, 4301, 5000])
async def test_an_unknown_replica_id_of_any_length_is_a_404(
    digits: int, emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(1)
    rt = await router(emus)
    status, data, _ = await call(client, "DELETE", f"{rt.url}/router/replicas/{'9' * digits}")
    assert status == 404, data
    assert orjson.loads(data)["error"]["message"].startswith("No replica with id '9")
    assert rt.fleet is not None and len(rt.fleet.replicas) == 1
