"""Every error the router answers itself, in vLLM's shape, and the limits behind them."""

from __future__ import annotations

import asyncio
import os

import orjson
import pytest
from helpers import until
from http_harness import (
    TOKEN,
    RawClient,
    Received,
    ReplicaConn,
    completion,
    json_response,
    post_completion,
    request,
)


def assert_vllm_error(r, status: int, type_: str | None = None) -> dict:
    assert r.status == status, r.raw
    assert r.header(b"content-type") == b"application/json"
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == status
    if type_ is not None:
        assert error["type"] == type_
    return error


# -- bad bodies: answered by the router, no replica bothered -------------------------------------

BAD_BODIES = {
    "not json": b"{nope",
    "non-utf8": b'{"prompt": "\xff\xfe"}',
    "empty": b"",
    "array": b"[1, 2]",
    "prompt object": b'{"prompt": {}}',
    "model number": b'{"model": 5, "prompt": [1]}',
    "stream string": b'{"prompt": [1], "stream": "yes"}',
    "negative id": b'{"prompt": [1, -2, 3]}',
    "float id": b'{"prompt": [1, 2.5]}',
    "id too big": b'{"prompt": [4294967296]}',
    "string in ids": b'{"prompt": [1, "2"]}',
    "empty prompt": b'{"prompt": []}',
    "mixed batch": b'{"prompt": [[1, 2], "x"]}',
    "nested too deep": b'{"prompt": [[[1]]]}',
    "no prompt": b'{"max_tokens": 5}',
    "too many tokens": orjson.dumps({"prompt": list(range(1001))}),
    # A valid token-id list the cut (proxy/body.py) finds first, the body's prompt another:
    "nested prompt first": b'{"a": {"prompt": [1]}, "prompt": [-1]}',
    "empty prompt after a nested one": b'{"a": {"prompt": [1]}, "prompt": []}',
    "prompt twice": b'{"prompt": [1], "prompt": [-2]}',
    "prompt twice, escaped": b'{"prompt": [1], "\\u0070rompt": [-1]}',
    "ids not json": b'{"prompt": [1,, 2]}',
}


@pytest.mark.parametrize("body", BAD_BODIES.values(), ids=BAD_BODIES.keys())
async def test_bad_completion_bodies_get_vllm_400_without_a_replica(router, replica, body):
    rt = await router([replica], max_prompt_tokens=1000)
    r = await request(rt.url, "POST", "/v1/completions", body)
    error = assert_vllm_error(r, 400, "Bad Request")
    assert error["message"]
    assert replica.requests == []


@pytest.mark.parametrize(
    "body",
    [
        b'{"messages": "hi"}',
        b'{"messages": []}',
        b'{"messages": [1]}',
        b'{"model": [], "messages": [{}]}',
    ],
)
async def test_bad_chat_bodies_get_vllm_400(router, replica, body):
    rt = await router([replica])
    r = await request(rt.url, "POST", "/v1/chat/completions", body)
    assert_vllm_error(r, 400, "Bad Request")
    assert replica.requests == []


async def test_every_valid_prompt_shape_passes(router, replica):
    rt = await router([replica])
    for prompt in ([[1, 2], [3]], "text", ["a", "b"]):
        r = await request(rt.url, "POST", "/v1/completions", completion(prompt=prompt))
        assert r.status == 200
    assert len(replica.requests) == 3


async def test_thousands_of_bad_requests_leak_nothing(router, replica, clients):
    rt = await router([replica])

    async def burst() -> None:
        # bad bodies on keep-alive connections, malformed HTTP on fresh ones
        client = await clients(rt.url)
        for _ in range(20):
            await client.send(
                b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 5\r\n\r\n{bad}"
            )
            assert (await client.response()).status == 400
        client.close()
        bad = await clients(rt.url)
        await bad.send(b"GET / HTTP/1.1\r\nbad header\r\n\r\n")
        await bad.read_all()
        bad.close()

    await burst()  # warm up
    await until(lambda: not rt.connections.open)
    fds = len(os.listdir("/proc/self/fd"))
    tasks = len(asyncio.all_tasks())
    for _ in range(10):
        await asyncio.gather(*(burst() for _ in range(10)))  # 2000 bad requests in all
    await until(lambda: not rt.connections.open)
    await until(lambda: len(os.listdir("/proc/self/fd")) <= fds)  # the transports' own closing
    assert len(os.listdir("/proc/self/fd")) <= fds
    assert len(asyncio.all_tasks()) <= tasks
    assert replica.requests == []


# -- size limits -------------------------------------------------------------------------------


async def test_body_over_the_limit_by_content_length_is_413(router, replica, clients):
    rt = await router([replica], max_body_bytes=1000)
    client = await clients(rt.url)
    await client.send(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 1001\r\n\r\n")
    assert_vllm_error(await client.response(), 413)
    assert await client.closed()
    assert replica.requests == []


async def test_chunked_body_over_the_limit_is_413(router, replica, clients):
    rt = await router([replica], max_body_bytes=1000)
    client = await clients(rt.url)
    await client.send(
        b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"200\r\n"
        + b"x" * 512
        + b"\r\n"
        + b"200\r\n"
        + b"x" * 512
        + b"\r\n"
    )
    assert_vllm_error(await client.response(), 413)
    assert replica.requests == []


async def test_body_at_the_limit_passes(router, replica):
    body = completion(prompt="x" * 100)
    rt = await router([replica], max_body_bytes=len(body))
    assert (await request(rt.url, "POST", "/v1/completions", body)).status == 200


async def test_header_bytes_over_the_limit_are_431(router, replica, clients):
    rt = await router([replica], max_header_bytes=2000)
    client = await clients(rt.url)
    await client.send(b"GET / HTTP/1.1\r\nhost: r\r\nx-big: " + b"a" * 2100 + b"\r\n\r\n")
    assert_vllm_error(await client.response(), 431)
    assert await client.closed()


@pytest.mark.parametrize(
    "line", [b"x-flood: ", b"x-flood-"], ids=["unfinished value", "unfinished name"]
)
async def test_an_unfinished_header_line_over_the_limit_is_431_as_it_arrives(
    router, replica, clients, line
):
    # The line never ends: httptools would hold it (and copy it on each read) until the
    # header deadline, the limit judged only once it was complete.
    rt = await router([replica], max_header_bytes=2000)
    client = await clients(rt.url)
    await client.send(b"GET /version HTTP/1.1\r\nhost: r\r\n" + line)
    for _ in range(20):  # 4000 bytes in writes below the limit: one read or many
        await client.send(b"a" * 200)
    assert_vllm_error(await client.response(timeout=2), 431)  # before the 5 s deadline
    assert await client.closed()
    assert replica.requests == []


async def test_a_head_under_the_limit_passes_in_pieces_and_behind_a_bigger_request(
    router, replica, clients
):
    # What arrives while a head is unfinished counts only when it is that head's: a head sent
    # in pieces is judged on its own bytes, and one that begins in the same read as a request
    # bigger than the limit does not inherit that request's bytes.
    rt = await router([replica], max_header_bytes=2000)
    client = await clients(rt.url)
    head = b"GET /version HTTP/1.1\r\nhost: r\r\nx-a: " + b"a" * 1800 + b"\r\n\r\n"
    for piece in (head[:900], head[900:1700], head[1700:]):
        await client.send(piece)
    assert (await client.response()).status == 200
    body = completion(prompt="x" * 3000)
    await client.send(post_completion(body) + head[:1000])
    assert (await client.response()).status == 200
    await client.send(head[1000:])
    assert (await client.response()).status == 200


async def test_a_long_url_counts_against_the_header_limit(router, replica):
    rt = await router([replica], max_header_bytes=2000)
    assert_vllm_error(await request(rt.url, path="/" + "a" * 2100), 431)


async def test_too_many_headers_are_431(router, replica):
    rt = await router([replica], max_headers=20)
    headers = {f"x-h{i}": "1" for i in range(21)}
    assert_vllm_error(await request(rt.url, headers=headers), 431)
    assert replica.requests == []


# -- time limits -------------------------------------------------------------------------------


async def _one_byte_at_a_time(conn: RawClient, data: bytes, *, gap: float) -> None:
    """Send `data` a byte per write, `gap` seconds apart (the test cancels it when done)."""
    for byte in data:
        await conn.send(bytes([byte]))
        await asyncio.sleep(gap)


async def test_slowloris_headers_get_408_while_other_clients_are_served(router, replica, clients):
    rt = await router([replica], header_timeout=0.5)
    slow = await clients(rt.url)
    loop = asyncio.get_running_loop()
    start = loop.time()
    trickle = b"GET /version HTTP/1.1\r\nhost: r\r\nx-pad: " + b"a" * 100
    sender = asyncio.create_task(_one_byte_at_a_time(slow, trickle, gap=0.02))
    served = 0
    while not sender.done() and loop.time() - start < 0.45:
        assert (await request(rt.url)).status == 200  # others are not held up
        served += 1
    r = await slow.response()
    assert_vllm_error(r, 408)
    assert 0.45 < loop.time() - start < 2.0
    assert served > 5
    sender.cancel()


async def test_a_body_too_slow_is_408(router, replica, clients):
    rt = await router([replica], body_timeout=0.3)
    client = await clients(rt.url)
    await client.send(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 100\r\n\r\n{")
    assert_vllm_error(await client.response(), 408)
    assert await client.closed()
    assert replica.requests == []


async def test_a_body_trickled_in_is_cut_off_at_its_deadline_from_the_head(
    router, replica, clients
):
    # Every read of the body is a new chunk of the same phase: none may push the deadline on.
    rt = await router([replica], body_timeout=0.4)
    client = await clients(rt.url)
    loop = asyncio.get_running_loop()
    start = loop.time()
    await client.send(b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: 100\r\n\r\n")
    # Never the whole body: 99 of its 100 bytes, 0.05 s apart.
    sender = asyncio.create_task(_one_byte_at_a_time(client, b" " * 99, gap=0.05))
    assert_vllm_error(await client.response(), 408)
    assert 0.35 < loop.time() - start < 2.0
    sender.cancel()
    assert replica.requests == []


async def test_an_idle_keep_alive_connection_is_closed(router, replica, clients):
    rt = await router([replica], keepalive_timeout=0.3)
    client = await clients(rt.url)
    await client.send(b"GET / HTTP/1.1\r\nhost: r\r\n\r\n")
    assert (await client.response()).status == 200
    loop = asyncio.get_running_loop()
    start = loop.time()
    assert await client.closed(timeout=3)
    assert 0.2 < loop.time() - start < 2.0


async def test_a_long_answer_is_not_cut_by_client_deadlines(router, replica):
    async def respond(req: Received, conn: ReplicaConn) -> None:
        await asyncio.sleep(0.5)
        await conn.write(json_response())

    replica.responder = respond
    rt = await router([replica], header_timeout=0.2, body_timeout=0.2, keepalive_timeout=0.2)
    assert (await request(rt.url)).status == 200


async def no_first_byte_in_time(router, replica):
    """A completion through a router that waits 0.3 s for a first byte from a replica that
    sends none: the router's answer."""

    async def respond(req: Received, conn: ReplicaConn) -> None:
        await asyncio.sleep(5)

    replica.responder = respond
    rt = await router([replica], first_byte_timeout=0.3)
    return await request(rt.url, "POST", "/v1/completions", completion())


async def test_no_first_byte_in_time_is_504(router, replica):
    error = assert_vllm_error(await no_first_byte_in_time(router, replica), 504)
    assert "Replica 0" in error["message"]


async def test_no_first_byte_in_time_is_not_retried(router, replica):
    await no_first_byte_in_time(router, replica)
    assert len(replica.requests) == 1


async def test_a_stream_that_stalls_is_cut_by_closing_the_client(router, replica, clients):
    async def respond(req: Received, conn: ReplicaConn) -> None:
        await conn.write(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await asyncio.sleep(5)

    replica.responder = respond
    rt = await router([replica], idle_timeout=0.3)
    client = await clients(rt.url)
    await client.send(b"GET /stream HTTP/1.1\r\nhost: r\r\n\r\n")
    raw = await client.read_all(timeout=3)
    assert raw.endswith(b"5\r\nhello\r\n")  # what came, then a close: never a fake end


async def test_a_head_that_stalls_halfway_is_cut_by_the_stream_idle_timeout(router, replica):
    async def respond(req: Received, conn: ReplicaConn) -> None:
        await conn.write(b"HTTP/1.1 200 OK\r\ncontent-")
        await asyncio.sleep(5)

    replica.responder = respond
    rt = await router([replica], first_byte_timeout=5.0, idle_timeout=0.3)
    async with asyncio.timeout(3):  # well before the first-byte timeout of 5 s
        answer = await request(rt.url, "POST", "/v1/completions", completion())
    error = assert_vllm_error(answer, 504)
    assert "between response bytes" in error["message"]


# -- replicas that cannot be reached -------------------------------------------------------------


async def test_an_unreachable_replica_is_502_naming_it_not_the_token(router, replica):
    rt = await router([replica], retries=0)
    url = replica.url
    await replica.stop()  # gone after the router started: connection refused
    error = assert_vllm_error(await request(rt.url, "POST", "/v1/completions", completion()), 502)
    assert f"Replica 0 ({url})" in error["message"]
    assert TOKEN not in error["message"]
    error = assert_vllm_error(await request(rt.url, path="/version"), 502)
    assert url in error["message"]


async def test_a_replica_that_answers_garbage_is_502(router, replica):
    rt = await router([replica])

    async def respond(req: Received, conn: ReplicaConn) -> None:
        await conn.write(b"SSH-2.0-OpenSSH\r\n\r\n")

    replica.responder = respond
    assert_vllm_error(await request(rt.url), 502)


# -- connections and in-flight caps ------------------------------------------------------------


async def test_connections_past_the_cap_are_refused_cleanly(router, replica, clients):
    rt = await router([replica], max_connections=3)
    held = [await clients(rt.url) for _ in range(3)]
    for c in held:  # make sure the router has accepted all three
        await c.send(b"GET / HTTP/1.1\r\nhost: r\r\n\r\n")
        assert (await c.response()).status == 200
    extra = await clients(rt.url)
    await extra.send(b"GET / HTTP/1.1\r\nhost: r\r\n\r\n")
    assert_vllm_error(await extra.response(), 503)
    assert await extra.closed()
    held[0].close()
    async with asyncio.timeout(5):
        while len(rt.connections.open) > 2:
            await asyncio.sleep(0.01)
    assert (await request(rt.url)).status == 200  # room again


async def test_in_flight_requests_per_replica_are_capped(router, replica):
    release = asyncio.Event()

    async def respond(req: Received, conn: ReplicaConn) -> None:
        await release.wait()
        await conn.write(json_response())

    replica.responder = respond
    rt = await router([replica], max_upstream_connections=2)
    pending = [
        asyncio.create_task(request(rt.url, "POST", "/v1/completions", completion()))
        for _ in range(5)
    ]
    await replica.wait_requests(2)
    with pytest.raises(TimeoutError):  # a third would arrive now if the limit did not hold
        await replica.wait_requests(3, timeout=0.1)
    assert len(replica.requests) == 2 and replica.peak_active <= 2
    release.set()
    assert [r.status for r in await asyncio.gather(*pending)] == [200] * 5
    assert replica.peak_active <= 2 and len(replica.conns) <= 2


async def test_the_router_s_own_answers_carry_their_reason_phrase(router, replica):
    # 409 (a replica already in the fleet) is one the router writes itself.
    rt = await router([replica])
    body = orjson.dumps({"url": replica.url})
    r = await request(rt.url, "POST", "/router/replicas", body)
    assert r.status == 409
    assert r.raw.startswith(b"HTTP/1.1 409 Conflict\r\n")
