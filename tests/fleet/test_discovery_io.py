"""Discovery's I/O never stalls the router and its reports stay bounded (fleet/discovery.py,
issue 44): a `--replicas-file` replaced by a FIFO is refused with a log line naming it while
the router keeps answering and stops on SIGTERM; 20,000 skipped entries give one WARNING and
a small `/router/status`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import sys
import time
from pathlib import Path

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import call, until

from lora_router.fleet.discovery import SKIPPED_SHOWN, FileSource, SourceError


async def _line(stream: asyncio.StreamReader, pattern: bytes, seen: list[bytes]) -> re.Match:
    """Read lines until one matches `pattern` (the caller bounds the time)."""
    while True:
        line = await stream.readline()
        assert line, b"".join(seen)
        seen.append(line)
        if found := re.search(pattern, line):
            return found


async def test_a_fifo_as_the_replica_file_is_refused_and_the_router_keeps_answering(
    emulators: StartEmulators, client: aiohttp.ClientSession, tmp_path: Path
) -> None:
    (emu,) = await emulators(1)
    members = tmp_path / "replicas"
    members.write_text(f"{emu.url}\n")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lora_router.cli",
        "--replicas",
        emu.url,
        "--no-token",
        "--replicas-file",
        str(members),
        "--replica-hosts",
        "127.0.0.0/8",
        "--port",
        "0",
        "--shutdown-grace",
        "2",
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    seen: list[bytes] = []
    try:
        async with asyncio.timeout(20):
            port = int((await _line(proc.stderr, rb"listening on [\d.]+:(\d+)", seen))[1])
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        os.replace(fifo, members)
        async with asyncio.timeout(10):  # the next poll (FILE_POLL_S) reads it
            line = await _line(proc.stderr, rb"not a regular file \(a FIFO\)", seen)
        assert str(members).encode() in line.string
        url = f"http://127.0.0.1:{port}"
        async with asyncio.timeout(5):
            assert (await call(client, "GET", url + "/health"))[0] == 200
            assert (await call(client, "GET", url + "/v1/models"))[0] == 200
        start = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            code = await proc.wait()
        assert code == 0 and time.monotonic() - start < 2 + 3  # within its grace
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@pytest.mark.parametrize(
    ("kind", "refusal"),
    [
        ("directory", r"not a regular file \(a directory\)"),
        ("device", r"not a regular file \(a character device\)"),
        ("oversized", "larger than 100 bytes"),
    ],
)
async def test_only_a_regular_file_within_the_cap_is_read(
    tmp_path: Path, kind: str, refusal: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "replicas"
    if kind == "directory":
        path.mkdir()
    elif kind == "device":
        path = Path("/dev/null")  # a character device
    else:
        monkeypatch.setattr("lora_router.fleet.discovery.MAX_FILE_BYTES", 100)
        path.write_text("http://127.0.0.1:8000\n" * 10)
    with pytest.raises(SourceError, match=refusal):
        async with asyncio.timeout(5):
            await FileSource(str(path)).read()


async def test_many_skipped_entries_give_one_warning_and_a_small_status(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="lora_router")
    first, member = await emulators(2)
    members = tmp_path / "replicas"
    outside = "".join(f"http://127.0.0.2:{1 + i % 60000}/p{i}\n" for i in range(20_000))
    members.write_text(f"{member.url}\n{outside}")
    rt = await router(
        [first], replicas_files=(str(members),), replica_hosts=("127.0.0.1",), discovery_grace=30
    )
    assert rt.discovery is not None
    state = rt.discovery.states[0]
    await until(lambda: state.skipped_count == 20_000, timeout=20)
    warnings = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(warnings) == 1 and "20000 new entries" in warnings[0].getMessage()
    code, body, _ = await call(client, "GET", rt.url + "/router/status")
    assert code == 200 and len(body) < 64 * 1024
    assert len(state.skipped) == SKIPPED_SHOWN
