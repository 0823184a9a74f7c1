"""Adapter broadcasts against real vLLM: late directories, reused replicas, unload under load."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import aiohttp
from recipe import PROBE, probe, probe_fresh

from lora_router.testbed.tiny_model import adapter_dir
from lora_router.testbed.trl_client import LORA_NAME
from lora_router.testbed.vllm_harness import Answer, Replica, Router, wait_for

V1 = f"{LORA_NAME}-v1"


def load_body(name: str, path: str) -> dict[str, object]:
    return {"lora_name": name, "lora_path": path, "load_inplace": False}  # TRL's payload


def load_404s(replica: Replica) -> int:
    """How many loads this replica has answered 404 (its access log)."""
    text = replica.log.read_text(errors="replace")
    return text.count('"POST /v1/load_lora_adapter HTTP/1.1" 404')


def test_load_waits_for_a_directory_renamed_into_place_later(
    fleet: list[Replica],
    routers: Callable[..., Router],
    publish: Callable[..., str],
    arrive: Callable[[str], None],
) -> None:
    """TRL publishes by atomic rename; a replica whose view lags answers 404 "No adapter
    found". The router retries until the directory appears and answers 200, never 404."""
    router = routers("--load-retry-interval", "0.3")
    path = publish(V1, 0, rename=False)  # on a mount that has not caught up
    before = [load_404s(r) for r in fleet]
    answers: list[Answer] = []
    loader = threading.Thread(
        target=lambda: answers.append(router.post("/v1/load_lora_adapter", load_body(V1, path)))
    )
    loader.start()
    # Rename only once every replica has refused the missing path at least once.
    wait_for(
        "every replica answered 404 to the early load",
        lambda: all(load_404s(r) > b for r, b in zip(fleet, before, strict=True)),
        60,
        [r.log for r in fleet] + [router.log],
    )
    arrive(path)
    loader.join(timeout=120)
    assert not loader.is_alive()
    [answer] = answers
    assert answer.status == 200, answer.text
    assert [r.adapters() for r in fleet] == [{V1: path}] * 2


def test_load_of_a_name_a_replica_already_holds_at_the_same_path_succeeds(
    fleet: list[Replica], router: Router, publish: Callable[..., str]
) -> None:
    """Replica 0 already has the adapter (a load that reached it before, not the router's);
    vLLM answers that second load 400 "already loaded", and the router, not knowing which
    files that copy was loaded from, replaces it: the load succeeds everywhere."""
    path = publish(V1, 0)
    direct = fleet[0].post("/v1/load_lora_adapter", load_body(V1, path))
    assert direct.status == 200, direct.text
    again = fleet[0].post("/v1/load_lora_adapter", load_body(V1, path))
    assert again.status == 400 and "has already been loaded" in again.text  # what the router meets

    answer = router.post("/v1/load_lora_adapter", load_body(V1, path))
    assert answer.status == 200, answer.text
    assert [r.adapters() for r in fleet] == [{V1: path}] * 2


def test_a_name_published_again_is_reloaded_with_none_of_its_old_kv(
    fleet: list[Replica], router: Router, publish: Callable[..., str], model: Path
) -> None:
    """trl-policy-v1 is loaded through the router and a prompt is cached under it on both
    replicas. New weights are then published at the same path (TRL's rename) and loaded again
    through the router, with no pause (a pause would clear the cache): on every replica the
    name then answers exactly as a fresh load of that directory does, and the prompt finds
    nothing cached (vLLM keys KV blocks by name and path: the router reset the cache)."""
    path = publish(V1, 0)
    assert router.post("/v1/load_lora_adapter", load_body(V1, path)).status == 200
    old = [probe(r, V1, PROBE) for r in fleet]
    assert [probe(r, V1, PROBE).cached for r in fleet] == [256, 256]  # the probe sees the cache
    staging = Path(path).parent / f".{V1}.new"
    shutil.copytree(adapter_dir(model, 1), staging)
    shutil.rmtree(path)
    staging.rename(path)
    answer = router.post("/v1/load_lora_adapter", load_body(V1, path))
    assert answer.status == 200, answer.text
    for i, replica in enumerate(fleet):
        new = probe(replica, V1, PROBE)
        assert new.cached == 0, f"replica {i} served KV computed with the old weights"
        assert new.agrees(probe_fresh(replica, "fresh-v1", path, PROBE))
        assert not new.agrees(old[i])  # the probe tells the two adapters apart


def test_load_of_a_name_a_replica_holds_at_another_path_fails_on_every_replica(
    fleet: list[Replica], router: Router, publish: Callable[..., str]
) -> None:
    """A same-named leftover at a different path is not this adapter: the load fails with a
    400 naming the replica and the leftover's path, and the replica that took the new one has
    it unloaded again."""
    old = publish(V1 + "-old-run", 1)
    assert fleet[0].post("/v1/load_lora_adapter", load_body(V1, old)).status == 200
    answer = router.post("/v1/load_lora_adapter", load_body(V1, publish(V1, 0)))
    assert answer.status == 400, answer.text
    message = answer.json()["error"]["message"]
    vllm = f"The lora adapter '{V1}' has already been loaded"  # vLLM's own words, kept
    assert message.startswith(f"Replica 0 ({fleet[0].url}) answered: {vllm}"), message
    assert old in message
    assert fleet[1].adapters() == {}
    assert fleet[0].adapters() == {V1: old}


def test_unload_stale_clears_a_reused_replicas_leftovers_before_serving(
    fleet: list[Replica], routers: Callable[..., Router], publish: Callable[..., str]
) -> None:
    """Replicas that served an earlier run still hold trl-policy-v1 and -v2;
    `--unload-stale 'trl-policy-*'` unloads them before the router serves, so TRL's first
    load of trl-policy-v1 succeeds. An adapter outside the pattern stays."""
    static = publish("static-adapter", 2)
    for replica in fleet:
        for name, index in ((V1, 0), (f"{LORA_NAME}-v2", 1)):
            body = load_body(name, publish(f"{name}-r{replica.port}", index))
            assert replica.post("/v1/load_lora_adapter", body).status == 200
        assert (
            replica.post("/v1/load_lora_adapter", load_body("static-adapter", static)).status == 200
        )

    router = routers("--unload-stale", f"{LORA_NAME}-*")
    assert [r.adapters() for r in fleet] == [{"static-adapter": static}] * 2
    models = [card["id"] for card in router.get("/v1/models").json()["data"]]
    assert models[1:] == ["static-adapter"]  # on every replica at one path: adopted
    fresh = publish(V1, 0)
    answer = router.post("/v1/load_lora_adapter", load_body(V1, fresh))
    assert answer.status == 200, answer.text


async def _stream(
    session: aiohttp.ClientSession, url: str, name: str, started: asyncio.Event, out: list[bytes]
) -> int:
    body = {
        "model": name,
        "prompt": list(range(20, 40)),
        # Long enough to outlast the wait for all four to start plus the unload on a fast CPU
        # (160 tokens once all finished first in CI, leaving nothing tested).
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
        "seed": 7,
    }
    async with session.post(url + "/v1/completions", json=body) as response:
        async for frame in response.content:
            out.append(frame)
            if frame.startswith(b"data: {"):
                started.set()
        return response.status


def test_unload_with_rollouts_running_is_answered_at_once_and_broadcast_after(
    fleet: list[Replica], router: Router, publish: Callable[..., str]
) -> None:
    """TRL unloads the oldest version while non-streamed rollouts under it still run (they
    hold the fence until answered): the unload is answered at once with vLLM's own text (TRL's
    trainer waits for it), a new request for the name is refused with vLLM's 404, every rollout
    finishes, and the replicas drop the name once they are answered."""
    path = publish(V1, 0)
    assert router.post("/v1/load_lora_adapter", load_body(V1, path)).status == 200
    body = {
        "model": V1,
        "prompt": list(range(20, 40)),
        "max_tokens": 1500,  # outlasts the unload's answer on a fast CPU (see _stream)
        "ignore_eos": True,
        "seed": 7,
    }

    async def scenario() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:

            async def rollout() -> int:
                async with session.post(router.url + "/v1/completions", json=body) as response:
                    await response.read()
                    return response.status

            async def routed() -> int:
                async with session.get(router.url + "/router/status") as response:
                    return sum((await response.json())["routing"].values())

            rollouts = [asyncio.create_task(rollout()) for _ in range(4)]
            # Every rollout routed, so admitted under V1: they need not all run at once (a CPU
            # replica can stall seconds on its first request while the first one runs).
            async with asyncio.timeout(60):
                while await routed() < 4:
                    await asyncio.sleep(0.05)
            async with session.post(
                router.url + "/v1/unload_lora_adapter", json={"lora_name": V1}
            ) as response:
                assert response.status == 200, await response.text()
                text = await response.text()
                assert text == f"Success: LoRA adapter '{V1}' removed successfully."
            assert not all(r.done() for r in rollouts), "every rollout ended first: nothing tested"
            assert all(V1 in r.adapters() for r in fleet)  # not broadcast while they run
            async with session.post(
                router.url + "/v1/completions",
                json={"model": V1, "prompt": [1, 2, 3], "max_tokens": 2},
            ) as refused:
                assert refused.status == 404
            assert await asyncio.wait_for(asyncio.gather(*rollouts), 240) == [200] * 4

    asyncio.run(scenario())
    wait_for(
        "the replicas drop the unloaded name",
        lambda: all(V1 not in r.adapters() for r in fleet),
        30,
        [router.log],
    )


def test_unload_with_requests_running_lets_them_finish(
    fleet: list[Replica], router: Router, publish: Callable[..., str]
) -> None:
    """Streams under trl-policy-v1 are generating when v1 is unloaded: the unload answers at
    once, every stream finishes normally (no error frame, [DONE]), and a new request for v1
    is refused with vLLM's 404."""
    path = publish(V1, 0)
    assert router.post("/v1/load_lora_adapter", load_body(V1, path)).status == 200

    async def scenario() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            events = [asyncio.Event() for _ in range(4)]
            frames: list[list[bytes]] = [[] for _ in events]
            streams = [
                asyncio.create_task(_stream(session, router.url, V1, e, f))
                for e, f in zip(events, frames, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 180)
            async with session.post(
                router.url + "/v1/unload_lora_adapter", json={"lora_name": V1}
            ) as response:
                assert response.status == 200, await response.text()
            still_running = [not s.done() for s in streams]
            async with session.post(
                router.url + "/v1/completions",
                json={"model": V1, "prompt": [1, 2, 3], "max_tokens": 2},
            ) as refused:
                assert refused.status == 404
                assert (await refused.json())["error"]["type"] == "NotFoundError"
            statuses = await asyncio.wait_for(asyncio.gather(*streams), 240)
            assert statuses == [200] * 4
            assert any(still_running), "every stream ended before the unload: nothing tested"
            for stream in frames:
                data = [f for f in stream if f.startswith(b"data: ")]
                assert data[-1] == b"data: [DONE]\n"
                last = json.loads(data[-2][len(b"data: ") :])
                assert last["choices"][0]["finish_reason"] == "length"
                assert not any(b'"error"' in f for f in data)

    asyncio.run(scenario())
    assert all(V1 not in r.adapters() for r in fleet)
