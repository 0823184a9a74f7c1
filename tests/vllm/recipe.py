"""The pieces of the recipe tests (test_vllm_recipe.py): prompts of an exact length, the trainer
process, probes of a replica, and what the replicas' logs and counters say about a run."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import replica_log

from lora_router.testbed.vllm_harness import TOKEN, TOKEN_ENV, Replica, http

HERE = Path(__file__).parent
BLOCK = 128  # the KV block size of vLLM's CPU build
PROMPT_TOKENS = 300  # every prompt, after TRL's chat template: two full blocks can be hit
WORDS = [
    *("the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "solve", "for", "x"),
    *("answer", "router", "sends", "every", "sample", "of", "prompt", "to", "replica", "that"),
    *("holds", "its", "prefix", "policy", "group", "baseline", "reward"),
]


def chat_tokenizer(base: str) -> Any:
    """The tiny model's tokenizer with TRL's Qwen2.5 chat template, as grpo_run.py gives it."""
    import trl
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.chat_template = (
        Path(trl.__file__).parent / "chat_templates/qwen2_5.jinja"
    ).read_text()
    return tokenizer


def prompt_ids(tokenizer: Any, text: str) -> list[int]:
    """The token ids TRL's rollout worker sends for a one-message prompt."""
    out = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
    )
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def exact_prompts(tokenizer: Any, count: int, seed: int) -> list[str]:
    """`count` distinct prompts of PROMPT_TOKENS tokens each (bounded search over word
    counts). Each starts with its own number, so no two share a full KV block."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(count):
        n = 150
        for _ in range(500):
            text = f"Prompt {seed}.{i}: " + " ".join(rng.choices(WORDS, k=n))
            length = len(prompt_ids(tokenizer, text))
            if length == PROMPT_TOKENS:
                out.append(text)
                break
            n = max(
                1,
                n
                + (1 if length < PROMPT_TOKENS else -1) * max(1, abs(PROMPT_TOKENS - length) // 3),
            )
        else:
            raise AssertionError(f"no prompt of {PROMPT_TOKENS} tokens found for seed {seed}")
    return out


@dataclass(slots=True)
class Trainer:
    """A grpo_run.py process (with the rollout worker it spawns, in its process group)."""

    process: subprocess.Popen[bytes]
    log: Path

    def died(self) -> str | None:
        code = self.process.poll()
        return None if code is None else f"the trainer exited with {code}"

    def kill(self) -> None:
        """SIGKILL the trainer and its rollout worker: a preemption."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def finished(self) -> dict[str, Any]:
        """What grpo_run.py printed at its end (raises if it did not get there)."""
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("grpo_run: finished "):
                result: dict[str, Any] = json.loads(line.removeprefix("grpo_run: finished "))
                return result
        raise AssertionError(f"the trainer did not finish:\n{replica_log_tail(self.log)}")


def replica_log_tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def start_trainer(spec: dict[str, Any], log: Path) -> Trainer:
    """grpo_run.py with `spec`, in its own process group; the replicas' token is not in its
    environment (TRL never needs it: the router holds it)."""
    spec_file = log.with_suffix(".json")
    spec_file.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")
    env.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    with log.open("ab") as out:
        process = subprocess.Popen(
            [sys.executable, str(HERE / "grpo_run.py"), str(spec_file)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    return Trainer(process, log)


# A prompt of token ids for probes: two full KV blocks and more, so cached KV would show.
PROBE = [(7 * i) % 470 + 5 for i in range(PROMPT_TOKENS)]


@dataclass(frozen=True, slots=True)
class Probe:
    """A greedy completion on one replica: its tokens with their logprobs, and the prompt tokens
    it found cached. Two probes agree when their tokens are equal and their logprobs are within
    LOGPROB_TOLERANCE: a tiny adapter's greedy tokens can be the same under two sets of weights,
    the logprobs tell them apart."""

    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    cached: int

    def distance(self, other: Probe) -> float:
        """How far apart two probes are: infinite when their tokens differ, else the largest
        difference of a token's logprob."""
        if self.tokens != other.tokens:
            return math.inf
        return max(abs(a - b) for a, b in zip(self.logprobs, other.logprobs, strict=True))

    def agrees(self, other: Probe) -> bool:
        return self.distance(other) <= LOGPROB_TOLERANCE


LOGPROB_TOLERANCE = 1e-4  # a replica computes one prompt under one adapter the same each time


def probe(replica: Replica, model: str, prompt: list[int]) -> Probe:
    answer = http(
        "POST",
        replica.url + "/v1/completions",
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0,
            "return_token_ids": True,
            "logprobs": 1,
        },
        token=TOKEN,
    )
    assert answer.status == 200, answer.text
    doc = answer.json()
    choice = doc["choices"][0]
    details = doc["usage"].get("prompt_tokens_details") or {}
    return Probe(
        tuple(choice["token_ids"]),
        tuple(float(x) for x in choice["logprobs"]["token_logprobs"]),
        int(details.get("cached_tokens") or 0),
    )


def probe_fresh(replica: Replica, name: str, path: Path | str, prompt: list[int]) -> Probe:
    """The probe under `name`, loaded on this replica alone from `path`, then unloaded."""
    body = {"lora_name": name, "lora_path": str(path)}
    loaded = replica.post("/v1/load_lora_adapter", body)
    assert loaded.status == 200, loaded.text
    try:
        return probe(replica, name, prompt)
    finally:
        replica.post("/v1/unload_lora_adapter", {"lora_name": name})


@dataclass(slots=True)
class RunRecord:
    """What the replicas' own logs and counters say about the stretch of a run."""

    loads: list[list[tuple[float, str]]]  # per replica: (time, adapter) of each load
    requests: list[list[replica_log.Request]]  # per replica
    accesses: list[list[replica_log.Access]]
    hits: float  # prefix-cache hits, summed over the replicas
    queries: float

    def families(self) -> Counter[tuple[tuple[int, ...], str | None]]:
        """Requests per (prompt, adapter): the samples that could share a prompt's blocks."""
        return Counter((r.head, r.adapter) for rs in self.requests for r in rs)

    def grouped_hits(self) -> int:
        """The most hits keeping each group together allows: in a family of k requests, the
        k - 1 after the first hit every full block but the last token's."""
        cacheable = (PROMPT_TOKENS - 1) // BLOCK * BLOCK
        return sum((k - 1) * cacheable for k in self.families().values())

    def late_versions(self, prefix: str) -> list[str]:
        """Adapters named `prefix...` that some request named before every replica had loaded
        them (the fence's invariant, from the replicas' side)."""
        first_use: dict[str, float] = {}
        for rs in self.requests:
            for r in rs:
                if r.adapter is not None and r.adapter.startswith(prefix):
                    first_use[r.adapter] = min(first_use.get(r.adapter, r.t), r.t)
        late = []
        for name, used in sorted(first_use.items()):
            loaded = [min((t for t, n in ls if n == name), default=None) for ls in self.loads]
            if any(t is None or t >= used for t in loaded):
                late.append(name)
        return late


def counters(fleet: list[Replica]) -> tuple[float, float]:
    return (
        sum(r.metric("vllm:prefix_cache_hits_total") for r in fleet),
        sum(r.metric("vllm:prefix_cache_queries_total") for r in fleet),
    )


def record(
    fleet: list[Replica], offsets: list[int], before: tuple[float, float] | None = None
) -> RunRecord:
    """The replicas' logs since `offsets`, and their counters since `before` (if given)."""
    texts = [replica_log.text_since(r.log, o) for r, o in zip(fleet, offsets, strict=True)]
    hits, queries = counters(fleet) if before is not None else (0.0, 0.0)
    before = before or (0.0, 0.0)
    return RunRecord(
        loads=[replica_log.loads(t) for t in texts],
        requests=[replica_log.requests(t) for t in texts],
        accesses=[replica_log.accesses(t) for t in texts],
        hits=hits - before[0],
        queries=queries - before[1],
    )
