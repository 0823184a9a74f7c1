"""Fuzzing the parser on a live router: hypothesis mutates valid request streams, splits them at
random points with random delays, and checks that the router always answers with well-formed
HTTP responses or closes, never hangs past its deadlines, keeps serving, that the replica only
ever sees well-formed requests the client really sent (under the path the router judged), and
that every body byte buffered is released."""

from __future__ import annotations

import asyncio
import contextlib
import itertools

import httptools
from http_harness import RawClient, completion
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lora_router.http.errors import HTTPError
from lora_router.http.target import canonical

BODY = completion()
SEEDS = [
    b"GET /a?x=1 HTTP/1.1\r\nhost: r\r\nx-k: v\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n%s" % (len(BODY), BODY),
    b"POST /b HTTP/1.1\r\nhost: r\r\ntransfer-encoding: chunked\r\n\r\n"
    b"3\r\nabc\r\n2;ext=1\r\nde\r\n0\r\nx-t: 1\r\n\r\n",
    b"GET /c HTTP/1.0\r\nconnection: keep-alive\r\n\r\n",
    b"PUT /d HTTP/1.1\r\nhost: r\r\nexpect: 100-continue\r\ncontent-length: 2\r\n\r\nok",
    b"HEAD /e HTTP/1.1\r\nhost: r\r\nconnection: close\r\n\r\n",
]
SPECIAL = [
    b"\r",
    b"\n",
    b"\r\n",
    b"\x00",
    b" ",
    b"\t",
    b":",
    b",",
    b"0",
    b"9",
    b"-",
    b"\x80",
    b"transfer-encoding: chunked\r\n",
    b"content-length: 1\r\n",
    b"\r\n\r\n",
    b"GET ",
]


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    data = b"".join(draw(st.lists(st.sampled_from(SEEDS), min_size=1, max_size=3)))
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["flip", "insert", "delete", "dup"]))
        at = draw(st.integers(0, len(data)))
        if op == "flip" and at < len(data):
            data = data[:at] + bytes([draw(st.integers(0, 255))]) + data[at + 1 :]
        elif op == "insert":
            data = data[:at] + draw(st.sampled_from(SPECIAL)) + data[at:]
        elif op == "delete":
            data = data[:at] + data[at + draw(st.integers(1, 8)) :]
        else:
            end = min(len(data), at + draw(st.integers(1, 40)))
            data = data[:end] + data[at:end] + data[end:]
    return data


def sent_requests(data: bytes) -> list[tuple[bytes, bytes, bytes]]:
    """(method, target, body) of every request a strict parser finds in what the client sent."""
    found: list[tuple[bytes, bytes, bytes]] = []

    class Collect:
        url = b""
        body = b""

        def on_message_begin(self) -> None:
            self.url, self.body = b"", b""

        def on_url(self, url: bytes) -> None:
            self.url += url

        def on_body(self, body: bytes) -> None:
            self.body += body

        def on_message_complete(self) -> None:
            found.append((parser.get_method(), self.url, self.body))

    parser = httptools.HttpRequestParser(Collect())
    with contextlib.suppress(httptools.HttpParserError):
        parser.feed_data(data)
    return found


def judged(target: bytes) -> bytes:
    """A target as the router forwards it: its path by the path rule, the query as sent."""
    path, mark, query = target.partition(b"?")
    try:
        return canonical(path) + mark + query
    except HTTPError:
        return target  # refused: never forwarded


def check_responses(raw: bytes) -> int:
    """`raw` is a sequence of complete, well-formed HTTP responses; returns how many."""
    count = 0
    while raw:
        end = raw.find(b"\r\n\r\n")
        assert end > 0, raw
        head, rest = raw[: end + 4], raw[end + 4 :]
        parser = httptools.HttpResponseParser(object())
        parser.feed_data(head)  # raises on a malformed head
        status = parser.get_status_code()
        fields = dict(
            line.split(b":", 1) for line in head.lower().split(b"\r\n")[1:] if b":" in line
        )
        count += status != 100
        if status == 100 or status in (204, 304):
            raw = rest
        elif b"content-length" in fields:
            n = int(fields[b"content-length"])
            if rest == b"" or rest.startswith(b"HTTP/1.1 "):
                raw = rest  # the answer to a HEAD: no body
            else:
                assert len(rest) >= n, raw
                raw = rest[n:]
        elif b"transfer-encoding" in fields:
            assert fields[b"transfer-encoding"].strip() == b"chunked"
            body = httptools.HttpResponseParser(object())
            body.feed_data(head + rest)  # raises on bad chunk framing
            raw = rest[rest.index(b"0\r\n\r\n") + 5 :]
        else:
            return count  # close-delimited: the rest is its body
    return count


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    data=streams(),
    cuts=st.lists(st.integers(0, 2000), max_size=4),
    delay=st.sampled_from([0.0, 0.0, 0.002, 0.01]),
)
async def test_every_fuzzed_stream_ends_in_a_valid_answer_or_a_close_in_time(
    router, replica, data, cuts, delay
):
    rt = getattr(replica, "fuzz_router", None)
    if rt is None:
        rt = await router([replica], header_timeout=0.3, body_timeout=0.3, keepalive_timeout=0.3)
        replica.fuzz_router = rt
    before = len(replica.requests)
    client = await RawClient.connect(rt.url)
    loop = asyncio.get_running_loop()
    try:
        points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
        for a, b in itertools.pairwise(points):
            try:
                await client.send(data[a:b])
            except ConnectionError:
                break  # the router already closed: fine
            if delay:
                await asyncio.sleep(delay)
        start = loop.time()
        # Every path ends in a close by the router within its deadlines (0.3 s here, plus
        # the linger), or earlier on an error.
        raw = await client.read_all(timeout=5)
        assert loop.time() - start < 4
    finally:
        client.close()
    check_responses(raw)
    sent = [(m, judged(t), b) for m, t, b in sent_requests(data)]
    for got in replica.requests[before:]:
        assert (got.method, got.target, got.body) in sent
    assert replica.malformed == []
    # every body byte the router buffered for it is released (the budget's count is exact)
    async with asyncio.timeout(5):
        while rt.connections.buffered:
            await asyncio.sleep(0.005)
    # and the router is still serving
    probe = await RawClient.connect(rt.url)
    try:
        await probe.send(b"GET /alive HTTP/1.1\r\nhost: r\r\n\r\n")
        assert (await probe.response()).status == 200
    finally:
        probe.close()
