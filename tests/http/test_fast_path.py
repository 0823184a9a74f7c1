"""The fast path (proxy/routed.py `handle_now`): a routed completion sent upstream from the parser
callback, with no Task, when the chosen replica has an idle pooled connection; and every retry
the general path makes, made the same way after a fast first attempt.

Each retry case runs on both paths (`path`): "general" turns the fast path off, so the same
assertions show the two behave alike. Which path a request took is seen from the replica while
it holds the request: the router's `ClientConnection._run` Tasks then alive.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from http_harness import FakeReplica, Received, ReplicaConn, completion, json_response, request

from lora_router.proxy.dispatch import RouterApp
from lora_router.runtime import RouterRuntime

StartReplica = Callable[..., Awaitable[FakeReplica]]
StartRouter = Callable[..., Awaitable[RouterRuntime]]
Answer = Callable[[Received, ReplicaConn, int], Awaitable[None]]


def router_tasks() -> int:
    """Requests the router is answering in a Task (the general path) right now."""
    return sum(
        1 for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "ClientConnection._run"
    )


class Replica:
    """A fake replica that notes, for each completion it receives, how many router Tasks were
    answering at that moment, and answers by `answer(request, conn, n)`, n counting from 0."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.tasks: list[int] = []
        self.fake: FakeReplica | None = None

    async def respond(self, req: Received, conn: ReplicaConn) -> None:
        if req.target != b"/v1/completions":
            await conn.write(json_response())
            return
        n = len(self.tasks)
        self.tasks.append(router_tasks())
        await self.answer(req, conn, n)

    async def start(self, replica_factory: StartReplica) -> Replica:
        self.fake = await replica_factory(self.respond)
        return self


async def ok(req: Received, conn: ReplicaConn, n: int) -> None:
    await conn.write(json_response(b'{"choices":[]}'))


def fails_from(first: int, how: Callable[[ReplicaConn], Awaitable[None]]) -> Answer:
    """Answers its completions ok until the `first`-th, then fails every one by `how`."""

    async def answer(req: Received, conn: ReplicaConn, n: int) -> None:
        if n < first:
            await ok(req, conn, n)
        else:
            await how(conn)

    return answer


async def reset(conn: ReplicaConn) -> None:
    conn.abort()


async def error_500(conn: ReplicaConn) -> None:
    await conn.write(json_response(b'{"error":"boom"}', b"500 Internal Server Error"))


async def adapter_404(conn: ReplicaConn) -> None:
    body = b'{"object":"error","message":"The model `pol-v1` does not exist.","code":404}'
    await conn.write(json_response(body, b"404 Not Found"))


@pytest.fixture(params=["fast", "general"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "general":
        monkeypatch.setattr(RouterApp, "handle_now", lambda self, req, conn: False)
    return str(request.param)


async def answered_by(router: RouterRuntime, **fields: Any) -> tuple[int, bytes | None]:
    """A completion through `router`: its status and the replica that answered it."""
    response = await request(router.url, "POST", "/v1/completions", completion(**fields))
    return response.status, response.header(b"x-lora-router-replica")


async def warm(router: RouterRuntime, replicas: list[Replica], **fields: Any) -> None:
    """One answered completion per replica, so each has an idle pooled connection."""
    for _ in range(2 * len(replicas)):
        if all(r.tasks for r in replicas):
            return
        assert (await answered_by(router, **fields))[0] == 200
    raise AssertionError("round-robin did not reach every replica")


async def test_a_completion_on_an_idle_pooled_connection_is_sent_without_a_task(
    replica_factory: StartReplica, router_factory: StartRouter
) -> None:
    replica = await Replica(ok).start(replica_factory)
    assert replica.fake is not None
    router = await router_factory(replica.fake.url)
    statuses = [(await answered_by(router))[0] for _ in range(3)]
    assert statuses == [200] * 3
    # The first had no pooled connection yet: the general path connected (a Task). The next
    # ones found the connection it left in the pool: sent from the parser callback.
    assert replica.tasks == [1, 0, 0]


async def test_the_general_path_is_taken_when_the_fast_path_is_off(
    path: str, replica_factory: StartReplica, router_factory: StartRouter
) -> None:
    replica = await Replica(ok).start(replica_factory)
    assert replica.fake is not None
    router = await router_factory(replica.fake.url)
    for _ in range(3):
        assert (await answered_by(router))[0] == 200
    assert replica.tasks == ([1, 0, 0] if path == "fast" else [1, 1, 1])


async def test_a_pooled_connection_reset_before_answering_is_resent_on_a_fresh_one(
    path: str, replica_factory: StartReplica, router_factory: StartRouter
) -> None:
    async def answer(req: Received, conn: ReplicaConn, n: int) -> None:
        await (reset(conn) if n == 1 else ok(req, conn, n))

    replica = await Replica(answer).start(replica_factory)
    assert replica.fake is not None
    router = await router_factory(replica.fake.url, breaker_failures=100)
    assert (await answered_by(router))[0] == 200
    assert (await answered_by(router))[0] == 200
    fake = replica.fake
    assert [r.conn for r in fake.requests] == [0, 0, 1]  # the reset one, again on a new one
    first, again = fake.requests[1], fake.requests[2]
    assert (first.header(b"x-request-id"), first.body) == (
        again.header(b"x-request-id"),
        again.body,
    )
    assert replica.tasks[1] == (0 if path == "fast" else 1)
    assert router.fleet is not None and router.fleet.replicas[0].breaker.failures == 0


async def retried_elsewhere(
    sick: Answer,
    path: str,
    replica_factory: StartReplica,
    router_factory: StartRouter,
    prepare: Callable[[RouterRuntime], Awaitable[None]] | None = None,
    **fields: Any,
) -> None:
    """Replica 0 answers its first completion, then fails every one by `sick`; a completion
    that reaches it after that is answered by replica 1."""
    replicas = [
        await Replica(sick).start(replica_factory),
        await Replica(ok).start(replica_factory),
    ]
    urls = [r.fake.url for r in replicas if r.fake is not None]
    router = await router_factory(*urls, breaker_failures=100)
    if prepare is not None:
        await prepare(router)
    await warm(router, replicas, **fields)
    for _ in range(4):  # round-robin: within two more, one goes to replica 0 first
        answered = len(replicas[1].tasks)
        status, label = await answered_by(router, **fields)
        assert status == 200
        if len(replicas[0].tasks) > 1:
            break
    assert len(replicas[0].tasks) > 1, "no completion reached the sick replica"
    assert label == b"1" and len(replicas[1].tasks) == answered + 1
    # Its first attempt: from the parser callback on the fast path, in a Task on the other.
    assert replicas[0].tasks[1] == (0 if path == "fast" else 1)


async def test_a_replica_resetting_before_answering_is_retried_on_the_next(
    path: str, replica_factory: StartReplica, router_factory: StartRouter
) -> None:
    # Reset on its pooled connection, then on the fresh one the pool tries: then replica 1.
    await retried_elsewhere(fails_from(1, reset), path, replica_factory, router_factory)


async def test_a_500_under_the_retry_rule_is_retried_on_the_next_replica(
    path: str, replica_factory: StartReplica, router_factory: StartRouter
) -> None:
    await retried_elsewhere(fails_from(1, error_500), path, replica_factory, router_factory)


async def test_a_404_for_a_live_adapter_is_retried_on_the_next_replica(
    path: str, replica_factory: StartReplica, router_factory: StartRouter
) -> None:
    async def load_pol_v1(router: RouterRuntime) -> None:
        body = orjson.dumps({"lora_name": "pol-v1", "lora_path": "/adapters/pol-v1"})
        loaded = await request(router.url, "POST", "/v1/load_lora_adapter", body)
        assert loaded.status == 200, loaded.body

    await retried_elsewhere(
        fails_from(1, adapter_404),
        path,
        replica_factory,
        router_factory,
        load_pol_v1,
        model="pol-v1",
    )


async def test_a_client_leaving_during_a_fast_exchange_stops_the_replicas_work(
    path: str, replica_factory: StartReplica, router_factory: StartRouter, clients: Any
) -> None:
    held: list[ReplicaConn] = []
    arrived = asyncio.Event()

    async def answer(req: Received, conn: ReplicaConn, n: int) -> None:
        if n == 0:
            await ok(req, conn, n)
            return
        held.append(conn)
        arrived.set()
        await conn.closed.wait()  # holds the answer until the router closes the connection

    replica = await Replica(answer).start(replica_factory)
    assert replica.fake is not None
    router = await router_factory(replica.fake.url)
    assert (await answered_by(router))[0] == 200
    client = await clients(router.url)
    body = completion()
    head = b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n" % len(body)
    await client.send(head + body)
    async with asyncio.timeout(5):
        await arrived.wait()
    client.writer.transport.abort()
    async with asyncio.timeout(5):
        await held[0].closed.wait()  # the router dropped the replica's connection
    assert replica.tasks[1] == (0 if path == "fast" else 1)
    assert router.fleet is not None and router.fleet.replicas[0].in_flight == 0
    assert router.app is not None
    async with asyncio.timeout(5):
        while ("/v1/completions", 499, b"0") not in router.app.stats.requests:
            await asyncio.sleep(0)  # the general path counts it once its Task is cancelled
