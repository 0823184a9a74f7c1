"""The routing bench's workload: the timing model, the traces' shapes and sizes, and each
trace's requests as bench/routing.py sends them (bench/replay.py replays the same)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from lora_router.emulator import EmulatorConfig
from lora_router.emulator.kv_events import KVEventsConfig
from lora_router.emulator.tokens import generate as emulator_generate
from lora_router.testbed import grpo_trace

MODEL = "Qwen/Qwen2.5-Math-1.5B"
MAX_STALENESS = 4  # TRL's default: unload v(N-5) after loading vN
MAX_MODEL_LEN = 16384  # three turns of up to 3,000-token completions fit

# --- settings ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Timing:
    """The emulated replicas' engine model (see the module docstring for the choice)."""

    prefill_s_per_token: float = 100e-6
    decode_s_per_token: float = 50e-6
    max_num_seqs: int = 1
    cache_blocks: int = 4096
    block_size: int = 16
    kv_events: bool = False  # replicas publish KV events (for the lr-kv contender)

    def emulator_config(self) -> EmulatorConfig:
        events = KVEventsConfig(
            enable_kv_cache_events=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0"
        )
        return EmulatorConfig(
            host="127.0.0.1",
            port=0,
            max_num_seqs=self.max_num_seqs,
            cache_blocks=self.cache_blocks,
            block_size=self.block_size,
            prefill_s_per_token=self.prefill_s_per_token,
            decode_s_per_token=self.decode_s_per_token,
            max_lora_rank=1,
            max_loras=MAX_STALENESS + 2,
            max_model_len=MAX_MODEL_LEN,
            kv_events_config=events if self.kv_events else None,
        )

    def service_s(self, uncached: int, generated: int) -> float:
        return uncached * self.prefill_s_per_token + generated * self.decode_s_per_token


@dataclass(frozen=True, slots=True)
class Scale:
    """How big each trace is, per replica of the fleet."""

    steps: int = 3
    prompts_per_replica: int = 8  # S = this x N, single-turn traces
    multi_prompts_per_replica: int = 4  # S = this x N, multi-turn
    pipelined_prompts_per_replica: int = 2  # S = this x N, the pipelined multi-turn traces
    long_tail_median: int = 100  # completion tokens, long-tail trace (log-normal, sigma 1)
    group_size: int = 8  # G
    in_flight_per_replica: int = 64  # the trainer's cap on requests in flight, x N
    completion_tokens: tuple[int, int] = (32, 128)
    seed: int = 0


@dataclass(frozen=True, slots=True)
class Shape:
    """A trace's shape (lora_router/testbed/grpo_trace.py's TraceSpec fields that differ between
    traces)."""

    template: int  # shared template / system prompt tokens
    turns: int
    pipelined: bool = False  # TRL's async worker: turns name the version current when sent
    render: str = "append"  # append | chat (re-rendered through the chat template)
    long_tail: bool = False  # log-normal completion lengths up to LONG_TAIL_MAX

    def describe(self) -> str:
        parts = [
            f"{self.template}-token shared prefix",
            f"{self.turns} turn" + "s" * (self.turns > 1),
        ]
        if self.pipelined:
            parts.append("a weight sync every round, during rollouts")
        if self.render == "chat":
            parts.append("turns re-rendered through a chat template")
        if self.long_tail:
            parts.append(f"long-tailed completions up to {LONG_TAIL_MAX} tokens")
        return ", ".join(parts)


LONG_TAIL_MAX = 3000  # the recipe's max_completion_length
TRACES: dict[str, Shape] = {
    "single-turn": Shape(23, 1),
    "system-300": Shape(300, 1),
    "system-1000": Shape(1000, 1),
    "multi-turn": Shape(23, 3),
    "multi-turn-sync": Shape(23, 3, pipelined=True),
    "chat-rerender": Shape(23, 3, pipelined=True, render="chat"),
    "long-tail": Shape(23, 3, pipelined=True, render="chat", long_tail=True),
}


def trace_spec(name: str, replicas: int, scale: Scale) -> Any:
    return shape_spec(TRACES[name], replicas, scale)


def shape_spec(shape: Shape, replicas: int, scale: Scale) -> Any:
    """The TraceSpec of a shape at a fleet size (bench/cache_pressure.py has shapes of its own)."""
    per_replica = scale.multi_prompts_per_replica if shape.turns > 1 else scale.prompts_per_replica
    return grpo_trace.TraceSpec(
        steps=scale.steps,
        prompts_per_step=per_replica * replicas,
        group_size=scale.group_size,
        template_tokens=shape.template,
        turns=shape.turns,
        completion_tokens=(16, LONG_TAIL_MAX) if shape.long_tail else scale.completion_tokens,
        version_every=1,
        seed=scale.seed,
        pipelined=shape.pipelined,
        render=shape.render,
        long_tail=shape.long_tail,
        long_tail_median=scale.long_tail_median,
    )


# --- workload ------------------------------------------------------------------------------


@dataclass(slots=True)
class Item:
    """One request of a run, its body rendered once."""

    index: int
    seed: int  # the request's `seed` (TRL's random.getrandbits(63)): how replicas name it
    family: int
    turn: int
    parent: int | None
    version: int
    prompt_len: int
    body: bytes
    expected: list[int] | None  # the completion the replicas will generate (multi-turn)


def build_workload(spec: Any, base: bool) -> list[Item]:
    """The trace's requests as sent: later turns carry the completion the replicas generate."""

    def complete(model: str, prompt: list[int], seed: int, max_tokens: int) -> list[int]:
        if spec.turns == 1:
            return []  # no later turn reads it
        # The emulator's generator: a pure function of (model, prompt, seed, index).
        sample = emulator_generate(
            MODEL if base else model,
            prompt,
            seed=seed,
            index=0,
            max_tokens=max_tokens,
            ignore_eos=True,
        )
        return sample.token_ids

    items: list[Item] = []
    for r in grpo_trace.generate(spec, complete):
        body = {
            "model": MODEL if base else r.model,
            "prompt": r.tokens,
            "max_tokens": r.completion_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "n": 1,
            "seed": r.seed,
            "ignore_eos": True,
        }
        expected = r.completion if spec.turns > 1 else None
        if expected is not None:
            body["return_token_ids"] = True  # to check that the next turn carries this output
        items.append(
            Item(
                index=r.index,
                seed=r.seed,
                family=r.family,
                turn=r.turn,
                parent=r.parent,
                version=int(r.model.removeprefix(spec.model_prefix)),
                prompt_len=len(r.tokens),
                body=orjson.dumps(body),
                expected=expected,
            )
        )
    if len({item.seed for item in items}) != len(items):
        raise RuntimeError("two requests drew one seed; the replicas could not tell them apart")
    return items


def seeds_of(text: str) -> list[int]:
    """`3` or a range `0-4` (inclusive)."""
    low, _, high = text.partition("-")
    return list(range(int(low), int(high or low) + 1))
