"""What the tests share, defined once: a client's calls to a router or a replica, the settings of
a router under test, its `/router/status`, a free port, waiting for a condition that has no
event to await, a `/metrics` page's samples, and the commands run as processes of their own: a
router (`router_process`, for what only a real process shows: signals, its memory) and
`lora-router top`. A router in the test's own process is tests/emulated_fleet.py's `router`.

The fixtures every test folder uses (`client`, `adapter`) are in tests/conftest.py; each folder's
conftest.py adds only what its tests alone need.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson
from aiohttp import web
from multidict import CIMultiDictProxy
from prometheus_client.parser import text_string_to_metric_families

from lora_router.config import Config, ReplicaAddress
from lora_router.testbed.net import free_port  # noqa: F401 (tests import it from here)

Adapter = Callable[..., str]  # the `adapter` fixture: (name, rank=1) -> the directory written


async def call(
    client: aiohttp.ClientSession, method: str, url: str, json: Any = None, **kwargs: Any
) -> tuple[int, bytes, CIMultiDictProxy[str]]:
    """One request, read whole: status, body, headers."""
    async with client.request(method, url, json=json, **kwargs) as response:
        return response.status, await response.read(), response.headers


async def router_status(client: aiohttp.ClientSession, url: str) -> dict[str, Any]:
    """The router at `url`'s `/router/status`, which must answer 200."""
    code, body, _ = await call(client, "GET", url + "/router/status")
    assert code == 200, body
    doc: dict[str, Any] = orjson.loads(body)
    return doc


async def load(client: aiohttp.ClientSession, url: str, name: str, path: str) -> tuple[int, bytes]:
    """`POST /v1/load_lora_adapter` as TRL sends it; status and body."""
    body = {"lora_name": name, "lora_path": path, "load_inplace": False}
    status, data, _ = await call(client, "POST", url + "/v1/load_lora_adapter", body)
    return status, data


async def unload(client: aiohttp.ClientSession, url: str, name: str) -> tuple[int, bytes]:
    status, data, _ = await call(
        client, "POST", url + "/v1/unload_lora_adapter", {"lora_name": name}
    )
    return status, data


async def complete(
    client: aiohttp.ClientSession, url: str, model: str | None = None, **fields: Any
) -> tuple[int, Any]:
    """A non-streamed completion (a 40-token prompt, 4 tokens, unless `fields` say otherwise):
    its status and its JSON body (the raw bytes when they are not JSON)."""
    body: dict[str, Any] = {"prompt": list(range(40)), "max_tokens": 4, **fields}
    if model is not None:
        body["model"] = model
    status, data, _ = await call(client, "POST", url + "/v1/completions", body)
    try:
        return status, orjson.loads(data)
    except orjson.JSONDecodeError:
        return status, data


async def completed(
    client: aiohttp.ClientSession, url: str, model: str | None = None, **fields: Any
) -> Any:
    """A completion that must succeed (a setup step): its JSON body."""
    status, body = await complete(client, url, model, **fields)
    assert status == 200, body
    return body


async def until(predicate: Callable[[], bool], timeout: float = 5.0, step: float = 0.005) -> None:
    """Wait until `predicate()` holds, for state that has no event to await (a health check, a
    replay, a request reaching a replica's queue)."""
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(step)


async def longest_lateness(work: Callable[[], Awaitable[object]]) -> float:
    """How late, at most, a task asking to wake every millisecond woke while `work` ran: the
    longest the loop was held."""
    worst, done = 0.0, False

    async def tick() -> None:
        nonlocal worst
        while not done:
            asked = time.perf_counter()
            await asyncio.sleep(0.001)
            worst = max(worst, time.perf_counter() - asked - 0.001)

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)  # the ticker is waiting before the work starts
    try:
        await work()
    finally:
        done = True
        await ticker
    return worst


def router_config(urls: Iterable[str], **settings: Any) -> Config:
    """A router's settings for the replicas at `urls`."""
    return Config(replicas=tuple(ReplicaAddress.parse(url) for url in urls), **settings)


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of an exposition, keyed by name and sorted labels."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


async def run_top(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """`lora-router top ARGS` in a process of its own: exit status, stdout, stderr."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lora_router.cli",
        "top",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    async with asyncio.timeout(60):
        out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


@dataclass
class RouterProcess:
    """A router running as `python -m lora_router.cli`: its process, the port it listens on,
    and its stderr read so far."""

    proc: asyncio.subprocess.Process
    port: int = 0
    log: bytes = b""

    async def read_until(self, pattern: bytes) -> re.Match[bytes]:
        """Read stderr line by line until `pattern` matches what was read (the caller bounds
        the wait); an end of stderr before it fails."""
        assert self.proc.stderr is not None
        while not (match := re.search(pattern, self.log)):
            line = await self.proc.stderr.readline()
            assert line, self.log
            self.log += line
        return match


@asynccontextmanager
async def router_process(
    *args: str, env: dict[str, str] | None = None
) -> AsyncIterator[RouterProcess]:
    """`python -m lora_router.cli ARGS --port 0`, once its log says where it listens (within
    20 s); killed on the way out if it still runs."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lora_router.cli",
        *args,
        "--port",
        "0",
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    router = RouterProcess(proc)
    try:
        async with asyncio.timeout(20):
            router.port = int((await router.read_until(rb"listening on [\d.]+:(\d+)")).group(1))
        yield router
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@asynccontextmanager
async def listing_replica(cards: Callable[[], list[dict[str, Any]]]) -> AsyncIterator[str]:
    """A small aiohttp server on loopback that answers like vLLM: its `/v1/models` lists the
    model cards `cards()` returns at each listing, every other route answers 200 `{}`. Its URL."""

    async def models(request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": cards()})

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_route("*", "/{tail:.*}", ok)
    runner = web.AppRunner(app)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()
