"""A real client, the openai SDK, streams a completion through the router from the emulator;
and a client that closes a stream at its `[DONE]` still has its answer's cached tokens
counted."""

from __future__ import annotations

import asyncio

import openai
import orjson
import pytest
from http_harness import (
    TOKEN,
    FakeReplica,
    Received,
    ReplicaConn,
    chunk,
    completion,
    json_response,
    post_completion,
    request,
)

from lora_router.emulator import EmulatorConfig, start_emulator


@pytest.fixture
async def emulator():
    emu = await start_emulator(EmulatorConfig(port=0, api_key=TOKEN))  # wants the router's token
    yield emu
    await emu.stop()


async def test_openai_sdk_streams_a_completion_through_the_router(router, emulator):
    rt = await router([emulator])
    client = openai.AsyncOpenAI(base_url=rt.url + "/v1", api_key="client-side-key")
    try:
        stream = await client.completions.create(
            model=emulator.config.model, prompt=[1, 2, 3, 4], max_tokens=8, stream=True
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert len(chunks) >= 2 and text

        plain = await client.completions.create(
            model=emulator.config.model, prompt="hello", max_tokens=4
        )
        assert plain.choices[0].text
    finally:
        await client.close()
    generation = [r for r in emulator.requests if r.path == "/v1/completions"]
    assert len(generation) == 2
    assert all(r.headers.get("Authorization") == f"Bearer {TOKEN}" for r in generation)


def _chunk(frame: dict[str, object]) -> bytes:
    return chunk(b"data: " + orjson.dumps(frame) + b"\n\n")


_FRAME = {"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "base"}
_STREAM = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    + _chunk({**_FRAME, "choices": [{"index": 0, "text": "hi", "finish_reason": "length"}]})
    + _chunk(
        {
            **_FRAME,
            "choices": [],
            "usage": {
                "prompt_tokens": 64,
                "completion_tokens": 1,
                "total_tokens": 65,
                "prompt_tokens_details": {"cached_tokens": 48},
            },
        }
    )
    + b"e\r\ndata: [DONE]\n\n\r\n"
)


@pytest.mark.parametrize("connection", ["new", "pooled"])
async def test_a_stream_its_client_closes_at_done_is_counted(
    router, replica_factory, clients, connection
) -> None:
    """A client that closes at `[DONE]`, before the replica's chunked terminator (as httpx-based
    SDKs may when they close the response there; it never comes here): the router counts the
    answer from the usage frame that passed, on a new replica connection and on a pooled one."""
    streaming: asyncio.Queue[ReplicaConn] = asyncio.Queue()

    async def respond(req: Received, conn: ReplicaConn) -> None:
        if b"stream" not in req.body:  # the warm-up: a text prompt, not counted
            await conn.write(json_response(orjson.dumps({**_FRAME, "choices": []})))
            return
        await conn.write(_STREAM)  # and no terminator: the router leaves first
        streaming.put_nowait(conn)

    replica: FakeReplica = await replica_factory(respond)
    rt = await router([replica], policy="prefix")  # round-robin predicts nothing
    if connection == "pooled":  # leaves an idle pooled connection to the replica
        warm = await request(rt.url, "POST", "/v1/completions", completion("warm"))
        assert warm.status == 200
    client = await clients(rt.url)
    body = completion(list(range(64)), stream=True, stream_options={"include_usage": True})
    await client.send(post_completion(body))
    got = b""
    async with asyncio.timeout(10):
        while b"data: [DONE]" not in got:
            got += await client.reader.read(65536)
        assert b'"cached_tokens":48' in got
        client.close()
        await (await streaming.get()).closed.wait()  # the router abandoned the answer's rest
    accuracy = (await request(rt.url, path="/router/status")).json()["routing_accuracy"]
    assert accuracy["answers"] == 1 and accuracy["unreported"] == 0, accuracy
    assert accuracy["reported_cached_tokens"] == 48
