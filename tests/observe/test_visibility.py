"""What operators see: `/metrics` (Prometheus), `/router/status` (JSON) and the log summary."""

from __future__ import annotations

import asyncio
import logging

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, call, complete, load, router_status, samples

from lora_router.observe.status import summary_line


async def test_metrics_count_each_request_by_its_route_status_replica(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    for _ in range(3):
        status, _ = await complete(client, rt.url)
        assert status == 200
    status, _ = await complete(client, rt.url, model="never-loaded")
    assert status == 404
    code, body, headers = await call(client, "GET", rt.url + "/metrics")
    assert code == 200 and headers["Content-Type"].startswith("text/plain")
    got = samples(body.decode())
    served = {
        labels: v
        for (name, labels), v in got.items()
        if name == "lora_router_requests_total" and ("route", "/v1/completions") in labels
    }
    ok = sum(v for labels, v in served.items() if ("status", "200") in labels)
    assert ok == 3
    assert all(
        dict(labels)["replica"] in ("0", "1") for labels in served if ("status", "200") in labels
    )
    # The router answered the unknown model itself: no replica label.
    assert served[(("replica", "-"), ("route", "/v1/completions"), ("status", "404"))] == 1
    # Latency and time to first byte were observed for the three answers.
    assert got[("lora_router_request_duration_seconds_count", (("route", "/v1/completions"),))] == 4
    assert (
        got[("lora_router_time_to_first_byte_seconds_count", (("route", "/v1/completions"),))] == 3
    )


@pytest.fixture
async def after_a_load_and_four_samples(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The router's `/metrics` samples after one load and four samples of one prompt."""
    emus = await emulators(2)
    rt = await router(emus)
    assert (await load(client, rt.url, "trl-policy-v1", adapter("trl-policy-v1")))[0] == 200
    for _ in range(4):  # one prompt, four samples: one fresh placement, three siblings
        status, _ = await complete(client, rt.url, model="trl-policy-v1")
        assert status == 200
    _, body, _ = await call(client, "GET", rt.url + "/metrics")
    return samples(body.decode())


async def test_metrics_show_the_fleet_state(
    after_a_load_and_four_samples: dict[tuple[str, tuple[tuple[str, str], ...]], float],
) -> None:
    got = after_a_load_and_four_samples
    assert got[("lora_router_adapters_live", ())] == 1
    assert got[("lora_router_replica_up", (("replica", "0"),))] == 1
    assert got[("lora_router_in_flight", (("replica", "1"),))] == 0
    assert got[("lora_router_breaker_opens_total", (("replica", "0"),))] == 0


async def test_metrics_count_routing_decisions_by_kind(
    after_a_load_and_four_samples: dict[tuple[str, tuple[tuple[str, str], ...]], float],
) -> None:
    got = after_a_load_and_four_samples
    assert got[("lora_router_routing_decisions_total", (("kind", "fresh"),))] == 1
    assert got[("lora_router_routing_decisions_total", (("kind", "sibling"),))] == 3


async def test_metrics_count_broadcasts_by_op_outcome(
    after_a_load_and_four_samples: dict[tuple[str, tuple[tuple[str, str], ...]], float],
) -> None:
    got = after_a_load_and_four_samples
    assert got[("lora_router_broadcasts_total", (("op", "load"), ("outcome", "ok")))] == 1


async def test_status_page_shows_the_whole_fleet_state(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(3)
    rt = await router(emus)
    path = adapter("trl-policy-v1")
    assert (await load(client, rt.url, "trl-policy-v1", path))[0] == 200
    assert (await call(client, "POST", rt.url + "/pause?mode=keep"))[0] == 200
    doc = await router_status(client, rt.url)
    assert [r["id"] for r in doc["replicas"]] == [0, 1, 2]
    assert all(r["adapters"] == ["trl-policy-v1"] and r["admitted"] for r in doc["replicas"])
    assert doc["adapters"] == {"trl-policy-v1": {"state": "live", "path": path}}
    assert doc["paused"] == "mode=keep"
    assert doc["fence"]["waiting"] == 0
    assert all(r["breaker_opens"] == 0 for r in doc["replicas"])
    assert doc["health"]["readmission_failures"] == 0


async def test_the_log_summary_names_what_an_operator_checks_first(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    caplog: pytest.LogCaptureFixture,
) -> None:
    emus = await emulators(2)
    for emu in emus:
        emu.faults.hang = "/metrics"  # the start's scrape gets no answer
    caplog.set_level(logging.INFO, logger="lora_router")
    rt = await router(emus, status_interval=0.05, health_timeout=0.2)
    assert (await complete(client, rt.url))[0] == 200
    assert rt.app is not None
    line = summary_line(rt.app.state)
    assert "2/2 replicas serving" in line and "1 requests" in line
    assert "waiting in replicas [?,?]" in line  # no report: unknown, not zero
    assert "0 syncs (paused 0% of the last 300 s)" in line
    async with asyncio.timeout(5):
        while not any("status: 2/2 replicas serving" in r.getMessage() for r in caplog.records):
            await asyncio.sleep(0.02)
