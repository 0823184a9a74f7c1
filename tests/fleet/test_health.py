"""Fleet health end to end: replicas that die, restart empty, fail, stall, join and leave.

In every scenario every client request gets an answer, and (checked by `FenceMonitor`) no
request for an adapter reaches a replica without it once the router could know.
"""

from __future__ import annotations

import asyncio

import aiohttp
import orjson
import pytest
from emulated_fleet import FenceMonitor, StartEmulators, StartRouter, paths_of
from helpers import Adapter, call, complete, load, until

from lora_router.emulator import Emulator
from lora_router.fleet.replica import Replica
from lora_router.http.request import Request
from lora_router.proxy.dispatch import RouterApp
from lora_router.runtime import RouterRuntime


def loads_after(emu: Emulator, start: int) -> list[str]:
    """The adapter names of the loads `emu` received from its request `start` on, sorted."""
    bodies = [r.body for r in emu.requests[start:] if r.path == "/v1/load_lora_adapter"]
    return sorted(orjson.loads(b)["lora_name"] for b in bodies)


def completions_after(emu: Emulator, start: int) -> int:
    return sum(1 for r in emu.requests[start:] if r.path == "/v1/completions")


async def stream(
    client: aiohttp.ClientSession, url: str, prompt: list[int], frames: list[int]
) -> tuple[bytes, str]:
    """A streamed completion read to its end; returns what arrived and how it ended.
    `frames` gets the replica's id first, then one count per chunk received, for the test to
    see where it went and watch its progress."""
    body = {"prompt": prompt, "max_tokens": 40, "stream": True}
    received = b""
    try:
        async with client.post(url + "/v1/completions", json=body) as resp:
            frames.append(int(resp.headers["x-lora-router-replica"]))
            async for chunk in resp.content.iter_any():
                received += chunk
                frames.append(1)
    except aiohttp.ClientPayloadError:
        return received, "cut"
    return received, "done" if received.endswith(b"data: [DONE]\n\n") else "short"


async def test_a_replica_killed_mid_stream_cuts_only_its_own_stream(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    monitor: FenceMonitor,
) -> None:
    emus = await emulators(3, decode_s_per_token=0.01)
    rt = await router(emus, policy="round-robin")
    assert rt.fleet is not None
    progress: list[list[int]] = [[], [], []]
    streams = [asyncio.create_task(stream(client, rt.url, [i] * 40, progress[i])) for i in range(3)]
    await until(lambda: all(len(p) >= 3 for p in progress))
    # Round robin gave each stream its own replica, in the order their requests arrived.
    assert sorted(p[0] for p in progress) == [0, 1, 2]
    await emus[0].crash()
    results = [await t for t in streams]
    cut = [p[0] == 0 for p in progress]
    assert [how for _, how in results] == ["cut" if c else "done" for c in cut]
    assert all(b"data: " in received for received, _ in results)  # each started
    # The failure on real traffic ejected it at once (a failed probe of a suspect replica).
    fleet = rt.fleet
    await until(lambda: not fleet.replicas[0].live, timeout=1.0)
    statuses = [(await complete(client, rt.url, prompt=[i] * 40))[0] for i in range(6)]
    assert statuses == [200] * 6


async def test_a_stopped_replica_is_ejected_then_readmitted_with_every_adapter_first(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monitor: FenceMonitor,
) -> None:
    emus = await emulators(3)
    interval = 0.1
    rt = await router(emus, health_interval=interval, health_successes=2)
    assert rt.fleet is not None and rt.health is not None
    down = rt.fleet.replicas[1]
    await load(client, rt.url, "v1", adapter("v1"))
    loop = asyncio.get_running_loop()
    crashed_at = loop.time()
    await emus[1].crash()
    await until(lambda: not down.live, timeout=2.0)
    assert loop.time() - crashed_at <= 2 * interval + 0.1  # ejected within two intervals
    # Its keys spread over the survivors, and the fleet keeps loading without it.
    before = [len(e.requests) for e in emus]
    results = [await complete(client, rt.url, "v1", prompt=[i, i + 1] * 20) for i in range(12)]
    assert [s for s, _ in results] == [200] * 12
    assert completions_after(emus[0], before[0]) > 0 and completions_after(emus[2], before[2]) > 0
    assert (await load(client, rt.url, "v2", adapter("v2")))[0] == 200
    assert (await call(client, "POST", rt.url + "/pause?mode=keep"))[0] == 200
    # It comes back empty, as a restarted vLLM does: every live adapter and the pause state
    # are replayed before it is routable again.
    mark = len(emus[1].requests)
    await emus[1].restart()
    await until(lambda: down.live, timeout=3.0)
    assert emus[1].state.adapters == {"v1": adapter("v1"), "v2": adapter("v2")}
    assert emus[1].state.paused and emus[1].state.pause_mode == "keep"
    replayed = [r.path for r in emus[1].requests[mark:] if r.method == "POST"]
    assert sorted(replayed) == [
        "/pause?mode=keep",
        "/v1/load_lora_adapter",
        "/v1/load_lora_adapter",
    ]
    assert (await call(client, "POST", rt.url + "/resume"))[0] == 200
    served = [await complete(client, rt.url, "v2", prompt=[i] * 40) for i in range(12)]
    assert [s for s, _ in served] == [200] * 12
    assert completions_after(emus[1], mark) > 0
    assert monitor.violations == []
    assert rt.health.readmissions == 1


async def test_a_replica_that_restarted_between_checks_is_replayed_before_serving_again(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monitor: FenceMonitor,
) -> None:
    emus = await emulators(3)
    rt = await router(emus, policy="round-robin")  # no health checks: only traffic can tell
    assert rt.fleet is not None and rt.health is not None
    for name in ("v1", "v2"):
        await load(client, rt.url, name, adapter(name))
    await emus[2].restart()
    monitor.check_fleet = False  # the router cannot know yet
    # Requests keep working: the 404 of the emptied replica never reaches the client.
    statuses = [(await complete(client, rt.url, "v2", prompt=[i] * 40))[0] for i in range(9)]
    assert statuses == [200] * 9
    assert rt.health.restarts_detected == 1
    await until(lambda: rt.fleet is not None and rt.fleet.replicas[2].live, timeout=3.0)
    assert set(emus[2].state.adapters) == {"v1", "v2"}
    # Exactly one request met the emptied replica: the one that revealed the restart.
    assert len(monitor.violations) == 1
    monitor.violations.clear()
    monitor.check_fleet = True
    statuses = [(await complete(client, rt.url, "v1", prompt=[i] * 40))[0] for i in range(6)]
    assert statuses == [200] * 6
    assert monitor.violations == []


async def test_health_checks_notice_a_restart_before_any_request_does(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monitor: FenceMonitor,
) -> None:
    emus = await emulators(2)
    rt = await router(emus, health_interval=0.05)
    assert rt.health is not None
    await load(client, rt.url, "v1", adapter("v1"))
    await emus[0].restart()
    await until(lambda: rt.health is not None and rt.health.readmissions == 1, timeout=3.0)
    assert rt.health.restarts_detected == 1
    assert emus[0].state.adapters == {"v1": adapter("v1")}
    statuses = [(await complete(client, rt.url, "v1", prompt=[i] * 40))[0] for i in range(6)]
    assert statuses == [200] * 6
    assert monitor.violations == []


async def test_a_replica_answering_5xx_is_avoided_unseen_once_its_breaker_opens(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(3)
    rt = await router(emus, breaker_failures=3, breaker_cooldown=60.0)
    assert rt.fleet is not None
    prompt = list(range(64))
    _, _, headers = await call(client, "POST", rt.url + "/v1/completions", {"prompt": prompt})
    home = int(headers["x-lora-router-replica"])
    emus[home].faults.error_rate = 1.0
    mark = len(emus[home].requests)
    statuses = [(await complete(client, rt.url, prompt=prompt))[0] for _ in range(10)]
    # The hash policy keeps sending this prompt home until the breaker opens, never after;
    # each of those 500s was held back and retried elsewhere, so the client saw none.
    assert statuses == [200] * 10
    assert completions_after(emus[home], mark) == 3
    assert rt.fleet.replicas[home].breaker.state == "open"
    assert rt.fleet.replicas[home].live  # /health still passes: not ejected, just avoided


async def test_a_refused_connection_is_retried_on_the_next_replica(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(3)
    rt = await router(emus, policy="round-robin")
    assert rt.fleet is not None
    await emus[0].crash()  # the router does not know yet: no health checks in this test
    statuses = [(await complete(client, rt.url, prompt=[i] * 40))[0] for i in range(6)]
    assert statuses == [200] * 6
    await until(lambda: rt.fleet is not None and not rt.fleet.replicas[0].live, timeout=1.0)


async def test_requests_after_a_replica_dropped_its_connections_succeed(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(1)
    rt = await router(emus)
    assert (await complete(client, rt.url))[0] == 200  # leaves a pooled keep-alive connection
    await emus[0].restart()  # closes every connection, the pooled one included
    assert (await complete(client, rt.url))[0] == 200


async def test_a_stalled_replica_times_out_without_a_retry(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(emus, policy="round-robin", first_byte_timeout=0.2)
    assert rt.fleet is not None
    emus[0].faults.stall = True
    try:
        status, body = await complete(client, rt.url)
        assert status == 504
        assert f"Replica 0 ({emus[0].url})" in body["error"]["message"]
        # A timeout is not retried elsewhere: the replica may still be working on it.
        assert completions_after(emus[1], 0) == 0
        assert rt.fleet.replicas[0].breaker.failures == 1
    finally:
        emus[0].faults.stall = False


async def test_down_replica_policy_fail_refuses_loads_while_a_replica_is_out(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(3)
    rt = await router(emus, down_replica_policy="fail", health_interval=0.05)
    assert rt.fleet is not None
    await emus[1].crash()
    await until(lambda: rt.fleet is not None and not rt.fleet.replicas[1].live)
    status, data = await load(client, rt.url, "v1", adapter("v1"))
    assert status == 503
    message = orjson.loads(data)["error"]["message"]
    assert f"Replica 1 ({emus[1].url})" in message and "--down-replica-policy" in message
    assert all("v1" not in e.state.adapters for e in (emus[0], emus[2]))


async def load_with_replica_2_down(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> tuple[list[Emulator], RouterRuntime]:
    """Three replicas; the third is down, unnoticed, when v1 is loaded (answered 200)."""
    emus = await emulators(3)
    rt = await router(emus, health_interval=0.05)
    await emus[2].crash()  # the next load finds out before any health check does
    assert (await load(client, rt.url, "v1", adapter("v1")))[0] == 200
    return emus, rt


async def test_a_replica_unreachable_during_a_load_is_ejected(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    _, rt = await load_with_replica_2_down(emulators, router, client, adapter)
    assert rt.fleet is not None
    assert not rt.fleet.replicas[2].live
    assert (await complete(client, rt.url, "v1"))[0] == 200


async def test_a_replica_unreachable_during_a_load_gets_it_on_return(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monitor: FenceMonitor,
) -> None:
    emus, rt = await load_with_replica_2_down(emulators, router, client, adapter)
    await emus[2].restart()
    await until(lambda: rt.fleet is not None and rt.fleet.replicas[2].live, timeout=3.0)
    assert emus[2].state.adapters == {"v1": adapter("v1")}
    assert monitor.violations == []


async def test_an_added_replica_is_replayed_then_serves(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(2)
    extra = (await emulators(1))[0]
    extra.faults.mount_lag = 2  # the new machine's mount is behind too
    rt = await router(emus, replica_hosts=("127.0.0.1",))
    assert rt.app is not None and rt.fleet is not None
    for name in ("v1", "v2"):
        await load(client, rt.url, name, adapter(name))
    await call(client, "POST", rt.url + "/pause?mode=keep")
    status, data, _ = await call(client, "POST", rt.url + "/router/replicas", {"url": extra.url})
    assert status == 200
    added = orjson.loads(data)
    assert added["id"] == 2 and added["admitted"] is True
    assert added["adapters"] == ["v1", "v2"]
    assert extra.state.adapters == {"v1": adapter("v1"), "v2": adapter("v2")}
    assert extra.state.paused
    await call(client, "POST", rt.url + "/resume")
    statuses = [(await complete(client, rt.url, "v2", prompt=[i] * 40))[0] for i in range(12)]
    assert statuses == [200] * 12
    assert extra.url in rt.app.policy.ring.names  # type: ignore[attr-defined]
    assert completions_after(extra, 0) > 0
    # The same replica twice, or a URL that is not one, is refused.
    assert (await call(client, "POST", rt.url + "/router/replicas", {"url": extra.url}))[0] == 409
    assert (await call(client, "POST", rt.url + "/router/replicas", {"url": "ftp://x"}))[0] == 400


async def test_an_added_replica_that_does_not_answer_stays_out_of_service(
    router: StartRouter, emulators: StartEmulators, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(1)
    rt = await router(emus, replica_hosts=("127.0.0.1",))
    gone = (await emulators(1))[0]
    await gone.crash()
    status, data, _ = await call(client, "POST", rt.url + "/router/replicas", {"url": gone.url})
    assert status == 202
    assert orjson.loads(data)["admitted"] is False
    statuses = [(await complete(client, rt.url, prompt=[i] * 40))[0] for i in range(4)]
    assert statuses == [200] * 4


async def test_a_removed_replica_drains_before_it_leaves(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(3, decode_s_per_token=0.01)
    rt = await router(emus, policy="round-robin")
    assert rt.app is not None and rt.fleet is not None
    long = [
        asyncio.create_task(complete(client, rt.url, prompt=[i] * 40, max_tokens=30))
        for i in range(3)
    ]
    await until(lambda: emus[1].state.num_running == 1)
    status, data, _ = await call(client, "DELETE", rt.url + "/router/replicas/1")
    assert status == 200 and orjson.loads(data)["drained"] is True
    assert [(await t)[0] for t in long] == [200] * 3
    assert [r.rid for r in rt.fleet.replicas] == [0, 2]
    mark = len(emus[1].requests)
    statuses = [(await complete(client, rt.url, prompt=[i] * 40))[0] for i in range(6)]
    assert statuses == [200] * 6
    assert len(emus[1].requests) == mark
    assert (await call(client, "DELETE", rt.url + "/router/replicas/1"))[0] == 404


async def test_membership_changes_from_beyond_loopback_are_refused_without_an_api_key(
    emulators: StartEmulators, router: StartRouter
) -> None:
    emus = await emulators(1)
    rt = await router(emus)
    assert rt.app is not None
    app: RouterApp = rt.app
    request = Request(
        method=b"POST",
        target=b"/router/replicas",
        path=b"/router/replicas",
        query=b"",
        headers=[],
        body=b'{"url": "http://10.0.0.9:8000"}',
        keep_alive=True,
        http11=True,
        client_ip=b"10.1.2.3",
    )
    with pytest.raises(Exception) as err:
        app._admin_allowed(request)
    assert getattr(err.value, "status", None) == 403


async def test_membership_routes_need_the_api_key_when_the_router_has_one(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    from lora_router.config import Secret

    emus = await emulators(1)
    rt = await router(emus, api_key=Secret("sesame"))
    status, _, _ = await call(client, "GET", rt.url + "/router/replicas")
    assert status == 401
    async with client.get(
        rt.url + "/router/replicas", headers={"Authorization": "Bearer sesame"}
    ) as resp:
        assert resp.status == 200
        assert [r["url"] for r in (await resp.json())["replicas"]] == [emus[0].url]


async def test_replayed_loads_use_the_trainers_own_request(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(2)
    rt = await router(emus, health_interval=0.05)
    assert rt.fleet is not None
    await load(client, rt.url, "v1", adapter("v1"))
    await emus[1].crash()
    await until(lambda: rt.fleet is not None and not rt.fleet.replicas[1].live)
    await emus[1].restart()
    await until(lambda: rt.fleet is not None and rt.fleet.replicas[1].live, timeout=3.0)
    sent = [r.body for r in emus[1].requests if r.path == "/v1/load_lora_adapter"]
    assert orjson.loads(sent[-1]) == {
        "lora_name": "v1",
        "lora_path": adapter("v1"),
        "load_inplace": False,
    }
    assert paths_of(emus[0], "/v1/load_lora_adapter") == ["v1"]


async def sync_v2_during_a_replay(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> tuple[list[Emulator], RouterRuntime, int]:
    """Two replicas with loads of 0.3 s; the second comes back and its replay is loading v1
    when the trainer pauses and loads v2 (not yet resumed). Returns the replicas, the router
    and the index of the second replica's first request after its restart."""
    emus = await emulators(2)
    for emu in emus:
        emu.faults.load_delay_s = 0.3
    rt = await router(emus, health_interval=0.05, health_successes=1)
    assert rt.fleet is not None
    back = rt.fleet.replicas[1]
    assert (await load(client, rt.url, "v1", adapter("v1")))[0] == 200
    await emus[1].crash()
    await until(lambda: not back.live, timeout=2.0)
    mark = len(emus[1].requests)
    await emus[1].restart()
    # The replay has started loading v1 when the trainer syncs v2.
    await until(lambda: any(r.path == "/v1/load_lora_adapter" for r in emus[1].requests[mark:]))
    assert (await call(client, "POST", rt.url + "/pause?mode=keep"))[0] == 200
    assert (await load(client, rt.url, "v2", adapter("v2")))[0] == 200
    return emus, rt, mark


async def test_a_load_during_a_replay_never_delays_resume(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    _, rt, _ = await sync_v2_during_a_replay(emulators, router, client, adapter)
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert (await call(client, "POST", rt.url + "/resume"))[0] == 200
    # v2 rode along with the broadcast, so the replay's final pass (which the resume queues
    # behind) had no load of 0.3 s left to do.
    assert loop.time() - started < 0.15


async def test_a_load_during_a_replay_reaches_the_replaying_replica_once(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monitor: FenceMonitor,
) -> None:
    emus, rt, mark = await sync_v2_during_a_replay(emulators, router, client, adapter)
    assert (await call(client, "POST", rt.url + "/resume"))[0] == 200
    assert rt.fleet is not None
    back = rt.fleet.replicas[1]
    await until(lambda: back.live, timeout=3.0)
    loads = [r.body for r in emus[1].requests[mark:] if r.path == "/v1/load_lora_adapter"]
    assert len(loads) == 2  # v1 by the replay, v2 by the broadcast: each once
    assert emus[1].state.adapters == {"v1": adapter("v1"), "v2": adapter("v2")}
    assert monitor.violations == []


async def _back_while_v2_is_broadcast(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
) -> tuple[list[Emulator], Replica, asyncio.Task[tuple[int, bytes]], int]:
    """v1 live on two replicas; replica 1 crashes, and comes back while the load of v2 is
    being broadcast to replica 0 alone (so it is not one of that broadcast's riders). Replica 0
    does not see v2's files (mount lag), so the broadcast keeps resending it until the test
    lifts `mount_lag`: no fixed delay could promise the overlap. Returns the replicas, replica
    1 as the router sees it, the load's task, and where replica 1's requests after its
    restart begin, once its replay has sent it v2."""
    emus = await emulators(2)
    rt = await router(emus, health_interval=0.05, health_successes=1)
    assert rt.fleet is not None
    back = rt.fleet.replicas[1]
    assert (await load(client, rt.url, "v1", adapter("v1")))[0] == 200
    await emus[1].crash()
    await until(lambda: not back.live, timeout=2.0)
    emus[0].faults.mount_lag = 1_000_000
    loading = asyncio.create_task(load(client, rt.url, "v2", adapter("v2")))
    await until(lambda: "v2" in paths_of(emus[0], "/v1/load_lora_adapter"))
    mark = len(emus[1].requests)
    await emus[1].restart()
    await until(lambda: "v2" in loads_after(emus[1], mark))
    return emus, back, loading, mark


async def test_a_replica_back_during_a_broadcast_loads_that_version_in_its_first_replay_round(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monitor: FenceMonitor,
) -> None:
    emus, back, loading, mark = await _back_while_v2_is_broadcast(
        emulators, router, client, adapter
    )
    emus[0].faults.mount_lag = 0
    assert (await loading)[0] == 200
    # Its replay's first round, outside the broadcast lock, took v2 along with v1 (before,
    # the final pass loaded v2 only once the broadcast had released the lock), and the final
    # pass had nothing left to load.
    await until(lambda: back.live, timeout=3.0)
    assert loads_after(emus[1], mark) == ["v1", "v2"]
    assert emus[1].state.adapters == {"v1": adapter("v1"), "v2": adapter("v2")}
    assert monitor.violations == []


async def test_a_version_whose_broadcast_fails_is_unloaded_from_a_replica_that_took_it_early(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monitor: FenceMonitor,
) -> None:
    emus, back, loading, _ = await _back_while_v2_is_broadcast(emulators, router, client, adapter)
    emus[0].faults.load_failures = 1  # the serving replica refuses v2: all or nothing
    emus[0].faults.mount_lag = 0
    assert (await loading)[0] != 200
    await until(lambda: back.live, timeout=3.0)
    assert emus[1].state.adapters == {"v1": adapter("v1")}  # given back before serving
    assert "v2" not in back.adapters
    assert monitor.violations == []
