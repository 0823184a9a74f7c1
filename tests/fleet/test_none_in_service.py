"""With no replica in service, a completion for any model the fleet served is answered 503 with
`Retry-After` in vLLM's error shape, naming why the replicas are out, never 404 "does not
exist": the model exists, the replicas are what is missing."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import orjson
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, load, until

pytestmark = pytest.mark.timeout(30)


def assert_unavailable(status: int, headers: object, body: bytes, interval: float) -> str:
    """A 503 with `Retry-After` (one health interval, whole seconds) in vLLM's shape; returns
    its message."""
    assert status == 503, body
    assert headers["Retry-After"] == str(max(1, int(interval)))  # type: ignore[index]
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["code"] == 503 and error["type"] == "ServiceUnavailableError"
    assert "No replica is in service" in error["message"]
    return str(error["message"])


async def completion(
    client: aiohttp.ClientSession, url: str, model: str
) -> tuple[int, object, bytes]:
    body = {"model": model, "prompt": list(range(40)), "max_tokens": 4}
    async with client.post(url + "/v1/completions", json=body) as resp:
        return resp.status, resp.headers, await resp.read()


async def test_the_base_model_and_a_live_adapter_get_503_once_every_replica_is_out(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
) -> None:
    emus = await emulators(2)
    rt = await router(emus, health_interval=0.1, health_failures=1)
    assert (await load(client, rt.url, "trl-policy-v1", adapter("trl-policy-v1")))[0] == 200
    for emu in emus:
        await emu.stop()
    assert rt.fleet is not None
    fleet = rt.fleet
    await until(lambda: not fleet.live())
    for model in (emus[0].config.model, "trl-policy-v1"):
        message = assert_unavailable(*await completion(client, rt.url, model), 0.1)
        assert "cannot connect" in message and "`vllm serve` is running there" in message


async def test_before_any_replica_answered_the_base_model_gets_503_not_404(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(1)
    await emus[0].stop()
    rt = await router(emus, health_interval=2.0)
    message = assert_unavailable(*await completion(client, rt.url, emus[0].config.model), 2.0)
    assert "at start: cannot connect" in message


async def test_a_fleet_discovery_has_not_filled_says_so(
    router: StartRouter, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    members = tmp_path / "replicas"
    members.write_text("")  # the file names no replica yet
    rt = await router([], replicas_files=(str(members),), replica_hosts=("127.0.0.1",))
    async with client.get(rt.url + "/health") as resp:
        status, headers, body = resp.status, resp.headers, await resp.read()
    message = assert_unavailable(status, headers, body, rt.config.health_interval)
    assert "the fleet has no member: discovery has named none yet" in message
    assert "/router/status's `discovery`" in message
