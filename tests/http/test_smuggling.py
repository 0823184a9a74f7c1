"""Hostile framing: every ambiguous or malformed request is refused and its connection closed;
no replica ever receives a request the client did not plainly send, and the router never talks
to a host that is not one of its replicas."""

from __future__ import annotations

import asyncio

import pytest
from http_harness import Received, ReplicaConn, json_response

HIDDEN = b"GET /hidden HTTP/1.1\r\nhost: r\r\n\r\n"

# Each is sent followed by HIDDEN: the router must answer with an error and close, and the
# hidden request must never reach a replica.
MALFORMED = {
    "CL and TE": b"POST /x HTTP/1.1\r\nhost: r\r\ncontent-length: 6\r\n"
    b"transfer-encoding: chunked\r\n\r\n0\r\n\r\n",
    "TE and CL": b"POST /x HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n"
    b"content-length: 6\r\n\r\n0\r\n\r\n",
    "two content-lengths": b"POST /x HTTP/1.1\r\nhost: r\r\ncontent-length: 0\r\n"
    b"content-length: 34\r\n\r\n",
    "same content-length twice": b"POST /x HTTP/1.1\r\nhost: r\r\ncontent-length: 2\r\n"
    b"content-length: 2\r\n\r\nab",
    "content-length list": b"POST /x HTTP/1.1\r\nhost: r\r\ncontent-length: 2, 2\r\n\r\nab",
    "content-length sign": b"POST /x HTTP/1.1\r\nhost: r\r\ncontent-length: +2\r\n\r\nab",
    "gzip, chunked": b"POST /x HTTP/1.1\r\nhost: r\r\ntransfer-encoding: gzip, chunked\r\n\r\n"
    b"0\r\n\r\n",
    "chunked, chunked": b"POST /x HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked, chunked"
    b"\r\n\r\n0\r\n\r\n",
    "two TE fields": b"POST /x HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n"
    b"transfer-encoding: identity\r\n\r\n0\r\n\r\n",
    "unknown coding": b"POST /x HTTP/1.1\r\nhost: r\r\ntransfer-encoding: xchunked\r\n\r\n"
    b"0\r\n\r\n",
    "space before colon": b"POST /x HTTP/1.1\r\nhost: r\r\ntransfer-encoding : chunked\r\n\r\n"
    b"0\r\n\r\n",
    "TE in HTTP/1.0": b"POST /x HTTP/1.0\r\ntransfer-encoding: chunked\r\n\r\n0\r\n\r\n",
    "bad chunk size": b"POST /x HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n\r\n"
    b"zz\r\n\r\n",
    "chunk size overflow": b"POST /x HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n\r\n"
    b"1000000000000000000\r\n",
    "chunk with bare LF": b"POST /x HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n\r\n"
    b"3\nabc\n0\n\n",
    "bare LF head": b"GET /x HTTP/1.1\nhost: r\n\n",
    "bare CR in value": b"GET /x HTTP/1.1\r\nhost: r\r\nx: a\rb\r\n\r\n",
    "obs-fold": b"GET /x HTTP/1.1\r\nhost: r\r\nx-a: 1\r\n x-b: 2\r\n\r\n",
    "NUL in value": b"GET /x HTTP/1.1\r\nhost: r\r\nx-a: a\x00b\r\n\r\n",
    "control in value": b"GET /x HTTP/1.1\r\nhost: r\r\nx-a: a\x1bb\r\n\r\n",
    "space in name": b"GET /x HTTP/1.1\r\nhost: r\r\nx a: 1\r\n\r\n",
    "HTTP/0.9": b"GET /x\r\n\r\n",
    "HTTP/2 preface": b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    "lower-case method": b"get /x HTTP/1.1\r\nhost: r\r\n\r\n",
    "garbage": b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
}


@pytest.mark.parametrize("raw", MALFORMED.values(), ids=MALFORMED.keys())
async def test_malformed_or_ambiguous_requests_are_refused_with_a_close(
    router, replica, clients, raw
):
    rt = await router([replica])
    client = await clients(rt.url)
    await client.send(raw + HIDDEN)
    received = await client.read_all(timeout=5)  # the router closes: no hang
    if received:  # an error answer, never a success
        status = int(received.split(b" ", 2)[1])
        assert status in (400, 501, 505), received
        assert b"connection: close" in received
    assert all(r.target != b"/hidden" for r in replica.requests)
    assert all(r.method in (b"GET", b"POST") and r.target == b"/x" for r in replica.requests)
    assert replica.malformed == []


async def test_a_request_in_front_of_bad_bytes_is_answered_then_the_connection_closes(
    router, replica, clients
):
    rt = await router([replica])
    client = await clients(rt.url)
    await client.send(b"GET /first HTTP/1.1\r\nhost: r\r\n\r\n" + MALFORMED["CL and TE"] + HIDDEN)
    assert (await client.response()).status == 200
    assert await client.closed()
    assert [r.target for r in replica.requests] == [b"/first"]


async def test_trailers_never_become_request_headers(router, replica, clients):
    rt = await router([replica])
    client = await clients(rt.url)
    await client.send(
        b"POST /x HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n\r\n"
        b"3\r\nabc\r\n0\r\nx-injected: 1\r\nx-forwarded-for: 6.6.6.6\r\n\r\n"
    )
    assert (await client.response()).status == 200
    got = replica.requests[0]
    assert got.body == b"abc"
    assert got.header(b"x-injected") is None
    assert got.header(b"x-forwarded-for") == b"127.0.0.1"


async def test_absolute_form_targets_never_reach_another_host(
    router, replica, replica_factory, clients
):
    rt = await router([replica])
    elsewhere = await replica_factory()  # the host the request names
    client = await clients(rt.url)
    await client.send(
        f"GET {elsewhere.url}/steal HTTP/1.1\r\nhost: 127.0.0.1:{elsewhere.port}\r\n\r\n".encode()
    )
    r = await client.response()
    assert r.status == 400
    assert await client.closed()
    assert elsewhere.conns == [] and elsewhere.control_conns == []
    assert replica.requests == []


async def test_connect_is_refused_without_opening_a_tunnel(
    router, replica, replica_factory, clients
):
    rt = await router([replica])
    elsewhere = await replica_factory()
    client = await clients(rt.url)
    target = f"127.0.0.1:{elsewhere.port}".encode()
    await client.send(b"CONNECT " + target + b" HTTP/1.1\r\nhost: " + target + b"\r\n\r\n")
    r = await client.response()
    assert r.status == 501
    assert await client.closed()
    assert elsewhere.conns == [] and replica.requests == []


@pytest.mark.parametrize("method", [b"TRACE", b"PROPFIND", b"LINK", b"MKCOL"])
async def test_unsupported_methods_are_501(router, replica, clients, method):
    rt = await router([replica])
    client = await clients(rt.url)
    await client.send(method + b" /x HTTP/1.1\r\nhost: r\r\n\r\n")
    r = await client.response()
    assert r.status == 501 and r.json()["error"]["code"] == 501
    assert replica.requests == []


UPGRADE = b"connection: upgrade\r\nupgrade: h2c\r\n"


@pytest.mark.parametrize(
    "raw",
    [
        b"GET /x HTTP/1.1\r\nhost: r\r\nconnection: upgrade\r\nupgrade: websocket\r\n\r\n"
        + b"\x81\x85raw websocket frame",
        # llhttp reads a body behind an upgrade as the new protocol's bytes: the request would
        # be handed over empty (a 400 "body is empty", or forwarded without its body).
        b"POST /x HTTP/1.1\r\nhost: r\r\n" + UPGRADE + b'content-length: 8\r\n\r\n{"a": 1}',
        b"POST /v1/completions HTTP/1.1\r\nhost: r\r\n"
        + UPGRADE
        + b'content-length: 15\r\n\r\n{"prompt": [1]}',
    ],
    ids=["websocket", "forwarded body", "completion body"],
)
async def test_an_upgrade_request_is_refused_whole_then_closed(router, replica, clients, raw):
    rt = await router([replica])
    client = await clients(rt.url)
    await client.send(raw + HIDDEN)
    r = await client.response()
    assert r.status == 501
    assert r.json()["error"]["message"] == "CONNECT and protocol upgrades are not supported."
    assert await client.closed()
    assert replica.requests == [] and replica.malformed == []


async def test_a_pipelined_request_behind_a_slow_one_gets_no_early_deadline(
    router, replica, clients
):
    # The second request arrives half-sent while the first is being answered; its deadline
    # only starts once the first answer is complete, and it never interleaves with it.
    async def respond(req: Received, conn: ReplicaConn) -> None:
        if req.target == b"/slow":
            await asyncio.sleep(0.5)
        await conn.write(json_response(req.target))

    replica.responder = respond
    rt = await router([replica], header_timeout=0.3)
    client = await clients(rt.url)
    await client.send(b"GET /slow HTTP/1.1\r\nhost: r\r\n\r\nGET /next HTTP/1.1\r\nho")
    first = await client.response()
    assert first.body == b"/slow"
    await client.send(b"st: r\r\n\r\n")
    assert (await client.response()).body == b"/next"


async def test_expect_continue_behind_a_pipelined_request_waits_for_its_turn(
    router, replica, clients
):
    rt = await router([replica])
    release = asyncio.Event()

    async def respond(req: Received, conn: ReplicaConn) -> None:
        if req.target == b"/slow":
            await release.wait()
        await conn.write(json_response(req.target))

    replica.responder = respond
    client = await clients(rt.url)
    await client.send(
        b"GET /slow HTTP/1.1\r\nhost: r\r\n\r\n"
        b"POST /next HTTP/1.1\r\nhost: r\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\n"
    )
    await replica.wait_requests(1)
    with pytest.raises(TimeoutError):  # no 100 Continue while /slow is unanswered
        await asyncio.wait_for(client.reader.readuntil(b"HTTP/1.1 100 Continue\r\n\r\n"), 0.05)
    release.set()
    async with asyncio.timeout(5):
        raw = await client.reader.readuntil(b"HTTP/1.1 100 Continue\r\n\r\n")
    assert raw.endswith(b"\r\n\r\n/slowHTTP/1.1 100 Continue\r\n\r\n")  # after, not inside
    await client.send(b"{}")
    assert (await client.response()).body == b"/next"
