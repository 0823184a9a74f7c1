"""Over real sockets: a replica at half speed is measured by the decode step its /metrics reports
(vllm:inter_token_latency_seconds, fleet/pace.py), its weight falls below 1 in /router/status
and /metrics, and it is dealt no new family while the others run below their batch and
some once they are past it, and a later turn of a conversation on it goes to a full-speed
replica; a fleet at one speed keeps every weight at 1, never telling the policy of a change; a
replica whose /metrics lacks the histogram keeps full weight and says why; a fleet that syncs
in every scrape interval is weighed all the same; the first weight is read one scrape after
traffic starts (the router's start scraped the baseline); with --no-pace every weight stays 1."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import call, router_status, samples

from lora_router.emulator import Emulator, Engine
from lora_router.emulator import metrics as emulator_metrics
from lora_router.fleet.pace import BAND, MIN_DECODED, UNMEASURED
from lora_router.fleet.report import Report
from lora_router.routing.policy import BATCH_FLOOR
from lora_router.runtime import RouterRuntime

G = 4  # samples a family
IN_FLIGHT = 16  # requests in flight at most, as TRL's async worker bounds them
# Each step decodes every sequence in it: a 24-token answer takes 24 steps (48 ms, 96 ms at
# half speed), on a fleet far from full.
STEP_S = 2e-3
COSTS: dict[str, Any] = dict(decode_s_per_token=STEP_S, prefill_s_per_token=1e-6)
# At 128 requests in flight the test's one event loop (router, client and emulators) is about
# saturated at 2 ms steps: fairly quiet, the full-speed replicas' intervals read 2.1-2.8 ms,
# past the dead band; with 2 CPU burners and a second run of the file, up to 3.4-20 ms a run.
# A step loop woken late by more than 2 ms counts the lateness as decode time
# (emulator/engine.py), unevenly. At 6 ms (the same 24 tokens: a third of the requests a
# second) quiet intervals read 6.0-6.8 ms, inside the band (`kept_pace`).
BUSY_STEP_S = 6e-3
BUSY_COSTS: dict[str, Any] = dict(decode_s_per_token=BUSY_STEP_S, prefill_s_per_token=1e-6)
# The router scrapes every replica's /metrics this often (the pace rule's samples). At 0.2 s a
# full-speed replica read 0.75 or 0.25 of the others' speed in about 1 run in 30 (a sample of
# about 100 steps, on a shared 2-core machine); at 0.4 s 30 of 30 passed alone, and a
# full-speed replica read 0.5 in 1 of 3 CI runs of the whole suite.
SCRAPE_S = 0.6


async def half_speed_fleet(
    emulators: StartEmulators, n: int = 4, costs: dict[str, Any] = COSTS
) -> list[Emulator]:
    """`n` emulated replicas at `costs`, the first (labelled "0") at half speed."""
    return [*await emulators(1, **costs, speed=0.5), *await emulators(n - 1, **costs)]


def intervals(runtime: RouterRuntime) -> dict[str, list[float]]:
    """Every interval's mean decode step the pace rule samples from now on, by replica URL."""
    rule = runtime.telemetry.pace if runtime.telemetry is not None else None
    assert rule is not None
    steps: dict[str, list[float]] = {}
    scraped = rule.scraped

    def record(replica: Any, report: Report, now: float, seconds: float) -> None:
        if report.interval > 0 and report.interval_decoded >= MIN_DECODED:
            step = report.interval_token_latency / report.interval_decoded
            steps.setdefault(replica.name, []).append(step)
        scraped(replica, report, now, seconds)

    rule.scraped = record  # type: ignore[method-assign]
    return steps


def kept_pace(steps: dict[str, list[float]], full: list[Emulator], step_s: float) -> bool:
    """Whether every interval of the full-speed replicas `full` read a step within BAND of
    `step_s`, their configured one. An emulator's step is never shorter than configured, so
    then every full-speed pace and their lower median lie within [step_s, BAND x step_s], and
    the rule cannot move a full-speed weight (a ratio of at least 1 / BAND is inside the dead
    band). Beyond it the test's loop fell behind their clock (module `BUSY_STEP_S`): their
    steps really were that uneven, and the rule may weigh one for an interval."""
    return all(step <= BAND * step_s for emu in full for step in steps.get(emu.url, []))


async def complete(
    client: aiohttp.ClientSession, url: str, prompt: list[int], rnd: random.Random
) -> str:
    """One 24-token completion of `prompt`: the replica that answered it."""
    body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "seed": rnd.getrandbits(63)}
    status, data, headers = await call(client, "POST", url + "/v1/completions", body)
    assert status == 200, data
    return headers["x-lora-router-replica"]


async def placed(
    client: aiohttp.ClientSession,
    url: str,
    count: int,
    rnd: random.Random,
    in_flight: int = IN_FLIGHT,
    size: int = G,
) -> list[tuple[list[int], list[str]]]:
    """`count` families of `size` samples each (distinct prompts), at most `in_flight`
    requests in flight: each family's prompt and the replicas that answered its samples, its
    first sample's first."""
    gate = asyncio.Semaphore(in_flight)

    async def sample(prompt: list[int]) -> str:
        async with gate:
            return await complete(client, url, prompt, rnd)

    async def family() -> tuple[list[int], list[str]]:
        prompt = [rnd.randrange(1000, 100_000) for _ in range(48)]
        return prompt, list(await asyncio.gather(*(sample(prompt) for _ in range(size))))

    async with asyncio.timeout(120):  # generous: a loaded machine slows every step
        return list(await asyncio.gather(*(family() for _ in range(count))))


async def families(
    client: aiohttp.ClientSession,
    url: str,
    count: int,
    rnd: random.Random,
    in_flight: int = IN_FLIGHT,
) -> list[str]:
    """`placed`'s homes alone: the replica of each family's first sample."""
    return [homes[0] for _, homes in await placed(client, url, count, rnd, in_flight)]


def told(runtime: RouterRuntime) -> list[tuple[str, int]]:
    """Every weight the pace rule tells the policy from now on."""
    rule = runtime.telemetry.pace if runtime.telemetry is not None else None
    assert rule is not None  # the rule is on by default
    calls: list[tuple[str, int]] = []
    tell = rule.on_weight

    def record(name: str, weight: int) -> None:
        calls.append((name, weight))
        tell(name, weight)

    rule.on_weight = record
    return calls


async def replicas(client: aiohttp.ClientSession, url: str) -> dict[str, dict[str, Any]]:
    """/router/status's replicas by their x-lora-router-replica label."""
    return {str(r["id"]): r for r in (await router_status(client, url))["replicas"]}


async def warm_up(
    client: aiohttp.ClientSession,
    url: str,
    rnd: random.Random,
    count: int = 16,
    in_flight: int = IN_FLIGHT,
    size: int = G,
) -> tuple[list[tuple[list[int], str]], dict[str, dict[str, Any]]]:
    """Rounds of `count` families (`placed`) until replica "0"'s weight falls below 1, at most
    12 (a round lasts about a second here: several scrapes): each family placed and its home,
    and /router/status's replicas after the last round."""
    dealt: list[tuple[list[int], str]] = []
    for _ in range(12):
        rounds = await placed(client, url, count, rnd, in_flight, size)
        dealt += [(prompt, homes[0]) for prompt, homes in rounds]
        status = await replicas(client, url)
        if status["0"]["weight"] < 1:
            break
    return dealt, status


async def slowed(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    rnd: random.Random,
    count: int = 16,
    in_flight: int = IN_FLIGHT,
    size: int = G,
    costs: dict[str, Any] = COSTS,
) -> tuple[RouterRuntime, list[tuple[list[int], str]], Callable[[], bool]]:
    """`half_speed_fleet` at `costs` behind a router that scrapes it every SCRAPE_S, warmed up
    (`warm_up`) until replica "0"'s weight fell: the router, the families dealt meanwhile with
    their homes, and a function telling whether the full-speed replicas' steps kept their
    pace so far (`kept_pace`)."""
    emus = await half_speed_fleet(emulators, costs=costs)
    runtime = await router(emus, health_interval=SCRAPE_S)
    steps = intervals(runtime)
    dealt, status = await warm_up(client, runtime.url, rnd, count, in_flight, size)
    assert status["0"]["weight"] < 1, status["0"]

    def kept() -> bool:
        return kept_pace(steps, emus[1:], costs["decode_s_per_token"])

    return runtime, dealt, kept


async def test_a_half_speed_replica_loses_weight_and_is_dealt_fewer_families(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await half_speed_fleet(emulators)
    runtime = await router(emus, health_interval=SCRAPE_S)
    changes = told(runtime)
    steps = intervals(runtime)
    rnd = random.Random(5)
    slow = "0"  # its x-lora-router-replica label
    _, status = await warm_up(client, runtime.url, rnd)
    weights = {name: r["weight"] for name, r in status.items()}
    assert 0.25 <= weights[slow] <= 0.75, status[slow]  # about half: its decode step is twice
    assert emus[0].url in {name for name, _ in changes}
    # At 16 in flight the full-speed intervals read 2.00-2.01 ms quiet, inside the band, so
    # no full-speed weight may move (`kept_pace`). With 2 CPU burners and a second run of the
    # file they read up to 2.1-3.7 ms a run (past the band in 14 of 20 runs), and one weight
    # fell to 0.75 in 1 of 20: the emulated steps really were that uneven.
    if kept_pace(steps, emus[1:], STEP_S):
        assert all(weights[r] == 1 for r in ("1", "2", "3")), (weights, steps)
        assert {name for name, _ in changes} == {emus[0].url}, changes
    step = {name: r["seconds_per_decode_step"] for name, r in status.items()}
    assert step["1"] > 0 and all(r["pace_unmeasured"] == "" for r in status.values())
    status, page, _ = await call(client, "GET", runtime.url + "/metrics")
    assert status == 200
    figures = samples(page.decode())
    assert figures[("lora_router_replica_weight", (("replica", slow),))] == weights[slow]
    assert figures[("lora_router_replica_weight", (("replica", "1"),))] == weights["1"]
    # No new family from now on (policy.py, the finish rule): 16 requests in flight, so no
    # full-speed replica holds more than the batch floor, and a family would finish twice as
    # late on the slow one. (The weighted deal alone gave it about a seventh.)
    assert IN_FLIGHT <= BATCH_FLOOR
    homes = await families(client, runtime.url, 96, rnd)
    assert homes.count(slow) == 0, (homes.count(slow), weights)


async def test_a_half_speed_replica_is_dealt_families_once_the_others_are_past_their_batch(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    # 128 asked in flight, at most 100 at once (the client's connection limit, aiohttp's
    # default): each full-speed replica holds about 26, past the batch floor, and the slow one
    # finishes a family sooner while it holds fewer than about 20: its capacity is used, about
    # its weight's share (a seventh at half weight).
    rnd = random.Random(9)
    slow = "0"
    runtime, _, kept = await slowed(
        emulators, router, client, rnd, 64, in_flight=128, costs=BUSY_COSTS
    )
    homes = await families(client, runtime.url, 192, rnd, in_flight=128)
    share = homes.count(slow) / len(homes)
    # Starved (the finish rule at any load) it would be dealt none; unweighted, a quarter.
    # Quiet, 0.094. A test loop that fell behind the steps (`kept_pace`) holds fewer of the
    # 128 at the replicas and misreads the slow one's weight (0.3125-0.75), so the rule deals
    # it less: with 2 CPU burners and a second run of the file, 0.083-0.156 in 20 runs (at 2
    # ms steps 0.047-0.115, and 0.036 in CI).
    assert share <= 0.2, share
    assert share >= (0.04 if kept() else 0.02), (share, kept())


async def test_no_family_is_split_over_a_half_speed_replica(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    # Families of 8 at 128 asked in flight (at most 100 at once, as above), past the others'
    # batch: the slow replica is dealt a family only while its scaled cap has room for all 8
    # besides the siblings still to come of the families it was dealt (policy.py, the finish
    # rule), and a sibling whose full-speed home is full spills to a full-speed replica with
    # room, not to it. A group split over the slow replica would wait for its slow siblings.
    rnd = random.Random(14)
    slow = "0"
    runtime, _, kept = await slowed(
        emulators, router, client, rnd, 32, in_flight=128, size=8, costs=BUSY_COSTS
    )
    dealt = await placed(client, runtime.url, 96, rnd, in_flight=128, size=8)
    whole = [homes for _, homes in dealt if set(homes) == {slow}]
    split = [homes for _, homes in dealt if slow in homes and len(set(homes)) > 1]
    assert whole  # its capacity is still used
    # The room they are counted against still moves (the cap with the fleet's load, the
    # weight with each scrape): at most 1 of 96 split in 30 runs (up to 3 when the rule
    # counted what the replica held alone); without the rule 2 to 6 of 96 (4 seeds). A test
    # loop behind the steps (`kept_pace`) moves the weights more, a full-speed one's too (in 4
    # of 20 runs with 2 CPU burners and a second run of the file; at most 2 split): 3 seen in
    # CI (2 ms steps) and in 1 of 5 runs with 4 burners (4 ms steps).
    assert len(split) <= (2 if kept() else 3), (split, kept())


async def test_later_turns_leave_a_half_speed_replica_for_a_full_speed_one(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    # Families dealt to the slow replica before its weight fell: each one's later turn goes to
    # a full-speed replica (policy.py, the finish rule for later turns), and the conversation's
    # next turn follows it there; a family homed at full speed keeps its later turns home.
    rnd = random.Random(11)
    slow = "0"
    runtime, dealt, _ = await slowed(emulators, router, client, rnd)
    on_slow = [prompt for prompt, home in dealt if home == slow][:4]
    at_full = [(prompt, home) for prompt, home in dealt if home != slow][:4]
    assert on_slow and at_full  # the first families were dealt before its weight was read
    for prompt in on_slow:
        later = [*prompt, *(rnd.randrange(1000, 100_000) for _ in range(16))]
        moved = await complete(client, runtime.url, later, rnd)
        assert moved != slow
        deeper = [*later, *(rnd.randrange(1000, 100_000) for _ in range(16))]
        assert await complete(client, runtime.url, deeper, rnd) == moved
    for prompt, home in at_full:
        later = [*prompt, *(rnd.randrange(1000, 100_000) for _ in range(16))]
        assert await complete(client, runtime.url, later, rnd) == home


async def test_a_fleet_at_one_speed_keeps_every_weight_at_1(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(4, **COSTS)
    runtime = await router(emus, health_interval=SCRAPE_S)
    changes = told(runtime)
    steps = intervals(runtime)
    rnd = random.Random(6)
    homes = await families(client, runtime.url, 160, rnd)
    status = await replicas(client, runtime.url)
    assert all(r["seconds_per_decode_step"] > 0 for r in status.values())  # it was measured
    # Strict while every interval read a step within the band (`kept_pace`): on a busy machine
    # the test's loop can fall behind an emulator's clock, whose steps then really are slower.
    if kept_pace(steps, emus, STEP_S):
        assert changes == []  # never told: every decision is the unweighted policy's
        assert [r["weight"] for r in status.values()] == [1.0] * 4
        assert {homes.count(str(i)) for i in range(4)} == {40}  # the deal, evenly


@pytest.fixture
def without_latency() -> Iterator[set[int]]:
    """Engines (by id) whose /metrics lack vLLM's inter-token latency histogram."""
    hidden: set[int] = set()
    collect = emulator_metrics._EngineCollector.collect

    def filtered(self: Any) -> Iterator[Any]:
        for family in collect(self):
            if id(self._engine) in hidden and family.name == "vllm:inter_token_latency_seconds":
                continue
            yield family

    emulator_metrics._EngineCollector.collect = filtered  # type: ignore[method-assign]
    try:
        yield hidden
    finally:
        emulator_metrics._EngineCollector.collect = collect  # type: ignore[method-assign]


async def test_a_replica_without_the_histogram_keeps_full_weight_and_says_why(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    without_latency: set[int],
) -> None:
    # Half speed, but it does not say so: it is dealt as the others are.
    emus = await half_speed_fleet(emulators, 3)
    engine: Engine = emus[0].state
    without_latency.add(id(engine))
    runtime = await router(emus, health_interval=SCRAPE_S)
    changes = told(runtime)
    homes = await families(client, runtime.url, 96, random.Random(7))
    status = await replicas(client, runtime.url)
    # It is never told a weight. (Its two full-speed peers are the only ones judged, each
    # against the faster: on a loaded machine one interval of their 2 ms steps can stretch
    # past the dead band and tell one a weight for an interval; not this test's subject.)
    assert all(name != emus[0].url for name, _ in changes), changes
    assert status["0"]["weight"] == 1.0 and status["0"]["pace_unmeasured"] == UNMEASURED
    assert status["0"]["reported"]["status"] == "ok"  # its other figures are read
    assert status["0"]["reported"]["decode_step_s"] is None
    assert all(status[r]["pace_unmeasured"] == "" for r in ("1", "2"))
    assert all(status[r]["seconds_per_decode_step"] > 0 for r in ("1", "2"))
    # About a third of the families, as the deal gives without weights (weighed, under a fifth).
    assert homes.count("0") / len(homes) > 0.25


async def test_a_fleet_that_syncs_in_every_interval_still_weighs_its_slow_replica(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    # A trainer that syncs every few seconds pauses the fleet inside nearly every scrape
    # interval. A pause a small share of the interval long is a sample (fleet/pace.py,
    # PAUSE_SHARE): the half-speed replica is weighed all the same.
    runtime = await router(await half_speed_fleet(emulators))  # scraped when the test asks
    telemetry = runtime.telemetry
    assert telemetry is not None and telemetry.pace is not None
    paused: list[float] = []  # the paused seconds of each interval the rule is given
    scraped = telemetry.pace.scraped

    def record(replica: Any, report: Report, now: float, seconds: float) -> None:
        if report.interval > 0:
            paused.append(seconds)
        scraped(replica, report, now, seconds)

    telemetry.pace.scraped = record  # type: ignore[method-assign]
    traffic = asyncio.create_task(families(client, runtime.url, 2000, random.Random(8)))
    # The first reports were the router's start's: each interval below is from a scrape here.
    weight = 1.0
    for _ in range(10):
        # An interval of at least 0.4 s, a sync (a pause and a resume) in its middle.
        await asyncio.sleep(0.2)
        for path in ("/pause?mode=keep", "/resume"):
            assert (await call(client, "POST", runtime.url + path))[0] == 200
        await asyncio.sleep(0.2)
        await telemetry.scrape_all()
        weight = (await replicas(client, runtime.url))["0"]["weight"]
        if weight < 1:
            break
    traffic.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await traffic
    assert weight < 1
    assert paused and all(seconds > 0 for seconds in paused)  # every interval saw a sync


async def test_the_first_weight_is_read_one_scrape_after_traffic_starts(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    # The router scrapes every replica as it starts, before it serves: the first interval
    # runs from there, so one scrape after traffic weighs the slow replica (the loop's first
    # round, one --health-interval after start), not two.
    runtime = await router(await half_speed_fleet(emulators))  # scraped when the test asks
    assert runtime.telemetry is not None and runtime.fleet is not None
    assert all(r.report is not None for r in runtime.fleet.replicas)  # the start's reports
    assert {r["weight"] for r in (await replicas(client, runtime.url)).values()} == {1.0}
    await families(client, runtime.url, 48, random.Random(9))
    await runtime.telemetry.scrape_all()  # the first scrape since the start's
    status = await replicas(client, runtime.url)
    assert status["0"]["weight"] < 1
    assert [status[r]["weight"] for r in ("1", "2", "3")] == [1.0] * 3


async def test_without_pace_a_half_speed_replica_is_dealt_its_even_share(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    # --no-pace: scraped as ever, weighed never; the deal is the unweighted policy's.
    emus = await half_speed_fleet(emulators)
    runtime = await router(emus, health_interval=SCRAPE_S, pace=False)
    assert runtime.telemetry is not None and runtime.telemetry.pace is None
    homes = await families(client, runtime.url, 160, random.Random(5))
    status = await replicas(client, runtime.url)
    assert [r["weight"] for r in status.values()] == [1.0] * 4
    assert [r["seconds_per_decode_step"] for r in status.values()] == [0.0] * 4
    assert status["0"]["reported"]["decode_step_s"] is not None  # the step is still read
    assert homes.count("0") / len(homes) >= 0.2  # weighed, under 0.2 (above)
