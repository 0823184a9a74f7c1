"""`lora-router --check` against real vLLM replicas, one of them misconfigured."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from lora_router.testbed.vllm_harness import Replica, run_check


@pytest.fixture(scope="module")
def too_few_slots(model: Path, logs: Path, fleet: list[Replica]) -> Iterator[Replica]:
    """A third replica started with `--max-loras 1` (started only for these tests)."""
    replica = Replica(model=model / "model", log=logs / "replica-max-loras-1.log", max_loras=1)
    replica.start()
    try:
        replica.wait_healthy()
        yield replica
    finally:
        replica.stop()


def test_check_passes_on_a_fleet_fit_for_trl(fleet: list[Replica]) -> None:
    # max_staleness 1 needs max_loras >= 3, what the shared replicas run with.
    result = run_check(fleet, "--max-staleness", "1")
    assert result.returncode == 0, result.stdout + result.stderr


def test_check_fails_naming_the_replica_with_too_few_lora_slots(
    fleet: list[Replica], too_few_slots: Replica
) -> None:
    result = run_check([*fleet, too_few_slots], "--max-staleness", "1")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "max_loras" in output
    assert too_few_slots.url in output or "replica 2" in output, output
