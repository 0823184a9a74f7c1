"""Replicas behind an in-process router, for every test folder (a plugin of tests/conftest.py):
`emulators` on free ports, the invariant monitor, and `router`, the one way a test starts a
router in the test's process: `await router(replicas, **overrides)`, in front of emulators, fake
replicas (tests/http_harness.py) or replicas' URLs, with the folder's `router_settings` (`FAST`
here; tests/data_plane.py's for tests/http and tests/proxy) under the test's overrides.
`start_router` is the same start for code that runs its own loop (a Hypothesis state machine).

`FenceMonitor` watches the fence's invariant from the replicas' side: every time an emulated
replica resolves the model of a completion naming an adapter, it records a violation unless
that replica holds the adapter and every replica the router counts as live holds it too.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, Protocol

import aiohttp
import pytest
from helpers import call, complete, load, router_config

from lora_router.emulator import Emulator, EmulatorConfig, Engine, start_emulator
from lora_router.runtime import RouterRuntime

# Short deadlines so every timeout path ends within a test's budget; no background health
# checks unless a test asks for them.
FAST = dict(
    port=0,
    connect_timeout=1.0,
    first_byte_timeout=10.0,
    idle_timeout=10.0,
    fence_timeout=5.0,
    load_retry_interval=0.02,
    load_deadline=3.0,
    health_interval=3600.0,
    health_timeout=1.0,
    health_failures=2,
    health_successes=1,
    shutdown_grace=2.0,
    status_interval=0.0,
)

StartEmulators = Callable[..., Awaitable[list[Emulator]]]
StartRouter = Callable[..., Awaitable[RouterRuntime]]


class Addressed(Protocol):
    """A replica a test started: an emulator or a fake replica."""

    @property
    def url(self) -> str: ...


async def start_router(replicas: Iterable[Addressed | str], **settings: Any) -> RouterRuntime:
    """A router started in front of `replicas` (replicas, or URLs: a process of its own, a port
    nothing listens on) with exactly `settings`; the caller stops it."""
    urls = (r if isinstance(r, str) else r.url for r in replicas)
    runtime = RouterRuntime(router_config(urls, **settings))
    await runtime.start()
    return runtime


class FenceMonitor:
    """Records every completion that reaches a replica in breach of the fence's invariant."""

    def __init__(self) -> None:
        self.emulators: list[Emulator] = []
        self.router: RouterRuntime | None = None
        self.violations: list[str] = []
        self.checked = 0
        self.check_fleet = True  # the "every live replica" half (off around restarts)

    def observe(self, engine: Engine, model: object) -> None:
        if not isinstance(model, str) or model == engine.config.model:
            return
        self.checked += 1
        if model not in engine.registry:
            self.violations.append(f"{model} reached a replica that does not hold it")
        if not self.check_fleet or self.router is None or self.router.fleet is None:
            return
        by_url = {e.url: e for e in self.emulators}
        for replica in self.router.fleet.replicas:
            emu = by_url.get(replica.name)
            live = replica.live and emu is not None and emu.listening
            if live and emu is not None and model not in emu.state.registry:
                self.violations.append(
                    f"{model} was routed while live replica {replica.rid} lacks it"
                )


@pytest.fixture
def monitor(monkeypatch: pytest.MonkeyPatch) -> FenceMonitor:
    watcher = FenceMonitor()
    original = Engine.resolve_model

    def resolve_model(self: Engine, name: object) -> Any:
        watcher.observe(self, name)
        return original(self, name)

    monkeypatch.setattr(Engine, "resolve_model", resolve_model)
    return watcher


@pytest.fixture
async def emulators(monitor: FenceMonitor) -> AsyncIterator[StartEmulators]:
    started: list[Emulator] = []

    async def start(n: int, **settings: Any) -> list[Emulator]:
        new = [await start_emulator(EmulatorConfig(**settings)) for _ in range(n)]
        started.extend(new)
        monitor.emulators.extend(new)
        return new

    yield start
    for emu in started:
        await emu.stop()


@pytest.fixture
def router_settings() -> dict[str, Any]:
    """The settings of every router a test in this folder starts (a folder's conftest.py may
    give its own)."""
    return FAST


@pytest.fixture
async def router(
    monitor: FenceMonitor, router_settings: dict[str, Any]
) -> AsyncIterator[StartRouter]:
    started: list[RouterRuntime] = []

    async def start(replicas: Iterable[Addressed | str], **overrides: Any) -> RouterRuntime:
        """A router in front of `replicas`, `overrides` over the folder's settings; stopped
        after the test."""
        runtime = await start_router(replicas, **{**router_settings, **overrides})
        started.append(runtime)
        monitor.router = runtime
        return runtime

    yield start
    for runtime in started:
        await runtime.stop(grace=0.0)


async def synced_traffic(client: aiohttp.ClientSession, rt: Any, name: str, path: str) -> None:
    """A weight sync of adapter `name` through router `rt`, four completions under it on two
    prompts, and a telemetry scrape before and after: every reported figure then has a value."""
    assert rt.telemetry is not None
    assert (await call(client, "POST", rt.url + "/pause?mode=keep"))[0] == 200
    assert (await load(client, rt.url, name, path))[0] == 200
    assert (await call(client, "POST", rt.url + "/resume"))[0] == 200
    await rt.telemetry.scrape_all()
    for i in (1, 2, 1, 2):
        prompt = [i * 100 + t for t in range(48)]
        assert (await complete(client, rt.url, name, prompt=prompt))[0] == 200
    await rt.telemetry.scrape_all()


def paths_of(emu: Emulator, route: str) -> list[str | None]:
    """The bodies' adapter names of every request `emu` received on `route`, in order; the
    readiness probe (an empty load, fleet/readiness.py) is not one."""
    import orjson

    names: list[str | None] = []
    for r in emu.requests:
        if r.path.split("?")[0] == route and r.body != b"{}":
            names.append(orjson.loads(r.body).get("lora_name") if r.body else None)
    return names
