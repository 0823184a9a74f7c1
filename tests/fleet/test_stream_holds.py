"""Over real sockets: once a replica is chosen, an open stream holds no routing key, no parsed
prompt (issue 16, "a stream holds what it needs")."""

from __future__ import annotations

import gc

import aiohttp
from emulated_fleet import StartEmulators, StartRouter

from lora_router.proxy.body import Completion
from lora_router.routing.keys import PromptKey, RouteKey


def routing_objects() -> list[object]:
    """The routed path's per-request objects still alive: keys and validated completions (the
    emulator in this process keys its cache with its own seeds; the router's are placement
    seeds, so their PromptKeys are never kept either)."""
    gc.collect()
    return [o for o in gc.get_objects() if isinstance(o, RouteKey | Completion | PromptKey)]


async def test_an_open_stream_holds_no_key_or_parsed_prompt(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(1, decode_s_per_token=0.05)
    runtime = await router(emus)
    model = emus[0].config.model
    prompt = list(range(1000, 1600))
    baseline = routing_objects()
    for sibling in (False, True):  # a fresh prompt (block key built), then its wire-key sibling
        body = {"model": model, "prompt": prompt, "max_tokens": 40, "stream": True}
        async with client.post(runtime.url + "/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert await resp.content.readline()  # the stream has begun
            alive = [o for o in routing_objects() if not any(o is b for b in baseline)]
            assert alive == [], (sibling, alive)
            await resp.read()
    counts = runtime.app.policy.counts if runtime.app else None
    assert counts is not None and (counts.fresh, counts.sibling) == (1, 1)
