"""`lora-router top`: the verdict rule, and `top --once` run as a process against a live router."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter, synced_traffic
from helpers import Adapter, router_status, run_top, until

from lora_router.config import Secret
from lora_router.tools.top import compact, verdict


def status(busy: float | None, paused: float, reporting: int = 2) -> dict[str, Any]:
    return {
        "replicas": [],
        "fleet": {"reporting": reporting, "busy_share": busy, "waiting": 3, "running": 9},
        "syncs": {"paused_share_window": paused, "window_s": 300.0},
    }


@pytest.mark.parametrize(
    ("busy", "paused", "expected"),
    [
        (0.99, 0.30, "trainer-bound"),  # long syncs outweigh a busy fleet
        (0.95, 0.05, "inference-bound"),
        (0.90, 0.24, "inference-bound"),
        (0.40, 0.05, "trainer-bound"),
        (0.70, 0.10, "balanced"),
        (0.50, 0.00, "balanced"),
        (0.00, 0.10, "idle"),
        (0.00, 0.25, "trainer-bound"),  # a fleet left paused is not idle
    ],
)
def test_the_verdict_follows_the_documented_rule(busy: float, paused: float, expected: str) -> None:
    line = verdict(status(busy, paused))
    assert line.startswith(expected + ":")
    # The numbers it was judged on are on the line.
    assert f"busy {busy:.0%}" in line and f"paused for syncs {paused:.0%}" in line
    assert "3 waiting" in line and "9 running" in line


def test_a_broadcast_queued_behind_a_slow_replay_reads_syncing() -> None:
    doc = status(0.99, 0.30)  # trainer-bound by its shares: the stall is named first
    doc["broadcasts"] = {"pending": 1, "replay_holding_lock": {"replica": 1, "seconds": 7.0}}
    line = verdict(doc)
    assert line.startswith("syncing: 1 broadcast(s) wait for the replay of replica 1"), line
    doc["broadcasts"]["pending"] = 0  # nothing waits for it
    assert verdict(doc).startswith("trainer-bound:")


def test_members_under_two_names_read_misconfigured_after_any_disagreement() -> None:
    doc = status(0.95, 0.05)  # inference-bound by its shares: the misconfiguration comes first
    doc["aliases"] = ["replica 0 (http://a:1) and replica 1 (http://b:1) reach ...; fix: ..."]
    assert verdict(doc) == f"misconfigured: {doc['aliases'][0]}"
    doc["disagreements"] = ["the replicas disagree on block size: ...; fix: ..."]
    assert verdict(doc) == f"misconfigured: {doc['disagreements'][0]}"


def test_no_verdict_without_a_reporting_replica() -> None:
    assert verdict(status(0.99, 0.0, reporting=0)).startswith("unknown:")


def pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0%}"


async def test_top_once_prints_each_replicas_reported_figures(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(2)
    # No scrape of its own between the two reads below: the test compares them figure by figure.
    rt = await router(emus, health_interval=60.0)
    await synced_traffic(client, rt, "trl-policy-v1", adapter("trl-policy-v1"))
    doc = await router_status(client, rt.url)

    code, out, err = await run_top("--once", "--url", rt.url)

    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"lora-router {rt.url}  2/2 replicas serving  paused: no")
    assert "live: trl-policy-v1" in out
    for replica in doc["replicas"]:
        rep = replica["reported"]
        row = next(
            line.split() for line in lines if line.split()[:2] == [str(replica["id"]), "serving"]
        )
        assert row[2] == str(replica["in_flight"])
        assert row[3] == f"{rep['running']}/{rep['waiting']}"
        assert row[4] == pct(rep["kv_cache_usage"])
        assert row[5:8] == [
            pct(rep["prefix_cache_hit_rate"]),
            "/",
            pct(rep["prefix_cache_hit_rate_total"]),
        ]
        tokens = rep["generation_tokens_per_s"]
        assert row[8] == (f"{tokens:,.0f}" if tokens is not None else "-")
        assert row[9] == pct(rep["busy_share"])
        accuracy = doc["routing_accuracy"]["replicas"].get(str(replica["id"])) or {}
        assert row[10] == pct(accuracy.get("ratio"))
        assert row[11:] == ["trl-policy-v1"]
    assert any(line.startswith("syncs: 1, ") for line in lines)
    accuracy = doc["routing_accuracy"]
    assert accuracy["answers"] == 4  # synced_traffic: four completions of token-id prompts
    reported, predicted = accuracy["reported_cached_tokens"], accuracy["predicted_cached_tokens"]
    assert (
        f"cache reports: 4 answers, reported {reported:,} of {predicted:,} predicted cached "
        f"tokens ({pct(accuracy['ratio'])}), 0 unreported"
    ) in out
    kind = verdict(doc).split(":")[0]
    assert lines[-1].startswith(f"verdict: {kind}: busy ")


async def test_top_once_shows_a_replica_that_does_not_report_as_unknown(
    emulators: StartEmulators, router: StartRouter
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    await emus[1].crash()
    assert rt.telemetry is not None
    await rt.telemetry.scrape_all()
    code, out, err = await run_top("--once", "--url", rt.url)
    assert code == 0, err
    row = next(line for line in out.splitlines() if line.split()[:1] == ["1"])
    assert "unknown" in row and "figures unknown: /metrics: cannot connect" in row
    assert "fleet: 1/2 reporting" in out


async def test_top_reads_a_router_that_wants_an_api_key(
    emulators: StartEmulators, router: StartRouter
) -> None:
    emus = await emulators(1)
    rt = await router(emus, api_key=Secret("sesame"))
    code, out, err = await run_top("--once", "--url", rt.url)
    assert code == 1 and "wants an API key: pass --api-key-env NAME" in err
    code, out, err = await run_top(
        "--once", "--url", rt.url, "--api-key-env", "ROUTER_KEY", env={"ROUTER_KEY": "sesame"}
    )
    assert code == 0, err
    assert "1/1 replicas serving" in out
    assert "sesame" not in out + err


async def test_top_once_fails_in_one_line_when_no_router_answers() -> None:
    code, out, err = await run_top("--once", "--url", "http://127.0.0.1:9")
    assert code == 1 and out == ""
    assert err.startswith("lora-router top: cannot reach http://127.0.0.1:9")
    assert len(err.splitlines()) == 1


def test_top_is_a_subcommand_beside_the_routers_own_flags(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from lora_router.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["top", "--help"])
    assert exc.value.code == 0
    assert "usage: lora-router top" in capsys.readouterr().out
    # The router's own forms are untouched: a bad flag still costs one line and status 2.
    with pytest.raises(SystemExit) as exc:
        main(["--replicas", "http://127.0.0.1:1", "--no-such-flag"])
    assert exc.value.code == 2


def test_adapter_versions_are_shown_compactly() -> None:
    assert compact([]) == "-"
    assert compact(["trl-policy-v9"]) == "trl-policy-v9"
    assert compact(["trl-policy-v10", "trl-policy-v8", "trl-policy-v9"]) == "trl-policy-v{8,9,10}"
    assert compact(["alpha", "beta"]) == "alpha, beta"


async def test_top_once_shows_each_discovery_source_and_its_members(
    emulators: StartEmulators, router: StartRouter, tmp_path: Path
) -> None:
    first, member = await emulators(2)
    members = tmp_path / "replicas"
    members.write_text(f"{member.url}\nnot a url\n")
    rt = await router([first], replicas_files=(str(members),), replica_hosts=("127.0.0.1",))
    await until(lambda: rt.fleet is not None and [r.live for r in rt.fleet.replicas] == [True] * 2)
    code, out, err = await run_top("--once", "--url", rt.url)
    assert code == 0, err
    words = " ".join(out.split())
    assert f"source file:{members}: 1 member (replicas 1), read " in words
    assert "entries skipped: 1" in words
    members.unlink()
    assert rt.discovery is not None
    await until(lambda: bool(rt.discovery and rt.discovery.states[0].error), timeout=10)
    code, out, err = await run_top("--once", "--url", rt.url)
    words = " ".join(out.split())  # the line is wrapped at the terminal's width
    assert f"source file:{members}: 1 member (replicas 1)" in words
    assert "last read failed: cannot read it" in words


async def test_a_replica_whose_engine_hangs_reads_stalled(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    # Its completions hang while /health and /metrics answer: nothing ejects it, and its
    # counters stand still while the router holds a request on it.
    (emu,) = await emulators(1)
    rt = await router([emu], health_interval=0.1)
    emu.faults.hang = "/v1/completions"
    body = {"prompt": list(range(40)), "max_tokens": 4}
    held = asyncio.create_task(client.post(rt.url + "/v1/completions", json=body))
    try:

        async def still_s() -> float:
            doc = await router_status(client, rt.url)
            return float(doc["replicas"][0]["reported"].get("still_s") or 0.0)

        deadline = asyncio.get_running_loop().time() + 15
        while (still := await still_s()) < 20 * 0.1 + 0.5:  # past STILL_SCRAPES intervals
            assert asyncio.get_running_loop().time() < deadline, still
            await asyncio.sleep(0.1)  # scrapes come every 0.1 s: no event to await
        code, out, err = await run_top("--once", "--url", rt.url)
        assert code == 0, err
        assert "verdict: stalled: replica 0 has computed no token for " in " ".join(out.split()), (
            out
        )
    finally:
        held.cancel()
        emu.faults.hang = None
    # Once it computes again, it is still no longer.
    async with client.post(rt.url + "/v1/completions", json=body) as resp:
        assert resp.status == 200
    await until(lambda: rt.fleet is not None and _still(rt) == 0.0, 5.0)


def _still(rt: Any) -> float:
    report = rt.fleet.replicas[0].report
    return 0.0 if report is None or report.still_since is None else 1.0
