"""The stall rule against real vLLM 0.32 (fleet/health.py, docs/design/fleet.md "Why an engine
that computes nothing is ejected"): a replica whose engine hangs while its API server runs is
ejected, its requests answered by the other replica, and it returns only once its engine
computes again.

The hang is a SIGSTOP, mid-generation (a long completion sent to the replica itself runs, and
a streamed one routed there), of one of the replica's engine processes: its engine core
(`VLLM::EngineCore`, a child of the API server: its scheduler loop), or the model worker the
CPU build runs under it (`VLLM::Worker`, the engine core's child: a hang in a kernel). What the
rule assumes of such a replica is checked on the replica itself too: its `/health` still
answers 200, its `/metrics` still answer with the token counters and the queue gauges as they
were when it stopped (though requests wait on it), and a completion sent to it gets no answer.
After a SIGCONT it answers again and the router takes it back.

A stream under way on the replica when its engine stops is cut at the ejection (the withdrawal
rule, http/upstream.py): a streamed completion of LONG tokens, routed to the replica and read
up to its first `data: ` line before the stop, ends within ANSWERED_WITHIN_S of the SIGSTOP and
no earlier than STALL_S after it, truncated (the router closes the client's connection: no
terminating chunk, no `data: [DONE]`), rather than wait out `--idle-timeout` (1,800 s); the
replica's `cut_streams` in `/router/status` counts it, and the router logs "cut stream:".
The router holds that stream on the replica from before the stop, so the stall, and with it
the answers to the completions routed there after the stop, is timed from the SIGSTOP.
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from http.client import HTTPResponse, IncompleteRead
from pathlib import Path

import pytest

from lora_router.testbed.vllm_harness import (
    TOKEN,
    Answer,
    Replica,
    Router,
    http,
    tail,
    wait_for,
)

STALL_S = 3.0  # --stall-timeout
CONTROL_S = 3.0  # --control-timeout: the one-token completion's bound
DIRECT_S = 5.0  # a completion sent to the stopped replica itself waits this long, unanswered
ANSWERED_WITHIN_S = 60.0  # the routed completions (the default --first-byte-timeout: 1,800 s)
BACK_WITHIN_S = 60.0  # from the SIGCONT to the replica serving through the router again
LONG = 4000  # tokens, ignore_eos: about 10 s on a CPU replica, if nothing stops it
STREAM_TRIES = 4  # streamed completions sent through the router until one lands on replica 1
READ_S = ANSWERED_WITHIN_S + 10  # each read of a stream: past it, the read fails
COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def _children(pid: int) -> list[int]:
    return [
        int(child)
        for task in Path(f"/proc/{pid}/task").iterdir()
        for child in (task / "children").read_text().split()
    ]


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def _engine_process(replica: Replica, title: str) -> int:
    """The pid of the replica's engine process whose title holds `title`: `EngineCore`, the
    one such child of its API server (the other is multiprocessing's resource tracker), or
    `Worker`, the one such child of that engine core."""
    assert replica.process is not None
    pid = replica.process.pid
    for wanted in dict.fromkeys(("EngineCore", title)):
        children = {child: _cmdline(child) for child in _children(pid)}
        found = [child for child, cmdline in children.items() if f"VLLM::{wanted}" in cmdline]
        assert len(found) == 1, (wanted, children)
        pid = found[0]
    return pid


def _state(pid: int) -> str:
    """The process's state letter in /proc/<pid>/stat (T: stopped)."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


@contextmanager
def _stopped(pid: int) -> Iterator[None]:
    """The engine core stopped (SIGSTOP) for the block, continued after it whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_for(f"engine core {pid} stopped", lambda: _state(pid) == "T", 10)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _page(replica: Replica) -> dict[str, float]:
    return {name: replica.metric(name) for name in COUNTERS + GAUGES}


def _completion(url: str, base: str, prompt: str, timeout: float) -> Answer:
    body = {"model": base, "prompt": prompt, "max_tokens": 4}
    return http("POST", url + "/v1/completions", body, token=TOKEN, timeout=timeout)


def _long_completion(replica: Replica, base: str, request_id: str) -> Answer:
    """A completion of LONG tokens sent to the replica itself (aborted by id when done with)."""
    body = {"model": base, "prompt": "a long one", "max_tokens": LONG, "ignore_eos": True}
    headers = {"X-Request-Id": request_id}
    return http(
        "POST", replica.url + "/v1/completions", body, token=TOKEN, timeout=300, headers=headers
    )


def _settled_page(replica: Replica) -> dict[str, float]:
    """The page once two reads a moment apart agree: what the engine reported just before it
    stopped may still be on its way to the API server."""
    previous = _page(replica)
    deadline = time.monotonic() + 5
    while True:
        time.sleep(0.2)
        page = _page(replica)
        if page == previous:
            return page
        assert time.monotonic() < deadline, f"/metrics still move: {previous} -> {page}"
        previous = page


def _no_answer(replica: Replica, base: str) -> float:
    """Send a completion to the replica itself; the seconds it waited for no answer."""
    sent = time.monotonic()
    try:
        answer = _completion(replica.url, base, "are you there?", DIRECT_S)
    except TimeoutError:
        return time.monotonic() - sent
    raise AssertionError(f"the stopped replica answered {answer.status}: {answer.text[:300]}")


@dataclass(slots=True)
class _Ended:
    """How a stream read to its end ended: `at` (monotonic), its body as read, and whether it
    ended whole (its terminating chunk came) or cut (the connection closed before it)."""

    at: float
    body: bytes
    whole: bool


def _stream_on(router: Router, base: str, rid: str) -> HTTPResponse:
    """A streamed completion of LONG tokens through the router that landed on replica `rid`
    (round robin alternates: one that landed elsewhere is closed and another sent,
    STREAM_TRIES at most), read up to its first `data: ` line. Every read is bounded (READ_S)."""
    landed = []
    for i in range(STREAM_TRIES):
        body = {"model": base, "prompt": f"a stream to cut {i}", "max_tokens": LONG}
        request = urllib.request.Request(
            router.url + "/v1/completions",
            data=json.dumps({**body, "ignore_eos": True, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        stream: HTTPResponse = urllib.request.urlopen(request, timeout=READ_S)
        landed.append(stream.headers["x-lora-router-replica"])
        if landed[-1] == rid:
            while not (line := stream.readline()).startswith(b"data: "):
                assert line, "the stream ended before its first data line"
            return stream
        stream.close()
    raise AssertionError(f"no stream landed on replica {rid}: {landed}")


def _read_to_end(stream: HTTPResponse) -> _Ended:
    """Read `stream` on until it ends: whole, or cut (`IncompleteRead`: the
    connection closed before the terminating chunk)."""
    try:
        body, whole = stream.read(), True
    except IncompleteRead as cut:
        body, whole = cut.partial, False
    return _Ended(time.monotonic(), body, whole)


@pytest.mark.parametrize("hung", ["EngineCore", "Worker"])
def test_a_replica_whose_engine_hangs_is_ejected_and_returns_once_it_computes(
    fleet: list[Replica], routers: Callable[..., Router], base: str, hung: str
) -> None:
    router = routers(
        "--policy",
        "round-robin",
        "--health-interval",
        "0.25",
        "--stall-timeout",
        str(STALL_S),
        "--control-timeout",
        str(CONTROL_S),
    )
    wait_for("both replicas serve", lambda: all(r["admitted"] for r in router.replicas()), 60)
    # Each replica has computed once (a cold replica's first prefill is no stall to time).
    for replica in fleet:
        assert _completion(replica.url, base, "warm up", 120).status == 200
    victim = fleet[1]
    engine = _engine_process(victim, hung)

    seen: list[str] = []  # replica 1's last_error, each new one as the router showed it
    with ThreadPoolExecutor(8) as pool:
        # The engine hangs mid-generation: a long completion, sent to the replica itself (the
        # router holds nothing on it yet), runs when it stops.
        long_id = f"stall-{uuid.uuid4().hex[:8]}"
        long = pool.submit(_long_completion, victim, base, long_id)
        wait_for(
            "the long completion runs",
            lambda: victim.metric("vllm:num_requests_running") == 1,
            60,
            [victim.log],
        )
        # A stream through the router runs there too, its first tokens read: it is cut when
        # the stall rule ejects the replica (read on in a thread until it ends).
        stream = _stream_on(router, base, "1")
        streamed = pool.submit(_read_to_end, stream)
        try:
            signalled = time.monotonic()
            with _stopped(engine):
                stopped_at = time.monotonic()
                # 1. Its /health answers as before: the API server asks the engine nothing.
                assert victim.healthy()
                before = _settled_page(victim)
                # The long completion and the stream.
                assert before["vllm:num_requests_running"] == 2, before
                # 3. A completion sent to it meanwhile gets no answer.
                direct = pool.submit(_no_answer, victim, base)
                # Round robin: three of the six go to the stopped replica and wait there until
                # the stall rule ejects it and they are retried on replica 0.
                sent = time.monotonic()
                routed = [
                    pool.submit(
                        _completion, router.url, base, f"stalled prompt {i}", 2 * ANSWERED_WITHIN_S
                    )
                    for i in range(6)
                ]

                def answered() -> bool:
                    error = router.replicas()[1]["last_error"]
                    if not seen or seen[-1] != error:
                        seen.append(error)
                    return all(future.done() for future in routed)

                wait_for(
                    "the routed completions are answered",
                    answered,
                    ANSWERED_WITHIN_S,
                    [router.log],
                )
                answered_at = time.monotonic()
                took = answered_at - sent
                answers = [future.result() for future in routed]
                assert [a.status for a in answers] == [200] * 6, [a.text[:200] for a in answers]
                assert {a.headers["x-lora-router-replica"] for a in answers} == {"0"}
                # Not before the stall: the router held the stream on it since before the stop,
                # so its stall is timed from the stop, not from these completions' send.
                assert took < ANSWERED_WITHIN_S, took
                assert answered_at - signalled >= STALL_S, (took, sent - signalled)
                ejections = [e for e in seen if e.startswith("stalled: it computed no token for")]
                assert ejections and "request(s) on it" in ejections[0], seen
                unanswered = direct.result()
                assert unanswered >= DIRECT_S - 0.5
                # The stream ends at the ejection, truncated: the router closed the connection.
                wait_for(
                    "the stream is cut",
                    streamed.done,
                    max(0.0, signalled + ANSWERED_WITHIN_S - time.monotonic()),
                    [router.log],
                )
                cut = streamed.result()
                cut_after = cut.at - signalled
                assert STALL_S <= cut_after < ANSWERED_WITHIN_S, cut_after
                assert not cut.whole and b"data: [DONE]" not in cut.body, cut

                # While it is still stopped it stays out: its /health passes, the one-token
                # completion asked before its replay does not (the ejection's reason names
                # that completion too).
                wait_for(
                    "the one-token completion fails",
                    lambda: "a one-token completion got" in router.replicas()[1]["last_error"],
                    30,
                    [router.log],
                )
                out = router.replicas()[1]
                assert not out["admitted"], out
                seen.append(out["last_error"])
                assert victim.healthy()
                status = router.get("/router/status").json()
                assert status["health"]["stalls_detected"] == 1, status["health"]
                cuts = {r["id"]: r["cut_streams"] for r in status["replicas"]}
                assert cuts == {0: 0, 1: 1}, cuts
                logged = router.log.read_text(errors="replace")
                assert "cut stream: " in logged, tail(router.log)
                # 2. Its /metrics answer, and nothing moved on them in all that time, the
                # queue gauges included: they still show the two requests running, and none of
                # the requests waiting on it since.
                after = _page(victim)
                still = time.monotonic() - stopped_at
                assert still >= STALL_S
                assert after == before, (before, after, still)
            continued = time.monotonic()
        finally:
            http("POST", victim.url + "/abort_requests", {"request_ids": [f"cmpl-{long_id}-0"]})
        ended = long.result(timeout=120)
        assert ended.status == 200, ended.text

    # 4. It computes again: the router replays it and routes to it.
    wait_for(
        "the continued replica serves again",
        lambda: router.replicas()[1]["admitted"],
        BACK_WITHIN_S,
        [router.log, victim.log],
    )
    back = time.monotonic() - continued
    assert back < BACK_WITHIN_S
    served = {
        _completion(router.url, base, f"back {i}", 60).headers["x-lora-router-replica"]
        for i in range(4)
    }
    assert served == {"0", "1"}, served
    moved = _page(victim)
    assert all(moved[c] > after[c] for c in COUNTERS), (after, moved)
    long_end = ended.json()
    print(
        f"\nstall ({hung} stopped): 6 routed answered in {took:.1f} s "
        f"({answered_at - signalled:.1f} s after SIGSTOP); {seen}; "
        f"the stream cut {cut_after:.1f} s after SIGSTOP ({len(cut.body):,} bytes of body "
        f"after its first data line); "
        f"direct completion unanswered after {unanswered:.1f} s; "
        f"/metrics {before} -> {after} over {still:.1f} s stopped; "
        f"serving {back:.1f} s after SIGCONT; then {moved}; {status['retries']}; "
        f"the long completion: {long_end['choices'][0]['finish_reason']}, "
        f"{long_end['usage']['completion_tokens']} tokens"
    )
