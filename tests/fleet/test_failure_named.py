"""A replica's failure is named by its cause, with its fix, wherever the router reports it.

Each replica below fails in one of a new user's first ways: the router's token does not match
its `--api-key`, nothing listens on its port, its host name does not resolve, its certificate
comes from a CA the router does not trust, it serves HTTPS to an http:// URL, its URL ends in
`/v1` (the OpenAI base-URL habit), it is not a vLLM server, it answers no valid HTTP or breaks
its answer off, or it never answers. The router's log, `/router/replicas`, `/router/status`,
`/health` and `lora-router top` name the cause and the fix (fleet/failure.py) from the start,
and still do after a health check has come and gone.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from aiohttp import ClientSession, web
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, free_port, load, run_top, until

from lora_router.config import Secret

pytestmark = pytest.mark.timeout(30)

INTERVAL = 0.2  # the health interval of these routers, in seconds

# A replica that fails: its URL and the router's settings for it.
Failing = tuple[str, dict[str, Any]]
MakeFailing = Callable[[], Awaitable[Failing]]


@pytest.fixture
async def plain_server() -> AsyncIterator[str]:
    """An HTTP server that is not vLLM: every path answers 200 with a web page."""

    async def page(request: web.Request) -> web.Response:
        return web.Response(text="<html>It works!</html>", content_type="text/html")

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", page)
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        site = web.SockSite(runner, s)
        await site.start()
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
        await runner.cleanup()


@pytest.fixture
async def stalled_server() -> AsyncIterator[str]:
    """A server that takes connections and never answers."""
    held: list[asyncio.StreamWriter] = []

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    for writer in held:
        writer.close()
    server.close()
    await server.wait_closed()


@pytest.fixture
async def answering() -> AsyncIterator[Callable[[bytes], Awaitable[str]]]:
    """Servers that answer every request with the bytes given, then close the connection."""
    servers: list[asyncio.Server] = []

    async def start(reply: bytes) -> str:
        async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(reply)
            await writer.drain()
            writer.close()

        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for server in servers:
        server.close()
        await server.wait_closed()


@pytest.fixture
def failing(
    emulators: StartEmulators,
    plain_server: str,
    stalled_server: str,
    answering: Callable[[bytes], Awaitable[str]],
) -> dict[str, MakeFailing]:
    """Each failing replica by name."""
    trustme = pytest.importorskip("trustme")

    async def wrong_token() -> Failing:
        (emu,) = await emulators(1, api_key="right")
        return emu.url, {"token": Secret("wrong")}

    async def refused() -> Failing:
        return f"http://127.0.0.1:{free_port()}", {}

    async def untrusted_tls() -> Failing:
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        trustme.CA().issue_cert("127.0.0.1").configure_cert(server_ctx)
        (emu,) = await emulators(1, ssl=server_ctx)
        return emu.url, {}

    async def unknown_host() -> Failing:
        return "http://no-such-replica.invalid:8000", {}  # .invalid never resolves (RFC 2606)

    async def https_as_http() -> Failing:
        server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        trustme.CA().issue_cert("127.0.0.1").configure_cert(server_ctx)
        (emu,) = await emulators(1, ssl=server_ctx)
        return emu.url.replace("https://", "http://"), {}

    async def v1_path() -> Failing:
        (emu,) = await emulators(1)
        return emu.url + "/v1", {}

    async def not_vllm() -> Failing:
        return plain_server, {}

    async def not_http() -> Failing:
        return await answering(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"), {}

    async def cut_body() -> Failing:
        head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
        return await answering(head + b'{"data": ['), {}

    async def stalled() -> Failing:
        return stalled_server, {"health_timeout": 0.3}

    return {
        "wrong-token": wrong_token,
        "refused": refused,
        "untrusted-tls": untrusted_tls,
        "unknown-host": unknown_host,
        "https-as-http": https_as_http,
        "v1-path": v1_path,
        "not-vllm": not_vllm,
        "timeout": stalled,
        "not-http": not_http,
        "cut-body": cut_body,
    }


@pytest.mark.parametrize(
    ("name", "cause", "fix"),
    [
        ("wrong-token", "HTTP 401 on /v1/models: the token was rejected", "--token-env NAME"),
        ("refused", "cannot connect (Connection refused)", "`vllm serve` is running there"),
        ("untrusted-tls", "TLS certificate not trusted (", "give --ca-file"),
        (
            "unknown-host",
            "cannot resolve the host no-such-replica.invalid (",
            "check the URL and that `vllm serve` is running there",
        ),
        (
            "https-as-http",
            "closed the connection without an answer (if it serves HTTPS, give its URL as https://)",
            "check the URL",
        ),
        ("v1-path", "/v1 is not a vLLM server's root URL", "give the server's root URL"),
        ("not-vllm", "/v1/models answered no model list", "the URL `vllm serve` listens on"),
        ("timeout", "no answer within ", "is not stuck or overloaded (--health-timeout"),
        ("not-http", "its answer is not valid HTTP (", "the URL `vllm serve` listens on"),
        ("cut-body", "its answer's body broke off (", "see the replica's log"),
    ],
)
async def test_a_failing_replica_is_named_by_its_cause_in_the_log_and_the_status_routes(
    name: str,
    cause: str,
    fix: str,
    failing: dict[str, MakeFailing],
    router: StartRouter,
    client: ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url, settings = await failing[name]()
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        rt = await router(
            [SimpleNamespace(url=url)], health_interval=INTERVAL, health_failures=1, **settings
        )
        assert rt.health is not None
        named = [await _reports(client, rt.url)]
        # A health check has come and gone (the second one began: the first one ended),
        # within one interval of the start; what it found is named the same way.
        await until(lambda: rt.health is not None and rt.health.checks >= 2, 5.0)
        named.append(await _reports(client, rt.url))
    logged = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(cause in line and fix in line for line in logged), logged
    for replicas, status, health in named:
        (replica,) = replicas["replicas"]
        assert cause in replica["last_error"] and fix in replica["last_error"], replica
        assert status["replicas"][0]["last_error"] == replica["last_error"]
        assert cause in health and fix in health, health
    everything = "\n".join([*logged, *(str(n) for n in named)])
    assert "right" not in everything and "wrong" not in everything  # the token never shows


async def _reports(client: ClientSession, url: str) -> tuple[Any, Any, str]:
    """`/router/replicas`, `/router/status` and `/health`'s 503 message."""
    async with client.get(url + "/router/replicas") as r:
        replicas = await r.json()
    async with client.get(url + "/router/status") as r:
        status = await r.json()
    async with client.get(url + "/health") as r:
        assert r.status == 503
        health = (await r.json())["error"]["message"]
    return replicas, status, health


async def test_top_shows_why_a_replica_is_out_of_service_and_the_fix(
    failing: dict[str, MakeFailing], router: StartRouter
) -> None:
    url, settings = await failing["wrong-token"]()
    rt = await router([SimpleNamespace(url=url)], **settings)
    code, out, err = await run_top("--once", "--url", rt.url)
    assert code == 0, err
    assert (
        "replica 0 ejected: at start: HTTP 401 on /v1/models: the token was rejected; "
        "fix: give --token-env NAME holding its token"
    ) in " ".join(out.split())  # however the terminal's width wrapped it


async def test_a_replica_without_dev_mode_is_named_at_start(
    emulators: StartEmulators, router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    emus = await emulators(1, dev_mode=False)
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        await router(emus)
    assert (
        "cannot take part in a weight sync: dev mode is off: /pause, /resume and /server_info "
        "do not exist; fix: start it with VLLM_SERVER_DEV_MODE=1"
    ) in caplog.text


async def test_a_load_on_a_replica_without_runtime_loading_names_the_fix(
    emulators: StartEmulators, router: StartRouter, client: ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(1, runtime_lora_updating=False)
    rt = await router(emus)
    status, data = await load(client, rt.url, "trl-policy-v1", adapter("trl-policy-v1"))
    assert status == 404  # what TRL reads as "runtime loading is off": here it is
    message = orjson.loads(data)["error"]["message"]
    assert "runtime adapter loading is off: /v1/load_lora_adapter does not exist" in message
    assert "fix: start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1" in message


async def test_a_load_on_a_replica_without_lora_names_lora_not_runtime_loading(
    emulators: StartEmulators, router: StartRouter, client: ClientSession, adapter: Adapter
) -> None:
    # Started with the runtime-loading variable but without --enable-lora: vLLM then has no
    # load route either, and the variable's fix would change nothing.
    emus = await emulators(1)
    (no_lora,) = await emulators(1, enable_lora=False)
    rt = await router([*emus, no_lora])
    status, data = await load(client, rt.url, "trl-policy-v1", adapter("trl-policy-v1"))
    assert status == 404
    message = orjson.loads(data)["error"]["message"]
    assert "Replica 1 " in message and "LoRA is disabled" in message, message
    assert "fix: start it with --enable-lora" in message, message
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in message, message


@pytest.mark.parametrize(
    ("setting", "cause"),
    [
        (
            "runtime_lora_updating",
            "runtime adapter loading is off: /v1/load_lora_adapter does not exist; fix: start "
            "it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1",
        ),
        ("enable_lora", "LoRA is disabled (vllm_config.lora_config is null)"),
    ],
)
async def test_a_replica_back_without_runtime_loading_or_lora_is_kept_out_with_the_fix(
    setting: str,
    cause: str,
    emulators: StartEmulators,
    router: StartRouter,
    client: ClientSession,
    adapter: Adapter,
) -> None:
    emus = await emulators(2)
    rt = await router(emus, health_interval=INTERVAL, health_failures=1)
    assert (await load(client, rt.url, "trl-policy-v1", adapter("trl-policy-v1")))[0] == 200
    setattr(emus[1].config, setting, False)  # restarted without the variable, or the flag
    await emus[1].restart()
    assert rt.fleet is not None
    back = rt.fleet.replicas[1].life
    await until(lambda: "replaying adapter" in back.last_error, 5.0)
    assert back.last_error.startswith(
        f"replay failed: replaying adapter 'trl-policy-v1' failed: {cause}"
    ), back.last_error
    assert not back.serving
