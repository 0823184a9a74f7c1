"""The bytes of an answer reach the client exactly as the replica wrote them, when it wrote them;
connections are reused, request bodies arrive whole whatever their framing."""

from __future__ import annotations

import asyncio
import gc
import itertools
import ssl

import pytest
import trustme
from http_harness import (
    RawClient,
    Received,
    ReplicaConn,
    chunk,
    completion,
    json_response,
    request,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SSE_HEAD = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
    b"x-request-id: cmpl-1\r\ntransfer-encoding: chunked\r\n\r\n"
)


def split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points) if b > a]


frames_strategy = st.lists(
    st.text(min_size=0, max_size=200).map(
        lambda t: b"data: " + t.encode("utf-8", "surrogatepass").replace(b"\n", b" ") + b"\n\n"
    ),
    min_size=1,
    max_size=6,
)
write_pattern = st.lists(st.integers(0, 10_000), max_size=4)  # where a frame is cut into writes
delays = st.sampled_from([0.0, 0.0, 0.001, 0.003])


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    frames=frames_strategy,
    cuts=st.lists(write_pattern, min_size=6, max_size=6),
    delay=delays,
    head_with_first=st.booleans(),
)
async def test_sse_stream_passes_through_byte_exact_frame_by_frame(
    router, replica_factory, frames, cuts, delay, head_with_first
):
    # The replica writes frame i (in pieces, with delays) and then waits until the client has
    # received all of it: a router that held bytes back would deadlock here and time out.
    received_up_to: list[asyncio.Event] = [asyncio.Event() for _ in frames]
    body = b"".join(chunk(f) for f in frames) + b"0\r\n\r\n"

    async def respond(req: Received, conn: ReplicaConn) -> None:
        if not head_with_first:
            await conn.write(SSE_HEAD)
        for i, frame in enumerate(frames):
            data = (SSE_HEAD if head_with_first and i == 0 else b"") + chunk(frame)
            for piece in split(data, cuts[i]):
                await conn.write(piece)
                if delay:
                    await asyncio.sleep(delay)
            async with asyncio.timeout(5):
                await received_up_to[i].wait()
        await conn.write(b"0\r\n\r\n")

    replica = await replica_factory(respond)
    rt = await router([replica])
    client = await RawClient.connect(rt.url)
    try:
        payload = completion(stream=True)
        await client.send(
            b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: "
            + str(len(payload)).encode()
            + b"\r\n\r\n"
            + payload
        )
        got = b""
        ends = []
        offset = 0
        for f in frames:
            offset += len(chunk(f))
            ends.append(offset)
        head_end = -1
        async with asyncio.timeout(10):
            i = 0
            while True:
                data = await client.reader.read(65536)
                assert data, "router closed the stream early"
                got += data
                if head_end < 0:
                    head_end = got.find(b"\r\n\r\n")
                    if head_end < 0:
                        continue
                stream = got[head_end + 4 :]
                assert body.startswith(stream)
                while i < len(frames) and len(stream) >= ends[i]:
                    received_up_to[i].set()
                    i += 1
                if stream == body:
                    break
        assert got[: head_end + 4] == (
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
            b"x-request-id: cmpl-1\r\ntransfer-encoding: chunked\r\n"
            b"x-lora-router-replica: 0\r\nconnection: keep-alive\r\n\r\n"
        )
    finally:
        client.close()
        await rt.stop()
        await replica.stop()


@pytest.fixture
async def front(router, replica):
    """The router in front of `replica`, one for all the examples of a property test."""
    return await router([replica])


@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=st.binary(max_size=20_000), cuts=write_pattern, request_body=st.binary(max_size=5000))
async def test_content_length_body_is_byte_exact_both_ways(
    front, replica, body, cuts, request_body
):
    async def respond(req: Received, conn: ReplicaConn) -> None:
        for piece in split(
            b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % len(body) + body, cuts
        ):
            await conn.write(piece)

    replica.responder = respond
    before = len(replica.requests)
    r = await request(front.url, "PUT", "/anything?x=1", request_body)
    assert r.status == 200
    assert r.body == body
    assert replica.requests[before].body == request_body
    assert replica.requests[before].target == b"/anything?x=1"


NGINX_HEAD = (
    b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Tue, 01 Dec 2026 19:35:22 GMT\r\n"
    b"Content-Type: application/json\r\nContent-Length: %d\r\nConnection: keep-alive\r\n"
    b'Keep-Alive: timeout=60\r\nETag: "692dbd84-1a0"\r\n\r\n'
)


@pytest.mark.parametrize("size", [0, 3_000, 4_096, 4_097, 40_000])
async def test_an_answer_arriving_with_its_head_reaches_the_client_exact_less_its_hop_lines(
    router, replica, clients, size
):
    # Small answers are joined behind the rewritten head, larger ones written beside it: both
    # must give the client the same bytes, on a connection that stays open.
    rt = await router([replica])
    body = bytes(range(256)) * (size // 256) + b"x" * (size % 256)

    async def respond(req: Received, conn: ReplicaConn) -> None:
        await conn.write(NGINX_HEAD % size + body)

    replica.responder = respond
    client = await clients(rt.url)
    for _ in range(2):
        await client.send(b"GET /a HTTP/1.1\r\nhost: r\r\n\r\n")
        answer = await client.response()
        assert answer.raw == (
            b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Tue, 01 Dec 2026 19:35:22 GMT\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n"
            b'ETag: "692dbd84-1a0"\r\nx-lora-router-replica: 0\r\nconnection: keep-alive\r\n\r\n'
            % size
            + body
        )
    assert len(replica.conns) == 1


async def test_keep_alive_connections_are_reused_on_both_sides(router, replica, clients):
    rt = await router([replica])
    client = await clients(rt.url)
    for _ in range(5):
        await client.send(b"GET /version HTTP/1.1\r\nhost: r\r\n\r\n")
        r = await client.response()
        assert r.status == 200 and r.header(b"connection") == b"keep-alive"
    assert len(replica.requests) == 5
    assert len(replica.conns) == 1  # one pooled upstream connection carried all five


async def test_pipelined_requests_are_answered_in_order(router, replica, clients):
    rt = await router([replica])

    async def respond(req: Received, conn: ReplicaConn) -> None:
        if req.target == b"/slow":
            await asyncio.sleep(0.05)
        await conn.write(json_response(req.target))

    replica.responder = respond
    client = await clients(rt.url)
    await client.send(
        b"GET /slow HTTP/1.1\r\nhost: r\r\n\r\nGET /fast HTTP/1.1\r\nhost: r\r\n\r\n"
        b"GET /last HTTP/1.1\r\nhost: r\r\n\r\n"
    )
    assert [(await client.response()).body for _ in range(3)] == [b"/slow", b"/fast", b"/last"]


async def test_chunked_request_body_is_forwarded_whole_with_a_content_length(
    router, replica, clients
):
    rt = await router([replica])
    body = completion(prompt=list(range(50)))
    pieces = [body[:7], body[7:30], body[30:]]
    chunked = b"".join(chunk(p) for p in pieces) + b"0\r\n\r\n"
    client = await clients(rt.url)
    await client.send(
        b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n\r\n"
    )
    for i in range(0, len(chunked), 5):  # and split across many writes
        await client.send(chunked[i : i + 5])
    r = await client.response()
    assert r.status == 200
    got = replica.requests[0]
    assert got.body == body
    assert got.header(b"content-length") == str(len(body)).encode()
    assert got.header(b"transfer-encoding") is None


async def test_expect_100_continue_is_answered_before_the_body_is_sent(router, replica, clients):
    rt = await router([replica])
    body = completion()
    client = await clients(rt.url)
    await client.send(
        b"POST /v1/completions HTTP/1.1\r\nhost: r\r\nexpect: 100-continue\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    async with asyncio.timeout(5):
        interim = await client.reader.readuntil(b"\r\n\r\n")
    assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
    await client.send(body)
    r = await client.response()
    assert r.status == 200
    assert replica.requests[0].body == body
    assert replica.requests[0].header(b"expect") is None


async def test_expect_100_continue_over_the_body_limit_gets_413_without_continue(
    router, replica, clients
):
    rt = await router([replica], max_body_bytes=100)
    client = await clients(rt.url)
    await client.send(
        b"POST /v1/completions HTTP/1.1\r\nhost: r\r\nexpect: 100-continue\r\n"
        b"content-length: 1000\r\n\r\n"
    )
    r = await client.response()
    assert r.status == 413
    assert b"100 Continue" not in r.raw
    assert replica.requests == []


async def test_a_stale_pooled_connection_is_retried_once_on_a_fresh_one(router, replica_factory):
    # The replica answers the first request, then closes that keep-alive connection the moment
    # the next request arrives on it (the race of a replica closing an idle connection).
    async def respond(req: Received, conn: ReplicaConn) -> None:
        if conn.index == 0 and req.target == b"/second":
            conn.abort()
            return
        await conn.write(json_response(req.target))

    replica = await replica_factory(respond)
    rt = await router([replica])
    assert (await request(rt.url, path="/first")).body == b"/first"
    r = await request(rt.url, "POST", "/second", b"{}")
    assert r.status == 200 and r.body == b"/second"
    assert [(q.target, q.conn) for q in replica.requests] == [
        (b"/first", 0),
        (b"/second", 0),
        (b"/second", 1),
    ]


async def test_a_completion_on_a_stale_pooled_connection_is_retried_once_on_a_fresh_one(
    replica_factory, router
):
    # The same race on the routed path (retries there are the app's, before any byte).
    async def respond(req: Received, conn: ReplicaConn) -> None:
        if conn.index == 0 and len(replica.requests) == 2:
            conn.abort()
            return
        await conn.write(json_response(b'{"n":%d}' % len(replica.requests)))

    replica = await replica_factory(respond)
    rt = await router([replica])
    for expected in (b'{"n":1}', b'{"n":3}'):
        r = await request(rt.url, "POST", "/v1/completions", completion())
        assert r.status == 200 and r.body == expected
    assert [q.conn for q in replica.requests] == [0, 0, 1]
    (serving,) = rt.fleet.replicas
    assert serving.breaker.failures == 0 and serving.in_flight == 0  # not the replica's fault


async def test_a_request_is_not_retried_after_the_first_response_byte(
    replica_factory, router, clients
):
    async def respond(req: Received, conn: ReplicaConn) -> None:
        if req.target == b"/second":
            await conn.write(b"HTTP/1.1 200 OK\r\ncontent-len")
            conn.abort()
            return
        await conn.write(json_response())

    replica = await replica_factory(respond)
    rt = await router([replica])
    await request(rt.url, path="/first")
    r = await request(rt.url, path="/second")
    assert r.status == 502
    assert [q.target for q in replica.requests] == [b"/first", b"/second"]


async def test_a_fresh_connection_that_fails_is_not_retried(replica_factory, router):
    async def respond(req: Received, conn: ReplicaConn) -> None:
        conn.abort()

    replica = await replica_factory(respond)
    rt = await router([replica], retries=0)
    r = await request(rt.url, path="/x")
    assert r.status == 502
    assert len(replica.requests) == 1


async def test_tls_replica_verified_against_a_private_ca(replica_factory, router, tmp_path):
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(server_ctx)
    replica = await replica_factory(ssl_context=server_ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))

    rt = await router([replica], ca_file=str(ca_file))
    r = await request(rt.url, "POST", "/v1/completions", completion())
    assert r.status == 200 and r.body == b'{"ok":true}'
    assert replica.requests[0].header(b"host") == f"localhost:{replica.port}".encode()

    # Verified against the system store only, the replica is refused: no request reaches it.
    before = len(replica.requests)
    untrusting = await router([replica], retries=0)
    r = await request(untrusting.url, "POST", "/v1/completions", completion())
    assert r.status in (502, 503)
    assert len(replica.requests) == before


@pytest.mark.parametrize("warm", [False, True], ids=["new-connection", "pooled-connection"])
async def test_client_disconnect_mid_stream_closes_the_upstream_within_a_second(
    router, replica, clients, warm
):
    rt = await router([replica])
    started = asyncio.Event()

    async def respond(req: Received, conn: ReplicaConn) -> None:
        if req.target == b"/v1/completions" and b'"stream":false' in req.body:
            await conn.write(json_response())
            return
        await conn.write(SSE_HEAD + chunk(b"data: {}\n\n"))
        started.set()
        await asyncio.sleep(30)  # a long generation

    replica.responder = respond
    if warm:
        # One answered completion first: the stream then goes out on the pooled connection.
        answered = await request(rt.url, "POST", "/v1/completions", completion(stream=False))
        assert answered.status == 200
    client = await clients(rt.url)
    payload = completion(stream=True)
    await client.send(
        b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n" % len(payload)
        + payload
    )
    await started.wait()
    await client.reader.readuntil(b"data: {}\n\n")
    client.close()
    async with asyncio.timeout(1.0):
        await replica.conns[0].closed.wait()
    assert len(replica.conns) == 1  # the stream went out on the pooled connection, if warm
    stats = rt.app.stats.requests
    async with asyncio.timeout(1.0):
        while stats.get(("/v1/completions", 200, b"0"), 0) != 1 + warm:
            await asyncio.sleep(0.01)  # counted once its replica connection is gone


async def test_client_disconnect_while_the_replica_thinks_closes_the_upstream(
    router, replica, clients
):
    rt = await router([replica])

    async def respond(req: Received, conn: ReplicaConn) -> None:
        await asyncio.sleep(30)  # a long prefill: no byte yet

    replica.responder = respond
    client = await clients(rt.url)
    await client.send(b"GET /slow HTTP/1.1\r\nhost: r\r\n\r\n")
    await replica.wait_requests(1)
    client.close()
    async with asyncio.timeout(1.0):
        await replica.conns[0].closed.wait()


async def test_http10_client_gets_a_dechunked_body_ended_by_close(router, replica, clients):
    rt = await router([replica])
    frames = [b"data: 1\n\n", b"data: [DONE]\n\n"]

    async def respond(req: Received, conn: ReplicaConn) -> None:
        await conn.write(SSE_HEAD + chunk(frames[0]))
        await conn.write(chunk(frames[1]) + b"0\r\n\r\n")

    replica.responder = respond
    client = await clients(rt.url)
    await client.send(b"GET /stream HTTP/1.0\r\n\r\n")
    raw = await client.read_all()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    assert b"transfer-encoding" not in head.lower()
    assert b"connection: close" in head
    assert body == b"".join(frames)
    # The same pooled replica connection then serves an HTTP/1.1 client: chunks pass as sent.
    client = await clients(rt.url)
    await client.send(b"GET /stream HTTP/1.1\r\nhost: r\r\n\r\n")
    answer = await client.response()
    assert answer.body == b"".join(frames)
    assert chunk(frames[0]) + chunk(frames[1]) + b"0\r\n\r\n" in answer.raw
    assert len(replica.conns) == 1


async def test_http10_client_with_a_content_length_answer(router, replica, clients):
    rt = await router([replica])
    client = await clients(rt.url)
    await client.send(b"GET /version HTTP/1.0\r\n\r\n")
    raw = await client.read_all()
    assert raw.startswith(b"HTTP/1.1 200 OK") and raw.endswith(b'\r\n\r\n{"ok":true}')


async def test_head_request_gets_headers_only(router, replica, clients):
    rt = await router([replica])

    async def respond(req: Received, conn: ReplicaConn) -> None:
        await conn.write(b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n")

    replica.responder = respond
    r = await request(rt.url, "HEAD", "/x")  # a --forward-path: every method forwarded
    assert r.status == 200 and r.header(b"content-length") == b"1234" and r.body == b""
    # and the router still works after it
    replica.responder = lambda req, conn: conn.write(json_response())
    assert (await request(rt.url)).status == 200


async def test_redirects_are_passed_to_the_client_untouched_not_followed(router, replica):
    rt = await router([replica])

    async def respond(req: Received, conn: ReplicaConn) -> None:
        await conn.write(
            b"HTTP/1.1 307 Temporary Redirect\r\nlocation: http://evil.example/steal\r\n"
            b"content-length: 0\r\n\r\n"
        )

    replica.responder = respond
    r = await request(rt.url, "POST", "/v1/completions", completion())
    assert r.status == 307
    assert r.header(b"location") == b"http://evil.example/steal"
    assert len(replica.requests) == 1


async def test_interim_1xx_from_a_replica_is_not_forwarded(router, replica):
    rt = await router([replica])

    async def respond(req: Received, conn: ReplicaConn) -> None:
        await conn.write(b"HTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n" + json_response())

    replica.responder = respond
    r = await request(rt.url)
    assert r.status == 200 and r.body == b'{"ok":true}'
    assert b"103" not in r.raw


async def test_bytes_after_the_end_of_a_response_never_reach_the_client(router, replica, clients):
    rt = await router([replica])

    async def respond(req: Received, conn: ReplicaConn) -> None:
        await conn.write(json_response() + b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nEVIL!")

    replica.responder = respond
    client = await clients(rt.url)
    await client.send(b"GET /a HTTP/1.1\r\nhost: r\r\n\r\n")
    # Head and junk arrive together: parsed before a byte goes out, the whole answer is refused.
    answer = await client.response()
    assert answer.status == 502 and b"malformed response" in answer.body
    assert b"EVIL" not in answer.raw and not client._pending


async def test_a_close_delimited_answer_is_forwarded_up_to_its_close(router, replica, clients):
    rt = await router([replica])

    async def respond(req: Received, conn: ReplicaConn) -> None:
        await conn.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\nuntil the end")
        conn.abort()

    replica.responder = respond
    client = await clients(rt.url)
    await client.send(b"GET / HTTP/1.1\r\nhost: r\r\n\r\n")
    raw = await client.read_all()
    assert raw.endswith(b"\r\n\r\nuntil the end") and b"connection: close" in raw


async def test_a_slow_client_pauses_the_replica_so_memory_stays_bounded(router, replica, clients):
    rt = await router([replica])
    total = 64 * 1024 * 1024
    piece = b"x" * (256 * 1024)
    written = 0
    done = asyncio.Event()

    async def respond(req: Received, conn: ReplicaConn) -> None:
        nonlocal written
        await conn.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        while written < total:
            await conn.write(piece)  # drain(): blocks while the router does not read
            written += len(piece)
        done.set()

    replica.responder = respond
    client = await clients(rt.url)
    await client.send(b"GET /big HTTP/1.1\r\nhost: r\r\n\r\n")
    await replica.wait_requests(1)
    with pytest.raises(TimeoutError):  # the client reads nothing: the replica cannot finish
        await asyncio.wait_for(done.wait(), 0.3)
    # The replica is stuck well short of the end (kernel socket buffers hold a few MB), and the
    # router itself holds little of it.
    assert written < 24 * 1024 * 1024
    (conn,) = rt.connections.open
    assert conn.transport.get_write_buffer_size() < 2 * 1024 * 1024
    received = 0
    async with asyncio.timeout(20):
        while received < total:
            data = await client.reader.read(1 << 20)
            assert data
            received += len(data)
    await done.wait()


async def test_many_requests_leave_no_upstream_connection_or_task_behind(router, replica, clients):
    rt = await router([replica])
    for _ in range(50):
        assert (await request(rt.url)).status == 200
    gc.collect()
    pool = rt.fleet.replicas[0].pool
    assert pool.open_connections <= 1
    assert len(asyncio.all_tasks()) < 10


@pytest.mark.parametrize("prefix", ["/base", "/deep/prefix"])
async def test_a_replica_url_path_prefix_is_prepended(replica_factory, router, prefix):
    replica = await replica_factory()
    rt = await router([replica.url + prefix + "/"])
    await request(rt.url, path="/version?x=1")
    assert replica.requests[0].target == prefix.encode() + b"/version?x=1"


async def test_connection_close_from_the_client_is_honoured(router, replica, clients):
    rt = await router([replica])
    client = await clients(rt.url)
    await client.send(
        b"GET /one HTTP/1.1\r\nhost: r\r\nconnection: close\r\n\r\n"
        b"GET /two HTTP/1.1\r\nhost: r\r\n\r\n"
    )
    r = await client.response()
    assert r.status == 200 and r.header(b"connection") == b"close"
    assert await client.closed()
    assert [q.target for q in replica.requests] == [b"/one"]
