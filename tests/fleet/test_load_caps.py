"""What a load may cost the router, whatever the trainer's request or directory holds: the
adapter files read outside the broadcast lock, bounded in bytes, time and place; an entry keeps
only what a replay needs; names bounded in size and number (fleet/adapter_files.py,
fleet/fence.py)."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import aiohttp
import orjson
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, call, load

from lora_router.fleet import adapter_files, broadcast, fence
from lora_router.fleet.adapter_files import read_digest
from lora_router.fleet.fence import AdapterFence, LoadRefused
from lora_router.routes import CONTROL_BODY_BYTES

HUGE = 6 << 30  # a sparse file: no disk used, but this many bytes to read


def test_a_link_out_of_the_adapter_directory_is_not_read(tmp_path: Path, adapter: Adapter) -> None:
    path = adapter("v1")
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"not the adapter's")
    os.symlink(outside, Path(path, "adapter_model.bin"))
    assert read_digest(path) is None


def test_a_link_inside_the_adapter_directory_is_read(adapter: Adapter) -> None:
    path = adapter("v1")
    os.symlink(Path(path, "adapter_config.json"), Path(path, "alias.json"))
    assert read_digest(path) is not None


def test_a_directory_larger_than_the_cap_is_not_read(adapter: Adapter) -> None:
    path = adapter("v1")
    with open(Path(path, "adapter_model.safetensors"), "wb") as f:
        f.truncate(HUGE)  # sparse: the cap is judged on sizes, before a byte is read
    assert adapter_files.MAX_BYTES < HUGE
    assert read_digest(path) is None


def test_reading_stops_at_its_time_limit(adapter: Adapter, monkeypatch: pytest.MonkeyPatch) -> None:
    path = adapter("v1")
    Path(path, "adapter_model.safetensors").write_bytes(b"w" * (3 << 20))
    monkeypatch.setattr(adapter_files, "MAX_SECONDS", -1.0)  # already past it
    assert read_digest(path) is None


async def test_a_huge_adapter_directory_never_holds_another_sync(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    tmp_path: Path,
) -> None:
    emus = await emulators(2)
    rt = await router(emus, load_deadline=1.0)
    path = adapter("trl-policy-v1")
    sparse = tmp_path / "huge.bin"
    with open(sparse, "wb") as f:
        f.truncate(HUGE)
    os.symlink(sparse, Path(path, "weights.bin"))
    async with asyncio.timeout(5):  # 18 s on the code before: the whole file was hashed
        status, _ = await load(client, rt.url, "trl-policy-v1", path)
        paused = await call(client, "POST", rt.url + "/pause?mode=keep")
    assert status == 200
    assert paused[0] == 200


async def test_adapter_files_on_a_hung_mount_never_hold_the_broadcasts(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A read of a file that never returns, as on a network mount that hangs: the thread blocks
    # in the read itself, where the read's own time limit is never checked.
    hung = threading.Event()
    reading = threading.Event()

    def hangs(path: str, deadline: float) -> bytes | None:
        reading.set()
        hung.wait()
        return None

    monkeypatch.setattr(adapter_files, "_file_digest", hangs)
    monkeypatch.setattr(broadcast, "FILES_READ_IN", 0.5)
    emus = await emulators(2)
    rt = await router(emus)
    try:
        async with asyncio.timeout(5):  # before: the load, and every broadcast behind it, hung
            status, body = await load(client, rt.url, "trl-policy-v1", adapter("trl-policy-v1"))
            paused = await call(client, "POST", rt.url + "/pause?mode=keep")
        assert reading.is_set()
        assert status == 200, body
        assert paused[0] == 200
        assert rt.fence is not None and "trl-policy-v1" in rt.fence.live()
    finally:
        hung.set()  # the thread ends


async def test_an_entry_keeps_only_what_a_replay_needs(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    path = adapter("trl-policy-v1")
    # Padded to half the cap on a control call's body (a load over it is a 413).
    pad = "x" * (CONTROL_BODY_BYTES // 2)
    padded = {"lora_name": "trl-policy-v1", "lora_path": path, "pad": pad}
    status, _, _ = await call(client, "POST", rt.url + "/v1/load_lora_adapter", padded)
    assert status == 200
    assert rt.fence is not None
    kept = rt.fence.live()["trl-policy-v1"].body
    assert orjson.loads(kept) == {
        "lora_name": "trl-policy-v1",
        "lora_path": path,
        "load_inplace": False,
    }
    # A replica that restarts gets that, not the padded request.
    await emus[1].restart()
    assert rt.health is not None and rt.fleet is not None
    replica = rt.fleet.replicas[1]
    replica.life.eject("restarted (test)")
    assert await rt.health.admit(replica)
    replayed = [r.body for r in emus[1].requests if r.path == "/v1/load_lora_adapter"]
    assert replayed[-1] == kept


async def test_an_overlong_name_is_refused_in_vllms_shape(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(1)
    rt = await router(emus)
    name = "n" * (fence.MAX_NAME_BYTES + 1)
    status, body = await load(client, rt.url, name, adapter("v1"))
    assert status == 400
    assert orjson.loads(body)["error"]["code"] == 400
    assert not emus[0].requests or all(r.path != "/v1/load_lora_adapter" for r in emus[0].requests)


def test_names_beyond_the_cap_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fence, "MAX_NAMES", 3)
    gate = AdapterFence(1.0)
    for i in range(3):
        gate.begin_load(f"v{i}", f"/a/v{i}", inplace=False)
    with pytest.raises(LoadRefused, match="already knows 3 adapter names"):
        gate.begin_load("v3", "/a/v3", inplace=False)
    gate.begin_load("v0", "/a/v0", inplace=False)  # a name it knows still joins its entry
