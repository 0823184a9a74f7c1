"""`Fleet.routable`, the second half of the fence's invariant, on its own (no replica needed)."""

from __future__ import annotations

import asyncio

from lora_router.config import Config, ReplicaAddress
from lora_router.fleet.fleet import Fleet


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


async def test_membership_changes_are_announced_with_every_member() -> None:
    fleet = fleet_of(2)
    seen: list[list[str]] = []
    fleet.on_members = lambda names: seen.append(list(names))
    added = fleet.add(ReplicaAddress.parse("http://127.0.0.1:9100"), joining=True)
    assert added.rid == 2 and not added.live
    fleet.remove(fleet.replicas[0])
    assert seen == [
        ["http://127.0.0.1:9000", "http://127.0.0.1:9001", "http://127.0.0.1:9100"],
        ["http://127.0.0.1:9001", "http://127.0.0.1:9100"],
    ]
    assert fleet.find(0) is None and fleet.find(2) is added
