"""Over real sockets: replicas that answer within a few milliseconds never stall the routed
path nor move a weight. When the pace rule took its samples from the answers' ends, one back
within the loop clock's millisecond read 0 s, a replica whose samples summed to 0 s made the
judgement divide by zero inside the answer's end callback, and the request hung there (wrk's 2
s timeout in bench/overhead.py); the rule now reads the replicas' /metrics (fleet/pace.py), and
the answer's end callback must still never stall."""

from __future__ import annotations

import asyncio

import aiohttp
from emulated_fleet import StartRouter
from helpers import call, router_status
from http_harness import Received as Got
from http_harness import ReplicaConn, json_response

# A completion with its usage, as vLLM reports it (its end is read for the cached tokens).
ANSWER = (
    b'{"id":"cmpl-1","object":"text_completion","choices":[{"index":0,"text":"abc",'
    b'"finish_reason":"length"}],"usage":{"prompt_tokens":4,"completion_tokens":3,'
    b'"total_tokens":7,"prompt_tokens_details":{"cached_tokens":0}}}'
)


async def instant(req: Got, conn: ReplicaConn) -> None:
    # The head, then the body in a read of its own (the end's reads hold the usage), at once.
    answer = json_response(ANSWER)
    split = answer.index(b"\r\n\r\n") + 4
    await conn.write(answer[:split])
    await asyncio.sleep(0)
    await conn.write(answer[split:])


async def test_answers_faster_than_the_clock_never_stall_a_request(
    replica_factory: object, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    replicas = [await replica_factory(instant) for _ in range(2)]  # type: ignore[operator]
    rt = await router(replicas, policy="prefix")  # the folder routes round robin
    for i in range(64):
        body = {"prompt": [1, 2, 3, i], "max_tokens": 3, "seed": i}
        async with asyncio.timeout(5):
            # Not aiohttp's own agent: the fake replica takes that for the control plane's.
            status, data, _ = await call(
                client, "POST", rt.url + "/v1/completions", body, headers={"User-Agent": "trl"}
            )
        assert status == 200, data
    assert all(len(r.requests) >= 8 for r in replicas)  # both answered
    weights = [r["weight"] for r in (await router_status(client, rt.url))["replicas"]]
    assert weights == [1.0, 1.0]
