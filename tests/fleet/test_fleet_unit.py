"""`Fleet.routable`, the second half of the fence's invariant, on its own (no replica needed):
what it answers, and that the sets it keeps per model follow every change without a rebuild
per request."""

from __future__ import annotations

import asyncio
import random

from lora_router.config import Config, ReplicaAddress
from lora_router.fleet.breaker import CLOSED
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.lifecycle import State
from lora_router.fleet.replica import Replica


def fleet_of(n: int) -> Fleet:
    addresses = tuple(ReplicaAddress.parse(f"http://127.0.0.1:{9000 + i}") for i in range(n))
    fleet = Fleet(Config(replicas=addresses, breaker_failures=1, breaker_cooldown=60.0))
    fleet.base_models.add("base")
    return fleet


async def test_an_adapter_is_routable_only_to_replicas_that_acknowledged_it() -> None:
    fleet = fleet_of(3)
    a, b, c = fleet.replicas
    a.adapters["v1"] = b.adapters["v1"] = "/p/v1"
    assert fleet.routable("v1") == [a, b]
    assert fleet.routable("base") == [a, b, c]
    assert fleet.routable(None) == [a, b, c]
    assert fleet.routable("v1", exclude=[a]) == [b]


async def test_only_live_replicas_with_a_closed_breaker_are_routable() -> None:
    fleet = fleet_of(4)
    a, b, c, d = fleet.replicas
    a.life.eject("test")
    b.life.eject("test")
    b.life.replay_begins(0.0, others_serving=True)  # healthy again, replay not finished
    c.life.drain()
    assert fleet.routable(None) == [d]
    d.breaker.failure(asyncio.get_running_loop().time())
    assert fleet.routable(None) == []
    assert a.life.ejections == 1 and a.life.last_error == "test" and not a.live


async def test_membership_changes_are_announced_with_every_member_before_the_next_choice() -> None:
    fleet = fleet_of(2)
    fleet.routable(None)
    seen: list[list[str]] = []
    fleet.on_members = lambda members: seen.append([r.name for r in members])
    added = fleet.add(ReplicaAddress.parse("http://127.0.0.1:9100"), "admin")
    assert added.rid == 2 and not added.live
    fleet.routable(None)
    fleet.remove(fleet.replicas[0])
    fleet.routable(None)
    fleet.routable(None)  # nothing changed since: nothing announced
    assert seen == [
        ["http://127.0.0.1:9000", "http://127.0.0.1:9001", "http://127.0.0.1:9100"],
        ["http://127.0.0.1:9001", "http://127.0.0.1:9100"],
    ]
    assert fleet.find(0) is None and fleet.find(2) is added


async def test_a_burst_of_joins_is_announced_once() -> None:
    """1,000 members named at once cost the policy one ring update, not one each."""
    fleet = fleet_of(2)
    fleet.routable(None)
    seen: list[int] = []
    fleet.on_members = lambda members: seen.append(len(members))
    for i in range(1000):
        fleet.add(ReplicaAddress.parse(f"http://127.0.0.1:{10000 + i}"), "file:replicas")
    assert seen == []
    fleet.routable("v1")
    assert seen == [1002]


def expected(fleet: Fleet, model: str | None, now: float) -> list[Replica]:
    """`routable` as defined, recomputed from every replica (the pre-issue-16 scan)."""
    adapter = model is not None and model not in fleet.base_models
    return [
        r
        for r in fleet.replicas
        if r.life.state is State.SERVING
        and (not adapter or model in r.adapters)
        and (r.breaker.state == CLOSED or r.breaker.allows(now))
    ]


async def test_the_kept_set_is_reused_while_nothing_changes() -> None:
    fleet = fleet_of(3)
    first = fleet.routable(None)
    assert fleet.routable(None) is first and fleet.routable("base") is first
    fleet.replicas[0].adapters["v1"] = "/p/v1"
    assert fleet.routable(None) is not first  # an adapter change drops the kept sets


async def test_membership_changes_reach_the_kept_sets() -> None:
    fleet = fleet_of(2)
    a, b = fleet.replicas
    assert fleet.routable(None) == [a, b]
    c = fleet.add(ReplicaAddress.parse("http://127.0.0.1:9100"))
    assert fleet.routable(None) == [a, b, c]
    joining = fleet.add(ReplicaAddress.parse("http://127.0.0.1:9101"), "admin")
    assert joining not in fleet.routable(None)
    fleet.remove(a)
    assert fleet.routable(None) == [b, c]


async def test_lifecycle_transitions_reach_the_kept_sets() -> None:
    fleet = fleet_of(2)
    a, b = fleet.replicas
    assert fleet.routable(None) == [a, b]
    a.life.eject("test")
    assert fleet.routable(None) == [b]
    a.life.replay_begins(0.0, others_serving=True)
    assert fleet.routable(None) == [b]  # replaying serves nothing
    a.life.replay_succeeded(1.0)
    assert fleet.routable(None) == [a, b]
    b.life.drain()
    assert fleet.routable(None) == [a]


async def test_adapter_loads_and_unloads_reach_the_kept_sets() -> None:
    fleet = fleet_of(2)
    a, b = fleet.replicas
    assert fleet.routable("v1") == []
    a.adapters["v1"] = "/p/v1"
    assert fleet.routable("v1") == [a]
    b.adapters = {"v1": "/p/v1", "v2": "/p/v2"}  # a replay's assignment
    assert fleet.routable("v1") == [a, b] and fleet.routable("v2") == [b]
    a.adapters.pop("v1", None)
    assert fleet.routable("v1") == [b] and fleet.routable(None) == [a, b]


async def test_an_open_breaker_lets_one_trial_through_once_its_cooldown_passed() -> None:
    fleet = fleet_of(2)
    a, b = fleet.replicas
    now = asyncio.get_running_loop().time()
    a.breaker.failure(now)  # threshold 1: open
    assert fleet.routable(None) == [b]
    a.breaker.opened_at = now - 61.0  # the 60 s cooldown is over: no event announces it
    assert fleet.routable(None) == [a, b]  # half-open: its trial may go
    a.breaker.begin()  # the trial is in flight
    assert fleet.routable(None) == [b]
    a.breaker.success()
    assert fleet.routable(None) == [a, b]


async def test_a_retry_excludes_what_it_tried_without_touching_the_kept_set() -> None:
    fleet = fleet_of(3)
    a, b, c = fleet.replicas
    kept = fleet.routable(None)
    assert fleet.routable(None, exclude=[a, c]) == [b]
    assert fleet.routable(None) is kept and kept == [a, b, c]


async def test_started_and_finished_keep_every_kept_total_and_tell_the_policy() -> None:
    fleet = fleet_of(2)
    a, b = fleet.replicas
    a.adapters["v1"] = "/p/v1"
    told: list[tuple[int, int]] = []
    fleet.on_load = lambda r: told.append((r.rid, r.in_flight))
    everyone, v1 = fleet.routable(None), fleet.routable("v1")
    fleet.started(a, 100)
    fleet.started(b, 7)
    assert (everyone.in_flight, v1.in_flight) == (2, 1)
    assert (a.in_flight_tokens, b.in_flight_tokens) == (100, 7)
    fleet.finished(a, 100)
    assert (everyone.in_flight, v1.in_flight) == (1, 0) and told == [(0, 1), (1, 1), (0, 0)]


async def test_the_kept_sets_always_equal_a_fresh_scan() -> None:
    # Random membership, lifecycle, breaker, adapter and request events, in bounded numbers:
    # after each, every model's answer and total is what a scan of the fleet gives.
    rnd = random.Random(16)
    fleet = fleet_of(4)
    loop = asyncio.get_running_loop()
    open_requests: list[tuple[Replica, int]] = []
    for step in range(400):
        replicas = fleet.replicas
        r = rnd.choice(replicas)
        event = rnd.randrange(9)
        if event == 0 and len(replicas) < 8:
            fleet.add(ReplicaAddress.parse(f"http://127.0.0.1:{9200 + step}"))
        elif event == 1 and len(replicas) > 2 and not any(o is r for o, _ in open_requests):
            fleet.remove(r)
        elif event == 2:
            r.life.eject("test")
        elif event == 3 and r.life.replay_begins(0.0, others_serving=False):
            r.life.replay_succeeded(1.0)
        elif event == 4:
            r.adapters[rnd.choice(["v1", "v2"])] = "/p"
        elif event == 5:
            r.adapters.pop(rnd.choice(["v1", "v2"]), None)
        elif event == 6:
            r.breaker.failure(loop.time() - rnd.choice([0.0, 61.0]))
        elif event == 7:
            r.breaker.success()
        elif open_requests and rnd.random() < 0.5:
            fleet.finished(*open_requests.pop(rnd.randrange(len(open_requests))))
        else:
            tokens = rnd.randrange(1, 500)
            fleet.started(r, tokens)
            open_requests.append((r, tokens))
        for model in (None, "base", "v1", "v2"):
            got = fleet.routable(model)
            now = loop.time()
            assert got == expected(fleet, model, now), (step, model)
            assert got.in_flight == sum(x.in_flight for x in got)
            assert all(got.get(x.name) is x for x in got)
