"""`lora-router --check` against emulated replicas over real sockets: a ready fleet passes, and
each failure the emulator can show is named in the table and fails the check."""

from __future__ import annotations

import asyncio
import contextlib
import io
import socket
import ssl
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import aiohttp.web
import pytest
from helpers import free_port, router_config

from lora_router import cli
from lora_router.config import Config, ReplicaAddress, Secret
from lora_router.emulator import EmulatorConfig, start_emulator, write_adapter
from lora_router.emulator.faults import Faults
from lora_router.fleet.aliases import ALIAS_FIX
from lora_router.tools.check import check, report

pytestmark = pytest.mark.timeout(30)


@asynccontextmanager
async def replicas(*configs: EmulatorConfig) -> AsyncIterator[list[Any]]:
    started = [await start_emulator(c) for c in configs]
    try:
        yield started
    finally:
        for emulator in started:
            await emulator.stop()


async def run_check(config: Config) -> tuple[int, str]:
    fleet, problems = await check(config)
    text = report(fleet, problems, config.max_staleness)
    return (1 if any(not p.note for p in problems) else 0), text


async def test_a_ready_fleet_exits_0_through_the_command_line() -> None:
    async with replicas(EmulatorConfig(), EmulatorConfig()) as emus:
        urls = ",".join(e.url for e in emus)
        out = io.StringIO()
        status = await asyncio.to_thread(
            _main_capturing, ["--check", "--replicas", urls, "--no-token"], out
        )
    assert status == 0, out.getvalue()
    assert out.getvalue().splitlines()[-1].startswith("READY: 2 replica(s) agree")


def _main_capturing(argv: list[str], out: io.StringIO) -> int:
    with contextlib.redirect_stdout(out):
        return cli.main(argv)


@pytest.mark.parametrize(
    ("name", "configs", "expected"),
    [
        ("lora-off", [EmulatorConfig(enable_lora=False)], "LoRA is disabled"),
        (
            "runtime-loading-off",
            [EmulatorConfig(runtime_lora_updating=False)],
            "runtime adapter loading is off",
        ),
        ("dev-mode-off", [EmulatorConfig(dev_mode=False)], "dev mode is off"),
        ("too-few-slots", [EmulatorConfig(max_loras=5)], "max_loras is 5, below"),
        (
            "rank-disagreement",
            [EmulatorConfig(max_lora_rank=16), EmulatorConfig(max_lora_rank=8)],
            "disagree on max_lora_rank",
        ),
        (
            "slots-disagreement",
            [EmulatorConfig(max_loras=6), EmulatorConfig(max_loras=8)],
            "disagree on max_loras",
        ),
        (
            "block-disagreement",
            [EmulatorConfig(block_size=16), EmulatorConfig(block_size=32)],
            "disagree on block size",
        ),
        (
            "model-disagreement",
            [EmulatorConfig(model="Qwen/Qwen2.5-Math-1.5B"), EmulatorConfig(model="other/m")],
            "disagree on base model",
        ),
        ("dead-engine", [EmulatorConfig(faults=Faults(dead=True))], "engine is dead"),
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
async def test_each_failure_fails_the_check_by_name(
    name: str, configs: list[EmulatorConfig], expected: str
) -> None:
    async with replicas(*configs) as emus:
        status, text = await run_check(router_config(e.url for e in emus))
    assert status == 1, text
    assert expected in text
    assert "NOT READY" in text.splitlines()[-1]


async def test_an_unreachable_replica_is_named() -> None:
    port = free_port()  # nothing listens there
    async with replicas(EmulatorConfig()) as emus:
        config = router_config(e.url for e in emus)
        dead = ReplicaAddress.parse(f"http://127.0.0.1:{port}")
        status, text = await run_check(Config(replicas=(*config.replicas, dead)))
    assert status == 1
    assert f"{dead.name}: unreachable: cannot connect" in text


async def check_with_token(token: str) -> tuple[int, str]:
    """`--check` with `token` against a replica whose API key is "right"."""
    async with replicas(EmulatorConfig(api_key="right")) as emus:
        return await run_check(router_config((e.url for e in emus), token=Secret(token)))


async def test_a_rejected_token_is_unauthorized() -> None:
    wrong, wrong_text = await check_with_token("wrong")
    assert wrong == 1 and "unauthorized: HTTP 401" in wrong_text
    assert "right" not in wrong_text and "wrong" not in wrong_text  # the token never shows


async def test_the_right_token_passes() -> None:
    right, right_text = await check_with_token("right")
    assert right == 0, right_text


async def test_leftover_adapters_fail_unless_unload_stale_covers_them(tmp_path: Path) -> None:
    async with replicas(EmulatorConfig()) as emus:
        path = write_adapter(tmp_path / "trl-policy-v1", rank=1)
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                emus[0].url + "/v1/load_lora_adapter",
                json={"lora_name": "trl-policy-v1", "lora_path": str(path)},
            ) as resp,
        ):
            assert resp.status == 200
        status, text = await run_check(router_config(e.url for e in emus))
        covered, covered_text = await run_check(
            router_config((e.url for e in emus), unload_stale="trl-policy-*")
        )
    assert status == 1 and "leftover adapter(s) from an earlier run: trl-policy-v1" in text
    assert covered == 0 and "will be unloaded at start" in covered_text


async def test_the_check_changes_nothing_on_the_replicas() -> None:
    async with replicas(EmulatorConfig()) as emus:
        status, _ = await run_check(router_config(e.url for e in emus))
        emu = emus[0]
        assert status == 0
        assert emu.state.adapters == {} and not emu.state.paused
        paths = {r.path.split("?")[0] for r in emu.requests}
    assert "/pause" not in paths and "/v1/unload_lora_adapter" not in paths


async def test_tls_replicas_are_checked_with_the_ca_file(tmp_path: Path) -> None:
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    async with replicas(EmulatorConfig(ssl=server_ctx)) as emus:
        assert emus[0].url.startswith("https://")
        trusted, trusted_text = await run_check(
            router_config((e.url for e in emus), ca_file=str(ca_file))
        )
        untrusted, untrusted_text = await run_check(router_config(e.url for e in emus))
    assert trusted == 0, trusted_text
    assert untrusted == 1 and "TLS certificate not trusted" in untrusted_text
    assert "--ca-file" in untrusted_text


async def check_from_the_command_line(
    monkeypatch: pytest.MonkeyPatch, *flags: str
) -> tuple[int, str]:
    """`lora-router --check --token-env REPLICA_TOKEN *flags` against a replica with 6 LoRA
    slots whose API key is the one in $REPLICA_TOKEN: the exit status and the output."""
    monkeypatch.setenv("REPLICA_TOKEN", "right")
    async with replicas(EmulatorConfig(api_key="right", max_loras=6)) as emus:
        argv = ["--check", "--replicas", emus[0].url, "--token-env", "REPLICA_TOKEN", *flags]
        out = io.StringIO()
        status = await asyncio.to_thread(_main_capturing, argv, out)
    return status, out.getvalue()


async def test_the_command_line_passes_the_token(monkeypatch: pytest.MonkeyPatch) -> None:
    ready, ready_out = await check_from_the_command_line(monkeypatch)
    assert ready == 0, ready_out


async def test_the_command_line_passes_max_staleness(monkeypatch: pytest.MonkeyPatch) -> None:
    strict, strict_out = await check_from_the_command_line(monkeypatch, "--max-staleness", "5")
    assert strict == 1 and "below max_staleness + 2 = 7" in strict_out


async def test_an_https_url_on_a_plain_http_replica_reports_the_tls_error() -> None:
    async with replicas(EmulatorConfig()) as emus:
        url = emus[0].url.replace("http://", "https://")
        status, text = await run_check(router_config([url]))
    assert status == 1
    assert "TLS handshake failed" in text and "http://" in text
    assert "Operation not permitted" not in text


async def test_a_fleet_without_lora_is_told_that_trl_falls_back_to_merged_weight_sync() -> None:
    async with replicas(EmulatorConfig(enable_lora=False)) as emus:
        status, text = await run_check(router_config(e.url for e in emus))
    assert status == 1
    assert "merged-weight sync" in text and "lora-router refuses it" in text


async def test_a_replica_whose_two_listings_disagree_is_flagged(tmp_path: Path) -> None:
    # Every other /v1/models answer lists no adapter: a balancer over two servers, one of
    # which took the load.
    async with replicas(EmulatorConfig(faults=Faults(hide_adapters=2))) as emus:
        path = write_adapter(tmp_path / "trl-policy-v1", rank=1)
        async with (
            aiohttp.ClientSession() as http,
            http.post(
                emus[0].url + "/v1/load_lora_adapter",
                json={"lora_name": "trl-policy-v1", "lora_path": str(path)},
            ) as resp,
        ):
            assert resp.status == 200
        status, text = await run_check(
            router_config((e.url for e in emus), unload_stale="trl-policy-*")
        )
    assert status == 1, text
    assert "two reads of /v1/models disagree (trl-policy-v1; then no adapter)" in text
    assert "its own --replicas URL" in text


async def test_check_reads_the_replica_file_as_the_router_does(tmp_path: Path) -> None:
    async with replicas(EmulatorConfig()) as emus:
        listing = tmp_path / "replicas.txt"
        listing.write_text(f"# the fleet\n{emus[0].url}\nhttp://10.1.2.3:8000\n")
        out = io.StringIO()
        argv = ["--check", "--replicas-file", str(listing), "--replica-hosts", "127.0.0.1"]
        status = await asyncio.to_thread(_main_capturing, [*argv, "--no-token"], out)
    text = out.getvalue()
    assert status == 0, text
    assert emus[0].url in text  # probed: the file named it
    assert "skipped discovery file:" in text and "outside --replica-hosts" in text
    assert text.splitlines()[-1].startswith("READY: 1 replica(s) agree")


async def test_check_fails_on_a_fleet_it_cannot_find(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    out = io.StringIO()
    argv = ["--check", "--replicas-file", str(missing), "--replica-hosts", "127.0.0.1"]
    status = await asyncio.to_thread(_main_capturing, [*argv, "--no-token"], out)
    text = " ".join(out.getvalue().split())
    assert status == 1, text
    assert f"discovery file:{missing}: cannot read it: No such file or directory" in text
    assert "no replica to check: --replicas names none and discovery found none" in text
    assert "NOT READY: 2 problem(s)" in text


async def _not_found(request: aiohttp.web.Request) -> aiohttp.web.Response:
    return aiohttp.web.json_response({"detail": "Not Found"}, status=404)


async def _web_page(request: aiohttp.web.Request) -> aiohttp.web.Response:
    return aiohttp.web.Response(text="<html>Sign in</html>", content_type="text/html")


async def _health_only(request: aiohttp.web.Request) -> aiohttp.web.Response:
    return aiohttp.web.Response() if request.path == "/health" else await _not_found(request)


@pytest.mark.parametrize(
    ("answer", "seen"),
    [
        (_not_found, "HTTP 404 on /health: no vLLM server answers at "),
        (_web_page, "/v1/models answered no model list: "),
        (_health_only, "HTTP 404 on /v1/models: no vLLM server answers at "),
    ],
    ids=["404-everywhere", "web-page", "health-only"],
)
async def test_a_server_that_is_not_vllm_is_named_as_such_and_nothing_else(
    answer: Any, seen: str
) -> None:
    app = aiohttp.web.Application()
    app.router.add_route("*", "/{tail:.*}", answer)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        site = aiohttp.web.SockSite(runner, s)
        await site.start()
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        try:
            status, text = await run_check(router_config([url]))
        finally:
            await runner.cleanup()
    flat = " ".join(text.split())
    assert status == 1, flat
    assert seen in flat and "give the URL `vllm serve` listens on" in flat
    assert "NOT READY: 1 problem(s)" in flat  # that one, not missing routes or settings
    assert "dev mode is off" not in flat and "runtime adapter loading is off" not in flat


async def test_one_replica_under_two_names_is_a_note_naming_both_with_the_fix() -> None:
    async with replicas(EmulatorConfig()) as emus:
        second = emus[0].url.replace("127.0.0.1", "localhost")  # one more name of it
        status, text = await run_check(router_config([emus[0].url, second]))
    text = " ".join(text.split())
    assert status == 0, text  # not refused: a proxy at one address may route by host name
    port = emus[0].url.rsplit(":", 1)[1]
    assert (
        f"note: fleet: {emus[0].url} and {second} reach the same address, 127.0.0.1:{port}: "
        "very likely one server listed twice"
    ) in text
    assert f"fix: {' '.join(ALIAS_FIX.split())}" in text
