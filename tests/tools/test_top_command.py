"""`lora-router top` as a command: `--url HOST:PORT`, frames without a terminal, and Ctrl-C,
each against a live router."""

from __future__ import annotations

import asyncio
import re

import aiohttp
from emulated_fleet import StartEmulators, StartRouter
from helpers import call, complete, run_top, until
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


def verdict_line(out: str) -> str:
    """The verdict of one frame, unwrapped (the terminal's width wraps it)."""
    return " ".join(out.split("verdict:", 1)[1].split())


async def test_top_names_a_paused_fleet_with_a_request_waiting(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    rt = await router(await emulators(1))
    assert (await call(client, "POST", rt.url + "/pause?mode=keep"))[0] == 200
    # vLLM queues a request while paused with mode=keep: it stays in flight.
    waiting = asyncio.create_task(complete(client, rt.url))
    await until(lambda: rt.fleet is not None and rt.fleet.replicas[0].in_flight == 1)
    code, out, err = await run_top("--once", "--url", rt.url)
    assert code == 0, err
    assert verdict_line(out).startswith(
        "paused: the fleet is paused (mode=keep) with 1 request(s) in flight and 0 waiting at "
        "the fence; a trainer that stopped between /pause and /resume? POST /resume"
    )
    assert (await call(client, "POST", rt.url + "/resume"))[0] == 200
    assert (await waiting)[0] == 200


async def test_top_names_a_fleet_with_no_replica_in_service_and_why(
    emulators: StartEmulators, router: StartRouter
) -> None:
    rt = await router(await emulators(1, api_key="guarded"))  # the router sends no token
    code, out, err = await run_top("--once", "--url", rt.url)
    assert code == 0, err
    line = verdict_line(out)
    assert line.startswith("down: no replica is in service; replica 0: at start: HTTP 401")
    assert "none was sent" in line and "idle" not in line


async def test_top_names_a_replica_without_dev_mode_when_it_is_the_only_one(
    emulators: StartEmulators, router: StartRouter
) -> None:
    rt = await router(await emulators(1, dev_mode=False))
    code, out, err = await run_top("--once", "--url", rt.url)
    assert code == 0, err
    assert verdict_line(out).startswith(
        "misconfigured: no replica in service can take part in a weight sync; replica 0: "
        "dev mode is off: /pause, /resume and /server_info do not exist; fix: start it with "
        "VLLM_SERVER_DEV_MODE=1"
    )
