"""`lora-router top` as a command: `--url HOST:PORT`, frames without a terminal, and Ctrl-C,
each against a live router."""

from __future__ import annotations

import re

from emulated_fleet import StartEmulators, StartRouter
from helpers import run_top
from interrupt import assert_one_line, interrupt_when_ready


async def test_top_once_takes_host_and_port(emulators: StartEmulators, router: StartRouter) -> None:
    rt = await router(await emulators(2))
    code, out, err = await run_top("--once", "--url", f"127.0.0.1:{rt.port}")
    assert code == 0, err
    assert out.startswith(f"lora-router http://127.0.0.1:{rt.port}  2/2 replicas serving")


async def test_a_url_that_is_no_router_address_is_a_usage_error() -> None:
    code, out, err = await run_top("--once", "--url", "ftp://127.0.0.1:8000")
    assert code == 2 and out == ""
    assert "give HOST:PORT (127.0.0.1:8000) or a URL" in err


async def test_top_without_a_terminal_prints_frames_until_ctrl_c(
    emulators: StartEmulators, router: StartRouter
) -> None:
    rt = await router(await emulators(1))
    argv = ["lora_router.cli", "top", "--url", f"127.0.0.1:{rt.port}", "--interval", "0.2"]
    # stdout is a pipe: the frames arrive as plain text, one after the other.
    result = await interrupt_when_ready(argv, r"(?s)(verdict: [^\n]*\n.*){2}")
    frames = re.findall(
        rf"(?m)^lora-router http://127\.0\.0\.1:{rt.port}  1/1 replicas", result.before
    )
    assert len(frames) >= 2 and "\x1b[" not in result.before  # no terminal codes
    assert_one_line(result, "lora-router top")
