"""Loads of a name the fleet already holds, end to end over real sockets: the same files answer
at once with nothing sent, new files are reloaded on every replica behind the fence (with the
prefix cache reset), and no copy the router did not load itself is served."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

import aiohttp
import orjson
import pytest
from emulated_fleet import FenceMonitor, StartEmulators, StartRouter
from helpers import Adapter, call, complete, load, until

from lora_router.emulator import Emulator, write_adapter
from lora_router.fleet.adapter_files import MAX_FILES, read_digest

V1 = "trl-policy-v1"
LOAD, UNLOAD, RESET = "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/reset_prefix_cache"
PROMPT = list(range(100, 148))  # three full 16-token blocks: two can be hit


def republish(path: str, alpha: int) -> None:
    """New weights at the same path, as TRL publishes them: written beside it, renamed in."""
    staging = Path(path).parent / f".{Path(path).name}.tmp"
    write_adapter(staging, alpha=alpha)
    shutil.rmtree(path)
    staging.rename(path)


def control(emu: Emulator) -> list[str]:
    """The adapter and cache calls `emu` received, in order (`load v1`, `reset`, ...)."""
    out = []
    for r in emu.requests:
        route = r.path.split("?")[0]
        if route in (LOAD, UNLOAD) and r.body != b"{}":  # not the readiness probe
            out.append(f"{route.split('_')[0][4:]} {orjson.loads(r.body)['lora_name']}")
        elif route == RESET:
            out.append("reset")
    return out


async def cached(client: aiohttp.ClientSession, url: str, model: str) -> int:
    """A completion of PROMPT under `model`: the prompt tokens the replica found cached."""
    status, body = await complete(client, url, model, prompt=PROMPT, max_tokens=2)
    assert status == 200, body
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_the_same_files_loaded_again_answer_success_and_send_nothing(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    """A retried load, or a trainer resumed with the files the router loaded: vLLM's success
    (plain text, no Content-Type), no request to any replica, still served."""
    emus = await emulators(2)
    rt = await router(emus)
    path = adapter(V1)
    assert (await load(client, rt.url, V1, path))[0] == 200
    status, data, headers = await call(
        client, "POST", rt.url + LOAD, {"lora_name": V1, "lora_path": path}
    )
    assert (status, data) == (200, f"Success: LoRA adapter '{V1}' added successfully.".encode())
    assert "Content-Type" not in headers and headers["x-lora-router-replica"] == "0,1"
    assert [control(e) for e in emus] == [[f"load {V1}"]] * 2
    assert (await complete(client, rt.url, V1))[0] == 200


async def test_new_files_under_a_live_name_are_reloaded_on_every_replica_and_no_stale_kv(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A trainer resumed from a checkpoint publishes trl-policy-v1 again with new weights at
    the same path. Every replica unloads it, resets its prefix cache and loads the new files;
    a prompt cached under the old weights is computed afresh; the reload is a warning."""
    emus = await emulators(2, vllm_version="0.32")  # KV keyed by (name, path)
    rt = await router(emus)
    path = adapter(V1)
    assert (await load(client, rt.url, V1, path))[0] == 200
    assert await cached(client, rt.url, V1) == 0
    assert await cached(client, rt.url, V1) == 32  # the old weights' blocks, cached
    republish(path, alpha=7)
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        status, data = await load(client, rt.url, V1, path)
    assert (status, data) == (200, f"Success: LoRA adapter '{V1}' added successfully.".encode())
    assert [control(e) for e in emus] == [[f"load {V1}", f"unload {V1}", "reset", f"load {V1}"]] * 2
    assert [e.state.adapters for e in emus] == [{V1: path}] * 2
    assert await cached(client, rt.url, V1) == 0  # nothing computed with the old weights
    assert f"load '{V1}': the fleet already serves this name" in caplog.text
    assert "its files differ from the ones the router loaded under it" in caplog.text


async def test_completions_under_a_name_being_reloaded_wait_and_meet_only_the_new_files(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monitor: FenceMonitor,
) -> None:
    """From the reload's arrival, completions under the name wait at the fence: none reaches a
    replica before that replica loaded the new files, and all are answered 200."""
    emus = await emulators(2)
    rt = await router(emus)
    path = adapter(V1)
    assert (await load(client, rt.url, V1, path))[0] == 200
    republish(path, alpha=9)
    for emu in emus:
        emu.faults.load_delay_s = 0.3
    reload = asyncio.create_task(load(client, rt.url, V1, path))
    await until(lambda: all(len(control(e)) == 4 for e in emus))  # the new files' load is on
    during = [asyncio.create_task(complete(client, rt.url, V1)) for _ in range(6)]
    assert (await reload)[0] == 200
    assert [s for s, _ in await asyncio.gather(*during)] == [200] * 6
    for emu in emus:
        routes = [r.path.split("?")[0] for r in emu.requests]
        last_load = max(i for i, r in enumerate(routes) if r == LOAD)
        assert "/v1/completions" not in routes[:last_load]  # none before the new files
    assert monitor.violations == [] and monitor.checked == 6


async def test_a_name_found_on_the_replicas_at_start_is_reloaded_when_loaded_again(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The router restarted after a preemption: trl-policy-v1 is on every replica (the first
    run's weights) and served; the resumed trainer loads it again from the same path. The
    router cannot know the replicas' files, so it reloads it everywhere."""
    emus = await emulators(2)
    path = adapter(V1)
    for emu in emus:
        assert (await load(client, emu.url, V1, path))[0] == 200
    rt = await router(emus)
    assert (await complete(client, rt.url, V1))[0] == 200  # served as found
    republish(path, alpha=5)
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        assert (await load(client, rt.url, V1, path))[0] == 200
    assert [control(e) for e in emus] == [[f"load {V1}", f"unload {V1}", "reset", f"load {V1}"]] * 2
    assert "it was on the replicas when this router started" in caplog.text


async def test_files_the_router_cannot_read_are_reloaded(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A directory the router cannot tell the files of (here: more files than an adapter has)
    never counts as the same files: a second load reloads it."""
    emus = await emulators(1)
    rt = await router(emus)
    path = adapter(V1)
    for i in range(MAX_FILES + 1):
        Path(path, f"extra-{i}").write_bytes(b"")
    assert read_digest(path) is None
    assert (await load(client, rt.url, V1, path))[0] == 200
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        assert (await load(client, rt.url, V1, path))[0] == 200
    assert control(emus[0]) == [f"load {V1}", f"unload {V1}", "reset", f"load {V1}"]
    assert f"the router cannot read its files at {path}" in caplog.text


async def test_a_copy_at_the_same_path_the_router_did_not_load_is_replaced(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    """Replica 0 holds trl-policy-v1 at its path from before this router (a load half done when
    the previous router was killed), with the first run's files. The fleet does not serve the
    name (replica 1 lacks it), so the trainer's load is a new one: replica 0 answers "already
    loaded", and its copy is dropped and the new files loaded, never taken as present."""
    emus = await emulators(2)
    path = adapter(V1)
    assert (await load(client, emus[0].url, V1, path))[0] == 200
    rt = await router(emus)
    republish(path, alpha=3)
    assert (await load(client, rt.url, V1, path))[0] == 200
    assert control(emus[0]) == [f"load {V1}", f"load {V1}", f"unload {V1}", "reset", f"load {V1}"]
    assert control(emus[1]) == [f"load {V1}"]
    assert [e.state.adapters for e in emus] == [{V1: path}] * 2


async def test_a_replica_away_during_a_reload_gets_the_new_files_in_its_replay(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    """Replica 1 is unreachable while trl-policy-v1 is reloaded (ejected; the reload goes on
    with replica 0). It comes back still holding the old copy at the same path: its replay
    drops that copy and loads the new files before it serves."""
    emus = await emulators(2)
    rt = await router(emus, health_interval=0.05)
    path = adapter(V1)
    assert (await load(client, rt.url, V1, path))[0] == 200
    await emus[1].crash()  # unreachable; its engine, and so its copy of v1, stays
    republish(path, alpha=11)
    assert (await load(client, rt.url, V1, path))[0] == 200
    assert rt.fleet is not None and not rt.fleet.replicas[1].live
    await emus[1].start()  # reachable again on its port, the old copy still loaded
    assert V1 in emus[1].state.adapters
    await until(lambda: rt.fleet is not None and rt.fleet.replicas[1].live)
    assert control(emus[1])[-3:] == [f"unload {V1}", "reset", f"load {V1}"]


async def test_a_failed_reload_unloads_the_name_everywhere(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    """Replica 1 fails the new files: the load answers its failure, and the name is gone from
    every replica and from the router, so the old weights are served under it nowhere."""
    emus = await emulators(2)
    rt = await router(emus)
    path = adapter(V1)
    assert (await load(client, rt.url, V1, path))[0] == 200
    republish(path, alpha=13)
    emus[1].faults.load_failures = 1
    status, data = await load(client, rt.url, V1, path)
    assert status == 500 and f"Replica 1 ({emus[1].url})" in orjson.loads(data)["error"]["message"]
    assert [e.state.adapters for e in emus] == [{}, {}]
    status, body = await complete(client, rt.url, V1)
    assert status == 404 and body["error"]["type"] == "NotFoundError"


def test_the_digest_follows_the_files_not_the_directory(tmp_path: Path) -> None:
    a = write_adapter(tmp_path / "a")
    b = write_adapter(tmp_path / "b")
    assert read_digest(str(a)) == read_digest(str(b)) is not None
    (b / "adapter_model.safetensors").write_bytes(b"other weights")
    assert read_digest(str(a)) != read_digest(str(b))
    assert read_digest(str(tmp_path / "missing")) is None
    (a / "adapter_config.json").unlink()
    assert read_digest(str(a)) is None  # not an adapter
