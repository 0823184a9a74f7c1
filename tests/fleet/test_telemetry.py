"""Replica telemetry end to end: what emulated replicas publish on their `/metrics` shows in the
router's `/router/status` and `/metrics`; replicas that publish nothing, or garbage, show
"unknown" and keep serving; the fleet's weight syncs are timed."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, call, complete, load, longest_lateness, router_status, samples, until

from lora_router.emulator import Emulator, EmulatorConfig, Engine, start_emulator
from lora_router.emulator import control as emulator_control
from lora_router.emulator import metrics as emulator_metrics
from lora_router.fleet import telemetry


def prompt(i: int) -> list[int]:
    return [i * 1000 + t for t in range(64)]


async def test_status_shows_what_each_replica_reports(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    assert rt.telemetry is not None
    await rt.telemetry.scrape_all()
    # Two prompts, each sent twice: the second of each hits the prefix cache of its replica.
    for i in (1, 2, 1, 2):
        code, _ = await complete(client, rt.url, prompt=prompt(i), max_tokens=8)
        assert code == 200
    await rt.telemetry.scrape_all()
    doc = await router_status(client, rt.url)
    by_url = {e.url: e for e in emus}
    for replica in doc["replicas"]:
        engine = by_url[replica["url"]].state
        rep = replica["reported"]
        assert rep["status"] == "ok"
        assert (rep["running"], rep["waiting"]) == (engine.num_running, engine.num_waiting)
        assert rep["prefix_cache_queries"] == engine.cache.queries
        assert rep["prefix_cache_hits"] == engine.cache.hits
        assert rep["generation_tokens"] == engine.counters.generated_tokens
        assert rep["max_lora"] == engine.config.max_loras
        assert rep["adapters_running"] == [] and rep["adapters_waiting"] == []
        if engine.cache.queries:
            total = round(engine.cache.hits / engine.cache.queries, 4)
            assert rep["prefix_cache_hit_rate_total"] == total
            # Everything this replica did happened between the two scrapes.
            assert rep["prefix_cache_hit_rate"] == total
            assert rep["generation_tokens_per_s"] > 0
    assert sum(r["reported"]["generation_tokens"] for r in doc["replicas"]) == 4 * 8
    # The second sample of each prompt followed the first: some replica hit its cache.
    assert any(r["reported"]["prefix_cache_hits"] > 0 for r in doc["replicas"])
    fleet = doc["fleet"]
    queries = sum(e.state.cache.queries for e in emus)
    hits = sum(e.state.cache.hits for e in emus)
    assert fleet["reporting"] == 2
    assert fleet["prefix_cache_hit_rate_total"] == round(hits / queries, 4)
    assert fleet["generation_tokens_per_s"] == pytest.approx(
        sum(r["reported"]["generation_tokens_per_s"] for r in doc["replicas"]), abs=0.2
    )


async def test_a_replicas_report_shows_its_queue_with_the_adapters_in_it(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    # One sequence at a time, slowly: the first request runs, the second waits behind it.
    (emu,) = await emulators(1, max_num_seqs=1, decode_s_per_token=0.05)
    rt = await router([emu])
    assert rt.telemetry is not None
    assert (await load(client, rt.url, "v1", adapter("v1")))[0] == 200
    tasks = [
        asyncio.create_task(complete(client, rt.url, model="v1", prompt=prompt(i), max_tokens=100))
        for i in (1, 2)
    ]
    try:
        await until(lambda: (emu.state.num_running, emu.state.num_waiting) == (1, 1))
        await rt.telemetry.scrape_all()
        (replica,) = rt.fleet.replicas if rt.fleet else []
        report = replica.report
        assert report is not None
        # The queue a routing policy can read from the replica's snapshot.
        assert (report.running, report.waiting) == (1, 1)
        assert report.adapters_running == ("v1",) and report.adapters_waiting == ("v1",)
        rep = (await router_status(client, rt.url))["replicas"][0]["reported"]
        assert rep["adapters_running"] == ["v1"] and rep["adapters_waiting"] == ["v1"]
        assert rep["kv_cache_usage"] > 0
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def test_replicas_are_scraped_on_the_health_interval(
    emulators: StartEmulators, router: StartRouter
) -> None:
    emus = await emulators(2)
    rt = await router(emus, health_interval=0.05)
    assert rt.fleet is not None and rt.telemetry is not None
    replicas = rt.fleet.replicas
    # A report with an interval means at least two scrapes of that replica, with no one asking.
    await until(lambda: all(r.report is not None and r.report.interval > 0 for r in replicas))
    assert all(r.report is not None and 0.03 < r.report.interval < 1.0 for r in replicas)


async def metrics_after_two_samples(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> tuple[Emulator, dict[tuple[str, tuple[tuple[str, str], ...]], float], str]:
    """Two replicas scraped before and after two samples of one prompt of 8 tokens each: the
    replica that served them, the router's `/metrics` samples and that replica's index."""
    emus = await emulators(2)
    rt = await router(emus)
    assert rt.telemetry is not None
    await rt.telemetry.scrape_all()
    for i in (1, 1):
        assert (await complete(client, rt.url, prompt=prompt(i), max_tokens=8))[0] == 200
    await rt.telemetry.scrape_all()
    code, body, _ = await call(client, "GET", rt.url + "/metrics")
    assert code == 200
    got = samples(body.decode())
    served = next(e for e in emus if e.state.counters.generated_tokens)
    rid = next(r.rid for r in rt.fleet.replicas if r.name == served.url) if rt.fleet else -1
    return served, got, str(rid)


async def test_router_metrics_export_each_replicas_report(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    served, got, rid = await metrics_after_two_samples(emulators, router, client)
    label = (("replica", rid),)
    assert got[("lora_router_replica_reporting", label)] == 1
    assert got[("lora_router_replica_requests_waiting", label)] == 0
    assert got[("lora_router_replica_generation_tokens_total", label)] == 16
    assert got[("lora_router_replica_prefix_cache_queries_total", label)] == (
        served.state.cache.queries
    )
    assert got[("lora_router_replica_prefix_cache_hit_ratio", label)] == pytest.approx(
        served.state.cache.hits / served.state.cache.queries
    )


async def test_router_metrics_export_the_fleet_totals(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    served, got, _ = await metrics_after_two_samples(emulators, router, client)
    assert got[("lora_router_fleet_prefix_cache_hit_ratio", ())] == pytest.approx(
        served.state.cache.hits / served.state.cache.queries
    )
    assert got[("lora_router_fleet_generation_tokens_per_second", ())] > 0


# -- replicas that report nothing -------------------------------------------------------------


@pytest.fixture
async def silent_emulator(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Emulator]:
    """An emulated replica that serves everything but `/metrics` (FastAPI's 404 there)."""
    config = EmulatorConfig(port=0)
    original = emulator_control.routes

    def routes(cfg: EmulatorConfig) -> Any:
        table = original(cfg)
        if cfg is config:
            del table["/metrics"]
        return table

    monkeypatch.setattr(emulator_control, "routes", routes)
    emu = await start_emulator(config)
    yield emu
    await emu.stop()


def garbage_from(monkeypatch: pytest.MonkeyPatch, emu: Emulator, body: bytes) -> None:
    """Make `emu`'s `/metrics` answer 200 with `body`."""
    original: Callable[[Engine], bytes] = emulator_metrics.render
    monkeypatch.setattr(
        emulator_metrics, "render", lambda engine: body if engine is emu.state else original(engine)
    )


async def assert_unknown_and_serving(
    rt: Any, client: aiohttp.ClientSession, rid: int, reason: str
) -> None:
    """Replica `rid` shows unknown, is never ejected through several scrapes and health checks,
    and still takes its share of completions."""
    await until(lambda: rt.telemetry.scrapes >= 8 and rt.health.checks >= 8)
    doc = await router_status(client, rt.url)
    replica = doc["replicas"][rid]
    assert replica["reported"]["status"] == "unknown"
    assert reason in replica["reported"]["reason"]
    assert replica["healthy"] and replica["admitted"] and replica["ejections"] == 0
    others = [r for r in doc["replicas"] if r["id"] != rid]
    assert all(r["reported"]["status"] == "ok" for r in others)
    assert doc["fleet"]["reporting"] == len(others)
    served = set()
    for i in range(4):  # round-robin: every replica gets some
        async with client.post(
            rt.url + "/v1/completions", json={"prompt": prompt(i), "max_tokens": 2}
        ) as resp:
            assert resp.status == 200
            served.add(resp.headers["x-lora-router-replica"])
    assert str(rid) in served


async def test_a_replica_without_metrics_is_only_marked_unknown(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    silent_emulator: Emulator,
) -> None:
    (emu,) = await emulators(1)
    rt = await router([emu, silent_emulator], health_interval=0.02, policy="round-robin")
    await assert_unknown_and_serving(rt, client, 1, "/metrics: HTTP 404")
    code, body, _ = await call(client, "GET", rt.url + "/metrics")
    assert code == 200
    got = samples(body.decode())
    assert got[("lora_router_replica_reporting", (("replica", "1"),))] == 0
    assert ("lora_router_replica_requests_running", (("replica", "1"),)) not in got
    assert got[("lora_router_replica_reporting", (("replica", "0"),))] == 1


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"<html><body>Bad gateway</body></html>", "no vLLM metrics"),
        (b"# some other program\nup 1\n", "no vLLM metrics"),
        (b"\xff\xfe\x00garbage", "no vLLM metrics"),
        (b'vllm:num_requests_running{engine="0" 1\n', "not a Prometheus exposition"),
        (b"vllm:num_requests_running 1\nvllm:num_requests_waiting 0\n", "no vllm:kv_cache"),
    ],
    ids=["html", "other-program", "binary", "broken-line", "partial"],
)
async def test_a_replica_answering_garbage_is_only_marked_unknown(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
    body: bytes,
    reason: str,
) -> None:
    emus = await emulators(2)
    garbage_from(monkeypatch, emus[1], body)
    rt = await router(emus, health_interval=0.02, policy="round-robin")
    await assert_unknown_and_serving(rt, client, 1, reason)


async def test_a_replica_that_stops_reporting_loses_its_figures(
    emulators: StartEmulators,
    router: StartRouter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    assert rt.telemetry is not None and rt.fleet is not None
    await rt.telemetry.scrape_all()
    assert rt.fleet.replicas[1].report is not None
    garbage_from(monkeypatch, emus[1], b"oops")
    await rt.telemetry.scrape_all()
    assert rt.fleet.replicas[1].report is None  # old figures are not passed off as current
    assert rt.fleet.replicas[0].report is not None


# -- large pages ------------------------------------------------------------------------------

AFTER_TRAFFIC = (
    Path(__file__).parent / "data" / "vllm-0.32-metrics-after-traffic.txt"
).read_bytes()


def long_run_page(size: int) -> bytes:
    """A real vLLM page after LoRA traffic, grown to `size` bytes with the
    `vllm:lora_requests_info` label sets of a long run (two versions in flight at each sync,
    each set newer than the one before)."""
    lines, total, n = [AFTER_TRAFFIC], len(AFTER_TRAFFIC), 0
    while True:
        names = f"trl-policy-v{n},trl-policy-v{n + 1}"
        line = (
            f'vllm:lora_requests_info{{max_lora="3",running_lora_adapters="{names}",'
            f'waiting_lora_adapters="{names}"}} {1.8e9 + n}\n'
        ).encode()
        if total + len(line) > size:
            return b"".join(lines)
        lines.append(line)
        total += len(line)
        n += 1


async def test_a_16_mib_metrics_page_never_holds_the_routers_loop(
    emulators: StartEmulators, router: StartRouter, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A page just under 16 MiB, read whole, took 100 ms or more to scan on this loop; read as it
    # arrives, no piece takes a millisecond. The bound is the median of three scrapes, generous
    # for a loaded machine.
    (emu,) = await emulators(1)
    page = long_run_page((16 << 20) - 1024)
    garbage_from(monkeypatch, emu, page)
    rt = await router([emu])
    assert rt.telemetry is not None and rt.fleet is not None
    stalls = [await longest_lateness(rt.telemetry.scrape_all) for _ in range(3)]
    report = rt.fleet.replicas[0].report
    assert report is not None, rt.fleet.replicas[0].report_error
    whole = telemetry.parse_report(page, report.at)
    assert (report.adapters_running, report.generation_tokens) == (
        whole.adapters_running,
        whole.generation_tokens,
    )
    assert report.adapters_running is not None and len(report.adapters_running) == 2
    assert sorted(stalls)[1] < 0.05, stalls


async def test_a_metrics_page_over_the_cap_shows_why_in_the_status(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(telemetry, "MAX_PAGE_BYTES", 1 << 20)
    emus = await emulators(2)
    garbage_from(monkeypatch, emus[1], long_run_page(2 << 20))
    rt = await router(emus, health_interval=0.02, policy="round-robin")
    await assert_unknown_and_serving(rt, client, 1, "the page is larger than 1 MiB (vLLM keeps")


# -- weight syncs -----------------------------------------------------------------------------


async def test_pause_then_resume_is_one_timed_sync(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    assert (await call(client, "POST", rt.url + "/pause?mode=keep"))[0] == 200
    during = (await router_status(client, rt.url))["syncs"]
    assert during["paused_now"] and during["count"] == 0 and during["paused_seconds"] > 0
    assert (await call(client, "POST", rt.url + "/resume"))[0] == 200
    syncs = (await router_status(client, rt.url))["syncs"]
    assert syncs["count"] == 1 and not syncs["paused_now"]
    (recent,) = syncs["recent"]
    assert 0 < recent["seconds"] == pytest.approx(syncs["paused_seconds"], abs=1e-3)
    assert 0 < syncs["paused_share_window"] <= 1
    code, body, _ = await call(client, "GET", rt.url + "/metrics")
    assert code == 200
    got = samples(body.decode())
    assert got[("lora_router_syncs_total", ())] == 1
    assert got[("lora_router_sync_duration_seconds_count", ())] == 1
    assert got[("lora_router_sync_paused_seconds_total", ())] == pytest.approx(
        recent["seconds"], abs=1e-3
    )


@pytest.fixture
async def stalled_metrics_emulator(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Emulator]:
    """An emulated replica whose `/metrics` never answers (until the test ends)."""
    config = EmulatorConfig(port=0)
    release = asyncio.Event()
    original = emulator_control.routes

    async def stalled(replica: Any, req: Any) -> Any:
        await release.wait()
        return await emulator_control.prometheus(replica, req)

    def routes(cfg: EmulatorConfig) -> Any:
        table = original(cfg)
        if cfg is config:
            table["/metrics"] = {"GET": stalled}
        return table

    monkeypatch.setattr(emulator_control, "routes", routes)
    emu = await start_emulator(config)
    yield emu
    release.set()
    await emu.stop()


async def test_a_replica_whose_metrics_hang_delays_neither_health_checks_nor_requests(
    router: StartRouter, client: aiohttp.ClientSession, stalled_metrics_emulator: Emulator
) -> None:
    rt = await router([stalled_metrics_emulator], health_interval=0.02, health_timeout=0.5)
    assert rt.telemetry is not None and rt.health is not None
    # The start's scrape timed out (the router started all the same); the loop's is next.
    assert rt.telemetry.scrapes == rt.telemetry.scrape_failures == 1
    await until(lambda: rt.telemetry.scrapes >= 2)  # a scrape is hanging from now on
    checks = rt.health.checks
    await until(lambda: rt.health.checks >= checks + 5, timeout=0.4)  # before it times out
    assert rt.telemetry.scrape_failures == 1  # ... still hanging
    assert (await complete(client, rt.url, max_tokens=2))[0] == 200
    await until(lambda: rt.telemetry.scrape_failures >= 2)
    (replica,) = (await router_status(client, rt.url))["replicas"]
    assert replica["reported"] == {
        "status": "unknown",
        "reason": "/metrics: no answer within 0.5 s",
    }
    assert replica["healthy"] and replica["admitted"] and replica["ejections"] == 0
