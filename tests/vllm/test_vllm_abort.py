"""Aborts through the router, against real vLLM 0.32 (issue #43 item 6): `/abort_requests` goes
to every replica, and a long completion it names ends early, as vLLM ends an aborted request.

vLLM knows a completion's prompt by `cmpl-<X-Request-Id>-<i>` (the router passes the header on
unchanged), and an empty `request_ids` aborts every request in flight. What the aborted client
gets is what these tests record (docs/operating.md#aborts): a 200 whose choice ends with
`finish_reason` "abort", before its `max_tokens`; a stream's last chunk says so, then `[DONE]`.

A long completion here is 4,000 tokens, about 10 s on a CPU replica: the tests wait until the
replica's own log says the engine holds it, then act within a second or so; nothing depends on
how much longer it would run.
"""

from __future__ import annotations

import json
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from http.client import HTTPResponse
from typing import Any

from lora_router.testbed.vllm_harness import Answer, Replica, Router, http

LONG = 4000  # tokens, ignore_eos: about 10 s on a CPU replica, if nothing stops it
ADDED_WITHIN_S = 120.0


def _body(base: str, request_id: str, stream: bool) -> dict[str, Any]:
    return {
        "model": base,
        "prompt": f"abort me {request_id}",
        "max_tokens": LONG,
        "ignore_eos": True,
        "stream": stream,
    }


def _long_completion(router: Router, base: str, request_id: str) -> Answer:
    body = _body(base, request_id, stream=False)
    headers = {"X-Request-Id": request_id}
    return http("POST", router.url + "/v1/completions", body, timeout=300, headers=headers)


def _wait_added(fleet: list[Replica], offsets: list[int], request_ids: list[str]) -> None:
    """Until every id's prompt is in a replica's engine (its log says `Added request cmpl-ID-0`;
    from then on an abort finds it). The log, not /metrics: a replica busy streaming answers
    /metrics seconds late, and a poll of it could miss a request that started and ended."""
    deadline = time.monotonic() + ADDED_WITHIN_S
    needles = [f"Added request cmpl-{i}-0-" for i in request_ids]
    while True:
        text = "".join(_since(r, offset) for r, offset in zip(fleet, offsets, strict=True))
        if all(n in text for n in needles):
            return
        assert time.monotonic() < deadline, f"{request_ids} not added on the replicas"
        time.sleep(0.1)


def _since(replica: Replica, offset: int) -> str:
    with replica.log.open("rb") as log:
        log.seek(offset)
        return log.read().decode("utf-8", "replace")


def _abort_all_directly(fleet: list[Replica]) -> None:
    """Whatever a test did, its long completions end with it (a failed test does not wait
    for their tokens): the dev route, on each replica itself."""
    for replica in fleet:
        http("POST", replica.url + "/abort_requests", {})


@contextmanager
def _in_flight(
    fleet: list[Replica], router: Router, base: str, ids: list[str]
) -> Iterator[list[Future[Answer]]]:
    """Long non-streamed completions through `router`, one per id, once the replicas' engines
    hold them all."""
    offsets = [r.log_size() for r in fleet]
    with ThreadPoolExecutor(len(ids)) as pool:
        try:
            futures = [pool.submit(_long_completion, router, base, i) for i in ids]
            _wait_added(fleet, offsets, ids)
            yield futures
        finally:
            _abort_all_directly(fleet)


def _ran_to_length(answer: Answer) -> bool:
    """Whether a long completion ran all its tokens (it ended before any abort came)."""
    return answer.status == 200 and answer.json()["usage"]["completion_tokens"] == LONG


def _aborted_early(answer: Answer) -> dict[str, Any]:
    assert answer.status == 200, answer.text
    doc: dict[str, Any] = answer.json()
    choice = doc["choices"][0]
    assert choice["finish_reason"] == "abort", choice
    assert doc["usage"]["completion_tokens"] < LONG, doc["usage"]
    return doc


def test_an_abort_by_id_ends_that_completion_early(
    fleet: list[Replica], routers: Callable[..., Router], base: str
) -> None:
    router = routers()
    mine = f"abort-{uuid.uuid4().hex[:8]}"
    with _in_flight(fleet, router, base, [mine]) as (aborted,):
        answer = router.post("/abort_requests", {"request_ids": [f"cmpl-{mine}-0"]})
        assert answer.status == 200, answer.text
        # What one vLLM answers (the number of ids named), from every replica.
        assert answer.json() == {"status": "aborted", "aborted": 1}
        assert answer.headers["x-lora-router-replica"] == "0,1"
        doc = _aborted_early(aborted.result(timeout=60))
        assert doc["id"] == f"cmpl-{mine}"


def _frame(stream: HTTPResponse) -> dict[str, Any] | None:
    """The next data frame of an SSE answer (None: `[DONE]`)."""
    while True:
        line = stream.readline()
        assert line, "the stream ended without [DONE]"
        if line.startswith(b"data: "):
            data = line[6:].strip()
            return None if data == b"[DONE]" else json.loads(data)


def test_an_abort_names_one_stream_and_ends_it_with_an_abort_chunk(
    fleet: list[Replica], router: Router, base: str
) -> None:
    mine = f"stream-{uuid.uuid4().hex[:8]}"
    request = urllib.request.Request(
        router.url + "/v1/completions",
        data=json.dumps(_body(base, mine, stream=True)).encode(),
        headers={"Content-Type": "application/json", "X-Request-Id": mine},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as stream:
            assert _frame(stream) is not None  # generating
            # An id no replica runs: every replica answers, and this stream goes on.
            other = router.post("/abort_requests", {"request_ids": [f"cmpl-not-{mine}-0"]})
            assert other.status == 200, other.text
            after = _frame(stream)
            assert after is not None and after["choices"][0]["finish_reason"] is None
            assert router.post("/abort_requests", {"request_ids": f"cmpl-{mine}-0"}).status == 200
            frames: list[dict[str, Any]] = []
            while (frame := _frame(stream)) is not None:
                frames.append(frame)
                assert len(frames) < LONG
    finally:
        _abort_all_directly(fleet)
    assert frames[-1]["choices"][0]["finish_reason"] == "abort", frames[-1]
    assert frames[-1]["id"] == f"cmpl-{mine}"


def test_an_empty_abort_ends_every_request_in_flight(
    fleet: list[Replica], routers: Callable[..., Router], base: str
) -> None:
    router = routers()
    # Both must still run when the abort comes: a replica's server once stalled 8 s before it
    # added its request (or logged that it had), while the other's ran all its tokens, once
    # finishing between the check below and the abort. A try where one ran to its length is
    # made again; in the others both were running, and both must have been aborted.
    for _ in range(3):
        ids = [f"all-{uuid.uuid4().hex[:8]}" for _ in range(2)]
        with _in_flight(fleet, router, base, ids) as running:
            if any(future.done() for future in running):
                continue
            answer = router.post("/abort_requests", {})
            answers = [future.result(timeout=60) for future in running]
        assert answer.status == 200, answer.text
        if any(_ran_to_length(a) for a in answers):
            continue
        assert answer.json()["status"] == "aborted"
        assert answer.json()["aborted"] >= 2  # the replicas' counts, summed
        for done in answers:
            _aborted_early(done)
        return
    raise AssertionError("no try had both completions running when the abort was sent")


def test_bad_abort_bodies_are_answered_as_vllm_answers_them(
    fleet: list[Replica], router: Router
) -> None:
    direct = http("POST", fleet[0].url + "/abort_requests", raw=b"")
    routed = http("POST", router.url + "/abort_requests", raw=b"")
    assert direct.status == routed.status == 400
    assert routed.json() == direct.json()  # {"error": {"message": "Invalid JSON format", ...}}
    direct = http("POST", fleet[0].url + "/abort_requests", [1])
    routed = router.post("/abort_requests", [1])
    assert direct.status == routed.status == 400
    assert routed.json() == direct.json()
    # The tier's replicas run without --enable-scale-out: vLLM answers the scale-out route 403,
    # and the router passes it on, naming the replica.
    routed = router.post("/inference/v1/abort_requests", {"request_ids": ["x"]})
    assert routed.status == 403, routed.text
    assert "--enable-scale-out" in routed.json()["error"]["message"]
    assert "Replica 0" in routed.json()["error"]["message"]
