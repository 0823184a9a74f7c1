"""Real clients against the emulator: the openai SDK, https with a private CA, the command."""

from __future__ import annotations

import asyncio
import ssl
import sys

import aiohttp
import openai
import pytest
import trustme
from helpers import call

from .conftest import StartEmulator


async def test_openai_sdk_reads_a_completion(start: StartEmulator) -> None:
    emu = await start(api_key="sk-test")
    sdk = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="sk-test")
    try:
        completion = await sdk.completions.create(
            model="Qwen/Qwen2.5-Math-1.5B",
            prompt="1+1=",
            max_tokens=5,
            logprobs=1,
            seed=3,
            extra_body={"ignore_eos": True},
        )
    finally:
        await sdk.close()
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage is not None and completion.usage.completion_tokens == 5
    assert completion.choices[0].logprobs is not None
    assert len(completion.choices[0].logprobs.token_logprobs or []) == 5


async def test_openai_sdk_reads_a_completion_stream(start: StartEmulator) -> None:
    emu = await start(api_key="sk-test")
    sdk = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="sk-test")
    try:
        stream = await sdk.completions.create(
            model="Qwen/Qwen2.5-Math-1.5B",
            prompt="1+1=",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
    finally:
        await sdk.close()
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert len(texts) == 6
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


async def test_openai_sdk_reads_a_chat_stream(start: StartEmulator) -> None:
    emu = await start()
    sdk = openai.AsyncOpenAI(base_url=emu.url + "/v1", api_key="unused")
    try:
        stream = await sdk.chat.completions.create(
            model="Qwen/Qwen2.5-Math-1.5B",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=4,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
    finally:
        await sdk.close()
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_an_https_replica_serves_with_a_private_ca(start: StartEmulator) -> None:
    ca = trustme.CA()
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_context)
    emu = await start(ssl=server_context)
    assert emu.url.startswith("https://")
    client_context = ssl.create_default_context()
    ca.configure_trust(client_context)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_context)) as client:
        assert (await call(client, "GET", emu.url + "/health"))[:2] == (200, b"")
        status, _, _ = await call(
            client,
            "POST",
            emu.url + "/v1/completions",
            json={"prompt": [1], "max_tokens": 2, "stream": True},
        )
        assert status == 200


@pytest.mark.parametrize("fast", [False, True])
async def test_the_command_serves_a_replica(fast: bool, unused_tcp_port: int) -> None:
    args = [
        sys.executable,
        "-m",
        "lora_router.emulator",
        "--port",
        str(unused_tcp_port),
        "--vllm-version",
        "0.27",
    ] + (["--fast"] if fast else [])
    process = await asyncio.create_subprocess_exec(*args, stdout=asyncio.subprocess.PIPE)
    try:
        assert process.stdout is not None
        banner = await asyncio.wait_for(process.stdout.readline(), timeout=20)
        assert f"127.0.0.1:{unused_tcp_port}".encode() in banner
        async with aiohttp.ClientSession() as client:
            url = f"http://127.0.0.1:{unused_tcp_port}"
            assert (await call(client, "GET", url + "/version"))[:2] == (
                200,
                b'{"version":"0.27.1"}',
            )
    finally:
        process.terminate()
        assert await asyncio.wait_for(process.wait(), timeout=10) == 0
