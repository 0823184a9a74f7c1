"""Adapter broadcasts and the fence, end to end: a router in front of emulated replicas."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import orjson
import pytest
from emulated_fleet import FenceMonitor, StartEmulators, StartRouter, paths_of
from helpers import Adapter, call, complete, load, run_top, unload, until
from multidict import CIMultiDictProxy

from lora_router.emulator import Emulator
from lora_router.fleet import broadcast
from lora_router.runtime import RouterRuntime


async def load_on_three(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> tuple[list[Emulator], str, int, CIMultiDictProxy[str], bytes]:
    """Load trl-policy-v1 through a router of three replicas: the replicas, the adapter's path
    and the router's answer (status, headers, body)."""
    emus = await emulators(3)
    rt = await router(emus)
    path = adapter("trl-policy-v1")
    body = {"lora_name": "trl-policy-v1", "lora_path": path}
    async with client.post(rt.url + "/v1/load_lora_adapter", json=body) as resp:
        return emus, path, resp.status, resp.headers, await resp.read()


async def test_a_load_reaches_every_replica(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus, path, _, headers, _ = await load_on_three(emulators, router, client, adapter)
    assert headers["x-lora-router-replica"] == "0,1,2"
    for emu in emus:
        assert emu.state.adapters == {"trl-policy-v1": path}


async def test_a_load_answers_vllms_own_success(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    _, _, status, headers, text = await load_on_three(emulators, router, client, adapter)
    assert status == 200
    # vLLM's success is plain text with no Content-Type at all; the router keeps it so.
    assert "Content-Type" not in headers
    assert text == b"Success: LoRA adapter 'trl-policy-v1' added successfully."


async def test_mount_lag_is_retried_until_the_replica_sees_the_files(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(3)
    emus[1].faults.mount_lag = 3
    rt = await router(emus)
    status, _ = await load(client, rt.url, "v1", adapter("v1"))
    assert status == 200
    assert paths_of(emus[1], "/v1/load_lora_adapter") == ["v1"] * 4
    assert paths_of(emus[0], "/v1/load_lora_adapter") == ["v1"]


async def test_a_load_that_never_becomes_visible_answers_504_never_404(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(3)
    emus[2].faults.mount_lag = 10_000
    rt = await router(emus, load_deadline=0.3)
    status, data = await load(client, rt.url, "v1", adapter("v1"))
    assert status == 504
    message = orjson.loads(data)["error"]["message"]
    assert f"Replica 2 ({emus[2].url})" in message and "No adapter found" in message
    # All or nothing: the replicas that took it gave it back.
    assert all("v1" not in emu.state.adapters for emu in emus)


async def load_failing_on_replica_1(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> tuple[list[Emulator], RouterRuntime, int, bytes]:
    """Load v1 through three replicas, the second of which fails it for real: the replicas,
    the router and its answer."""
    emus = await emulators(3)
    emus[1].faults.load_failures = 1
    rt = await router(emus)
    status, data = await load(client, rt.url, "v1", adapter("v1"))
    return emus, rt, status, data


async def test_a_real_failure_names_the_replica(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus, _, status, data = await load_failing_on_replica_1(emulators, router, client, adapter)
    assert status == 500
    error = orjson.loads(data)["error"]
    assert error["message"].startswith(f"Cannot load adapter 'v1': Replica 1 ({emus[1].url})")
    assert error["type"] == "InternalServerError"


async def test_a_real_failure_rolls_back_every_replica(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monitor: FenceMonitor,
) -> None:
    emus, rt, _, _ = await load_failing_on_replica_1(emulators, router, client, adapter)
    assert all("v1" not in emu.state.adapters for emu in emus)
    assert paths_of(emus[0], "/v1/unload_lora_adapter") == ["v1"]
    # The name never became live: completions get vLLM's 404 from the router itself.
    status, body = await complete(client, rt.url, "v1")
    assert status == 404 and body["error"]["message"] == "The model `v1` does not exist."
    assert monitor.checked == 0


async def test_already_loaded_from_another_path_is_a_conflict_that_explains_itself(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(3)
    rt = await router(emus)
    await load(client, emus[2].url, "trl-policy-v1", adapter("old-run"))
    status, data = await load(client, rt.url, "trl-policy-v1", adapter("trl-policy-v1"))
    assert status == 400
    message = orjson.loads(data)["error"]["message"]
    assert f"Replica 2 ({emus[2].url})" in message
    assert "old-run" in message and "--unload-stale" in message
    assert "trl-policy-v1" not in emus[0].state.adapters  # rolled back
    assert "trl-policy-v1" in emus[2].state.adapters  # not the router's to remove


async def test_unload_stale_clears_matching_adapters_at_start(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(2)
    for emu in emus:
        await load(client, emu.url, "trl-policy-v1", adapter("old-run"))
        await load(client, emu.url, "keep-me", adapter("keep-me"))
    rt = await router(emus, unload_stale="trl-policy-*")
    assert all(set(emu.state.adapters) == {"keep-me"} for emu in emus)
    # TRL's first load now works instead of colliding with the earlier run's adapter.
    assert (await load(client, rt.url, "trl-policy-v1", adapter("trl-policy-v1")))[0] == 200


async def test_adapters_present_on_every_replica_at_start_are_served(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(3)
    for emu in emus:
        await load(client, emu.url, "static", adapter("static"))
    await load(client, emus[0].url, "partial", adapter("partial"))
    rt = await router(emus)
    _, data, _ = await call(client, "GET", rt.url + "/v1/models")
    ids = [card["id"] for card in orjson.loads(data)["data"]]
    assert ids == [emus[0].config.model, "static"]
    assert (await complete(client, rt.url, "static"))[0] == 200
    status, _ = await complete(client, rt.url, "partial")
    assert status == 404


async def test_unknown_model_is_answered_by_the_router_not_a_replica(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    before = [len(e.requests) for e in emus]
    status, data, headers = await call(
        client, "POST", rt.url + "/v1/completions", {"model": "ghost", "prompt": [1, 2]}
    )
    assert status == 404
    assert orjson.loads(data) == {
        "error": {
            "message": "The model `ghost` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }
    assert "x-lora-router-replica" not in headers
    assert [len(e.requests) for e in emus] == before


async def test_eager_requests_wait_at_the_fence_until_every_replica_loaded(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monitor: FenceMonitor,
) -> None:
    emus = await emulators(3)
    emus[2].faults.load_delay_s = 0.3  # the slowest replica decides when the name is live
    rt = await router(emus)
    assert rt.fence is not None
    loading = asyncio.create_task(load(client, rt.url, "v1", adapter("v1")))
    # The load has reached the replicas: the fast two hold it, replica 2 is still busy.
    await until(lambda: all("v1" in emu.state.adapters for emu in emus[:2]))
    eager = [asyncio.create_task(complete(client, rt.url, "v1")) for _ in range(6)]
    await until(lambda: rt.fence is not None and rt.fence.waiting == 6)
    assert not any(t.done() for t in eager) and "v1" not in emus[2].state.adapters
    assert (await loading)[0] == 200
    assert [(await t)[0] for t in eager] == [200] * 6
    assert monitor.checked == 6 and monitor.violations == []


async def test_a_request_waiting_past_the_fence_timeout_gets_a_clear_503(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(2)
    emus[1].faults.load_delay_s = 0.5
    rt = await router(emus, fence_timeout=0.1)
    loading = asyncio.create_task(load(client, rt.url, "v1", adapter("v1")))
    await until(lambda: rt.fence is not None and rt.fence.state("v1") is not None)  # arrived
    status, body = await complete(client, rt.url, "v1")
    assert status == 503 and "still being loaded" in body["error"]["message"]
    assert (await loading)[0] == 200


async def test_unload_stops_routing_at_once_while_in_flight_requests_finish(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(2, decode_s_per_token=0.02)
    rt = await router(emus)
    await load(client, rt.url, "v1", adapter("v1"))
    in_flight = [
        asyncio.create_task(complete(client, rt.url, "v1", max_tokens=15, prompt=[i] * 40))
        for i in range(4)
    ]
    assert rt.fleet is not None
    fleet = rt.fleet
    await until(lambda: sum(r.in_flight for r in fleet.replicas) == 4)  # all four on the replicas
    status, _ = await unload(client, rt.url, "v1")
    assert status == 200  # answered at once; broadcast once the four are answered
    assert (await complete(client, rt.url, "v1"))[0] == 404
    results = [await t for t in in_flight]
    assert [s for s, _ in results] == [200] * 4
    assert all(len(body["choices"][0]["text"]) > 0 for _, body in results)
    await until(lambda: all("v1" not in emu.state.adapters for emu in emus))


async def test_unload_counts_a_replica_that_never_had_it_as_done(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    await load(client, rt.url, "v1", adapter("v1"))
    await unload(client, emus[1].url, "v1")  # gone behind the router's back
    assert (await unload(client, rt.url, "v1"))[0] == 200
    # A name nobody ever had gets the answer a single vLLM gives.
    status, data = await unload(client, rt.url, "never")
    assert status == 404 and b"cannot be found" in data


async def paused_three(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> tuple[list[Emulator], RouterRuntime, int, bytes]:
    """Three replicas behind a router paused with `mode=keep&clear_cache=false`: the replicas,
    the router and its answer to the pause."""
    emus = await emulators(3)
    rt = await router(emus)
    status, data, _ = await call(client, "POST", rt.url + "/pause?mode=keep&clear_cache=false")
    return emus, rt, status, data


async def test_pause_reaches_every_replica_with_its_query(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus, rt, status, data = await paused_three(emulators, router, client)
    assert (status, orjson.loads(data)) == (200, {"status": "paused"})
    assert all(e.state.paused and e.state.pause_mode == "keep" for e in emus)
    assert all(
        r.path == "/pause?mode=keep&clear_cache=false" for e in emus for r in e.requests[-1:]
    )
    assert rt.fleet is not None and rt.fleet.pause.query == "mode=keep&clear_cache=false"


async def test_resume_undoes_the_pause_everywhere(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus, rt, _, _ = await paused_three(emulators, router, client)
    status, data, _ = await call(client, "POST", rt.url + "/resume")
    assert (status, orjson.loads(data)) == (200, {"status": "resumed"})
    assert not any(e.state.paused for e in emus)
    assert rt.fleet is not None and rt.fleet.pause.query is None


async def test_a_failed_pause_names_the_replica(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    status, data, _ = await call(client, "POST", rt.url + "/pause?mode=sideways")
    assert status == 400
    assert "Replica 0" in orjson.loads(data)["error"]["message"]


async def test_reset_prefix_cache_succeeds_only_if_every_replica_did(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    status, data, _ = await call(client, "POST", rt.url + "/reset_prefix_cache")
    assert (status, orjson.loads(data)) == (200, {"success": True})
    assert all(any(r.path == "/reset_prefix_cache" for r in e.requests) for e in emus)


async def test_health_is_200_only_when_every_live_replica_is(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(3)
    rt = await router(emus)
    for path in ("/health", "/ping"):
        status, data, _ = await call(client, "GET", rt.url + path)
        assert (status, data) == (200, b"")
    emus[1].faults.dead = True
    status, data, _ = await call(client, "GET", rt.url + "/health")
    assert status == 503
    assert f"Replica 1 ({emus[1].url})" in orjson.loads(data)["error"]["message"]


async def test_models_lists_the_base_first_then_only_fenced_adapters(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(2)
    emus[1].faults.load_delay_s = 0.4
    rt = await router(emus, policy="round-robin")
    await load(client, rt.url, "v1", adapter("v1"))
    loading = asyncio.create_task(load(client, rt.url, "v2", adapter("v2")))
    await until(lambda: "v2" in emus[0].state.adapters)  # replica 1 does not have it yet
    for _ in range(2):  # whichever replica answers
        _, data, _ = await call(client, "GET", rt.url + "/v1/models")
        cards = orjson.loads(data)["data"]
        assert [c["id"] for c in cards] == [emus[0].config.model, "v1"]
        assert cards[0]["max_model_len"] == emus[0].config.max_model_len
    await loading
    _, data, _ = await call(client, "GET", rt.url + "/v1/models")
    assert [c["id"] for c in orjson.loads(data)["data"]][1:] == ["v1", "v2"]


async def test_server_info_comes_from_one_replica_as_one_server(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(3)
    rt = await router(emus)
    status, data, _ = await call(client, "GET", rt.url + "/server_info?config_format=json")
    assert status == 200
    config = orjson.loads(data)["vllm_config"]
    assert config["parallel_config"]["data_parallel_size"] == 1
    assert config["lora_config"]["max_loras"] == emus[0].config.max_loras


async def test_disagreeing_replicas_are_reported_at_start(
    emulators: StartEmulators, router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    emus = [*(await emulators(1, max_loras=6)), *(await emulators(1, max_loras=4))]
    emus += await emulators(1, block_size=32)
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        rt = await router(emus)
    text = caplog.text
    fix = "fix: start every replica with the same model and LoRA flags"
    max_loras = "the replicas disagree on max_loras: 6 on replica 0, replica 2; 4 on replica 1"
    block = "the replicas disagree on block size: 16 on replica 0, replica 1; 32 on replica 2"
    assert f"{max_loras}; {fix}" in text and f"{block}; {fix}" in text
    assert rt.route is not None and rt.route.block_size == 16  # no agreement: vLLM's default
    async with aiohttp.ClientSession() as client:
        _, data, _ = await call(client, "GET", rt.url + "/router/status")
    assert orjson.loads(data)["disagreements"] == [f"{max_loras}; {fix}", f"{block}; {fix}"]


async def test_replicas_serving_different_models_are_named_to_the_client_and_the_operator(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = [*(await emulators(1)), *(await emulators(1, model="meta-llama/Llama-3.2-1B"))]
    rt = await router(emus)
    base = emus[0].config.model
    status, body = await complete(client, rt.url, base)
    assert status == 404
    assert body["error"]["message"] == (
        f"The model `{base}` does not exist. Not every replica serves it as its base model: "
        "replica 1 (meta-llama/Llama-3.2-1B) lists another; fix: start every replica with the "
        "same model and LoRA flags."
    )
    status, data, _ = await call(client, "GET", rt.url + "/router/status")
    (disagreement,) = orjson.loads(data)["disagreements"]
    assert disagreement.startswith(
        f"the replicas disagree on base model: {base} on replica 0; "
        "meta-llama/Llama-3.2-1B on replica 1; fix: "
    )
    code, out, err = await run_top("--once", "--url", rt.url)
    assert code == 0, err
    assert "misconfigured: the replicas disagree on base model" in " ".join(out.split())
    status, body = await complete(client, rt.url, "no-such-model")  # vLLM's words, no more
    assert (status, body["error"]["message"]) == (404, "The model `no-such-model` does not exist.")


async def test_a_replica_back_with_other_settings_makes_the_disagreement_appear(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emus = await emulators(2)
    rt = await router(emus, health_interval=0.2, health_failures=1)
    assert (await load(client, rt.url, "trl-policy-v1", adapter("trl-policy-v1")))[0] == 200
    emus[1].config.max_lora_rank = 8  # restarted with another --max-lora-rank: replayed
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        await emus[1].restart()
        await until(lambda: "disagree on max_lora_rank" in caplog.text, 5.0)
    _, data, _ = await call(client, "GET", rt.url + "/router/status")
    (disagreement,) = orjson.loads(data)["disagreements"]
    assert disagreement.startswith("the replicas disagree on max_lora_rank: ")


async def test_block_size_is_read_from_the_replicas(
    emulators: StartEmulators, router: StartRouter
) -> None:
    emus = await emulators(2, block_size=32)
    rt = await router(emus)
    assert rt.route is not None and rt.route.block_size == 32


async def test_broadcasts_run_one_at_a_time_in_arrival_order(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(3)
    emus[0].faults.load_delay_s = 0.2
    rt = await router(emus)
    ops = [
        ("POST", "/v1/load_lora_adapter", {"lora_name": "v1", "lora_path": adapter("v1")}),
        ("POST", "/v1/unload_lora_adapter", {"lora_name": "v1"}),
        ("POST", "/v1/load_lora_adapter", {"lora_name": "v2", "lora_path": adapter("v2")}),
        ("POST", "/pause?mode=keep", None),
        ("POST", "/resume", None),
    ]
    tasks = []
    assert rt.broadcaster is not None
    broadcaster = rt.broadcaster
    for n, (method, path, body) in enumerate(ops, 1):
        tasks.append(asyncio.create_task(call(client, method, rt.url + path, body)))
        await until(lambda n=n: broadcaster.received == n)  # fixes the arrival order
    assert [(await t)[0] for t in tasks] == [200] * 5
    expected = ["/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/load_lora_adapter"]
    expected += ["/pause?mode=keep", "/resume"]
    for emu in emus:
        control = [r.path for r in emu.requests if r.method == "POST"]
        assert control == expected
        assert set(emu.state.adapters) == {"v2"}


async def test_a_client_that_leaves_mid_load_does_not_split_the_fleet(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(3)
    emus[1].faults.load_delay_s = 0.3
    rt = await router(emus)
    assert rt.fence is not None
    body = {"lora_name": "v1", "lora_path": adapter("v1")}
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.1):
            await call(client, "POST", rt.url + "/v1/load_lora_adapter", body)
    assert rt.broadcaster is not None
    broadcaster = rt.broadcaster
    await until(lambda: broadcaster.pending == 0)  # the load ran to its end without the client
    assert all("v1" in emu.state.adapters for emu in emus)
    assert (await complete(client, rt.url, "v1"))[0] == 200


async def test_broadcasts_their_clients_left_are_capped(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A client that asks for a broadcast and leaves: the broadcast still runs in its turn,
    # keeping its body until then, so behind a long load such clients must not pile up.
    monkeypatch.setattr(broadcast, "MAX_PENDING", 4)
    emus = await emulators(2)
    emus[0].faults.load_delay_s = 2.0
    rt = await router(emus)
    assert rt.broadcaster is not None and rt.server is not None
    broadcaster = rt.broadcaster
    loading = asyncio.create_task(load(client, rt.url, "v1", adapter("v1")))
    await until(broadcaster.lock.locked)
    host, port = rt.server.sockets[0].getsockname()[:2]
    for n in range(2, 5):  # up to the cap: each client gone once its pause is queued
        _, writer = await asyncio.open_connection(host, port)
        writer.write(b"POST /pause?mode=keep HTTP/1.1\r\nhost: r\r\ncontent-length: 0\r\n\r\n")
        await until(lambda n=n: broadcaster.pending == n)
        writer.close()
        await writer.wait_closed()
    async with asyncio.timeout(1):  # before: queued behind the load, answered after it
        status, body, headers = await call(client, "POST", rt.url + "/pause?mode=keep")
    assert status == 503, body
    assert "Retry-After" in headers and b"queued or running" in body
    assert broadcaster.pending == 4
    assert (await loading)[0] == 200
    await until(lambda: broadcaster.pending == 0)  # the pauses left behind ran in their turn
    assert all(e.requests[-1].path == "/pause?mode=keep" for e in emus)


async def test_reloading_a_live_name_in_place_is_refused(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    path = adapter("v1")
    await load(client, rt.url, "v1", path)
    body = {"lora_name": "v1", "lora_path": path, "load_inplace": True}
    status, data, _ = await call(client, "POST", rt.url + "/v1/load_lora_adapter", body)
    assert status == 400 and "in place" in orjson.loads(data)["error"]["message"]


async def test_malformed_load_requests_are_refused_like_vllm(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(1)
    rt = await router(emus)
    status, data, _ = await call(
        client, "POST", rt.url + "/v1/load_lora_adapter", {"lora_name": "v1"}
    )
    assert status == 400
    assert orjson.loads(data)["error"]["message"] == (
        "Both 'lora_name' and 'lora_path' must be provided."
    )
    assert not any(r.path == "/v1/load_lora_adapter" for r in emus[0].requests)


async def test_the_token_is_sent_to_the_replicas_only(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from lora_router.config import Secret

    token = "tok-5f1e2d9c"
    emus = await emulators(2, api_key=token)  # like vLLM --api-key: /v1/* needs the bearer
    emus[1].faults.load_failures = 1
    with caplog.at_level(logging.DEBUG, logger="lora_router"):
        rt = await router(emus, token=Secret(token), health_interval=0.05)
        answers = [await load(client, rt.url, "v1", adapter("v1"))]
        answers.append(await load(client, rt.url, "v1", adapter("v1")))
        await emus[0].crash()
        answers.append(await load(client, rt.url, "v2", adapter("v2")))
        _, data, _ = await call(client, "GET", rt.url + "/health")
        answers.append((0, data))
    assert [status for status, _ in answers[:3]] == [500, 200, 200]
    assert all(r.headers.get("authorization") == f"Bearer {token}" for r in emus[1].requests)
    assert token not in caplog.text
    assert all(token.encode() not in body for _, body in answers)
