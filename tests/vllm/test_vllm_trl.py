"""TRL 1.16's exact control sequence, with TRL's own client, through the router to real vLLM."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import SimpleNamespace

from lora_router.testbed.trl_client import LORA_NAME, Rollouts, vllm_client
from lora_router.testbed.vllm_harness import Replica, Router

PROMPT = list(range(10, 60))


def test_trl_sync_sequence_reaches_every_replica(
    fleet: list[Replica], router: Router, publish: Callable[..., str], base: str
) -> None:
    """health, server_info, get_world_size, v1/models, pause?mode=keep, load, resume, a rollout,
    then the next sync's unload: each call TRL makes answers as TRL needs, and each broadcast
    is on every replica."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    from trl.experimental.async_grpo.async_grpo_trainer import select_adapter_sync

    client = vllm_client(router.url)
    client.wait_for_server_ready(poll_interval_s=0.2)

    # TRL's own decision from the router's /server_info: adapter-only sync, no error raised
    # (DP must read 1, max_loras must cover max_staleness + 2, max_lora_rank the adapter's).
    v1 = publish(f"{LORA_NAME}-v1", 0)
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), v1)
    args = SimpleNamespace(max_staleness=1)
    assert select_adapter_sync(client.get_server_info(), peft_model, args) is True
    assert client.get_dtype()
    assert client.get_world_size() == 1
    assert client.get_max_model_len() == 4096

    client.pause()
    assert [r.get("/is_paused").json() for r in fleet] == [{"is_paused": True}] * 2
    client.load_lora_adapter(f"{LORA_NAME}-v1", v1)
    client.resume()
    assert [r.get("/is_paused").json() for r in fleet] == [{"is_paused": False}] * 2
    assert [r.adapters() for r in fleet] == [{f"{LORA_NAME}-v1": v1}] * 2

    rollouts = Rollouts(router.url, base, version=1)
    [completion] = asyncio.run(rollouts.groups([PROMPT], group_size=1))
    assert 1 <= len(completion) <= 4

    # The next sync (max_staleness 0 in effect): pause, load v2, resume, unload v1.
    client.pause()
    v2 = publish(f"{LORA_NAME}-v2", 1)
    client.load_lora_adapter(f"{LORA_NAME}-v2", v2)
    client.resume()
    client.unload_lora_adapter(f"{LORA_NAME}-v1")
    assert [r.adapters() for r in fleet] == [{f"{LORA_NAME}-v2": v2}] * 2
    models = [card["id"] for card in router.get("/v1/models").json()["data"]]
    assert models == [base, f"{LORA_NAME}-v2"]
