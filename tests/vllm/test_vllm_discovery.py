"""A third real vLLM replica joins through `--replicas-file` while rollouts run: it is given the
live adapter before it serves (its own log: the load comes before any request naming it), and
then it serves rollouts; no rollout is answered other than 200."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import recipe
from rollouts import Rollouts

from lora_router.testbed.trl_client import LORA_NAME
from lora_router.testbed.vllm_harness import REPLICA_START_S, Replica, Router, wait_for

V1 = f"{LORA_NAME}-v1"


def test_a_replica_named_in_the_file_mid_run_is_replayed_then_serves(
    fleet: list[Replica],
    routers: Callable[..., Router],
    publish: Callable[..., str],
    model: Path,
    logs: Path,
    tmp_path: Path,
) -> None:
    members = tmp_path / "replicas"
    members.write_text("# replicas that joined\n")
    router = routers(
        "--replicas-file", str(members), "--replica-hosts", "127.0.0.1", "--discovery-grace", "5"
    )
    path = publish(V1, 0)
    assert router.post("/v1/load_lora_adapter", {"lora_name": V1, "lora_path": path}).status == 200
    third = Replica(model=model / "model", log=logs / "replica-joining.log")
    try:
        # Started before the rollouts, outside the fleet until the file names it: on 2 cores a
        # vLLM starting beside two replicas under load can take more than REPLICA_START_S.
        third.start()
        third.wait_healthy(REPLICA_START_S)
        with Rollouts(router.url, V1, seed=7) as rollouts:
            aside = members.with_suffix(".new")
            aside.write_text(f"# replicas that joined\n{third.url}\n")
            os.replace(aside, members)
            wait_for(
                "the third replica is replayed and admitted",
                lambda: any(r["url"] == third.url and r["admitted"] for r in router.replicas()),
                120,
                [router.log, third.log],
            )
            [joined] = [r for r in router.replicas() if r["url"] == third.url]
            assert joined["origin"] == f"file:{members}"
            assert third.adapters() == {V1: path}
            wait_for(
                "rollouts reach the third replica",
                lambda: rollouts.served_by(str(joined["id"])),
                120,
                [router.log, third.log],
            )
    finally:
        third.stop()  # after the rollouts: a replica shutting down answers 500
    statuses = rollouts.statuses
    assert statuses and {s for s, _ in statuses} == {200}, sorted({s for s, _ in statuses})
    assert rollouts.cut == []
    run = recipe.record([third], [0])
    assert run.loads[0] and run.late_versions(LORA_NAME) == []  # loaded before it was asked
    completions = [a.status for a in run.accesses[0] if a.path == "/v1/completions"]
    assert completions and set(completions) == {200}, sorted(set(completions))
