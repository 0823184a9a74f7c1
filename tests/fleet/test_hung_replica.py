"""A replica that hangs instead of dying: every broadcast still ends in bounded time.

A hung replica accepts connections and never answers: a process stopped with SIGSTOP (here, an
emulator started as its own process and really stopped), or an engine wedged in the middle of
a sync (the emulator's `hang` switch, for a hang that must start at one precise request). The
rule under test is broadcast.py's "every broadcast ends in bounded time": the trainer gets an
answer, the hung replica is ejected, and the broadcast lock is never held past its deadline.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from emulated_fleet import FAST, StartEmulators, StartRouter, paths_of
from helpers import Adapter, call, complete, load, router_status, unload, until

from lora_router.fleet.broadcast import SLOW_ANSWER_S
from lora_router.fleet.lifecycle import State
from lora_router.runtime import RouterRuntime
from lora_router.tools.top import verdict

# A broadcast with a hung replica must be answered within the bound under test plus this much
# (the machine is shared: scheduling noise, never a second deadline).
SLACK = 3.0


class Stoppable:
    """An emulator in its own process, which SIGSTOP really stops."""

    def __init__(self, proc: asyncio.subprocess.Process, url: str) -> None:
        self.proc = proc
        self.url = url

    def stop(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)


@pytest.fixture
async def stoppable() -> AsyncIterator[Callable[[], Awaitable[Stoppable]]]:
    started: list[Stoppable] = []

    async def start() -> Stoppable:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "lora_router.emulator",
            "--port",
            "0",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            line = (await proc.stdout.readline()).decode()
        found = re.search(r"on (http://\S+)", line)
        assert found, line
        replica = Stoppable(proc, found.group(1))
        started.append(replica)
        return replica

    yield start
    for replica in started:
        replica.cont()
        replica.proc.terminate()
        async with asyncio.timeout(10):
            await replica.proc.wait()


async def timed(work: Awaitable[tuple[int, bytes]], bound: float) -> tuple[int, bytes, float]:
    """`work`'s status and body, and the seconds it took; fails past `bound` + SLACK."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    async with asyncio.timeout(bound + SLACK):
        status, body = await work
    return status, body, loop.time() - started


async def post(client: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    status, body, _ = await call(client, "POST", url)
    return status, body


def state_of(rt: RouterRuntime, url: str) -> State:
    assert rt.fleet is not None
    return next(r.state for r in rt.fleet.replicas if r.name == url)


async def test_a_pause_is_answered_within_the_control_timeout_when_a_replica_is_stopped(
    emulators: StartEmulators,
    router: StartRouter,
    stoppable: Callable[[], Awaitable[Stoppable]],
    client: aiohttp.ClientSession,
) -> None:
    (emu,) = await emulators(1)
    frozen = await stoppable()
    rt = await router([emu, frozen.url], control_timeout=1.0)
    frozen.stop()
    status, _, _ = await timed(post(client, rt.url + "/pause?mode=keep"), 1.0)
    # The broadcast completes on the rest; the stopped replica is out until it answers again.
    assert status == 200
    assert emu.state.paused
    assert state_of(rt, frozen.url) is State.EJECTED
    status, _, seconds = await timed(post(client, rt.url + "/resume"), 1.0)
    assert status == 200 and not emu.state.paused
    assert seconds < 1.0  # the ejected replica is no longer waited for


async def test_a_load_is_answered_by_its_deadline_when_a_replica_is_stopped(
    emulators: StartEmulators,
    router: StartRouter,
    stoppable: Callable[[], Awaitable[Stoppable]],
    client: aiohttp.ClientSession,
    adapter: Adapter,
) -> None:
    (emu,) = await emulators(1)
    frozen = await stoppable()
    rt = await router([emu, frozen.url], load_deadline=2.0, control_timeout=30.0)
    frozen.stop()
    status, body, _ = await timed(load(client, rt.url, "trl-policy-v1", adapter("v1")), 2.0)
    assert status == 200, body  # --down-replica-policy replay: loaded on the rest
    assert "trl-policy-v1" in emu.state.adapters
    assert state_of(rt, frozen.url) is State.EJECTED


async def test_a_rollback_that_meets_a_stopped_replica_still_answers(
    emulators: StartEmulators,
    router: StartRouter,
    stoppable: Callable[[], Awaitable[Stoppable]],
    client: aiohttp.ClientSession,
    adapter: Adapter,
) -> None:
    (failing,) = await emulators(1)
    failing.faults.load_delay_s = 0.5
    failing.faults.load_failures = 1
    frozen = await stoppable()
    rt = await router([failing, frozen.url], control_timeout=1.0)

    async def stop_once_loaded() -> None:
        async def holds() -> bool:
            _, data, _ = await call(client, "GET", frozen.url + "/v1/models")
            return b"trl-policy-v1" in data

        async with asyncio.timeout(5):
            while not await holds():
                await asyncio.sleep(0.01)
        frozen.stop()  # it took the load; the rollback will find it stopped

    stopper = asyncio.create_task(stop_once_loaded())
    status, body, _ = await timed(load(client, rt.url, "trl-policy-v1", adapter("v1")), 1.5)
    await stopper
    assert status == 500, body  # the first replica's own failure, named
    assert b"Replica 0" in body
    assert "trl-policy-v1" not in failing.state.adapters
    # It may still hold the name: out of service until a replay makes it mirror the fleet.
    assert state_of(rt, frozen.url) is State.EJECTED


async def test_a_replay_that_hangs_under_the_lock_never_holds_the_trainers_next_call(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(emus, control_timeout=1.0, health_interval=0.05)
    assert (await post(client, rt.url + "/pause?mode=keep"))[0] == 200
    # Replica 1 dies, is ejected, and comes back wedged: its replay's last step, the fleet's
    # pause replayed under the broadcast lock, gets no answer.
    emus[1].faults.dead = True
    await until(lambda: state_of(rt, emus[1].url) is State.EJECTED)
    emus[1].faults.hang = "/pause"
    emus[1].faults.dead = False
    pauses = len([r for r in emus[1].requests if r.path.startswith("/pause")])
    await until(lambda: len([r for r in emus[1].requests if r.path.startswith("/pause")]) > pauses)
    # The trainer's resume queues behind the replay's final pass, which ends at the deadline.
    status, _, _ = await timed(post(client, rt.url + "/resume"), 1.0)
    assert status == 200
    assert not emus[0].state.paused
    assert state_of(rt, emus[1].url) is not State.SERVING
    emus[1].faults.hang = None


@pytest.mark.parametrize("op", ["pause", "load", "unload"])
async def test_a_broadcast_stops_waiting_for_a_replica_its_health_checks_eject(
    op: str,
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
) -> None:
    emus = await emulators(2)
    rt = await router(
        emus, control_timeout=30.0, load_deadline=60.0, health_interval=0.05, health_timeout=0.2
    )
    if op == "unload":
        assert (await load(client, rt.url, "trl-policy-v1", adapter("v1")))[0] == 200
    emus[1].faults.hang = "/"  # /health too: its checks eject it within a second
    work = {
        "pause": lambda: post(client, rt.url + "/pause?mode=keep"),
        "load": lambda: load(client, rt.url, "trl-policy-v1", adapter("v1")),
        "unload": lambda: unload(client, rt.url, "trl-policy-v1"),
    }[op]()
    # Answered once the health checks eject it, not at --control-timeout (30 s).
    status, body, _ = await timed(work, 1.0)
    assert status == 200, body
    assert state_of(rt, emus[1].url) is State.EJECTED
    assert rt.fleet is not None
    # It keeps the reason its health checks gave, not a second one from the broadcast.
    assert "unreachable" not in rt.fleet.replicas[1].life.last_error
    emus[1].faults.hang = None


async def test_a_load_never_waits_for_a_replica_that_replays(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
) -> None:
    (emu, joiner) = await emulators(2)
    rt = await router([emu], control_timeout=30.0, load_deadline=60.0, replica_hosts=("127.0.0.1",))
    assert (await load(client, rt.url, "trl-policy-v0", adapter("v0")))[0] == 200
    joiner.faults.hang = "/v1/load_lora_adapter"  # its replay waits on its first load
    joining = asyncio.create_task(
        call(client, "POST", rt.url + "/router/replicas", {"url": joiner.url})
    )
    await until(lambda: "trl-policy-v0" in paths_of(joiner, "/v1/load_lora_adapter"))
    assert state_of(rt, joiner.url) is State.REPLAYING
    # The trainer's load rides along to the replaying replica and is answered without it.
    status, body, _ = await timed(load(client, rt.url, "trl-policy-v1", adapter("v1")), 1.0)
    assert status == 200, body
    await until(lambda: "trl-policy-v1" in paths_of(joiner, "/v1/load_lora_adapter"))
    joiner.faults.hang = None
    async with asyncio.timeout(10):
        await joining
    # Its replay kept what rode to it: admitted with both, v1 sent to it once.
    assert state_of(rt, joiner.url) is State.SERVING
    assert {"trl-policy-v0", "trl-policy-v1"} <= set(joiner.state.adapters)
    assert paths_of(joiner, "/v1/load_lora_adapter").count("trl-policy-v1") == 1


async def test_a_replay_that_hangs_on_the_pause_state_never_holds_a_broadcast_and_backs_off(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(emus, control_timeout=3.0, health_interval=0.05)
    assert (await post(client, rt.url + "/pause?mode=keep"))[0] == 200
    # Replica 1 dies, is ejected, and comes back with /pause hung and /health fine.
    emus[1].faults.dead = True
    await until(lambda: state_of(rt, emus[1].url) is State.EJECTED)
    emus[1].faults.hang = "/pause"
    pauses = len([r for r in emus[1].requests if r.path.startswith("/pause")])
    emus[1].faults.dead = False
    await until(lambda: len([r for r in emus[1].requests if r.path.startswith("/pause")]) > pauses)
    # Its replay waits for that /pause outside the broadcast lock: the trainer does not.
    status, _, seconds = await timed(post(client, rt.url + "/resume"), 3.0)
    assert status == 200 and not emus[0].state.paused
    assert seconds < 1.0
    # Its replay fails for want of an answer, says so, and backs off before the next.
    await until(lambda: state_of(rt, emus[1].url) is State.BACKING_OFF)
    assert rt.fleet is not None
    life = rt.fleet.replicas[1].life
    assert "/pause" in life.last_error and "no answer within 3 s" in life.last_error
    assert life.readmit_at > asyncio.get_running_loop().time()
    emus[1].faults.hang = None


async def test_a_replica_that_hangs_a_broadcast_is_named_while_it_waits(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emus = await emulators(2)
    rt = await router(emus, control_timeout=30.0)
    assert rt.broadcaster is not None
    emus[1].faults.hang = "/pause"  # its /health answers: nothing ejects it before 30 s
    pausing = asyncio.create_task(post(client, rt.url + "/pause?mode=keep"))
    waited = rt.broadcaster.waiting_for
    await until(lambda: bool(waited()), timeout=SLOW_ANSWER_S + 3)
    doc = await router_status(client, rt.url)
    assert [(w["replica"], w["call"]) for w in doc["broadcasts"]["waiting_for"]] == [(1, "/pause")]
    assert verdict(doc).startswith("syncing: /pause waits for replica 1, which has not answered")
    # A call queued behind it says why it waits.
    resuming = asyncio.create_task(post(client, rt.url + "/resume"))
    await until(lambda: "has not answered /pause" in caplog.text)
    assert f"/resume waits: Replica 1 ({emus[1].url})" in caplog.text
    emus[1].faults.hang = None
    async with asyncio.timeout(5):
        assert (await pausing)[0] == 200
        assert (await resuming)[0] == 200
    assert rt.broadcaster.waiting_for() == []


async def test_a_final_pass_reapplies_a_changed_pause_within_the_health_timeout(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    emus = await emulators(2)
    rt = await router(emus, control_timeout=30.0, health_interval=0.05, health_timeout=0.5)
    assert rt.health is not None and rt.fleet is not None
    replay, back = rt.health.replay, rt.fleet.replicas[1]
    assert (await post(client, rt.url + "/pause?mode=keep"))[0] == 200
    # Replica 1 comes back; its replay is held once it has applied the pause outside the lock.
    applied, go_on = asyncio.Event(), asyncio.Event()
    settle = replay.loads.settle

    async def held(replica: Any) -> Any:
        if replica is back and not go_on.is_set():
            applied.set()
            await go_on.wait()
        return await settle(replica)

    monkeypatch.setattr(replay.loads, "settle", held)
    emus[1].faults.dead = True
    await until(lambda: state_of(rt, emus[1].url) is State.EJECTED)
    emus[1].faults.dead = False
    async with asyncio.timeout(5):
        await applied.wait()
    # Meanwhile the trainer resumes, and replica 1 hangs /resume: its final pass must apply it.
    assert (await post(client, rt.url + "/resume"))[0] == 200
    emus[1].faults.hang = "/resume"
    go_on.set()
    await until(lambda: replay.holding is not None)
    # The trainer's next call waits for that final pass within --health-timeout, not 30 s.
    status, _, seconds = await timed(post(client, rt.url + "/pause?mode=keep"), 0.5)
    assert status == 200 and seconds < 2.0
    await until(lambda: state_of(rt, emus[1].url) is State.BACKING_OFF)
    assert "/resume" in back.life.last_error and "held the broadcast lock" in back.life.last_error
    emus[1].faults.hang = None


async def test_stopping_during_a_load_rolls_it_back(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(2)
    emus[1].faults.mount_lag = 1_000_000  # never sees the files: the load waits
    rt = await router(emus, load_deadline=60.0)
    try:
        loading = asyncio.create_task(load(client, rt.url, "trl-policy-v1", adapter("v1")))
        await until(lambda: "trl-policy-v1" in emus[0].state.adapters)
        await until(lambda: rt.broadcaster is not None and bool(rt.broadcaster.loads.mount_waits))
    finally:
        async with asyncio.timeout(FAST["load_deadline"] + SLACK):
            await rt.stop(grace=0.0)
    # SIGTERM's path: the load is abandoned and rolled back, not cancelled half done.
    assert "trl-policy-v1" not in emus[0].state.adapters
    with pytest.raises(aiohttp.ClientError):
        await loading


async def test_requests_waiting_on_a_replica_that_hangs_are_retried_once_it_is_ejected(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(
        emus,
        policy="round-robin",
        first_byte_timeout=60.0,
        health_interval=0.1,
        health_timeout=0.5,
        health_failures=2,
    )
    assert rt.fleet is not None
    hung = rt.fleet.replicas[1]
    emus[1].faults.hang = "/"  # accepts, answers nothing, /health included
    try:
        # Round robin: half of them go to the hung replica and wait there for a first byte.
        work = [
            asyncio.create_task(complete(client, rt.url, prompt=[i + 1] * 20)) for i in range(4)
        ]
        await until(lambda: hung.in_flight == 2)
        # Ejected by its health checks within a second or so; the requests on it are then
        # retried on replica 0 at once, not after --first-byte-timeout (60 s).
        async with asyncio.timeout(2.0 + SLACK):
            answers = await asyncio.gather(*work)
        assert [status for status, _ in answers] == [200] * 4
        assert hung.state is State.EJECTED
        assert hung.in_flight == 0
        assert hung.breaker.failures == 0  # the withdrawal is not a second failure of it
    finally:
        emus[1].faults.hang = None
