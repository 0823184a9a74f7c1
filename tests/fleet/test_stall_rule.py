"""The stall rule (fleet/health.py): a serving replica whose engine hangs while its `/health`
answers is ejected once its `/metrics` show no token computed for `--stall-timeout` while the
router holds requests on it, its waiting requests retried on the others; it is replayed only
once it answers a one-token completion; and a fleet paused by the trainer is never stalled.
A stream under way on a replica that hangs whole (ejected by its health checks, not the stall
rule) ends once silent for `--stall-timeout` (http/upstream.py's withdrawal rule). Emulated
replicas over loopback sockets."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import call, complete, router_status, until

# Scrapes and checks every 50 ms: a stall of 0.5 s is about ten unmoved scrapes.
FAST_STALL = dict(health_interval=0.05, stall_timeout=0.5, control_timeout=0.5)


async def test_a_replica_whose_engine_hangs_is_ejected_and_its_requests_answered_elsewhere(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(emus, policy="round-robin", **FAST_STALL)
    assert rt.fleet is not None
    hung = rt.fleet.replicas[0]
    emus[0].faults.stall = True  # completions wait; /health and /metrics answer
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        answers = await asyncio.wait_for(
            asyncio.gather(*(complete(client, rt.url, prompt=[i] * 40) for i in range(6))),
            timeout=10.0,  # the default --first-byte-timeout would hold them 1,800 s
        )
        assert [status for status, _ in answers] == [200] * 6
        assert (
            sum(r.path == "/v1/completions" for r in emus[1].requests) == 6
        )  # replica 0's three, retried there
        assert not hung.live and "stalled: it computed no token for" in hung.life.last_error
        took = loop.time() - started
        assert took >= 0.5  # not before the stall timeout

        # While its engine still hangs, the one-token completion it must answer times out:
        # it stays out, saying why, and new requests go to replica 1.
        await until(lambda: "a one-token completion got" in hung.life.last_error, timeout=5.0)
        assert not hung.live
        assert (await complete(client, rt.url))[0] == 200
        status = await router_status(client, rt.url)
        assert status["health"]["stalls_detected"] == 1
        _, page, _ = await call(client, "GET", rt.url + "/metrics")
        assert f'lora_router_replica_stalls_total{{replica="{hung.rid}"}} 1.0' in page.decode()
    finally:
        emus[0].faults.stall = False
    # Its engine moves again: it answers the probe, is replayed and serves.
    await until(lambda: hung.live, timeout=5.0)
    assert rt.fleet.replicas[1].live
    # Removed for good, its series leaves /metrics; the total keeps its stall.
    assert (await call(client, "DELETE", rt.url + f"/router/replicas/{hung.rid}"))[0] == 200
    assert (await router_status(client, rt.url))["health"]["stalls_detected"] == 1
    _, page, _ = await call(client, "GET", rt.url + "/metrics")
    assert "lora_router_replica_stalls_total{" + f'replica="{hung.rid}"' not in page.decode()


async def test_a_fleet_paused_by_the_trainer_is_never_stalled(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    # Requests in flight when the trainer pauses wait on their replica, which computes
    # nothing meanwhile: that is no stall, however long the pause.
    emus = await emulators(1, decode_s_per_token=0.02)
    rt = await router(emus, **FAST_STALL)
    assert rt.fleet is not None
    replica = rt.fleet.replicas[0]
    held = asyncio.create_task(complete(client, rt.url, max_tokens=40, ignore_eos=True))
    await until(lambda: emus[0].state.counters.generated_tokens > 0, timeout=5.0)
    # TRL's pause: requests in flight freeze on their replica until the resume.
    assert (await call(client, "POST", rt.url + "/pause?mode=keep"))[0] == 200
    deadline = asyncio.get_running_loop().time() + 4 * FAST_STALL["stall_timeout"]
    while asyncio.get_running_loop().time() < deadline:
        assert replica.live, replica.life.last_error
        await asyncio.sleep(0.05)  # scrapes come every 50 ms: no event to await
    assert (await call(client, "POST", rt.url + "/resume"))[0] == 200
    status, body = await asyncio.wait_for(held, timeout=10.0)
    assert status == 200 and body["choices"][0]["finish_reason"] == "length", body
    assert replica.live
    assert (await router_status(client, rt.url))["health"]["stalls_detected"] == 0


# A host frozen or cut off: every route hangs, /metrics too, so the stall rule cannot judge it
# and its health checks eject it (in about 0.5 s here), before its stream's silence ends it.
HOST_HANGS = dict(health_interval=0.05, health_timeout=0.2, stall_timeout=1.0, control_timeout=0.5)


@pytest.mark.parametrize(
    ("host_hangs", "settings"),
    [(False, FAST_STALL), (True, HOST_HANGS)],
    ids=["engine-hangs", "host-hangs"],
)
async def test_a_stream_under_way_on_a_replica_that_hangs_is_cut_after_stall_timeout(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    host_hangs: bool,
    settings: dict[str, float],
) -> None:
    # A stream whose first tokens reached the client when its replica froze would otherwise
    # wait out --idle-timeout (30 minutes by default: 60 s here). Its engine hung, it ends at
    # the stall; its whole host hung, it ends once silent for --stall-timeout after its health
    # checks ejected the replica (http/upstream.py's withdrawal rule).
    emus = await emulators(2, decode_s_per_token=0.02)
    rt = await router(emus, policy="round-robin", idle_timeout=60.0, **settings)
    assert rt.fleet is not None
    body = {"prompt": [7] * 40, "max_tokens": 400, "ignore_eos": True, "stream": True}
    loop = asyncio.get_running_loop()
    async with client.post(rt.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
        rid = int(resp.headers["x-lora-router-replica"])
        (stuck,) = [r for r in rt.fleet.replicas if r.rid == rid]
        emu = emus[rt.fleet.replicas.index(stuck)]
        assert (await resp.content.readline()).startswith(b"data: ")  # tokens came
        # The engine freezes mid-stream (a keep-mode pause the router did not ask for: no
        # step runs, /health and /metrics still answer, as of an engine hung in a kernel).
        assert (await call(client, "POST", emu.url + "/pause?mode=keep"))[0] == 200
        if host_hangs:
            emu.faults.hang = "/"  # and nothing more answers: not /health, not /metrics
        frozen = loop.time()
        try:
            with pytest.raises(aiohttp.ClientPayloadError):
                async with asyncio.timeout(10.0):
                    while await resp.content.readline():
                        pass
            took = loop.time() - frozen
            assert not stuck.live
            assert ("stalled" in stuck.life.last_error) is not host_hangs
        finally:
            emu.faults.hang = None
    # Not before the bound: from the freeze, or from the last byte, which came just before it.
    assert took >= settings["stall_timeout"] - 0.1
    status = await router_status(client, rt.url)
    (mine,) = [r for r in status["replicas"] if r["id"] == rid]
    assert mine["cut_streams"] == 1
    # The other replica serves meanwhile, and the frozen one returns once its engine moves.
    assert (await complete(client, rt.url))[0] == 200
    assert (await call(client, "POST", emu.url + "/resume"))[0] == 200
    await until(lambda: stuck.live, timeout=5.0)
