"""Control answers kept whole are capped (fleet/client.py): a replica answering its
`/v1/models` with a 16 MiB document is refused before it is parsed, never holds the router's
loop, and is taken out of service saying why.

The cap is tried on a small aiohttp server on loopback that answers any path with the number
of bytes asked, whole or chunked; the 16 MiB listing comes from an emulated replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import orjson
import pytest
from aiohttp import web
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, complete, load, longest_lateness, router_config, router_status, until

from lora_router.emulator import control as emulator_control
from lora_router.emulator.replies import Reply
from lora_router.fleet import client as client_module
from lora_router.fleet.client import ANSWER_CAP, Answer, ReplicaClient
from lora_router.fleet.failure import Cause
from lora_router.fleet.fleet import Fleet

# -- the cap ---------------------------------------------------------------------------------


@pytest.fixture
async def sized() -> AsyncIterator[str]:
    """A server answering any GET with `?size=N` bytes, chunked when `&chunked=1`; its URL."""

    async def answer(request: web.Request) -> web.StreamResponse:
        body = b"x" * int(request.query["size"])
        if not request.query.get("chunked"):
            return web.Response(body=body)
        resp = web.StreamResponse()
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        for at in range(0, len(body), 256 << 10):
            await resp.write(body[at : at + (256 << 10)])
        await resp.write_eof()
        return resp

    app = web.Application()
    app.router.add_get("/{path:.*}", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    await runner.cleanup()


@pytest.mark.parametrize("path", ["/v1/models", "/server_info", "/v1/load_lora_adapter"])
@pytest.mark.parametrize("chunked", [False, True], ids=["length", "chunked"])
async def test_an_answer_is_kept_up_to_the_cap_and_refused_past_it(
    sized: str, path: str, chunked: bool
) -> None:
    assert ANSWER_CAP == 1 << 20
    config = router_config([sized])
    fleet = Fleet(config)
    try:
        async with ReplicaClient(config) as control, asyncio.timeout(20):
            replica = fleet.replicas[0]

            async def get(size: int) -> Answer[Any]:
                query = f"size={size}" + ("&chunked=1" if chunked else "")
                return await control.call(replica, "GET", path, query=query, timeout=10)

            kept = await get(ANSWER_CAP)
            assert (kept.status, len(kept.body)) == (200, ANSWER_CAP)
            refused = await get(ANSWER_CAP + 1)
            assert (refused.status, refused.body, refused.transport) == (0, b"", Cause.NOT_VLLM)
            size = "larger than" if chunked else f"{ANSWER_CAP + 1:,} bytes, over"
            assert refused.error.startswith(
                f"its answer to {path} is {size} the 1 MiB cap of a control answer"
            )
            # A listing's refusal names the one way a vLLM server's could be that long.
            assert ("unload those no longer used" in refused.error) == (path == "/v1/models")
            assert str(refused.failure(path)).startswith(refused.error)
    finally:
        fleet.close()


async def test_redirects_to_ever_new_hosts_are_remembered_within_a_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A replica whose every answer redirects somewhere new: the router logs each redirect
    # once, and what it remembers for that must not grow with every call.
    monkeypatch.setattr(client_module, "REDIRECTS_KEPT", 8)
    sent = 0

    async def redirect(request: web.Request) -> web.Response:
        nonlocal sent
        sent += 1
        return web.Response(status=307, headers={"Location": f"http://h{sent}.example:80/"})

    app = web.Application()
    app.router.add_get("/{path:.*}", redirect)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    config = router_config([f"http://127.0.0.1:{runner.addresses[0][1]}"])
    fleet = Fleet(config)
    try:
        async with ReplicaClient(config) as control, asyncio.timeout(20):
            for _ in range(3 * 8):
                answer = await control.call(fleet.replicas[0], "GET", "/health", timeout=5)
                assert answer.status == 307 and "not followed" in answer.error
            assert sent == 3 * 8
            assert len(control._redirects) <= 8
    finally:
        fleet.close()
        await runner.cleanup()


def test_an_answer_is_parsed_once() -> None:
    answer = Answer(object(), 200, b'{"data": []}')
    doc = answer.parsed()
    assert doc == {"data": []} and answer.parsed() is doc
    assert Answer(object(), 200, b"not json").parsed() is None


# -- a hostile listing ------------------------------------------------------------------------


@pytest.fixture
def listings(monkeypatch: pytest.MonkeyPatch) -> dict[int, bytes]:
    """What an emulated replica's `/v1/models` answers instead of its own listing, by the id of
    its engine (`Emulator.state`): an entry turns it hostile."""
    bodies: dict[int, bytes] = {}
    original = emulator_control.routes
    own = emulator_control.models

    async def models(replica: Any, req: Any) -> Reply:
        body = bodies.get(id(replica.state))
        return Reply(200, body) if body is not None else await own(replica, req)

    def routes(config: Any) -> Any:
        table = original(config)
        table["/v1/models"] = {"GET": models}
        return table

    monkeypatch.setattr(emulator_control, "routes", routes)
    return bodies


def huge_listing(base: str, name: str, root: str, size: int) -> bytes:
    """A model list of about `size` bytes that lists `name` at `root` like vLLM, then adapters
    by the thousand: under the old 16 MiB cap it was kept and parsed whole."""
    card = {"id": name, "object": "model", "root": root, "parent": base, "permission": [{}]}
    cards = [{"id": base, "object": "model", "root": base, "parent": None}, card]
    one = len(orjson.dumps({**card, "id": "trl-policy-v0000000"})) + 1
    cards += [{**card, "id": f"trl-policy-v{i:07d}"} for i in range(size // one - 2)]
    return orjson.dumps({"object": "list", "data": cards})


async def test_a_16_mib_listing_never_holds_the_loop_and_takes_the_replica_out(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    listings: dict[int, bytes],
) -> None:
    # Kept whole under the old 16 MiB cap, such a listing held this loop 100 ms or more at each
    # health check (orjson, then parse_models); refused by its Content-Length, it costs the loop
    # nothing. The bound is the median of three windows of health checks, generous for a loaded
    # machine.
    emus = await emulators(2)
    rt = await router(emus, health_interval=0.02, policy="round-robin")
    assert rt.health is not None and rt.fleet is not None
    path = adapter("trl-policy-v1")
    code, body = await load(client, rt.url, "trl-policy-v1", path)
    assert code == 200, body
    hostile = emus[1]
    base = hostile.config.model
    listings[id(hostile.state)] = huge_listing(base, "trl-policy-v1", path, (16 << 20) - 1024)

    def asked() -> int:
        return sum(r.path == "/v1/models" for r in hostile.requests)

    async def checks() -> None:  # two listings asked of the hostile replica
        start = asked()
        await until(lambda: asked() >= start + 2, timeout=20)

    stalls = [await longest_lateness(checks) for _ in range(3)]
    assert sorted(stalls)[1] < 0.05, stalls
    doc = await router_status(client, rt.url)
    out = doc["replicas"][1]
    assert not out["admitted"], out
    assert "its answer to /v1/models is" in out["last_error"], out
    assert "over the 1 MiB cap of a control answer" in out["last_error"], out
    assert doc["replicas"][0]["admitted"]
    for i in range(4):  # the other replica serves the adapter alone
        code, got = await complete(client, rt.url, "trl-policy-v1", prompt=[1, 2, i])
        assert code == 200, got
