"""Over real sockets: the real-vLLM tier's harness (lora_router/testbed/vllm_harness.py) starts
the `lora-router` command and finds the port of the process it started, also when its log
already holds an earlier router's "listening" line (a log name that came back)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from emulated_fleet import StartEmulators

from lora_router.testbed.vllm_harness import start_router


async def test_a_router_is_found_on_its_own_port_in_a_log_an_earlier_router_wrote(
    emulators: StartEmulators, tmp_path: Path
) -> None:
    [emu] = await emulators(1)
    log = tmp_path / "router.log"
    stale = "INFO lora_router: lora-router listening on 127.0.0.1:9, 1 replicas (gone)\n"
    log.write_text(stale)
    # The harness blocks while it polls: off the loop the emulator answers on.
    router = await asyncio.to_thread(start_router, [emu], log)  # type: ignore[list-item]
    try:
        assert router.port not in (0, 9)
        health = await asyncio.to_thread(router.get, "/health")
        assert health.status == 200
        assert log.read_text().startswith(stale)  # appended to, never truncated
    finally:
        await asyncio.to_thread(router.stop)
