"""Inbound authentication (`--api-key-env`): clients must present the key, in constant time;
health polling stays open; the client's credential never reaches a replica."""

from __future__ import annotations

import pytest
from http_harness import API_KEY, TOKEN, completion, request

from lora_router.config import Secret
from lora_router.http import auth


@pytest.fixture
async def locked(router, replica):
    return await router([replica], api_key=Secret(API_KEY))


@pytest.mark.parametrize(
    "authorization",
    [None, "", "Bearer", "Bearer wrong", f"Basic {API_KEY}", f"Bearer {API_KEY}x", f"{API_KEY}"],
)
async def test_requests_without_the_key_are_refused_401_at_the_door(locked, replica, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    r = await request(locked.url, "POST", "/v1/completions", completion(), headers=headers)
    assert r.status == 401
    error = r.json()["error"]
    assert error["code"] == 401 and API_KEY not in error["message"]
    assert replica.requests == []


async def with_the_key(locked, scheme):
    """A completion through the locked router with the key under `scheme`."""
    return await request(
        locked.url,
        "POST",
        "/v1/completions",
        completion(),
        headers={"Authorization": f"{scheme} {API_KEY}"},
    )


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
async def test_the_key_lets_a_request_through(locked, scheme):
    r = await with_the_key(locked, scheme)
    assert r.status == 200


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
async def test_the_key_is_replaced_by_the_replicas_token_upstream(locked, replica, scheme):
    await with_the_key(locked, scheme)
    assert replica.requests[0].all(b"authorization") == [f"Bearer {TOKEN}".encode()]


@pytest.mark.parametrize("path", ["/version", "/metrics", "/v1/models", "/pause?mode=keep"])
async def test_every_other_path_needs_the_key(locked, replica, path):
    method = "POST" if path.startswith("/pause") else "GET"
    assert (await request(locked.url, method, path)).status == 401
    assert replica.requests == []


@pytest.mark.parametrize("path", ["/health", "/ping"])
async def test_health_polling_stays_open(locked, path):
    r = await request(locked.url, "GET", path)
    assert r.status != 401


async def test_without_a_configured_key_nothing_is_asked(router, replica):
    rt = await router([replica])
    assert (await request(rt.url, "POST", "/v1/completions", completion())).status == 200


async def test_the_key_is_compared_in_constant_time(locked, monkeypatch):
    calls: list[tuple[bytes, bytes]] = []
    real = auth.hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", spy)
    await request(locked.url, headers={"Authorization": "Bearer guess"})
    assert calls == [(b"guess", API_KEY.encode())]
