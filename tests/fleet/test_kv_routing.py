"""Over real sockets: emulated replicas publish vLLM's KV events, a router with `--policy kv`
subscribes, and a new family goes where its prefix really is, where the prediction (the deal)
would have sent it elsewhere; a gap, a stopped or silent publisher, a restarted replica or another
block size put that replica back on the prediction, visibly in /router/status."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from typing import Any

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, call, completed, load, router_status, until

from lora_router.emulator import Emulator
from lora_router.emulator.kv_events import KVEventsConfig
from lora_router.fleet.kv_wire import parse_sources
from lora_router.routing.keys import Lineages, RouteKey, prompt_key
from lora_router.routing.policy import Candidates, PrefixAffinity
from lora_router.runtime import RouterRuntime

BLOCK = 16
KV = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
PROMPT = list(range(3000, 3064))  # 4 blocks
LATER = [*PROMPT, *range(9000, 9040)]  # its next turn: a new family to a router that never saw it


class Member:
    def __init__(self, name: str) -> None:
        self.name = name
        self.in_flight = 0
        self.in_flight_tokens = 0


def predicted(emus: list[Emulator], tokens: list[int], model: str | None = None) -> Emulator:
    """Where `--policy prefix` deals `tokens` as a new family on an idle fleet of `emus`."""
    members = [Member(e.url.replace("localhost", "127.0.0.1")) for e in emus]
    policy = PrefixAffinity()
    policy.set_members(members)
    seed = Lineages().seeds(model, model is not None).token
    key = prompt_key(None, tokens, BLOCK, seed=seed)
    chosen = policy.choose(RouteKey(lambda: key), Candidates(members, model)).replica
    return emus[members.index(chosen)]


def chain(tokens: list[int]) -> list[int]:
    return prompt_key(None, tokens, BLOCK, seed=Lineages().seeds(None, False).token).chain


def other(emus: list[Emulator], than: Emulator) -> Emulator:
    return next(e for e in emus if e is not than)


async def served_by(
    client: aiohttp.ClientSession, rt: RouterRuntime, emus: list[Emulator], **body: Any
) -> Emulator:
    """Send a completion through the router; the emulator that answered."""
    status, data, headers = await call(
        client, "POST", rt.url + "/v1/completions", {"max_tokens": 1, **body}
    )
    assert status == 200, data
    assert rt.fleet is not None
    replica = rt.fleet.find(int(headers["x-lora-router-replica"]))
    assert replica is not None
    return next(e for e in emus if e.url == replica.name)


async def kv_status(client: aiohttp.ClientSession, rt: RouterRuntime, emu: Emulator) -> Any:
    return (await router_status(client, rt.url))["kv_events"]["replicas"][emu.url]


def held(rt: RouterRuntime, emu: Emulator) -> int:
    assert rt.kv_events is not None
    return rt.kv_events.index.held(emu.url)


def state(rt: RouterRuntime, emu: Emulator) -> str:
    assert rt.kv_events is not None
    return rt.kv_events.index.replica(emu.url).state


async def subscribed(
    client: aiohttp.ClientSession, rt: RouterRuntime, emu: Emulator, block: int = BLOCK
) -> None:
    """Publish on `emu` (its KV blocks of `block` tokens) until the router's subscription
    receives (ZMQ's slow joiner: a subscription takes effect a moment after the connection)."""
    assert rt.kv_events is not None
    stream = rt.kv_events.streams[emu.url]
    seen = stream.batches
    async with asyncio.timeout(10):
        for i in itertools.count():
            await completed(client, emu.url, prompt=[50_000 + i] * block, max_tokens=1)
            with contextlib.suppress(TimeoutError):
                await until(lambda: stream.batches > seen, timeout=0.05)
                return


async def caught_up(rt: RouterRuntime, emu: Emulator) -> None:
    """Every batch `emu` has published has reached the router (`subscribed` may leave one on the
    way), and the loop's clock, which counts milliseconds, has moved past the last one."""
    assert rt.kv_events is not None and emu.kv_publisher is not None
    stream, publisher = rt.kv_events.streams[emu.url], emu.kv_publisher
    await until(lambda: stream.next_seq == publisher.seq)
    loop = asyncio.get_running_loop()
    await until(lambda: loop.time() > stream.batch_at)


class Dropped:
    """A PUB socket whose messages never arrive: the subscriber misses a batch (ZMQ drops
    beyond its high-water mark) that the replay buffer still keeps."""

    def send_multipart(self, frames: object, flags: int = 0) -> None:
        pass


async def test_a_new_family_goes_where_its_prefix_is_after_the_router_restarts(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(3, kv_events_config=KV)
    model = "trl-policy-v3"
    for emu in emus:
        assert (await load(client, emu.url, model, adapter(model)))[0] == 200
    guess = predicted(emus, LATER, model)
    holder = other(emus, guess)
    # Two conversations' first turns ran on `holder` before this router existed.
    second = list(range(6000, 6064))
    for first in (PROMPT, second):
        await completed(client, holder.url, model, prompt=first, max_tokens=1)
    rt = await router(emus, policy="kv")
    await until(lambda: held(rt, holder) >= 8)  # learnt from the replay buffer
    assert await served_by(client, rt, emus, model=model, prompt=LATER) is holder
    # The second follows too, though its replica was just dealt a family: it was placed
    # before this router started (its blocks are inherited), not drawn by a shared prefix.
    later = [*second, *range(9000, 9040)]
    assert await served_by(client, rt, emus, model=model, prompt=later) is holder
    assert rt.app is not None and rt.app.policy.counts.kv == 2
    seen = await kv_status(client, rt, holder)
    assert seen["state"] == "live" and seen["blocks"] >= 4 and seen["batches"] >= 1


async def test_the_same_prompt_under_another_version_is_dealt(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(2, kv_events_config=KV)
    for name in ("trl-policy-v3", "trl-policy-v4"):
        for emu in emus:
            assert (await load(client, emu.url, name, adapter(name)))[0] == 200
    guess = predicted(emus, LATER, "trl-policy-v4")
    await completed(client, other(emus, guess).url, "trl-policy-v3", prompt=PROMPT, max_tokens=1)
    rt = await router(emus, policy="kv")
    await until(lambda: held(rt, other(emus, guess)) >= 4)
    assert await served_by(client, rt, emus, model="trl-policy-v4", prompt=LATER) is guess


async def test_a_gap_in_the_sequence_drops_what_the_replica_held(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2, kv_events_config=KV)
    guess = predicted(emus, LATER)
    holder = other(emus, guess)
    await completed(client, holder.url, prompt=PROMPT, max_tokens=1)
    rt = await router(emus, policy="kv")
    await until(lambda: held(rt, holder) >= 4)
    await subscribed(client, rt, holder)
    assert holder.kv_publisher is not None
    holder.kv_publisher.seq += 1  # one batch lost before the replay buffer kept it
    await completed(client, holder.url, prompt=[7] * BLOCK, max_tokens=1)
    await until(lambda: state(rt, holder) == "gap")
    assert held(rt, holder) <= 1  # only what came after the gap
    assert await served_by(client, rt, emus, prompt=LATER) is guess
    seen = await kv_status(client, rt, holder)
    assert seen["gaps"] == 1 and "missed batches" in seen["reason"]
    # The next batch in sequence ends the fault.
    await completed(client, holder.url, prompt=[8] * BLOCK, max_tokens=1)
    await until(lambda: state(rt, holder) == "live")


async def test_a_gap_the_replay_buffer_fills_loses_nothing(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (emu,) = await emulators(1, kv_events_config=KV)
    rt = await router([emu], policy="kv")
    await subscribed(client, rt, emu)
    assert rt.kv_events is not None and emu.kv_publisher is not None
    stream = rt.kv_events.streams[emu.url]
    publisher = emu.kv_publisher
    pub, publisher._pub = publisher._pub, Dropped()  # type: ignore[assignment]
    await completed(client, emu.url, prompt=PROMPT, max_tokens=1)  # only in the buffer
    publisher._pub = pub
    await completed(client, emu.url, prompt=[*PROMPT, *range(16)], max_tokens=1)
    await until(lambda: held(rt, emu) >= 5)  # the replay brought the 4 blocks before it
    assert stream.gaps == 0 and state(rt, emu) == "live" and stream.replays >= 2


async def test_a_stopped_publisher_puts_the_replica_on_the_prediction(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2, kv_events_config=KV)
    guess = predicted(emus, LATER)
    holder = other(emus, guess)
    await completed(client, holder.url, prompt=PROMPT, max_tokens=1)
    rt = await router(emus, policy="kv")
    await until(lambda: held(rt, holder) >= 4)
    await subscribed(client, rt, holder)
    await holder.stop_kv_events()
    await until(lambda: state(rt, holder) == "stale")
    assert held(rt, holder) >= 4  # kept, but not trusted
    assert await served_by(client, rt, emus, prompt=LATER) is guess
    seen = await kv_status(client, rt, holder)
    assert seen["disconnects"] >= 1 and seen["reason"] == "its publisher went away"


async def test_a_silent_publisher_puts_the_replica_on_the_prediction_until_it_speaks(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (emu,) = await emulators(1, kv_events_config=KV)
    rt = await router([emu], policy="kv")  # the check is called here, not by its loop
    await subscribed(client, rt, emu)
    assert rt.kv_events is not None and emu.kv_publisher is not None
    kv, stream, publisher = rt.kv_events, rt.kv_events.streams[emu.url], emu.kv_publisher
    kv.silence_s = 0.0  # judged at the second check that finds a batch owed
    # Heard: a routed request computed 4 blocks, and their batch came.
    batches = stream.batches
    await served_by(client, rt, [emu], prompt=PROMPT)
    await until(lambda: stream.batches > batches)
    kv.check_silence()
    kv.check_silence()
    assert state(rt, emu) == "live" and stream.silences == 0
    # Silent: the next request computes a block whose batch never arrives, the connection up.
    await caught_up(rt, emu)
    pub, publisher._pub = publisher._pub, Dropped()  # type: ignore[assignment]
    await served_by(client, rt, [emu], prompt=[*PROMPT, *range(16)])
    kv.check_silence()
    assert state(rt, emu) == "live"  # owed, not yet judged
    kv.check_silence()
    seen = await kv_status(client, rt, emu)
    assert seen["state"] == "stale" and seen["silences"] == 1
    assert "its publisher is silent" in seen["reason"]
    # It speaks again: its replay buffer brings what the silence hid.
    publisher._pub = pub
    await completed(client, emu.url, prompt=[*PROMPT, *range(32)], max_tokens=1)
    await until(lambda: state(rt, emu) == "live")
    assert held(rt, emu) >= 6 and stream.gaps == 0


async def test_the_silence_check_runs_every_health_interval(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (emu,) = await emulators(1, kv_events_config=KV)
    rt = await router([emu], policy="kv", health_interval=0.05)
    await subscribed(client, rt, emu)
    assert rt.kv_events is not None and emu.kv_publisher is not None
    stream = rt.kv_events.streams[emu.url]
    await caught_up(rt, emu)
    publisher = emu.kv_publisher
    pub, publisher._pub = publisher._pub, Dropped()  # type: ignore[assignment]
    try:
        await served_by(client, rt, [emu], prompt=PROMPT)
        await until(lambda: state(rt, emu) == "stale", timeout=10)
        assert stream.silences == 1
    finally:
        publisher._pub = pub


async def test_a_restarted_replica_starts_again_from_nothing(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2, kv_events_config=KV)
    guess = predicted(emus, LATER)
    holder = other(emus, guess)
    await completed(client, holder.url, prompt=PROMPT, max_tokens=1)
    rt = await router(emus, policy="kv")
    await until(lambda: held(rt, holder) >= 4)
    await subscribed(client, rt, holder)
    assert rt.kv_events is not None
    stream = rt.kv_events.streams[holder.url]
    await holder.restart()  # a new process: an empty cache, batches from 0 again
    await until(lambda: stream.disconnects == 1)
    await subscribed(client, rt, holder)
    seen = await kv_status(client, rt, holder)
    assert seen["restarts"] == 1 and "it restarted" in seen["last_fault"]
    assert rt.kv_events.index.longest(None, chain(PROMPT)) == (0, frozenset())
    assert await served_by(client, rt, emus, prompt=LATER) is guess


async def test_the_health_monitors_restart_verdict_drops_the_blocks(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(1, kv_events_config=KV)
    await completed(client, emus[0].url, prompt=PROMPT, max_tokens=1)
    rt = await router(emus, policy="kv")
    await until(lambda: held(rt, emus[0]) >= 4)
    assert rt.health is not None and rt.fleet is not None
    assert rt.health.on_restart is not None
    rt.health.on_restart(rt.fleet.replicas[0])
    assert state(rt, emus[0]) == "restarted" and held(rt, emus[0]) == 0


async def test_another_block_size_is_never_looked_up(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2, kv_events_config=KV, block_size=32)
    guess = predicted(emus, LATER)
    holder = other(emus, guess)
    await completed(client, holder.url, prompt=PROMPT, max_tokens=1)
    rt = await router(emus, policy="kv", block_size=BLOCK)
    await until(lambda: state(rt, holder) == "mismatch")
    assert held(rt, holder) == 0
    assert await served_by(client, rt, emus, prompt=LATER) is guess
    assert "block size 32" in (await kv_status(client, rt, holder))["reason"]


async def test_a_block_size_no_replica_said_at_start_is_learned_when_one_is_readmitted(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    """A replica that does not answer while the router starts leaves the block size unknown
    (keyed by vLLM's default 16 meanwhile, its events of 32-token blocks a `mismatch`): once
    it is readmitted its size is the router's, and its events are looked up again."""
    emu = (await emulators(1, kv_events_config=KV, block_size=32))[0]
    emu.faults.hang = "/v1/models"
    rt = await router([emu], policy="kv", control_timeout=0.5, health_interval=0.05)
    assert rt.route is not None and rt.route.block_size == BLOCK
    assert (await router_status(client, rt.url))["block_size"] is None
    await subscribed(client, rt, emu, block=32)
    await until(lambda: state(rt, emu) == "mismatch")
    emu.faults.hang = None
    await until(lambda: rt.route is not None and rt.route.block_size == 32)
    assert (await router_status(client, rt.url))["block_size"] == 32
    await completed(client, emu.url, prompt=list(range(7000, 7064)), max_tokens=1)
    await until(lambda: state(rt, emu) == "live" and held(rt, emu) >= 2)


async def test_a_block_size_a_serving_replica_did_not_say_at_start_is_read_at_its_next_check(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    """A replica that lists its models at start but does not answer `/server_info` is admitted
    with the block size unknown; once `/server_info` answers, its next passing health check
    reads it, without an ejection or a replay."""
    emu = (await emulators(1, kv_events_config=KV, block_size=32))[0]
    emu.faults.hang = "/server_info"
    rt = await router([emu], policy="kv", control_timeout=0.5, health_interval=0.05)
    assert rt.route is not None and rt.route.block_size == BLOCK
    assert (await router_status(client, rt.url))["block_size"] is None
    assert rt.fleet is not None and rt.health is not None
    replica = rt.fleet.replicas[0]
    assert replica.live and replica.info_unread
    emu.faults.hang = None
    await until(lambda: rt.route is not None and rt.route.block_size == 32)
    assert (await router_status(client, rt.url))["block_size"] == 32
    assert replica.live and not replica.info_unread and rt.health.readmissions == 0


async def test_a_replica_without_events_is_off(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(1)
    rt = await router(emus, policy="kv")
    seen = await kv_status(client, rt, emus[0])
    assert seen["state"] == "off" and "no ZMQ publisher" in seen["reason"]
    assert (await served_by(client, rt, emus, prompt=LATER)) is emus[0]


async def test_a_replica_naming_another_host_for_its_events_is_not_followed(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    """The router subscribes only on the fleet's own hosts: a `/kv_event_sources` that names
    another one leaves the replica off, saying so, and on the prediction."""
    elsewhere = KVEventsConfig(enable_kv_cache_events=True, endpoint="tcp://127.0.0.2:1")
    emus = await emulators(1, kv_events_config=elsewhere)
    rt = await router(emus, policy="kv")
    seen = await kv_status(client, rt, emus[0])
    assert seen["state"] == "off" and "another host (tcp://127.0.0.2:1)" in seen["reason"]
    assert (await served_by(client, rt, emus, prompt=LATER)) is emus[0]


async def test_an_endpoint_template_replaces_discovery(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    (emu,) = await emulators(1, kv_events_config=KV)
    assert emu.kv_publisher is not None
    port = emu.kv_publisher.endpoint.rpartition(":")[2]
    await completed(client, emu.url, prompt=PROMPT, max_tokens=1)
    rt = await router([emu], policy="kv", kv_events=f"tcp://{{host}}:{port}")
    await subscribed(client, rt, emu)
    assert state(rt, emu) == "live"


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"0": {"publisher": "zmq", "endpoint": "tcp://*:5557", "topic": "t"}}, "tcp://h:5557"),
        (
            {"0": {"endpoint": "tcp://10.0.0.5:41000", "replay_endpoint": None}},
            "tcp://10.0.0.5:41000",
        ),
        ({}, None),
        ({"0": {"publisher": "null", "endpoint": "tcp://*:5557"}}, None),
        ({"1": {"endpoint": "tcp://*:5558"}}, None),
    ],
)
def test_sources_are_read_from_rank_0(doc: Any, expected: str | None) -> None:
    source = parse_sources(doc, "h")
    assert (source.endpoint if source else None) == expected


async def test_a_replica_without_events_is_not_asked_again_until_it_restarts(
    emulators: StartEmulators, router: StartRouter
) -> None:
    (emu,) = await emulators(1)
    rt = await router([emu], policy="kv")
    assert rt.kv_events is not None and rt.fleet is not None

    def asked() -> int:
        return sum(1 for r in emu.requests if r.path == "/kv_event_sources")

    await rt.kv_events.sync()
    assert asked() == 1
    rt.kv_events.restarted(rt.fleet.replicas[0])  # a new process may publish
    await rt.kv_events.sync()
    assert asked() == 2


async def test_a_replica_restarted_publishing_elsewhere_is_followed_there(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    """Started again with its KV events on other ports (`auto`): the router, which saw its
    publisher go away, asks `/kv_event_sources` again at its next sync, drops what the old
    process held, and follows the new one; until then the replica is on the prediction."""
    (emu,) = await emulators(1, kv_events_config=KV)
    rt = await router([emu], policy="kv")
    assert rt.kv_events is not None
    await subscribed(client, rt, emu)
    await completed(client, emu.url, prompt=PROMPT, max_tokens=1)
    await until(lambda: held(rt, emu) >= 4)
    stream = rt.kv_events.streams[emu.url]
    old = stream.source
    assert old is not None

    await emu.restart(events_elsewhere=True)
    await until(lambda: stream.recheck)  # the publisher went away
    assert state(rt, emu) == "stale"
    await rt.kv_events.sync()  # what the resync loop does every health interval
    assert stream.source is not None and stream.source.endpoint != old.endpoint
    assert not stream.recheck and held(rt, emu) == 0
    await subscribed(client, rt, emu)
    await completed(client, emu.url, prompt=PROMPT, max_tokens=1)
    await until(lambda: state(rt, emu) == "live" and held(rt, emu) >= 4)


async def test_a_replica_restarted_publishing_where_it_did_is_asked_once(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    """The same ports again (a fixed `--kv-events-config`): one more `/kv_event_sources`, the
    subscription kept."""
    (emu,) = await emulators(1, kv_events_config=KV)
    rt = await router([emu], policy="kv")
    assert rt.kv_events is not None
    await subscribed(client, rt, emu)
    stream = rt.kv_events.streams[emu.url]
    task = stream.task

    def asked() -> int:
        return sum(1 for r in emu.requests if r.path == "/kv_event_sources")

    await emu.restart()
    await until(lambda: stream.recheck)
    before = asked()
    await rt.kv_events.sync()
    await rt.kv_events.sync()
    assert asked() == before + 1 and stream.task is task and not stream.recheck
