"""Fixtures for the emulator's tests: emulators on free ports, a client session, adapters."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest

from lora_router.emulator import Emulator, EmulatorConfig, start_emulator, write_adapter

FRAME = re.compile(rb"data: (\{[^\n]*\}|\[DONE\])\n\n")


def frames_of(raw: bytes) -> list[bytes]:
    """Split an SSE body into data frames, insisting every byte belongs to one."""
    position, frames = 0, []
    while position < len(raw):
        match = FRAME.match(raw, position)
        assert match is not None, (
            f"bad framing at byte {position}: {raw[position : position + 60]!r}"
        )
        frames.append(match.group(1))
        position = match.end()
    return frames


StartEmulator = Callable[..., Awaitable[Emulator]]


@pytest.fixture
async def start() -> AsyncIterator[StartEmulator]:
    """Start emulators with `EmulatorConfig` keyword arguments; all are stopped afterwards."""
    started: list[Emulator] = []

    async def _start(**settings: object) -> Emulator:
        emulator = await start_emulator(EmulatorConfig(**settings))  # type: ignore[arg-type]
        started.append(emulator)
        return emulator

    yield _start
    for emulator in started:
        await emulator.stop()


@pytest.fixture
async def emu(start: StartEmulator) -> Emulator:
    """A default replica (vLLM 0.32, max_lora_rank 16)."""
    return await start()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def adapter(tmp_path: Path) -> Callable[..., str]:
    """Write an adapter directory under tmp_path and return its absolute path."""

    def _adapter(name: str = "trl-policy-v1", rank: int = 1) -> str:
        return str(write_adapter(tmp_path / ".vllm_lora" / name, rank=rank))

    return _adapter


async def load(client: aiohttp.ClientSession, emu: Emulator, name: str, path: str) -> None:
    """Load an adapter and insist it worked (setup step of many tests)."""
    async with client.post(
        emu.url + "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}
    ) as response:
        assert response.status == 200, await response.text()


async def complete(
    client: aiohttp.ClientSession, emu: Emulator, **body: object
) -> dict[str, object]:
    """A non-streamed completion that must succeed; returns the JSON body."""
    body.setdefault("prompt", list(range(40)))
    body.setdefault("max_tokens", 8)
    async with client.post(emu.url + "/v1/completions", json=body) as response:
        assert response.status == 200, await response.text()
        result: dict[str, object] = await response.json()
        return result


async def call(
    client: aiohttp.ClientSession, method: str, url: str, **kwargs: object
) -> tuple[int, bytes]:
    """One request, read completely; returns status and body."""
    async with client.request(method, url, **kwargs) as response:  # type: ignore[arg-type]
        return response.status, await response.read()


async def eventually(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    """Wait until `predicate()` holds, for state that has no event to await."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.002)
