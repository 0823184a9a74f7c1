"""A load's path judged before any replica is asked (fleet/adapter_files.py's `path_problem`):
the mistakes the router can see are answered at once, in vLLM's error shape, instead of after
`--load-deadline` (300 s by default)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import orjson
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, load

from lora_router.fleet.adapter_files import path_problem

LONG = 300.0  # the deadline a judged path must not wait out


async def refused_at_once(
    client: aiohttp.ClientSession, url: str, path: str
) -> tuple[dict[str, object], float]:
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.timeout(5):
        status, body = await load(client, url, "trl-policy-v1", path)
    assert status == 400, body
    return orjson.loads(body)["error"], loop.time() - started


async def test_a_relative_path_is_refused_at_once(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(emus, load_deadline=LONG)
    error, seconds = await refused_at_once(client, rt.url, "out/.vllm_lora/trl-policy-v1")
    assert seconds < 1.0
    assert error["type"] == "InvalidUserInput" and error["code"] == 400
    assert "'out/.vllm_lora/trl-policy-v1' is a relative path" in str(error["message"])
    assert all(r.path != "/v1/load_lora_adapter" for e in emus for r in e.requests)


async def test_a_missing_path_beside_a_visible_parent_is_refused_at_once(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
) -> None:
    emus = await emulators(2)
    rt = await router(emus, load_deadline=LONG)
    written = Path(adapter("trl-policy-v1"))
    typo = str(written.parent / "trl-policy-v01")
    error, seconds = await refused_at_once(client, rt.url, typo)
    assert seconds < 1.0
    assert f"'{typo}' does not exist, although its parent {written.parent} does" in str(
        error["message"]
    )
    assert all(r.path != "/v1/load_lora_adapter" for e in emus for r in e.requests)
    # The name is not left loading: a completion naming it is vLLM's 404, not a fence wait.
    assert rt.fence is not None and rt.fence.state("trl-policy-v1") is None


def test_a_path_on_a_mount_the_router_cannot_see_is_not_judged(tmp_path: Path) -> None:
    assert path_problem(str(tmp_path / "elsewhere" / "trl-policy-v1")) is None
    assert path_problem(str(tmp_path)) is None  # it exists
