"""Header rules at both borders: what a replica receives, and what a client gets back."""

from __future__ import annotations

import re

from http_harness import TOKEN, Received, ReplicaConn, completion, json_response, request

from lora_router.http.headers import client_response_head, upstream_request_head

# -- unit: the two rewriting functions -----------------------------------------------------------


def _head(headers: list[tuple[bytes, bytes]], **kw: object) -> bytes:
    args: dict[str, object] = dict(
        host=b"replica:8000",
        authorization=b"Bearer tok",
        client_ip=b"10.0.0.9",
        new_request_id=lambda: b"new-id",
        body_length=0,
    )
    args.update(kw)
    return upstream_request_head(b"GET", b"/p?q=1", headers, **args)  # type: ignore[arg-type]


def _fields(head: bytes) -> list[tuple[bytes, bytes]]:
    lines = head.split(b"\r\n")[1:-2]
    return [(n.lower(), v) for n, _, v in (line.partition(b": ") for line in lines)]


def test_hop_by_hop_headers_are_removed_with_those_connection_names() -> None:
    head = _head(
        [
            (b"connection", b"keep-alive, X-Secret-Hop , x-other"),
            (b"keep-alive", b"timeout=5"),
            (b"proxy-authorization", b"Basic abc"),
            (b"proxy-connection", b"keep-alive"),
            (b"te", b"trailers"),
            (b"trailer", b"x-t"),
            (b"upgrade", b"websocket"),
            (b"x-secret-hop", b"1"),
            (b"x-other", b"2"),
            (b"x-kept", b"3"),
        ]
    )
    names = [n for n, _ in _fields(head)]
    assert names == [b"host", b"x-kept", b"x-request-id", b"authorization", b"x-forwarded-for"]


def test_the_clients_authorization_is_replaced_by_the_token() -> None:
    fields = _fields(_head([(b"authorization", b"Bearer client-secret")]))
    assert fields.count((b"authorization", b"Bearer tok")) == 1
    assert all(b"client-secret" not in v for _, v in fields)


def test_without_a_token_no_authorization_at_all() -> None:
    fields = _fields(_head([(b"authorization", b"Bearer client-secret")], authorization=None))
    assert all(n != b"authorization" for n, _ in fields)


def test_host_is_set_for_the_replica() -> None:
    fields = _fields(_head([(b"host", b"router.example")]))
    assert [v for n, v in fields if n == b"host"] == [b"replica:8000"]


def test_x_forwarded_for_is_appended_to_every_earlier_hop() -> None:
    fields = _fields(
        _head([(b"x-forwarded-for", b"1.1.1.1"), (b"x-forwarded-for", b"2.2.2.2, 3.3.3.3")])
    )
    assert [v for n, v in fields if n == b"x-forwarded-for"] == [
        b"1.1.1.1, 2.2.2.2, 3.3.3.3, 10.0.0.9"
    ]


def test_x_request_id_is_passed_or_created() -> None:
    passed = _fields(_head([(b"x-request-id", b"client-id")]))
    assert [v for n, v in passed if n == b"x-request-id"] == [b"client-id"]
    created = _fields(_head([]))
    assert [v for n, v in created if n == b"x-request-id"] == [b"new-id"]


def test_values_are_forwarded_verbatim_never_resplit() -> None:
    odd = b'a, "b,c";q=1 \t\xc3\xa9'
    fields = _fields(_head([(b"x-odd", odd), (b"accept", b"a/b, c/d")]))
    assert (b"x-odd", odd) in fields and (b"accept", b"a/b, c/d") in fields


def test_the_forwarded_body_is_framed_by_its_exact_content_length_only() -> None:
    head = upstream_request_head(
        b"POST",
        b"/v1/completions",
        [(b"transfer-encoding", b"chunked"), (b"content-length", b"999")],
        host=b"h",
        authorization=None,
        client_ip=b"1.2.3.4",
        new_request_id=lambda: b"r",
        body_length=12,
    )
    fields = _fields(head)
    assert [v for n, v in fields if n == b"content-length"] == [b"12"]
    assert all(n != b"transfer-encoding" for n, _ in fields)


def test_response_hop_by_hop_dropped_replica_index_added() -> None:
    raw = (
        b"HTTP/1.1 200 OK\r\nConnection: close, X-Hop\r\nKeep-Alive: timeout=5\r\nX-Hop: 1\r\n"
        b"Transfer-Encoding: chunked\r\nx-lora-router-replica: forged\r\nX-End: 2"
    )
    out = client_response_head(raw, b"3", True, False)
    assert out == (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nX-End: 2\r\n"
        b"x-lora-router-replica: 3\r\nconnection: keep-alive\r\n\r\n"
    )
    dechunked = client_response_head(raw, b"3", False, True)
    assert b"Transfer-Encoding" not in dechunked and dechunked.endswith(
        b"connection: close\r\n\r\n"
    )


def test_response_hop_by_hop_lines_in_any_case_are_cut_and_the_body_follows_the_head() -> None:
    raw = (
        b"HTTP/1.1 200 OK\r\nServer: nginx\r\nCONNECTION: keep-alive\r\nContent-Length: 4\r\n"
        b'Keep-Alive: timeout=5\r\nX-Lora-Router-Replica: forged\r\nETag: "a-1"'
    )
    out = client_response_head(raw, b"1", True, False, b"body")
    assert out == (
        b'HTTP/1.1 200 OK\r\nServer: nginx\r\nContent-Length: 4\r\nETag: "a-1"\r\n'
        b"x-lora-router-replica: 1\r\nconnection: keep-alive\r\n\r\nbody"
    )


# -- end to end -----------------------------------------------------------------------------------


async def test_what_a_replica_receives(router, replica) -> None:
    rt = await router([replica])
    body = completion()
    r = await request(
        rt.url,
        "POST",
        "/v1/completions",
        body,
        headers={
            "Authorization": "Bearer client-key",
            "Connection": "x-drop-me",
            "X-Drop-Me": "1",
            "X-Forwarded-For": "203.0.113.7",
            "X-Keep": "a,b",
        },
    )
    assert r.status == 200
    got = replica.requests[0]
    assert got.all(b"authorization") == [f"Bearer {TOKEN}".encode()]
    assert got.header(b"host") == f"127.0.0.1:{replica.port}".encode()
    assert got.header(b"x-drop-me") is None and got.header(b"connection") is None
    assert got.header(b"x-forwarded-for") == b"203.0.113.7, 127.0.0.1"
    assert got.header(b"x-keep") == b"a,b"
    assert re.fullmatch(rb"[0-9a-f]{32}", got.header(b"x-request-id") or b"")
    assert got.body == body


async def test_a_client_request_id_reaches_the_replica(router, replica) -> None:
    rt = await router([replica])
    await request(rt.url, headers={"X-Request-Id": "trace-42"})
    assert replica.requests[0].all(b"x-request-id") == [b"trace-42"]


async def test_responses_name_the_replica_by_index(router, replica_factory) -> None:
    a, b = await replica_factory(), await replica_factory()
    rt = await router([a, b])
    labels = {
        (await request(rt.url, "POST", "/v1/completions", completion())).header(
            b"x-lora-router-replica"
        )
        for _ in range(4)
    }
    assert labels == {b"0", b"1"}


async def test_response_headers_pass_verbatim(router, replica) -> None:
    rt = await router([replica])

    async def respond(req: Received, conn: ReplicaConn) -> None:
        await conn.write(
            json_response(extra=b"Set-Cookie: a=b, c=d; Path=/\r\nX-Weird:  spaced  \r\n")
        )

    replica.responder = respond
    r = await request(rt.url)
    assert b"\r\nSet-Cookie: a=b, c=d; Path=/\r\n" in r.raw
    assert b"\r\nX-Weird:  spaced  \r\n" in r.raw
