"""The embedded default (`lora-router --demo`) at a small size: it completes, and what its
summary reports is consistent with the run it describes."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys

import pytest
from interrupt import assert_one_line, interrupt_when_ready

from lora_router import cli
from lora_router.tools.demo import DemoPlan, run
from lora_router.tools.demo_command import build_parser, run_demo
from lora_router.tools.demo_report import summary

pytestmark = pytest.mark.timeout(60)

SMALL = DemoPlan(replicas=2, steps=6, prompts=4, group=8, max_tokens=8, mount_lag=1)


async def test_a_small_runs_numbers_add_up() -> None:
    result = await run(SMALL, progress=None)
    plan = SMALL
    total = plan.steps * plan.prompts * plan.group
    assert result.failures == []
    assert result.requests == total
    assert sum(r.requests for r in result.replicas) == total
    assert result.streamed == plan.steps * len(range(0, plan.prompts, plan.stream_every)) * 8
    # Every replica took part, and siblings mostly met on one replica.
    assert all(r.requests > 0 for r in result.replicas)
    assert 1 / plan.replicas < result.affinity <= 1.0
    # Prompts share a chat template and siblings share their whole prompt, so the caches hit;
    # but never everything: the first sample of a prompt computes its own tokens.
    assert all(0.0 < r.hit_rate < 1.0 for r in result.replicas)
    assert 0.0 < result.hit_rate <= result.ideal_hit_rate < 1.0
    # What the router read of the answers is what the replicas counted (streams without a
    # usage frame aside); it predicted no more than that: the shared template is not a family.
    hits = sum(r.cache_hits for r in result.replicas)
    assert 0 < result.predicted_cached <= result.reported_cached <= hits
    # One load per step, every one answered; the oldest versions were unloaded.
    assert len(result.load_times) == plan.steps
    assert result.unloads == plan.steps - plan.max_staleness - 1
    # The eager groups were held at the fence, never longer than their load took.
    assert len(result.fence_waits) == plan.steps * plan.eager_groups * plan.group
    assert max(result.fence_waits) <= max(result.load_times)
    assert result.wall < 30


async def test_the_summary_reports_the_run() -> None:
    result = await run(DemoPlan(replicas=2, steps=2, prompts=2, max_tokens=4), progress=None)
    text = summary(result)
    assert text.splitlines()[-1] == "OK: the run completed."
    assert f"requests      {result.requests} (" in text
    shown = [int(m) for m in re.findall(r"http://127\.0\.0\.1:\d+\s+(\d+)", text)]
    assert sum(shown) == result.requests


def test_the_command_line_runs_the_demo(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--demo"]) == 0
    out = capsys.readouterr().out
    assert "OK: the run completed." in out


def test_demo_sizes_are_validated() -> None:
    assert run_demo(["--replicas", "0"], out=io.StringIO()) == 2


def test_the_demos_router_uses_the_policy_it_was_given() -> None:
    out = io.StringIO()
    sizes = ["--replicas", "2", "--steps", "2", "--prompts", "4", "--max-tokens", "4"]
    status = run_demo([*sizes, "--no-progress"], out=out, router={"policy": "round-robin"})
    text = out.getvalue()
    assert status == 0, text
    assert "--policy round-robin" in text.splitlines()[1]
    # Round robin deals the 8 samples of a prompt 4 and 4 over 2 replicas, where prefix
    # affinity would keep them together.
    assert "affinity      50.0% of samples" in text


def test_the_summary_explains_the_fence_waits() -> None:
    out = io.StringIO()
    sizes = ["--replicas", "2", "--steps", "2", "--prompts", "4", "--max-tokens", "4"]
    assert run_demo([*sizes, "--no-progress"], out=out) == 0
    text = " ".join(out.getvalue().split())
    assert "an eager client" in text and "with TRL these waits are rare" in text


def lora_router(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lora_router.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ,
    )


def test_every_flag_of_the_demos_usage_works_after_lora_router_demo() -> None:
    own = ["--replicas", "2", "--steps", "2", "--prompts", "2", "--group", "4"]
    own += ["--max-tokens", "4", "--mount-lag", "1", "--policy", "round-robin", "--no-progress"]
    # Every flag the demo's usage line offers is in the command line above.
    usage = build_parser().format_usage()
    assert set(re.findall(r"\[(--[a-z-]+)", usage)) == {a for a in own if a.startswith("--")}
    result = lora_router("--demo", *own, "--vnodes", "7")  # and a routing flag for its router
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # --no-progress
    header = result.stdout.splitlines()[1]
    assert header.startswith(
        "lora-router demo: 2 steps x 2 prompts x G=4 over 2 emulated replicas, "
        "--policy round-robin, --vnodes 7, "
    )
    assert result.stdout.splitlines()[-1] == "OK: the run completed."


def test_help_after_demo_is_the_demos_help() -> None:
    result = lora_router("--demo", "--help")
    assert result.returncode == 0
    assert result.stdout.startswith("usage: lora-router --demo [-h] [--replicas REPLICAS]")
    assert "--vnodes" in result.stdout  # the routing flags it also takes


async def test_ctrl_c_stops_the_demo_with_one_line_and_status_130() -> None:
    # Interrupted mid-run: the first adapter is live and rollouts are in flight.
    result = await interrupt_when_ready(
        ["lora_router.cli", "--demo"], r"trl-policy-v1 live", on="stderr"
    )
    assert_one_line(result, "lora-router --demo")
