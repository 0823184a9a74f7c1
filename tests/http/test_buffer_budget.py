"""One budget bounds the request body bytes buffered at once over all client connections
(`--max-buffered-bytes`): past it a request is refused 503 with `Retry-After`, the router stays
up, and the count comes back to zero on every path (answered, refused, client gone)."""

from __future__ import annotations

import asyncio

import pytest
from http_harness import RawClient, completion, json_response, request

BUDGET = 10_000


@pytest.fixture
async def tight(router, replica):
    return await router([replica], max_body_bytes=8_000, max_buffered_bytes=BUDGET)


async def buffered_reaches(rt, value: int) -> None:
    async with asyncio.timeout(5):
        while rt.connections.buffered != value:
            await asyncio.sleep(0.005)


def post_head(length: int, path: bytes = b"/x") -> bytes:
    return b"POST %s HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n" % (path, length)


async def test_past_the_budget_a_body_is_refused_503_with_retry_after_and_the_router_goes_on(
    tight, replica, clients
):
    holding: RawClient = await clients(tight.url)
    await holding.send(post_head(6_000) + b"a" * 4_000)  # its 6,000 counted from its head
    await buffered_reaches(tight, 6_000)
    refused = await request(tight.url, "POST", "/x", b"b" * 5_000)  # 6,000 + 5,000 > 10,000
    assert refused.status == 503 and refused.header(b"retry-after") == b"1"
    error = refused.json()["error"]
    assert error["code"] == 503 and "--max-buffered-bytes" in error["message"]
    assert (await request(tight.url, "POST", "/x", b"c" * 3_000)).status == 200  # fits
    chunked: RawClient = await clients(tight.url)
    await chunked.send(
        b"POST /x HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n\r\n"
        + b"3e8\r\n"
        + b"d" * 1_000  # counted as it arrives: no length ahead
        + b"\r\n1388\r\n"
        + b"d" * 5_000  # 6,000 + 1,000 + 5,000 > 10,000
        + b"\r\n"
    )
    assert (await chunked.response()).status == 503
    assert tight.connections.buffered == 6_000  # its 1,000 uncounted before the 503 went out
    assert await chunked.closed()
    await holding.send(b"a" * 2_000)
    assert (await holding.response()).status == 200
    await buffered_reaches(tight, 0)
    assert [len(r.body) for r in replica.requests] == [3_000, 6_000]


async def test_the_count_is_exact_when_a_client_leaves_mid_body(tight, replica, clients):
    gone: RawClient = await clients(tight.url)
    await gone.send(post_head(8_000) + b"a" * 7_000)
    await buffered_reaches(tight, 8_000)
    gone.close()
    await buffered_reaches(tight, 0)
    assert (await request(tight.url, "POST", "/x", b"e" * 8_000)).status == 200
    assert replica.requests[-1].body == b"e" * 8_000


async def test_the_count_is_exact_after_errors_router_answers_and_pipelined_requests(
    tight, replica, clients
):
    kept: RawClient = await clients(tight.url)  # one keep-alive connection: nothing lost
    for path, body, status in [
        (b"/v1/completions", b"{nope", 400),
        (b"/sleep", b"{}", 501),
        (b"/router/replicas", b"[]", 400),
        (b"/nope", b"{}", 404),
        (b"/v1/completions", completion(), 200),
    ]:
        await kept.send(post_head(len(body), path) + body)
        answer = await kept.response()
        assert answer.status == status
        await buffered_reaches(tight, 0)
    await kept.send((post_head(3_000) + b"f" * 3_000) * 3)  # pipelined
    assert [(await kept.response()).status for _ in range(3)] == [200] * 3
    await buffered_reaches(tight, 0)
    chunks = b"3e8\r\n" + b"g" * 1_000 + b"\r\n"
    await kept.send(
        b"POST /x HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n\r\n"
        + chunks * 2
        + b"0\r\n\r\n"
    )
    assert (await kept.response()).status == 200
    await buffered_reaches(tight, 0)
    assert replica.requests[-1].body == b"g" * 2_000


async def test_the_count_is_exact_when_a_client_leaves_while_its_request_is_answered(
    tight, replica, clients
):
    release = asyncio.Event()

    async def hold(req, conn) -> None:
        await release.wait()
        await conn.write(json_response())

    replica.responder = hold
    leaving: RawClient = await clients(tight.url)
    await leaving.send(post_head(5_000) + b"h" * 5_000)
    await replica.wait_requests(1)  # forwarded, no answer yet: its body is still held
    assert tight.connections.buffered == 5_000
    leaving.close()
    await buffered_reaches(tight, 0)
    release.set()
