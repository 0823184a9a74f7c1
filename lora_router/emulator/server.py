"""A running emulated replica: start, crash, restart and stop it on a fixed port.

`start_emulator(config)` is what tests and the CLI call. The returned `Emulator` exposes the
engine (`state`), the fault switches (`faults`), every request received (`requests`), and the
lifecycle a router must survive:
- `crash()` stops listening and cuts every connection (connection refused from then on);
- `restart()` comes back on the same port as a fresh process would: no adapters, not paused,
  empty caches (the fault switches stay as set, except `dead`, which a restart cures);
- `stop()` shuts down for good.
With `config.kv_events_config` enabled, each process publishes its cache's KV events
(kv_events.py): a crash closes the publisher, a restart starts a new one (sequence from 0) on
the endpoints the first one bound.
The same object serves either the aiohttp application or, with `config.fast`, the raw protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

from aiohttp import web

from lora_router.emulator import fast
from lora_router.emulator.app import build_app
from lora_router.emulator.config import EmulatorConfig
from lora_router.emulator.control import RecordedRequest
from lora_router.emulator.engine import Engine
from lora_router.emulator.faults import Faults
from lora_router.emulator.kv_events import KvEventPublisher

# Handlers are cancelled as their connections drop, so shutdown never waits long for them.
_SHUTDOWN_TIMEOUT_S = 1.0


class Emulator:
    """One emulated vLLM replica listening on `url`."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.faults: Faults = config.faults
        self.requests: list[RecordedRequest] = []
        self.background: set[asyncio.Task[None]] = set()
        self.host = config.host
        self.port = config.port
        self._engine = Engine(config)
        self._runner: web.AppRunner | None = None
        self._fast: fast.FastServer | None = None
        self._lifecycle = asyncio.Lock()
        self.kv_publisher: KvEventPublisher | None = None
        self._kv_bound: tuple[str, str | None] | None = None

    @property
    def state(self) -> Engine:
        """The engine of the current process (a new one after each restart)."""
        return self._engine

    @property
    def url(self) -> str:
        scheme = "https" if self.config.ssl is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    @property
    def listening(self) -> bool:
        return self._runner is not None or self._fast is not None

    async def start(self) -> None:
        async with self._lifecycle:
            await self._listen()

    async def restart(self, *, events_elsewhere: bool = False) -> None:
        """Come back (from a crash, or while running) as a freshly started replica;
        `events_elsewhere`: its KV events bound anew (`tcp://*:0`: on other ports), as a
        process started with another `--kv-events-config`."""
        async with self._lifecycle:
            await self._close(abrupt=False)
            self._engine.abort_all()
            await self._stop_events()
            if events_elsewhere:
                self._kv_bound = None
            self._engine = Engine(self.config)
            self.faults.dead = False
            self.faults.reset_load_attempts()
            await self._listen()

    async def crash(self) -> None:
        """Stop listening and cut every open connection, like a killed process."""
        async with self._lifecycle:
            await self._close(abrupt=True)
            self._engine.abort_all()
            await self._stop_events()

    async def stop(self) -> None:
        async with self._lifecycle:
            await self._close(abrupt=False)
            self._engine.abort_all()
            await self._stop_events()
        for task in list(self.background):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def kv_event_sources(self) -> dict[str, Any]:
        """`GET /kv_event_sources`: where this process publishes, by DP rank ({}: nowhere)."""
        return self.kv_publisher.sources() if self.kv_publisher is not None else {}

    async def stop_kv_events(self) -> None:
        """Stop publishing while serving on (a publisher that went away, for tests)."""
        async with self._lifecycle:
            await self._stop_events()

    async def _start_events(self) -> None:
        kv = self.config.kv_events_config
        if kv is None or not kv.enabled or self.kv_publisher is not None:
            return
        publisher = KvEventPublisher(kv, self.host, self._kv_bound)
        await publisher.start()
        self._kv_bound = (publisher.endpoint, publisher.replay_endpoint)
        self.kv_publisher = publisher
        self._engine.kv_sink = publisher.publish

    async def _stop_events(self) -> None:
        publisher, self.kv_publisher = self.kv_publisher, None
        self._engine.kv_sink = None
        if publisher is not None:
            await publisher.stop()

    async def _listen(self) -> None:
        if self.listening:
            return
        await self._start_events()
        if self.config.fast:
            self._fast = await fast.serve(self, self.host, self.port, self.config.ssl)
            self.port = self._fast.port
            return
        runner = web.AppRunner(
            build_app(self),
            handle_signals=False,
            handler_cancellation=True,  # a client that goes away cancels its generation
            shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
            access_log=None,
        )
        await runner.setup()
        site = web.TCPSite(
            runner, self.host, self.port, ssl_context=self.config.ssl, reuse_address=True
        )
        try:
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        address: Any = runner.addresses[0]
        self.port = int(address[1])

    async def _close(self, abrupt: bool) -> None:
        if self._fast is not None:
            server, self._fast = self._fast, None
            await server.close(abrupt)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            server_obj = runner.server
            if server_obj is not None:
                for handler in server_obj.connections:
                    transport = handler.transport
                    if transport is not None:
                        # abort() drops unsent bytes (a killed process); close() flushes them
                        # (a restart answered over the admin route must still reach the client).
                        transport.abort() if abrupt else transport.close()
            await runner.cleanup()


async def start_emulator(config: EmulatorConfig | None = None) -> Emulator:
    """Start a replica and return once it accepts connections."""
    emulator = Emulator(config or EmulatorConfig())
    await emulator.start()
    return emulator
