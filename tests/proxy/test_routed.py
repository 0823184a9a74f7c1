"""The routed completion (proxy/routed.py) over real sockets: each move of a `RoutedRequest`
between its stages, seen from the client and the replicas, with the moves it made recorded
(`moves`); and the retry rule's cases, as they play out on the wire.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import pytest
from emulated_fleet import StartRouter
from http_harness import FakeReplica, Received, ReplicaConn, completion, json_response, request

from lora_router.proxy.routed import NEXT, RoutedRequest, Stage
from lora_router.runtime import RouterRuntime

StartReplica = Callable[..., Awaitable[FakeReplica]]
Answer = Callable[[Received, ReplicaConn, int], Awaitable[None]]
Move = tuple[Stage, Stage]

A, S, D, P = Stage.ADMITTED, Stage.SENT, Stage.DIVERTED, Stage.PASSED
ANSWERED, FAILED, GONE = Stage.ANSWERED, Stage.FAILED, Stage.GONE


@pytest.fixture
def moves(monkeypatch: pytest.MonkeyPatch) -> list[Move]:
    """Every move a routed request makes in this test, in order."""
    made: list[Move] = []
    move = RoutedRequest.move

    def recorded(self: RoutedRequest, stage: Stage) -> None:
        made.append((self.stage, stage))
        move(self, stage)

    monkeypatch.setattr(RoutedRequest, "move", recorded)
    return made


class Replica:
    """A fake replica that answers its n-th completion (from 0) by `answer(request, conn, n)`."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.completions = 0
        self.fake: FakeReplica | None = None

    async def respond(self, req: Received, conn: ReplicaConn) -> None:
        if req.target != b"/v1/completions":
            await conn.write(json_response())
            return
        n = self.completions
        self.completions += 1
        await self.answer(req, conn, n)

    async def start(self, replica_factory: StartReplica) -> Replica:
        self.fake = await replica_factory(self.respond)
        return self

    @property
    def url(self) -> str:
        assert self.fake is not None
        return self.fake.url


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


async def hold(conn: ReplicaConn) -> None:
    await conn.closed.wait()  # answers nothing until the router closes the connection


async def answered_by(rt: RouterRuntime, **fields: Any) -> tuple[int, bytes | None]:
    """A completion through `router`: its status and the replica that answered it."""
    response = await request(rt.url, "POST", "/v1/completions", completion(**fields))
    return response.status, response.header(b"x-lora-router-replica")


async def load_pol_v1(rt: RouterRuntime) -> None:
    body = orjson.dumps({"lora_name": "pol-v1", "lora_path": "/adapters/pol-v1"})
    loaded = await request(rt.url, "POST", "/v1/load_lora_adapter", body)
    assert loaded.status == 200, loaded.body


def within(moves: list[Move], window: list[Move]) -> bool:
    """Whether `window` was made, in a row, among `moves`."""
    n = len(window)
    return any(moves[i : i + n] == window for i in range(len(moves) - n + 1))


async def counted(rt: RouterRuntime, key: tuple[str, int, bytes]) -> None:
    """Waits (bounded) until the router counted a request under `key`."""
    assert rt.app is not None
    async with asyncio.timeout(5):
        while key not in rt.app.stats.requests:
            await asyncio.sleep(0.01)


def test_only_the_moves_of_next_are_allowed() -> None:
    job = RoutedRequest.__new__(RoutedRequest)
    for start, allowed in NEXT.items():
        for stage in Stage:
            job.stage = start
            if stage in allowed:
                job.move(stage)
                assert job.stage is stage
            else:
                with pytest.raises(RuntimeError):
                    job.move(stage)
                assert job.stage is start
    assert not NEXT[ANSWERED] and not NEXT[FAILED] and not NEXT[GONE]  # the ends


async def test_an_answer_passed_on_whole_goes_sent_passed_answered(
    moves: list[Move], replica_factory: StartReplica, router: StartRouter
) -> None:
    replica = await Replica(ok).start(replica_factory)
    rt = await router([replica])
    assert await answered_by(rt) == (200, b"0")
    assert moves == [(A, S), (S, P), (P, ANSWERED)]
    await counted(rt, ("/v1/completions", 200, b"0"))


async def test_a_reset_before_any_byte_goes_back_to_admitted_and_on_to_the_next_replica(
    moves: list[Move], replica_factory: StartReplica, router: StartRouter
) -> None:
    replicas = [
        await Replica(fails_from(0, reset)).start(replica_factory),
        await Replica(ok).start(replica_factory),
    ]
    rt = await router(replicas, breaker_failures=100)
    for _ in range(2):  # round-robin: one of two starts on replica 0
        assert (await answered_by(rt))[0] == 200
    assert replicas[0].completions >= 1
    assert (S, A) in moves  # replica 0 reset: admitted again, then replica 1 answered
    assert moves[-3:] == [(A, S), (S, P), (P, ANSWERED)]


async def test_a_pooled_connection_reset_before_answering_is_resent_on_a_fresh_one(
    moves: list[Move], replica_factory: StartReplica, router: StartRouter
) -> None:
    async def answer(req: Received, conn: ReplicaConn, n: int) -> None:
        await (reset(conn) if n == 1 else ok(req, conn, n))

    replica = await Replica(answer).start(replica_factory)
    rt = await router([replica], breaker_failures=100)
    assert (await answered_by(rt))[0] == 200
    assert (await answered_by(rt))[0] == 200
    fake = replica.fake
    assert fake is not None
    assert [r.conn for r in fake.requests] == [0, 0, 1]  # the reset one, again on a new one
    first, again = fake.requests[1], fake.requests[2]
    assert (first.header(b"x-request-id"), first.body) == (
        again.header(b"x-request-id"),
        again.body,
    )
    # The pool's re-send (http/upstream.py) is within one attempt: no move back.
    assert moves == [(A, S), (S, P), (P, ANSWERED)] * 2
    assert rt.fleet is not None and rt.fleet.replicas[0].breaker.failures == 0


async def test_a_500_held_back_goes_diverted_then_admitted_and_the_next_replica_answers(
    moves: list[Move], replica_factory: StartReplica, router: StartRouter
) -> None:
    replicas = [
        await Replica(fails_from(0, error_500)).start(replica_factory),
        await Replica(ok).start(replica_factory),
    ]
    rt = await router(replicas, breaker_failures=100)
    for _ in range(2):
        assert await answered_by(rt) == (200, b"1")
    assert replicas[0].completions >= 1
    assert within(moves, [(S, D), (D, A), (A, S), (S, P), (P, ANSWERED)])


async def test_a_404_for_a_live_adapter_is_retried_on_the_next_replica(
    moves: list[Move], replica_factory: StartReplica, router: StartRouter
) -> None:
    replicas = [
        await Replica(fails_from(0, adapter_404)).start(replica_factory),
        await Replica(ok).start(replica_factory),
    ]
    rt = await router(replicas, breaker_failures=100)
    await load_pol_v1(rt)
    for _ in range(2):
        assert await answered_by(rt, model="pol-v1") == (200, b"1")
    assert replicas[0].completions >= 1
    assert within(moves, [(S, D), (D, A), (A, S), (S, P), (P, ANSWERED)])


async def test_a_404_held_back_with_no_retry_left_fails_with_the_routers_answer(
    moves: list[Move], replica_factory: StartReplica, router: StartRouter
) -> None:
    replica = await Replica(fails_from(0, adapter_404)).start(replica_factory)
    rt = await router([replica], retries=0, breaker_failures=100)
    await load_pol_v1(rt)
    response = await request(rt.url, "POST", "/v1/completions", completion(model="pol-v1"))
    assert response.status == 502 and b"replayed" in response.body  # proxy/answers.py
    assert moves == [(A, S), (S, D), (D, FAILED)]


async def test_no_replica_left_after_a_reset_fails_from_admitted_with_a_503(
    moves: list[Move], replica_factory: StartReplica, router: StartRouter
) -> None:
    replica = await Replica(fails_from(0, reset)).start(replica_factory)
    rt = await router([replica], breaker_failures=100)
    response = await request(rt.url, "POST", "/v1/completions", completion())
    assert response.status == 503 and response.header(b"retry-after") is not None
    assert moves == [(A, S), (S, A), (A, FAILED)]


async def test_a_replica_silent_past_the_first_byte_timeout_fails_from_sent_with_a_504(
    moves: list[Move], replica_factory: StartReplica, router: StartRouter
) -> None:
    replica = await Replica(fails_from(0, hold)).start(replica_factory)
    rt = await router([replica], first_byte_timeout=0.2, breaker_failures=100)
    response = await request(rt.url, "POST", "/v1/completions", completion())
    assert response.status == 504  # a timeout is never retried: the replica may be working
    assert moves == [(A, S), (S, FAILED)]


async def test_a_stream_broken_after_its_head_fails_from_passed_and_closes_the_client(
    moves: list[Move], replica_factory: StartReplica, router: StartRouter, clients: Any
) -> None:
    async def broken(req: Received, conn: ReplicaConn, n: int) -> None:
        await conn.write(b'HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{"choices":')
        conn.abort()

    replica = await Replica(broken).start(replica_factory)
    rt = await router([replica], breaker_failures=100)
    client = await clients(rt.url)
    body = completion()
    head = b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n" % len(body)
    await client.send(head + body)
    received = await client.read_all(timeout=5)
    assert received.startswith(b"HTTP/1.1 200") and received.endswith(b'{"choices":')
    assert moves == [(A, S), (S, P), (P, FAILED)]


@pytest.mark.parametrize("answered", [False, True], ids=["sent", "passed"])
async def test_a_client_leaving_goes_gone_and_stops_the_replicas_work(
    answered: bool,
    moves: list[Move],
    replica_factory: StartReplica,
    router: StartRouter,
    clients: Any,
) -> None:
    held: list[ReplicaConn] = []
    arrived = asyncio.Event()

    async def answer(req: Received, conn: ReplicaConn, n: int) -> None:
        if answered:  # a head and the start of a body, the rest held
            await conn.write(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\n{")
        held.append(conn)
        arrived.set()
        await hold(conn)

    replica = await Replica(answer).start(replica_factory)
    rt = await router([replica])
    client = await clients(rt.url)
    body = completion()
    head = b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n" % len(body)
    await client.send(head + body)
    async with asyncio.timeout(5):
        await arrived.wait()
        if answered:
            assert (await client.reader.readuntil(b"{")).startswith(b"HTTP/1.1 200")
    client.writer.transport.abort()
    async with asyncio.timeout(5):
        await held[0].closed.wait()  # the router dropped the replica's connection
    await counted(rt, ("/v1/completions", 200 if answered else 499, b"0"))
    assert rt.fleet is not None and rt.fleet.replicas[0].in_flight == 0
    assert moves == ([(A, S), (S, P), (P, GONE)] if answered else [(A, S), (S, GONE)])


async def test_a_diverted_500_is_not_read_on_and_a_client_leaving_its_retry_goes_gone(
    moves: list[Move], replica_factory: StartReplica, router: StartRouter, clients: Any
) -> None:
    held: list[ReplicaConn] = []
    arrived = asyncio.Event()

    async def answer(req: Received, conn: ReplicaConn, n: int) -> None:
        if not held:  # the first replica asked: a 500 head, its body held
            await conn.write(b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 100\r\n\r\n{")
        held.append(conn)  # the second: no answer yet
        arrived.set()
        await hold(conn)

    replicas = [await Replica(answer).start(replica_factory) for _ in range(2)]
    rt = await router(replicas, breaker_failures=100)
    client = await clients(rt.url)
    body = completion()
    head = b"POST /v1/completions HTTP/1.1\r\nhost: r\r\ncontent-length: %d\r\n\r\n" % len(body)
    await client.send(head + body)
    async with asyncio.timeout(5):
        await arrived.wait()
        await held[0].closed.wait()  # diverted: closed at once, the rest of its body unread
        while len(held) < 2:  # the retry is on the other replica
            await asyncio.sleep(0.01)
    client.writer.transport.abort()
    async with asyncio.timeout(5):
        await held[1].closed.wait()
    await counted(rt, ("/v1/completions", 499, b"1"))
    assert moves == [(A, S), (S, D), (D, A), (A, S), (S, GONE)]
