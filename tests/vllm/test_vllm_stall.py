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

A replica stopped whole mid-stream (its API server and engine processes: a host that hangs or
is cut off) has its `/health` and `/metrics` hang, so its health checks eject it, never as
stalled; the stream then ends truncated SILENT_S (`--stall-timeout`) after its last byte, not
at `--idle-timeout` (the withdrawal rule's bound on the silence of a begun answer whose
replica is out of service).
"""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
# The whole replica stopped: two checks that time out eject it about 4-4.5 s after its stop (a
# streaming API server may answer /health in over a second: no shorter timeout), and the stall
# bound is set above that, so the cut is timed by that bound from the stream's last byte.
HEALTH_TIMEOUT_S = 2.0  # --health-timeout
SILENT_S = 6.0  # --stall-timeout
HUNG_S = 2.0  # its /health and /metrics, asked by the test itself, wait this long, unanswered
CUT_MARGIN_S = 0.5  # its stream's last byte may come this much before the SIGSTOP is signalled
CUT_WITHIN_S = 15.0  # from the SIGSTOP to the cut of its stream (--idle-timeout: 1,800 s)
ANSWERED_WITHIN_S = 60.0  # the routed completions (the default --first-byte-timeout: 1,800 s)
BACK_WITHIN_S = 60.0  # from the SIGCONT to the replica serving through the router again
LONG = 4000  # tokens, ignore_eos: about 10 s on a CPU replica, if nothing stops it
STREAM_TRIES = 4  # streamed completions sent through the router until one lands on replica 1
READ_S = ANSWERED_WITHIN_S + 10  # each read of a stream: past it, the read fails
# Both cases' router: round robin, so that a stream can be sent to the replica to stop.
ROUTER_FLAGS = (
    "--policy",
    "round-robin",
    "--health-interval",
    "0.25",
    "--control-timeout",
    str(CONTROL_S),
)
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
def _stopped(pid: int, group: bool = False) -> Iterator[None]:
    """The process (an engine process), or with `group` the process group it leads (a
    replica's API server and every engine process under it), stopped (SIGSTOP) for the block,
    continued after it whatever happens."""
    signal_to = os.killpg if group else os.kill
    signal_to(pid, signal.SIGSTOP)
    try:
        wait_for(f"process {pid} stopped", lambda: _state(pid) == "T", 10)
        yield
    finally:
        signal_to(pid, signal.SIGCONT)


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


def _no_answer(url: str, body: object = None, timeout: float = DIRECT_S) -> float:
    """Send a request to the stopped replica itself (POST `body`, or GET without one); the
    seconds it waited for no answer."""
    sent = time.monotonic()
    try:
        answer = http("POST" if body else "GET", url, body, token=TOKEN, timeout=timeout)
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


def _cut(
    streamed: Future[_Ended], signalled: float, within: float, router: Router
) -> tuple[_Ended, float]:
    """Wait, until `within` s after `signalled`, for the stream read in `streamed` to end: it
    must end truncated (the router closed the client's connection). Returns how it ended and
    the seconds from `signalled` to its end."""
    wait_for(
        "the stream is cut",
        streamed.done,
        max(0.0, signalled + within - time.monotonic()),
        [router.log],
    )
    cut = streamed.result()
    assert not cut.whole and b"data: [DONE]" not in cut.body, cut
    assert cut.at - signalled < within, cut.at - signalled
    return cut, cut.at - signalled


def _serves_again(router: Router, victim: Replica, base: str, continued: float) -> float:
    """Wait for the replica continued at `continued` to be admitted again, within BACK_WITHIN_S,
    and to take routed completions (round robin: two of four); the seconds it took."""
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
    return back


@pytest.mark.parametrize("hung", ["EngineCore", "Worker"])
def test_a_replica_whose_engine_hangs_is_ejected_and_returns_once_it_computes(
    fleet: list[Replica], routers: Callable[..., Router], base: str, hung: str
) -> None:
    router = routers(*ROUTER_FLAGS, "--stall-timeout", str(STALL_S))
    wait_for("both replicas serve", lambda: all(r["admitted"] for r in router.replicas()), 60)
    # Each replica has computed once (a cold replica's first prefill is no stall to time).
    for replica in fleet:
        assert _completion(replica.url, base, "warm up", 120).status == 200
    victim = fleet[1]
    engine = _engine_process(victim, hung)

    seen: list[str] = []  # replica 1's last_error, each new one as the router showed it
    with ThreadPoolExecutor(8) as pool:
        # The engine hangs mid-generation. A stream through the router runs there, its first
        # tokens read: it is cut when the stall rule ejects the replica (read on in a thread
        # until it ends). Beside it, a long completion sent to the replica itself: the stop
        # comes once both run, so neither can end before it however long finding a stream
        # that lands on the replica took (seconds, on a loaded machine: CI saw both end first).
        stream = _stream_on(router, base, "1")
        streamed = pool.submit(_read_to_end, stream)
        long_id = f"stall-{uuid.uuid4().hex[:8]}"
        long = pool.submit(_long_completion, victim, base, long_id)
        wait_for(
            "the long completion runs beside the stream",
            lambda: victim.metric("vllm:num_requests_running") == 2,
            60,
            [victim.log],
        )
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
                ask = {"model": base, "prompt": "are you there?", "max_tokens": 4}
                direct = pool.submit(_no_answer, victim.url + "/v1/completions", ask)
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
                cut, cut_after = _cut(streamed, signalled, ANSWERED_WITHIN_S, router)
                assert cut_after >= STALL_S, cut_after

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
    back = _serves_again(router, victim, base, continued)
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


def test_a_stream_on_a_replica_that_hangs_whole_ends_once_silent_that_long(
    fleet: list[Replica], routers: Callable[..., Router], base: str
) -> None:
    router = routers(
        *ROUTER_FLAGS,
        "--health-timeout",
        str(HEALTH_TIMEOUT_S),
        "--health-failures",
        "2",
        "--stall-timeout",
        str(SILENT_S),
    )
    wait_for("both replicas serve", lambda: all(r["admitted"] for r in router.replicas()), 60)
    for replica in fleet:  # a cold replica's first tokens come late: the stop is mid-stream
        assert _completion(replica.url, base, "warm up", 120).status == 200
    victim = fleet[1]
    assert victim.process is not None
    server = victim.process.pid  # the API server, which leads the replica's process group

    with ThreadPoolExecutor(4) as pool:
        # A stream through the router runs on the replica, its first tokens read: read on in a
        # thread until it ends.
        sent = time.monotonic()
        stream = _stream_on(router, base, "1")
        first = time.monotonic() - sent
        streamed = pool.submit(_read_to_end, stream)
        signalled = time.monotonic()
        with _stopped(server, group=True):
            # Whatever the router asks the replica hangs, /health (its checks fail) and /metrics
            # (its reports stop: the stall rule cannot judge it) alike.
            health = pool.submit(_no_answer, victim.url + "/health", None, HUNG_S)
            metrics = pool.submit(_no_answer, victim.url + "/metrics", None, HUNG_S)
            wait_for(
                "the health checks eject it",
                lambda: not router.replicas()[1]["admitted"],
                CUT_WITHIN_S,
                [router.log],
            )
            ejected_after = time.monotonic() - signalled
            # The stream goes on past the ejection until it has been silent SILENT_S, then ends
            # truncated: the router closed the client's connection.
            cut, cut_after = _cut(streamed, signalled, CUT_WITHIN_S, router)
            assert cut_after >= SILENT_S - CUT_MARGIN_S, (cut_after, ejected_after)
            hung = (health.result(), metrics.result())
            assert min(hung) >= HUNG_S - 0.5, hung
            out = router.replicas()[1]
            assert not out["admitted"] and "stalled" not in out["last_error"], out
            status = router.get("/router/status").json()
            assert status["health"]["stalls_detected"] == 0, status["health"]
            cuts = {r["id"]: r["cut_streams"] for r in status["replicas"]}
            assert cuts == {0: 0, 1: 1}, cuts
            assert "cut stream: " in router.log.read_text(errors="replace"), tail(router.log)
            # The other replica serves meanwhile.
            other = _completion(router.url, base, "the other one", 60)
            assert other.status == 200, other.text
            assert other.headers["x-lora-router-replica"] == "0"
        continued = time.monotonic()

    # Continued, it passes its checks again: the router replays it and routes to it.
    back = _serves_again(router, victim, base, continued)
    print(
        f"\nreplica stopped once its stream was read to a data line ({first:.1f} s): ejected "
        f"{ejected_after:.1f} s after SIGSTOP ({out['last_error']}); the stream cut "
        f"{cut_after:.1f} s after SIGSTOP ({len(cut.body):,} bytes of body after its first "
        f"data line); /health and /metrics unanswered after {hung[0]:.1f} s and "
        f"{hung[1]:.1f} s; serving {back:.1f} s after SIGCONT"
    )
