"""Ctrl-C, as a user sends it: a real process, interrupted once it is ready, judged by its exit.

A command is ready when what it prints shows so (a banner, a log line, a first frame): the
helper waits for that event, never for a guessed time.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass

INTERRUPTED = 130  # 128 + SIGINT


@dataclass(slots=True)
class Interrupted:
    status: int
    before: str  # what the ready stream showed up to the interrupt
    after: str  # stderr from the interrupt on (all of it, when readiness showed on stdout)


async def interrupt_when_ready(
    argv: Sequence[str],
    ready: str | asyncio.Event,
    *,
    on: str = "stdout",
    env: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> Interrupted:
    """Run `python -m ARGV`, wait until its `on` stream ("stdout" or "stderr") matches the
    regex `ready` (or until the event `ready` is set), send SIGINT, and wait for the exit."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    stream = proc.stdout if on == "stdout" else proc.stderr
    assert stream is not None and proc.stdout is not None and proc.stderr is not None
    seen = b""
    try:
        async with asyncio.timeout(timeout):
            if isinstance(ready, asyncio.Event):
                await ready.wait()
            while isinstance(ready, str) and not re.search(ready.encode(), seen):
                chunk = await stream.read(4096)
                assert chunk, f"exited ({await proc.wait()}) before {ready!r}: {seen!r}"
                seen += chunk
        proc.send_signal(signal.SIGINT)
        async with asyncio.timeout(timeout):
            _, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return Interrupted(proc.returncode, seen.decode(), err.decode())


def assert_one_line(result: Interrupted, prog: str) -> None:
    """The interrupt ended the command the documented way: status 130, one line on stderr
    (as a terminal shows it: a progress bar redrawn with carriage returns, then cleared, is
    not a line)."""
    assert result.status == INTERRUPTED, result
    shown = [line.rsplit("\r", 1)[-1] for line in result.after.split("\n")]
    assert [line for line in shown if line.strip()] == [f"{prog}: interrupted"], result
