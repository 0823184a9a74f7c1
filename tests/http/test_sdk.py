"""A real client, the openai SDK, streams a completion through the router from the emulator."""

from __future__ import annotations

import openai
import pytest
from http_harness import TOKEN

from lora_router.emulator import EmulatorConfig, start_emulator


@pytest.fixture
async def emulator():
    emu = await start_emulator(EmulatorConfig(port=0, api_key=TOKEN))  # wants the router's token
    yield emu
    await emu.stop()


async def test_openai_sdk_streams_a_completion_through_the_router(router_factory, emulator):
    router = await router_factory(emulator.url)
    client = openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="client-side-key")
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
