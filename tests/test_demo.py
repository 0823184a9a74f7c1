"""The embedded default (`lora-router --demo`) at a small size: it completes, and what its
summary reports is consistent with the run it describes."""

from __future__ import annotations

import io
import re

import pytest

from lora_router import cli
from lora_router.demo import DemoPlan, run, summary

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
    from lora_router.demo import run_demo

    assert run_demo(["--replicas", "0"], out=io.StringIO()) == 2


def test_the_demos_router_uses_the_policy_it_was_given() -> None:
    from lora_router.demo import run_demo

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
    from lora_router.demo import run_demo

    out = io.StringIO()
    sizes = ["--replicas", "2", "--steps", "2", "--prompts", "4", "--max-tokens", "4"]
    assert run_demo([*sizes, "--no-progress"], out=out) == 0
    text = " ".join(out.getvalue().split())
    assert "an eager client" in text and "with TRL these waits are rare" in text
