"""The route table over real sockets: only what the router knows reaches a replica, under the
canonical path of the route it applied; the rest is refused (501), unknown (404) or asked with
the wrong method (405), as vLLM itself would answer."""

from __future__ import annotations

import pytest
from http_harness import RawClient, Response, completion, request

from lora_router.routes import ROUTES, Kind, Route

REFUSED = [r for r in ROUTES if r.kind is Kind.REFUSED]
CLOSED = [r for r in ROUTES if r.kind is Kind.CLOSED]
FORWARDED = [r for r in ROUTES if r.kind is Kind.FORWARD]


def vllm_error(r: Response, status: int) -> str:
    """The message of an error in vLLM's shape."""
    assert r.status == status, r.raw
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return str(error["message"])


def reached(replica, path: bytes) -> list[bytes]:
    """Every target a replica received (data or control plane) whose path is `path`."""
    got = [r.target for r in (*replica.requests, *replica.control_requests)]
    return [t for t in got if t.partition(b"?")[0] == path]


@pytest.mark.parametrize("route", REFUSED, ids=lambda r: r.label)
async def test_a_call_that_changes_one_engine_is_refused_501_naming_why_and_reaches_no_replica(
    router, replica, route: Route
):
    rt = await router([replica])
    r = await request(rt.url, "POST", route.label, b'{"action": "reset"}')
    message = vllm_error(r, 501)
    assert route.label in message and route.why in message
    assert reached(replica, route.path) == [] and replica.requests == []


@pytest.mark.parametrize(
    ("spelled", "route"),
    [
        ("/update%5Fweights", "/update_weights"),
        ("/%75pdate_weights", "/update_weights"),
        ("/sl%65ep", "/sleep"),
        ("/collective%5frpc", "/collective_rpc"),
        ("/weight%5Fchecker", "/weight_checker"),
    ],
)
async def test_a_refused_route_is_refused_however_it_is_spelled(router, replica, spelled, route):
    rt = await router([replica])
    message = vllm_error(await request(rt.url, "POST", spelled, b"{}"), 501)
    assert route in message
    assert replica.requests == [] and reached(replica, route.encode()) == []


@pytest.mark.parametrize(
    "target",
    [
        "//update_weights",
        "/./update_weights",
        "/x/../update_weights",
        "/v1%2Fload_lora_adapter",
        "/v1%2fload_lora_adapter",
        "/v1%5Cload_lora_adapter",
        "/v1\\load_lora_adapter",
        "/pause/",
        "/pause%00",
        "/pause%zz",
        "/pause%ff",
        "/pause#x",
        "/pause?mode=keep#x",
    ],
)
async def test_a_spelling_that_could_mean_two_routes_is_refused_400(router, replica, target):
    rt = await router([replica])
    message = vllm_error(await request(rt.url, "POST", target, b""), 400)
    assert "`#`" in message or "path" in message
    assert replica.requests == [] and reached(replica, b"/pause") == []


@pytest.mark.parametrize(
    "path", ["/nope", "/PAUSE", "/pause;x", "/Version", "/emulator/faults", "/v1/models/x"]
)
async def test_an_unknown_path_is_answered_404_as_vllm_answers_it_and_reaches_no_replica(
    router, replica, path
):
    rt = await router([replica])
    r = await request(rt.url, "GET", path)
    assert r.status == 404 and r.json() == {"detail": "Not Found"}
    assert replica.requests == []


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/pause", b"POST"),
        ("GET", "/v1/completions", b"POST"),
        ("DELETE", "/v1/models", b"GET"),
        ("POST", "/version", b"GET"),
        ("PUT", "/sleep", b"POST"),
    ],
)
async def test_a_known_path_with_another_method_is_answered_405_with_allow(
    router, replica, method, path, allow
):
    rt = await router([replica])
    r = await request(rt.url, method, path)
    assert r.status == 405 and r.json() == {"detail": "Method Not Allowed"}
    assert r.header(b"allow") == allow
    assert replica.requests == []


async def test_a_head_the_router_answers_itself_has_no_body_and_the_connection_goes_on(
    router, replica, clients
):
    rt = await router([replica])
    client: RawClient = await clients(rt.url)
    await client.send(b"HEAD /version HTTP/1.1\r\nhost: r\r\n\r\n")
    r = await client.response(head=True)
    assert r.status == 405 and r.raw.endswith(b"\r\n\r\n")  # as FastAPI: GET takes no HEAD
    await client.send(b"GET /version HTTP/1.1\r\nhost: r\r\n\r\n")
    assert (await client.response()).json() == {"ok": True}
    assert [q.target for q in replica.requests] == [b"/version"]


CHAT = completion(messages=[{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("method", "spelled", "body", "sent"),
    [
        ("GET", "/v%65rsion?x=1", b"", b"/version?x=1"),
        ("GET", "/%69s_paused", b"", b"/is_paused"),
        ("POST", "/tok%65nize", b"{}", b"/tokenize"),
        ("POST", "/v1/%63ompletions", completion(), b"/v1/completions"),
        ("POST", "/v1/ch%61t/completions?a=%2F", CHAT, b"/v1/chat/completions?a=%2F"),
    ],
)
async def test_a_forwarded_request_carries_the_canonical_path_never_the_clients_spelling(
    router, replica, method, spelled, body, sent
):
    rt = await router([replica])
    assert (await request(rt.url, method, spelled, body)).status == 200
    assert [q.target for q in replica.requests] == [sent]  # the query as the client sent it


async def test_a_broadcast_spelled_otherwise_is_broadcast_under_its_own_path(router, replica):
    rt = await router([replica])
    r = await request(rt.url, "POST", "/p%61use?mode=keep")
    assert r.status == 200
    assert reached(replica, b"/pause") == [b"/pause?mode=keep"]
    assert replica.requests == []  # broadcasts go through the control plane, not one replica


@pytest.mark.parametrize("route", FORWARDED, ids=lambda r: r.label)
async def test_every_read_only_route_is_forwarded_to_one_replica(router, replica, route: Route):
    rt = await router([replica])
    method = sorted(route.methods or {b"GET"})[0].decode()
    r = await request(rt.url, method, route.label, b"{}" if method == "POST" else b"")
    assert r.status == 200
    assert [q.target for q in replica.requests] == [route.path]


@pytest.mark.parametrize("route", CLOSED[:3], ids=lambda r: r.label)
async def test_another_generation_api_is_refused_naming_the_flag_that_opens_it(
    router, replica, route: Route
):
    closed = await router([replica], forward_paths=())
    message = vllm_error(await request(closed.url, "POST", route.label, b"{}"), 501)
    assert f"--forward-path {route.label}" in message
    assert replica.requests == []
    opened = await router([replica], forward_paths=(route.label,))
    assert (await request(opened.url, "POST", route.label, b"{}")).status == 200
    assert [q.target for q in replica.requests] == [route.path]


async def test_metrics_label_a_spelled_route_by_its_route_and_unknown_paths_as_other(
    router, replica
):
    rt = await router([replica])
    await request(rt.url, "POST", "/p%61use?mode=keep")
    for i in range(3):
        await request(rt.url, "GET", f"/made-up-{i}")
    text = (await request(rt.url, "GET", "/metrics")).body.decode()
    assert 'route="/pause",status="200"' in text
    assert 'route="other",status="404"' in text and "made-up" not in text
