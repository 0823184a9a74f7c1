"""Fixtures for the emulator's tests: emulators on free ports, and SSE framing (the shared helpers:
tests/helpers.py)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from lora_router.emulator import Emulator, EmulatorConfig, start_emulator

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
