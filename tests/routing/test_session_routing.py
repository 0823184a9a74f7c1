"""Over real sockets (emulated replicas, an aiohttp client): `X-Session-ID` pins a session to
its replica, `/finish_session` releases it, the idle TTL and the bound forget it, a bad header
is vLLM's 400, and requests without the header are routed as the policy alone would
(routing/sessions.py states the rules)."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import orjson
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import call, router_status, until

from lora_router.routing.keys import Lineages, completion_key
from lora_router.routing.policy import Candidates, make_policy
from lora_router.runtime import RouterRuntime


def prompt(seed: int, n: int = 64) -> list[int]:
    return [seed * 1000 + t for t in range(n)]


async def turn(
    client: aiohttp.ClientSession,
    rt: RouterRuntime,
    tokens: list[int],
    session: str | None = None,
    max_tokens: int = 4,
) -> str:
    """One completion, which must succeed: the id of the replica that served it."""
    headers = {} if session is None else {"X-Session-ID": session}
    body = {"prompt": tokens, "max_tokens": max_tokens}
    async with client.post(rt.url + "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 200, await resp.text()
        await resp.read()
        return resp.headers["x-lora-router-replica"]


async def sessions(client: aiohttp.ClientSession, rt: RouterRuntime) -> dict[str, Any]:
    figures: dict[str, Any] = (await router_status(client, rt.url))["sessions"]
    return figures


async def pinned_apart(
    client: aiohttp.ClientSession, rt: RouterRuntime, session: str
) -> tuple[str, str]:
    """`session` pinned by its first turn, and a header-less prompt family placed on the other
    replica of two: (the session's replica, the family's). The session then sticks: a turn
    that extends the family's prompt goes to the session's replica."""
    home = await turn(client, rt, prompt(1), session)
    other = await turn(client, rt, prompt(2))  # a new family: dealt to the replica with fewer
    assert other != home
    assert await turn(client, rt, prompt(2) + prompt(8, 16), session) == home
    return home, other


async def test_a_session_sticks_where_its_prefix_key_would_not(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    rt = await router(await emulators(2))
    home, other = await pinned_apart(client, rt, "traj-1")
    # Without the header the family's later turn follows its prefix to `other`...
    assert await turn(client, rt, prompt(2) + prompt(3, 16)) == other
    # ...with it, every turn of the session stays on the session's replica.
    for extra in range(4, 7):
        assert await turn(client, rt, prompt(2) + prompt(extra, 16), "traj-1") == home
    figures = await sessions(client, rt)
    assert (figures["count"], figures["placed"], figures["stuck"]) == (1, 1, 4)


async def test_a_groups_siblings_meet_where_their_prompt_is_whatever_their_ids(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    rt = await router(await emulators(3))
    replicas = await asyncio.gather(*(turn(client, rt, prompt(9), f"s-{g}") for g in range(8)))
    assert len(set(replicas)) == 1
    assert (await sessions(client, rt))["count"] == 8


async def test_finish_session_releases_it(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    rt = await router(await emulators(2))
    _, other = await pinned_apart(client, rt, "traj-2")
    status, body, _ = await call(client, "POST", rt.url + "/finish_session?session_id=traj-2")
    assert status == 200 and orjson.loads(body) == {"session_id": "traj-2", "released": True}
    # Released: its next turn is placed by the policy, as a continuation of the family.
    assert await turn(client, rt, prompt(2) + prompt(3, 16), "traj-2") == other
    # An unknown id (or a JSON body naming one) is harmless.
    status, body, _ = await call(client, "POST", rt.url + "/finish_session", {"session_id": "no"})
    assert status == 200 and orjson.loads(body)["released"] is False
    figures = await sessions(client, rt)
    assert (figures["finished"], figures["count"], figures["placed"]) == (1, 1, 2)


async def test_an_idle_session_expires_after_the_ttl(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    rt = await router(await emulators(2), session_ttl=1.0)
    _, other = await pinned_apart(client, rt, "traj-3")
    async with asyncio.timeout(10):  # the status poll: about 1 s
        while (await sessions(client, rt))["count"]:
            await asyncio.sleep(0.02)
    assert await turn(client, rt, prompt(2) + prompt(3, 16), "traj-3") == other
    figures = await sessions(client, rt)
    assert figures["expired"] == 1 and figures["placed"] == 2


async def test_the_bound_forgets_the_least_recently_used_session(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    rt = await router(await emulators(2), max_sessions=2)
    _, other = await pinned_apart(client, rt, "oldest")
    await turn(client, rt, prompt(5), "second")
    await turn(client, rt, prompt(6), "third")  # one too many: "oldest" is forgotten
    assert await turn(client, rt, prompt(2) + prompt(3, 16), "oldest") == other
    figures = await sessions(client, rt)
    assert figures["evicted"] == 2 and figures["count"] == 2  # then "second" made room


async def test_a_session_whose_replica_left_is_pinned_again(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    rt = await router(await emulators(2))
    home, other = await pinned_apart(client, rt, "traj-4")
    status, body, _ = await call(client, "DELETE", f"{rt.url}/router/replicas/{home}")
    assert status == 200, body
    assert await turn(client, rt, prompt(1) + prompt(3, 16), "traj-4") == other
    assert await turn(client, rt, prompt(7), "traj-4") == other
    figures = await sessions(client, rt)
    assert (figures["replaced"], figures["stuck"]) == (1, 2)


async def test_a_session_leaves_a_replica_far_over_the_load(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    # No slack: twice the others' mean (1 when idle) is far over. Slow decode holds requests.
    rt = await router(await emulators(2, decode_s_per_token=0.01), load_slack=0)
    home, other = await pinned_apart(client, rt, "traj-5")
    assert rt.fleet is not None
    pinned = next(r for r in rt.fleet.replicas if str(r.rid) == home)
    held = []
    for n in (1, 2):
        held.append(asyncio.create_task(turn(client, rt, prompt(1) + prompt(n, 16), "traj-5", 200)))
        await until(lambda n=n: pinned.in_flight == n)  # type: ignore[misc]
    # Two in flight against none elsewhere: the third turn goes where the policy places it,
    # and the session stays there.
    assert await turn(client, rt, prompt(1) + prompt(3, 16), "traj-5") == other
    assert await asyncio.gather(*held) == [home, home]
    assert await turn(client, rt, prompt(1) + prompt(4, 16), "traj-5") == other
    figures = await sessions(client, rt)
    assert (figures["stuck"], figures["replaced"]) == (4, 1)


@pytest.mark.parametrize(
    "headers",
    [
        [("X-Session-ID", "a" * 257)],
        [("X-Session-ID", "two words")],
        [("X-Session-ID", "caf\u00e9")],
        [("X-Session-ID", "a"), ("X-Session-ID", "b")],
    ],
    ids=["too-long", "space", "non-ascii", "twice"],
)
async def test_a_bad_header_is_vllms_400(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    headers: list[tuple[str, str]],
) -> None:
    rt = await router(await emulators(1))
    body = {"prompt": prompt(1), "max_tokens": 4}
    async with client.post(rt.url + "/v1/completions", json=body, headers=headers) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    assert error["code"] == 400 and error["type"] == "Bad Request"
    assert error["param"] == "X-Session-ID" and "X-Session-ID" in error["message"]
    assert await turn(client, rt, prompt(1)) == "0"  # the router is still up
    assert (await sessions(client, rt))["placed"] == 0


@pytest.mark.parametrize(
    ("target", "json"),
    [("/finish_session", None), ("/finish_session?session_id=a%20b", None)],
    ids=["no-id", "bad-id"],
)
async def test_a_finish_without_a_good_id_is_vllms_400(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    target: str,
    json: Any,
) -> None:
    rt = await router(await emulators(1))
    status, body, _ = await call(client, "POST", rt.url + target, json)
    error = orjson.loads(body)["error"]
    assert status == 400 and error["code"] == 400 and error["param"] == "session_id"
    status, _, headers = await call(client, "GET", rt.url + "/finish_session?session_id=a")
    assert status == 405 and headers["allow"] == "POST"


async def test_without_the_header_routing_is_the_policys_alone(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    # The oracle: the same policy, fed the same keys, with every load 0 (one request at a time).
    rt = await router(await emulators(3))
    assert rt.app is not None and rt.fleet is not None
    route = rt.app.completions
    oracle = make_policy("prefix", rt.config.policy_params())
    idle = Candidates([_Idle(r.name) for r in rt.fleet.replicas])
    oracle.set_members(idle)
    seeds = Lineages(rt.config.lineage_pattern).seeds(None, False)
    by_name = {r.name: str(r.rid) for r in rt.fleet.replicas}
    for family in range(6):  # 6 families of 2 siblings, each then 2 later turns
        for tokens in (prompt(family), prompt(family), prompt(family) + prompt(50 + family, 20)):
            body = orjson.dumps({"prompt": tokens, "max_tokens": 4})
            key = completion_key(route.reader.read(body, chat=False), seeds, route.block_size)
            expected = by_name[oracle.choose(key, idle).replica.name]
            assert await turn(client, rt, tokens) == expected
    figures = await sessions(client, rt)
    assert (figures["placed"], figures["count"]) == (0, 0)


class _Idle:
    """A replica with nothing in flight, as the policy reads one."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.in_flight = 0
        self.in_flight_tokens = 0
