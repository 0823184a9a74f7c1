"""GRPO-shaped request traces, generated from a few parameters (used by bench/routing.py).

What a TRL GRPO trainer sends its vLLM server, as token-id prompts:
- every step, `prompts_per_step` (S) problems, each sent `group_size` (G) times (the samples
  of a group are identical requests: *siblings*);
- every prompt starts with the same chat template / system prompt of `template_tokens`, then
  problem tokens of a length drawn from `problem_tokens`;
- in multi-turn mode (`turns` > 1) each sample then goes on: its next prompt is its previous
  prompt + that sample's completion + a user (environment) message, so the samples of a group
  branch after the first turn and each conversation is a chain of continuations;
- the adapter is retrained live: steps use `trl-policy-v1`, `-v2`, ... , a new version every
  `version_every` steps (so a prompt's KV from the previous version is useless).

Requests come out in the order the trainer submits them: step by step, turn by turn within a
step (turn t+1 of a sample needs turn t's completion; `parent` names that request), group by
group, sample by sample. Completions are fixed by the trace (deterministic per sample), so a
replica emulator that returns `completion_tokens` tokens keeps the next turn's prompt honest.

Everything is a pure function of the spec: the same spec gives the same requests in every
process (seeded `random.Random`, never `hash()`).

Run `python bench/grpo_trace.py --help` for a summary of a trace from the command line.
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TraceSpec:
    steps: int = 4
    prompts_per_step: int = 16  # S
    group_size: int = 8  # G
    template_tokens: int = 23  # the shared chat template / system prompt
    problem_tokens: tuple[int, int] = (40, 400)  # inclusive range of problem lengths
    turns: int = 1  # > 1: multi-turn, every sample continues
    completion_tokens: tuple[int, int] = (50, 300)  # inclusive range of completion lengths
    user_tokens: tuple[int, int] = (10, 60)  # inclusive range of a later turn's user message
    version_every: int = 1  # k: a new adapter version every k steps
    model_prefix: str = "trl-policy-v"
    vocab: int = 151_000
    seed: int = 0

    def __post_init__(self) -> None:
        if min(self.steps, self.prompts_per_step, self.group_size, self.turns) < 1:
            raise ValueError("steps, prompts_per_step, group_size and turns must be >= 1")
        if self.version_every < 1:
            raise ValueError("version_every must be >= 1")
        for low, high in (self.problem_tokens, self.completion_tokens, self.user_tokens):
            if not 0 <= low <= high:
                raise ValueError("token ranges must be 0 <= low <= high")

    @property
    def requests(self) -> int:
        return self.steps * self.prompts_per_step * self.group_size * self.turns


@dataclass(frozen=True, slots=True)
class Request:
    index: int  # position in the trace
    step: int
    model: str
    tokens: list[int]  # the prompt
    family: int  # the problem (one per group per step): what an oracle pins to one replica
    sample: int  # 0 .. G-1 within the group
    turn: int  # 0 .. turns-1
    parent: int | None  # index of this sample's previous turn, None on the first turn
    completion_tokens: int  # length of this turn's completion (appended on the next turn)


def _tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(count)]


def generate(spec: TraceSpec) -> Iterator[Request]:
    """Every request of the trace, in submission order."""
    template = _tokens(random.Random(f"{spec.seed}:template"), spec.template_tokens, spec.vocab)
    index = 0
    for step in range(spec.steps):
        model = f"{spec.model_prefix}{1 + step // spec.version_every}"
        families = range(step * spec.prompts_per_step, (step + 1) * spec.prompts_per_step)
        prompts: dict[tuple[int, int], list[int]] = {}  # (family, sample) -> current prompt
        parents: dict[tuple[int, int], int] = {}
        for family in families:
            rng = random.Random(f"{spec.seed}:problem:{family}")
            problem = _tokens(rng, rng.randint(*spec.problem_tokens), spec.vocab)
            for sample in range(spec.group_size):
                prompts[family, sample] = template + problem
        for turn in range(spec.turns):
            for family in families:
                for sample in range(spec.group_size):
                    # Seeded by the sample and the turn, not the family alone: samples branch.
                    rng = random.Random(f"{spec.seed}:turn:{family}:{sample}:{turn}")
                    completion = _tokens(rng, rng.randint(*spec.completion_tokens), spec.vocab)
                    prompt = prompts[family, sample]
                    yield Request(
                        index=index,
                        step=step,
                        model=model,
                        tokens=prompt,
                        family=family,
                        sample=sample,
                        turn=turn,
                        parent=parents.get((family, sample)),
                        completion_tokens=len(completion),
                    )
                    parents[family, sample] = index
                    index += 1
                    if turn + 1 < spec.turns:
                        user = _tokens(rng, rng.randint(*spec.user_tokens), spec.vocab)
                        prompts[family, sample] = prompt + completion + user


def main(argv: list[str] | None = None) -> None:
    defaults = TraceSpec()
    parser = argparse.ArgumentParser(description="Summarize a GRPO-shaped trace.")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--template-tokens", type=int, default=defaults.template_tokens)
    parser.add_argument("--turns", type=int, default=defaults.turns)
    parser.add_argument("--version-every", type=int, default=defaults.version_every)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    spec = TraceSpec(
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        template_tokens=args.template_tokens,
        turns=args.turns,
        version_every=args.version_every,
        seed=args.seed,
    )
    requests = list(generate(spec))
    tokens = sum(len(r.tokens) for r in requests)
    models = sorted({r.model for r in requests}, key=lambda m: (len(m), m))
    print(f"{len(requests)} requests, {tokens} prompt tokens, models {', '.join(models)}")


if __name__ == "__main__":
    main()
