"""The token goes only to the fleet: a local client with no key cannot make it reach a host
outside the allow-list (`--replica-hosts`, by default the `--replicas` themselves), by any
route, spelling, redirect or flag slip. A second local listener stands for the thief: it
records every connection and whether an `Authorization` header ever reached it."""

from __future__ import annotations

import asyncio
import logging

import http_harness
import orjson
import pytest
from http_harness import API_KEY, TOKEN, RawClient, json_response, request

from lora_router.config import Secret
from lora_router.fleet.client import ReplicaClient
from lora_router.routes import REPLICA, ROUTES
from lora_router.tools.check import probe_replica


class Recorder:
    """A listener on this machine that records what reaches it, and answers like vLLM."""

    def __init__(self) -> None:
        self.connections = 0
        self.raw = b""
        self._server: asyncio.Server | None = None

    async def start(self, host: str = "127.0.0.1") -> Recorder:
        self._server = await asyncio.start_server(self._serve, host, 0)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    @property
    def token_reached(self) -> bool:
        return b"authorization" in self.raw.lower() or TOKEN.encode() in self.raw

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while data := await reader.read(65536):
                self.raw += data
                if b"\r\n\r\n" in data:
                    writer.write(json_response(b"{}"))
        except ConnectionError:
            pass
        finally:
            writer.close()

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()


@pytest.fixture
async def thief():
    recorder = await Recorder().start()
    yield recorder
    recorder.stop()


def urls_of(port: int) -> list[str]:
    """Every way a client may write the thief's address."""
    return [
        f"http://127.0.0.1:{port}",
        f"http://localhost:{port}",
        f"HTTP://127.0.0.1:{port}/v1",
        f"http://127.0.0.1:{port}/",
        f"https://127.0.0.1:{port}",
        f"http://127.0.0.2:{port}",
    ]


async def test_a_replica_outside_the_allow_list_is_refused_403_and_never_contacted(
    router, replica, thief
):
    rt = await router([replica])
    for url in urls_of(thief.port):
        for path in ("/router/replicas", "/router/%72eplicas", "/ro%75ter/replicas"):
            r = await request(rt.url, "POST", path, orjson.dumps({"url": url}))
            assert r.status == 403, (url, path, r.raw)
            assert "--replica-hosts" in r.json()["error"]["message"]
    assert thief.connections == 0
    assert len((await request(rt.url, path="/router/replicas")).json()["replicas"]) == 1


async def test_no_route_of_any_spelling_or_host_header_makes_the_router_contact_another_host(
    router, replica, thief
):
    rt = await router([replica])
    thief_host = f"127.0.0.1:{thief.port}".encode()
    for route in (*ROUTES, REPLICA):
        for method in sorted(route.methods or {b"GET"}):
            for target in (route.path, b"http://" + thief_host + route.path):
                client = await RawClient.connect(rt.url)
                body = orjson.dumps({"url": f"http://{thief_host.decode()}"})
                await client.send(
                    b"%s %s HTTP/1.1\r\nhost: %s\r\nx-forwarded-host: %s\r\n"
                    b"content-length: %d\r\n\r\n%s"
                    % (method, target, thief_host, thief_host, len(body), body)
                )
                await client.response()
                client.close()
    assert thief.connections == 0 and not thief.token_reached


async def test_with_an_api_key_membership_needs_the_key_and_the_allow_list_still_holds(
    router, replica, thief
):
    locked = await router([replica], api_key=Secret(API_KEY))
    body = orjson.dumps({"url": f"http://127.0.0.1:{thief.port}"})
    assert (await request(locked.url, "POST", "/router/replicas", body)).status == 401
    assert (await request(locked.url, "GET", "/router/replicas")).status == 401
    key = {"Authorization": f"Bearer {API_KEY}"}
    r = await request(locked.url, "POST", "/router/replicas", body, headers=key)
    assert r.status == 403 and thief.connections == 0
    assert (await request(locked.url, "GET", "/router/replicas", headers=key)).status == 200


async def test_replica_hosts_admit_what_they_name_and_only_that(router, replica, thief):
    named = (f"127.0.0.1:{replica.port}", f"127.0.0.1:{thief.port}")  # --replicas' included
    wide = await router([replica], replica_hosts=named)
    other = orjson.dumps({"url": f"http://127.0.0.1:{thief.port + 1}"})
    assert (await request(wide.url, "POST", "/router/replicas", other)).status == 403
    assert thief.connections == 0
    body = orjson.dumps({"url": f"http://127.0.0.1:{thief.port}"})
    r = await request(wide.url, "POST", "/router/replicas", body)
    assert r.status in (200, 202), r.raw
    assert thief.token_reached  # the operator named it: it is a replica now


async def test_a_redirect_from_a_replica_is_reported_with_its_host_and_never_followed(
    router, replica_factory, thief, token_never_leaks, monkeypatch
):
    to_thief = f"http://127.0.0.1:{thief.port}/steal".encode()

    async def redirect(req, conn) -> None:
        if not req.target.startswith(b"/health"):
            return await answer(req, conn)
        head = b"HTTP/1.1 307 Temporary Redirect\r\nlocation: %s\r\ncontent-length: 0\r\n\r\n"
        await conn.write(head % to_thief)

    # What the replica answers the router's control plane: a healthy vLLM whose health check
    # redirects.
    answer = http_harness.control_responder
    monkeypatch.setattr(http_harness, "control_responder", redirect)
    sly = await replica_factory()
    rt = await router([sly], health_interval=0.05, health_failures=1)
    await asyncio.wait_for(_ejected(rt), 5)
    error = (await request(rt.url, path="/router/status")).json()["replicas"][0]["last_error"]
    assert f"/health: HTTP 307, a redirect to http://127.0.0.1:{thief.port} (not followed" in error
    await asyncio.wait_for(_checks(sly, 3), 5)  # more health checks, each redirected
    client = [line for line in token_never_leaks.records if "fleet.client" in line]
    assert len(client) == 1 and client[0].startswith("WARNING")  # once, not every check
    assert f"redirect to http://127.0.0.1:{thief.port}" in client[0]
    facts = await probe_replica_of(rt.config)  # lora-router --check
    assert facts.answer == "unreachable" and f"http://127.0.0.1:{thief.port}" in facts.detail
    assert thief.connections == 0 and not thief.token_reached


async def probe_replica_of(config):
    """What `lora-router --check` finds about the first replica."""
    async with ReplicaClient(config) as client:
        return await probe_replica(client, config.replicas[0])


async def _checks(replica, n: int) -> None:
    while sum(r.target == b"/health" for r in replica.control_requests) < n:
        await asyncio.sleep(0.01)


async def _ejected(rt) -> None:
    while rt.fleet.replicas[0].live:
        await asyncio.sleep(0.01)


async def test_a_token_sent_in_the_clear_beyond_this_machine_is_warned_about_by_name(
    router, replica, caplog
):
    caplog.set_level(logging.WARNING, logger="lora_router")
    far, farther = "http://192.0.2.1:9", "http://192.0.2.2:9"  # TEST-NET-1: never routed
    rt = await router(
        [replica, far],
        replica_hosts=("127.0.0.1", "192.0.2.0/24"),
        connect_timeout=0.2,
        health_timeout=0.2,
    )
    r = await request(rt.url, "POST", "/router/replicas", orjson.dumps({"url": farther}))
    assert r.status == 202
    warned = [rec.getMessage() for rec in caplog.records if rec.levelno == logging.WARNING]
    assert [w for w in warned if "plain http://" in w] == [
        f"the replicas' token goes to {name} over plain http:// beyond this machine, readable "
        "on the way: give the replica an https:// URL, or reach it through a tunnel"
        for name in (far, farther)  # at start, then when added; never the loopback replica
    ]
