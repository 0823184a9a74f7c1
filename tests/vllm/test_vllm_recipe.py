"""The whole recipe: TRL's real `AsyncGRPOTrainer.train()` through the router to two real vLLM
replicas, and a preempted run (trainer and router killed together) that resumes.

The trainer runs in its own process (grpo_run.py, which documents its two CPU stand-ins); the
router is started as the guide starts it (`python -m lora_router --replicas ... --token-env ...
--port P`). What is checked comes from the replicas' own logs and counters (recipe.py,
replica_log.py). `VLLM_RECIPE_ROUTER_FLAGS` adds router flags, to show what fails without the
router's work: with `--policy round-robin` the trainer test fails on its hit rate.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import recipe
from recipe import PROBE, PROMPT_TOKENS, Trainer, probe, probe_fresh, start_trainer

from lora_router.testbed.trl_client import LORA_NAME
from lora_router.testbed.vllm_harness import (
    TOKEN,
    Replica,
    Router,
    free_port,
    start_router_as_user,
    tail,
    wait_for,
)

GROUP = 4  # num_generations
BATCH = 8  # samples a step: two groups
STALENESS = 1  # max_staleness: the replicas' --max-loras 3 is max_staleness + 2
TRAIN_S = 600.0  # a trainer run, its start (imports, the spawned worker) included
EXTRA = tuple(shlex.split(os.environ.get("VLLM_RECIPE_ROUTER_FLAGS", "")))


def spec(model: Path, url: str, out: Path, prompts: list[str], **more: object) -> dict[str, object]:
    return {
        "url": url,
        "model": str(model / "model"),
        "output_dir": str(out),
        "prompts": prompts,
        "group": GROUP,
        "batch": BATCH,
        "max_staleness": STALENESS,
        "max_tokens": 4,
        "learning_rate": 0.2,  # large: each step moves the rank-1 adapter's greedy answers
        **more,
    }


def run_to_the_end(trainer: Trainer, routers: list[Router]) -> dict[str, object]:
    wait_for(
        "the trainer's run",
        lambda: trainer.process.poll() is not None,
        TRAIN_S,
        [trainer.log, *(r.log for r in routers)],
    )
    assert trainer.process.returncode == 0, tail(trainer.log, 80)
    return trainer.finished()


def no_secret_in(*texts: str) -> None:
    for text in texts:
        assert TOKEN not in text


def test_trl_trains_through_the_router_keeping_groups_together(
    fleet: list[Replica], model: Path, base: str, logs: Path, tmp_path: Path
) -> None:
    """TRL's trainer, six steps (rank 1, G=4, a sync every step, max_staleness 1): adapter-only
    sync; every version on every replica before any request names it (the replicas' logs); the
    replicas' prefix-cache hits ≥ 0.95 of what keeping each group on one replica allows; no
    request answered other than 200; the replicas' token in no log or answer."""
    tokenizer = recipe.chat_tokenizer(base)
    prompts = recipe.exact_prompts(tokenizer, 96, seed=1)
    router = start_router_as_user(fleet, logs / "recipe-router.log", free_port(), *EXTRA)
    offsets = [r.log_size() for r in fleet]
    before = recipe.counters(fleet)
    trainer = start_trainer(
        spec(model, router.url, tmp_path / "run", prompts, max_steps=6), logs / "recipe-trainer.log"
    )
    try:
        result = run_to_the_end(trainer, [router])
    finally:
        trainer.kill()
        seen = [router.get("/v1/models").text, router.get("/router/status").text]
        router.stop()
    run = recipe.record(fleet, offsets, before)
    trainer_log = trainer.log.read_text(errors="replace")

    assert result["global_step"] == 6 and result["model_version"] == 7 and result["finite_loss"]
    assert "Adapter-only vLLM sync enabled" in trainer_log, tail(trainer.log, 80)
    versions = [f"{LORA_NAME}-v{n}" for n in range(1, 8)]
    assert [sorted({n for _, n in ls}) for ls in run.loads] == [sorted(versions)] * 2
    assert run.late_versions(LORA_NAME) == []
    requests = [r for rs in run.requests for r in rs]
    assert requests and {r.adapter for r in requests} <= set(versions)
    assert all(len(r.head) == 100 for r in requests)  # each request's prompt is known
    assert run.queries == len(requests) * PROMPT_TOKENS  # each request counted once
    allowed = run.grouped_hits()
    figures = {"requests": len(requests), "families": len(run.families()), "hits": run.hits}
    figures |= {"allowed": allowed, "ratio": round(run.hits / allowed, 4), "flags": EXTRA}
    (logs / "recipe-hits.json").write_text(json.dumps(figures) + "\n")  # the tier's record
    assert run.hits >= 0.95 * allowed, (
        f"prefix-cache hits {run.hits:.0f} of {allowed} that keeping groups together allows "
        f"({run.hits / allowed:.3f}; {len(requests)} requests, {len(run.families())} families)"
    )
    assert {a.status for acc in run.accesses for a in acc} == {200}
    no_secret_in(trainer_log, router.log.read_text(errors="replace"), *seen)
    no_secret_in(
        *(recipe.replica_log.text_since(r.log, o) for r, o in zip(fleet, offsets, strict=True))
    )


# -- preemption ---------------------------------------------------------------------------

CHECKPOINT_VERSION = 4  # checkpoint-3: the cold sync's v1, then one sync per step
REPUBLISHED = [f"{LORA_NAME}-v5", f"{LORA_NAME}-v6"]  # the syncs past it, before the kill


def held(path: Path, trainer: Trainer, routers: list[Router]) -> None:
    """Wait until the trainer holds after the sync that published v6 (grpo_run.py)."""
    wait_for(
        f"the trainer holding ({path.name})",
        lambda: Path(f"{path}.reached").exists(),
        TRAIN_S,
        [trainer.log, *(r.log for r in routers)],
        trainer.died,
    )


def test_a_preempted_run_resumes_and_republished_names_serve_the_new_weights(
    fleet: list[Replica], model: Path, base: str, logs: Path, tmp_path: Path
) -> None:
    """Run 1 checkpoints at step 3 (model_version 4), syncs v5 and v6, and is killed there with
    the router; the replicas keep v5 and v6 (the first run's weights) and a probe prompt cached
    under them. The router is started again with the same command, the trainer resumed from
    its checkpoint: it publishes v5 and v6 again, with other weights. On every replica a
    greedy probe under each name then equals a fresh load of its directory under a new name,
    with nothing of the old KV, and differs from the first run's; training reaches step 8."""
    tokenizer = recipe.chat_tokenizer(base)
    prompts = recipe.exact_prompts(tokenizer, 96, seed=2)
    port = free_port()
    out = tmp_path / "run"
    adapters = out / ".vllm_lora"
    routers = [start_router_as_user(fleet, logs / "preempt-router-1.log", port, *EXTRA)]
    first = spec(
        model, routers[0].url, out, prompts, max_steps=8, save_steps=3, hold_after_version=6
    )
    trainers = [
        start_trainer({**first, "hold_file": str(tmp_path / "hold-1")}, logs / "preempt-1.log")
    ]
    try:
        held(tmp_path / "hold-1", trainers[0], routers)
        assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
        state = json.loads((out / "checkpoint-3" / "rollout_state.json").read_text())
        assert state["model_version"] == CHECKPOINT_VERSION
        old = {n: [probe(r, n, PROBE) for r in fleet] for n in REPUBLISHED}
        for name in REPUBLISHED:
            shutil.copytree(adapters / name, tmp_path / f"old-{name}")

        # The preemption: the trainer (with its rollout worker) and the router, together.
        trainers[0].kill()
        routers[0].kill()
        assert all(set(REPUBLISHED) <= set(r.adapters()) for r in fleet)

        routers.append(start_router_as_user(fleet, logs / "preempt-router-2.log", port, *EXTRA))
        offsets = [r.log_size() for r in fleet]
        hold = tmp_path / "hold-2"
        resumed = {**first, "resume": True, "hold_file": str(hold)}
        trainers.append(start_trainer(resumed, logs / "preempt-2.log"))
        held(hold, trainers[1], routers)
        for name in REPUBLISHED:
            new = [probe(r, name, PROBE) for r in fleet]  # the first under the new files
            for i, replica in enumerate(fleet):
                assert new[i].cached == 0, f"{name} on replica {i} hit KV of the old weights"
                fresh = probe_fresh(replica, f"fresh-{name}", adapters / name, PROBE)
                again = probe_fresh(replica, f"old-{name}", tmp_path / f"old-{name}", PROBE)
                assert new[i].agrees(fresh), (name, i, new[i], fresh)
                assert old[name][i].agrees(again), (name, i, old[name][i], again)
                # The probe tells the two runs' weights apart (else the checks above prove nothing).
                assert not new[i].agrees(old[name][i]), (name, i, new[i], old[name][i])
            weights = "adapter_model.safetensors"
            assert (adapters / name / weights).read_bytes() != (
                tmp_path / f"old-{name}" / weights
            ).read_bytes()
        hold.write_text("go")
        result = run_to_the_end(trainers[1], routers)
    finally:
        for trainer in trainers:
            trainer.kill()
        for router in routers:
            router.stop()

    assert result["global_step"] == 8 and result["finite_loss"]
    run = recipe.record(fleet, offsets)
    # No TRL call failed: every completion and load answered 200 (TRL unloads v3 and v4 again,
    # which the first run had unloaded: vLLM's 404, which TRL ignores).
    bad = [a for acc in run.accesses for a in acc if a.status != 200]
    assert all(a.path == "/v1/unload_lora_adapter" and a.status == 404 for a in bad), bad
    assert run.late_versions(LORA_NAME) == []
    second = routers[1].log.read_text(errors="replace")
    for name in REPUBLISHED:
        assert f"load '{name}': the fleet already serves this name" in second
    no_secret_in(second, trainers[1].log.read_text(errors="replace"))
    no_secret_in(
        *(recipe.replica_log.text_since(r.log, o) for r, o in zip(fleet, offsets, strict=True))
    )
