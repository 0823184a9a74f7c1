"""TRL 1.16's `AsyncGRPOTrainer.train()` on CPU, as a user runs it against a vLLM server: the
trainer process of the vLLM tier's recipe tests (test_vllm_recipe.py).

    python tests/vllm/grpo_run.py RUN.json

RUN.json names the server (the router's URL), the tiny model, the output directory, the prompts
and the run's length; see `main`. Everything TRL does over the network is TRL's own code: its
`VLLMClient` (health, server info, pause, load, resume, unload), its rollout worker (the
`/v1/completions` requests, in a spawned process), its checkpoints and `resume_from_checkpoint`.

Two stand-ins replace, in this process only, what cannot run on a CPU; neither is on the
network path:

- `torch.cuda.get_device_name`: TRL calls it unconditionally when the trainer is built
  (`trl.trainer.utils.get_peak_flops_per_device`, for its MFU metric), and on a CPU-only torch
  it raises. The stand-in names no device, so TRL turns MFU off ("peak FLOPs are unknown").
- the attention kernel of TRL's tree packing (`packing._flash_attn`): TRL downloads
  flash-attention 3 from the Hub (`kernels.get_kernel`), a CUDA-only kernel. The stand-in
  computes the same `flash_attn_varlen_func` with torch's scaled-dot-product attention, one
  packed segment at a time (causal, aligned to the end of each segment's keys, as flash-attn
  aligns a query block shorter than its keys), so TRL's packing, its K/V gather and its loss
  run unchanged.

The tiny model's tokenizer gets TRL's own Qwen2.5 chat template (`trl/chat_templates/`): TRL's
rollout worker recognises chat templates by their text and refuses any other ("Unrecognized chat
template").

`hold_after_version` makes the run wait after the weight sync that published that version,
until the file `hold_file` exists (bounded by `hold_timeout`): the test probes the replicas
meanwhile, or kills the run there (a preemption). It is a trainer callback, TRL's own API.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

QWEN25_TEMPLATE = "chat_templates/qwen2_5.jinja"  # TRL's own, under the trl package


def reward_letters(completions: list[Any], **_: Any) -> list[float]:
    """A reward with spread in every group (the tiny model writes random text): the share of
    letters among a completion's characters. Module level: TRL pickles it for its worker."""
    out = []
    for completion in completions:
        text = completion if isinstance(completion, str) else completion[-1]["content"]
        out.append(sum(c.isalpha() for c in text) / max(len(text), 1))
    return out


def cpu_varlen_attention(
    q: Any,
    k: Any,
    v: Any,
    cu_seqlens_q: Any,
    cu_seqlens_k: Any,
    max_seqlen_q: int,
    max_seqlen_k: int,
    softmax_scale: float | None = None,
    causal: bool = True,
    window_size: tuple[int, int] = (-1, -1),
    **_: Any,
) -> Any:
    """flash_attn_varlen_func's contract on the CPU: packed (tokens, heads, dim) queries and
    keys, segment i being q[cu_q[i]:cu_q[i+1]] against k[cu_k[i]:cu_k[i+1]]; grouped-query
    heads repeated; causal masks aligned bottom-right. Differentiable (sdpa)."""
    import torch
    import torch.nn.functional as F

    assert window_size == (-1, -1), "the tiny Qwen2 has no sliding window"
    heads, kv_heads = q.shape[1], k.shape[1]
    out = []
    for i in range(len(cu_seqlens_q) - 1):
        qs = q[int(cu_seqlens_q[i]) : int(cu_seqlens_q[i + 1])].transpose(0, 1)
        ks = k[int(cu_seqlens_k[i]) : int(cu_seqlens_k[i + 1])].transpose(0, 1)
        vs = v[int(cu_seqlens_k[i]) : int(cu_seqlens_k[i + 1])].transpose(0, 1)
        if kv_heads != heads:
            ks = ks.repeat_interleave(heads // kv_heads, dim=0)
            vs = vs.repeat_interleave(heads // kv_heads, dim=0)
        lq, lk = qs.shape[1], ks.shape[1]
        mask = None
        if causal:
            rows = torch.arange(lq).unsqueeze(1) + (lk - lq)
            mask = torch.arange(lk).unsqueeze(0) <= rows
        out.append(
            F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=softmax_scale)
            .transpose(0, 1)
            .contiguous()
        )
    return torch.cat(out, dim=0)


def install_cpu_stand_ins() -> None:
    """The two stand-ins of the module docstring, nothing else."""
    import torch
    from trl.experimental.async_grpo import packing

    torch.cuda.get_device_name = lambda *_a, **_k: "no CUDA device (CPU run)"
    packing._flash_attn = lambda: SimpleNamespace(flash_attn_varlen_func=cpu_varlen_attention)


def hold_callback(version: int, hold_file: Path, timeout: float, trainer: Any) -> Any:
    from transformers import TrainerCallback

    class Hold(TrainerCallback):
        """After the sync that published `version` (TRL's callbacks run first): wait."""

        def __init__(self) -> None:
            self.done = False

        def check(self) -> None:
            if self.done or trainer.model_version != version:
                return
            self.done = True
            Path(f"{hold_file}.reached").write_text(str(version))
            deadline = time.monotonic() + timeout
            while not hold_file.exists():  # bounded by `timeout`
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{hold_file} did not appear within {timeout:.0f} s")
                time.sleep(0.05)

        def on_train_begin(self, *_: Any, **__: Any) -> None:
            self.check()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            self.check()

    return Hold()


def main(spec_file: str) -> int:
    spec = json.loads(Path(spec_file).read_text())
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    # TRL's own lines (the sync mode it chose, each sync's phases) are what the tests read.
    logging.basicConfig(format="%(created).6f %(levelname)s [%(name)s] %(message)s")
    logging.getLogger("trl").setLevel(logging.INFO)
    install_cpu_stand_ins()

    import trl
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    model = spec["model"]
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = (
        Path(trl.__file__).parent / "chat_templates/qwen2_5.jinja"
    ).read_text()
    dataset = Dataset.from_dict(
        {"prompt": [[{"role": "user", "content": p}] for p in spec["prompts"]]}
    )
    config = AsyncGRPOConfig(
        output_dir=spec["output_dir"],
        vllm_server_base_url=spec["url"],
        vllm_server_timeout=60.0,
        request_timeout=120,
        max_staleness=spec["max_staleness"],
        num_generations=spec["group"],
        max_completion_length=spec["max_tokens"],
        per_device_train_batch_size=spec["batch"],
        gradient_accumulation_steps=1,
        weight_sync_steps=1,
        max_steps=spec["max_steps"],
        # Each step trains `batch` samples (no token budget, which would pack ~60 on this
        # model), and the worker keeps at most one step's samples queued: without it, it
        # fills TRL's default 1024 slots with samples that go stale, hundreds of requests a
        # step on two CPU replicas.
        token_budget=0,
        queue_maxsize=spec["batch"],
        learning_rate=spec["learning_rate"],
        save_strategy="steps",
        save_steps=spec.get("save_steps", 10_000),
        logging_steps=1,
        report_to=[],
        bf16=False,
        use_cpu=True,
        gradient_checkpointing=False,
        dataloader_num_workers=0,
        seed=spec.get("seed", 0),
    )
    trainer = AsyncGRPOTrainer(
        model=model,
        reward_funcs=reward_letters,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=LoraConfig(
            r=1, lora_alpha=2, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]
        ),
    )
    if "hold_after_version" in spec:
        trainer.add_callback(
            hold_callback(
                spec["hold_after_version"],
                Path(spec["hold_file"]),
                spec.get("hold_timeout", 300.0),
                trainer,
            )
        )
    trainer.train(resume_from_checkpoint=spec.get("resume") or None)
    loss = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    print(
        "grpo_run: finished "
        + json.dumps(
            {
                "global_step": trainer.state.global_step,
                "model_version": trainer.model_version,
                "finite_loss": all(math.isfinite(x) for x in loss),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
