"""GRPO-shaped request traces, generated from a few parameters (the routing benches' workload).

What TRL 1.16's async GRPO rollout worker sends its vLLM server (trl/experimental/async_grpo/
async_rollout_worker.py), as token-id prompts:
- every step, `prompts_per_step` (S) problems, each sent `group_size` (G) times (the samples
  of a group are identical requests: *siblings*);
- every prompt starts with the same chat template / system prompt of `template_tokens`, then
  problem tokens of a length drawn from `problem_tokens`;
- every request carries its own `seed`, drawn as TRL draws it (`random.getrandbits(63)` in
  `_generate_one_turn`, from a seeded generator here);
- in multi-turn mode (`turns` > 1) each sample then goes on, as a tool-calling rollout does:
  its next prompt holds its previous prompt, that sample's completion and a tool message, so the
  samples of a group branch after the first turn and each conversation is a chain of turns.
  How the next prompt is built (`render`):
  - `"append"`: previous prompt + completion ids + tool tokens (a prefix-preserving template
    whose completion re-tokenizes to the very ids sampled);
  - `"chat"`: the conversation re-rendered through a chat template every turn, as `_generate_one`
    and OpenEnv's `_sample_turn` do. `render_chat` is Qwen3's shape on ids (`<|im_start|>role\\n
    content <|im_end|>\\n`, a generation prompt with an empty think stub the history drops), so a
    turn's prompt is *not* a prefix of the next (it ends 4 tokens differently); the completion
    comes back re-tokenized (`retokenize`), with ids that differ from the sampled ones;
- the adapter is retrained live; TRL names the *current* version on every request. Without
  `pipelined`, a step's rollouts end before the next starts, and a new version `trl-policy-vN`
  comes every `version_every` steps. With `pipelined` (TRL's async worker), round r sends turn t
  of step r - t's rollouts naming version `1 + r // version_every`: a conversation's turns name
  the version current when each is sent, so a weight sync lands in the middle of rollouts;
- completion lengths are uniform in `completion_tokens`, or with `long_tail` log-normal (median
  `long_tail_median`, sigma 1) clipped to `completion_tokens`: most short, a few up to the recipe's
  3,000 tokens.

Requests come out in the order the trainer submits them: turn t+1 of a sample needs turn t's
completion (`parent` names that request) and comes after it; within a turn, group by group,
sample by sample; in a pipelined round the oldest rollouts' turns first. A completion is given
by `complete(model, prompt, seed, max_tokens)` (bench/routing.py passes the replicas' own
generator, so each later prompt holds what the replica returned); without it, the trace's own.

Everything is a pure function of the spec: the same spec gives the same requests in every
process (seeded `random.Random`, never `hash()`). A trace's summary:
`python -m lora_router.testbed.grpo_trace --help`.
"""

from __future__ import annotations

import argparse
import math
import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass

Complete = Callable[[str, list[int], int, int], list[int]]

# Qwen-style special and role tokens (ids as in Qwen2.5/Qwen3's vocabulary).
IM_START, IM_END, NEWLINE, BLANK_LINE = 151644, 151645, 198, 271
THINK, END_THINK = 151667, 151668
ROLES = {"system": 8948, "user": 872, "assistant": 77091, "tool": 14172}
GENERATION_PROMPT = [
    IM_START,
    ROLES["assistant"],
    NEWLINE,
    THINK,
    BLANK_LINE,
    END_THINK,
    BLANK_LINE,
]
Message = tuple[str, list[int]]  # (role, content ids)


@dataclass(frozen=True, slots=True)
class TraceSpec:
    steps: int = 4
    prompts_per_step: int = 16  # S
    group_size: int = 8  # G
    template_tokens: int = 23  # the shared chat template / system prompt
    problem_tokens: tuple[int, int] = (40, 400)  # inclusive range of problem lengths
    turns: int = 1  # > 1: multi-turn, every sample continues
    completion_tokens: tuple[int, int] = (50, 300)  # inclusive range of completion lengths
    user_tokens: tuple[int, int] = (10, 60)  # inclusive range of a later turn's tool message
    version_every: int = 1  # k: a new adapter version every k steps (pipelined: rounds)
    model_prefix: str = "trl-policy-v"
    vocab: int = 151_000
    seed: int = 0
    pipelined: bool = False  # later turns run while the next steps start (versions straddle)
    render: str = "append"  # append | chat (re-rendered through the chat template)
    long_tail: bool = False  # log-normal completion lengths instead of uniform
    long_tail_median: int = 150

    def __post_init__(self) -> None:
        if min(self.steps, self.prompts_per_step, self.group_size, self.turns) < 1:
            raise ValueError("steps, prompts_per_step, group_size and turns must be >= 1")
        if self.version_every < 1:
            raise ValueError("version_every must be >= 1")
        for low, high in (self.problem_tokens, self.completion_tokens, self.user_tokens):
            if not 0 <= low <= high:
                raise ValueError("token ranges must be 0 <= low <= high")
        if self.render not in ("append", "chat"):
            raise ValueError("render must be 'append' or 'chat'")

    @property
    def requests(self) -> int:
        return self.steps * self.prompts_per_step * self.group_size * self.turns

    @property
    def versions(self) -> int:
        """The highest version the trace names."""
        rounds = self.steps + (self.turns - 1 if self.pipelined else 0)
        return 1 + (rounds - 1) // self.version_every


@dataclass(frozen=True, slots=True)
class Request:
    index: int  # position in the trace
    step: int  # the step whose problems this rollout samples
    model: str  # the version current when the request is sent
    tokens: list[int]  # the prompt
    family: int  # the problem (one per group per step): what an oracle pins to one replica
    sample: int  # 0 .. G-1 within the group
    turn: int  # 0 .. turns-1
    parent: int | None  # index of this sample's previous turn, None on the first turn
    completion_tokens: int  # max_tokens: the length of this turn's completion
    seed: int  # the request's sampling seed (TRL: random.getrandbits(63))
    completion: list[int]  # what the replica generates for it (from `complete`)


def _tokens(rng: random.Random, count: int, vocab: int) -> list[int]:
    return [rng.randrange(vocab) for _ in range(count)]


def render_chat(messages: list[Message]) -> list[int]:
    """`apply_chat_template(messages, add_generation_prompt=True)` for the Qwen3-shaped template
    on ids: every message as `<|im_start|>role\\n content <|im_end|>\\n`, then the generation
    prompt `<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n`. A rendered assistant message
    has no think stub (Qwen3 drops empty reasoning from history)."""
    out: list[int] = []
    for role, content in messages:
        out += [IM_START, ROLES[role], NEWLINE, *content, IM_END, NEWLINE]
    return out + GENERATION_PROMPT


def retokenize(ids: list[int], vocab: int) -> list[int]:
    """`parse_response` then tokenization of its text: sampled ids are not always the
    tokenizer's own spelling of the text, so some adjacent pairs come back merged into one id
    (deterministically: every pair whose sum is divisible by 7)."""
    out: list[int] = []
    i = 0
    while i < len(ids):
        if i + 1 < len(ids) and (ids[i] + ids[i + 1]) % 7 == 0:
            out.append((ids[i] * 31 + ids[i + 1]) % vocab)
            i += 2
        else:
            out.append(ids[i])
            i += 1
    return out


def completion_length(rng: random.Random, spec: TraceSpec) -> int:
    """A completion's tokens under `spec`'s law (uniform, or long-tailed: module docstring)."""
    low, high = spec.completion_tokens
    if not spec.long_tail:
        return rng.randint(low, high)
    drawn = int(rng.lognormvariate(math.log(spec.long_tail_median), 1.0))
    return min(high, max(low, drawn))


def _own_completion(spec: TraceSpec) -> Complete:
    def complete(model: str, prompt: list[int], seed: int, max_tokens: int) -> list[int]:
        return _tokens(random.Random(f"{spec.seed}:completion:{seed}"), max_tokens, spec.vocab)

    return complete


def _schedule(spec: TraceSpec) -> Iterator[tuple[int, int, int]]:
    """(version, step, turn) blocks in submission order."""
    if not spec.pipelined:
        for step in range(spec.steps):
            for turn in range(spec.turns):
                yield 1 + step // spec.version_every, step, turn
        return
    for round_ in range(spec.steps + spec.turns - 1):
        for turn in reversed(range(spec.turns)):  # the oldest rollouts' next turns first
            step = round_ - turn
            if 0 <= step < spec.steps:
                yield 1 + round_ // spec.version_every, step, turn


def generate(spec: TraceSpec, complete: Complete | None = None) -> Iterator[Request]:
    """Every request of the trace, in submission order."""
    complete = complete or _own_completion(spec)
    template = _tokens(random.Random(f"{spec.seed}:template"), spec.template_tokens, spec.vocab)
    seeds = random.Random(f"{spec.seed}:seeds")
    per_step = spec.prompts_per_step
    # (family, sample) -> its conversation: the messages so far, the last request's index,
    # prompt and completion.
    messages: dict[tuple[int, int], list[Message]] = {}
    last: dict[tuple[int, int], tuple[int, list[int], list[int]]] = {}
    index = 0
    for version, step, turn in _schedule(spec):
        model = f"{spec.model_prefix}{version}"
        for family in range(step * per_step, (step + 1) * per_step):
            if turn == 0:
                rng = random.Random(f"{spec.seed}:problem:{family}")
                problem = _tokens(rng, rng.randint(*spec.problem_tokens), spec.vocab)
            for sample in range(spec.group_size):
                conversation = family, sample
                # Seeded by the sample and the turn, not the family alone: samples branch.
                rng = random.Random(f"{spec.seed}:turn:{family}:{sample}:{turn}")
                if turn == 0:
                    if spec.render == "chat":
                        messages[conversation] = [("system", template), ("user", problem)]
                        prompt = render_chat(messages[conversation])
                    else:
                        prompt = template + problem
                    parent = None
                else:
                    parent, previous, output = last[conversation]
                    tool = _tokens(rng, rng.randint(*spec.user_tokens), spec.vocab)
                    if spec.render == "chat":
                        history = messages[conversation]
                        history += [("assistant", retokenize(output, spec.vocab)), ("tool", tool)]
                        prompt = render_chat(history)
                    else:
                        prompt = previous + output + tool
                length = completion_length(rng, spec)
                seed = seeds.getrandbits(63)
                completion = complete(model, prompt, seed, length)
                yield Request(
                    index=index,
                    step=step,
                    model=model,
                    tokens=prompt,
                    family=family,
                    sample=sample,
                    turn=turn,
                    parent=parent,
                    completion_tokens=length,
                    seed=seed,
                    completion=completion,
                )
                last[conversation] = index, prompt, completion
                index += 1


def main(argv: list[str] | None = None) -> None:
    defaults = TraceSpec()
    parser = argparse.ArgumentParser(description="Summarize a GRPO-shaped trace.")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--prompts-per-step", type=int, default=defaults.prompts_per_step)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--template-tokens", type=int, default=defaults.template_tokens)
    parser.add_argument("--turns", type=int, default=defaults.turns)
    parser.add_argument("--version-every", type=int, default=defaults.version_every)
    parser.add_argument("--pipelined", action="store_true", help="versions straddle rollouts")
    parser.add_argument("--render", choices=("append", "chat"), default=defaults.render)
    parser.add_argument("--long-tail", action="store_true", help="log-normal completions")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    args = parser.parse_args(argv)
    spec = TraceSpec(
        steps=args.steps,
        prompts_per_step=args.prompts_per_step,
        group_size=args.group_size,
        template_tokens=args.template_tokens,
        turns=args.turns,
        version_every=args.version_every,
        pipelined=args.pipelined,
        render=args.render,
        long_tail=args.long_tail,
        seed=args.seed,
    )
    requests = list(generate(spec))
    tokens = sum(len(r.tokens) for r in requests)
    models = sorted({r.model for r in requests}, key=lambda m: (len(m), m))
    spans: dict[tuple[int, int], set[str]] = {}
    for r in requests:
        spans.setdefault((r.family, r.sample), set()).add(r.model)
    straddling = sum(len(s) > 1 for s in spans.values())
    print(
        f"{len(requests)} requests, {tokens} prompt tokens, models {', '.join(models)}, "
        f"{straddling} of {len(spans)} rollouts span more than one version"
    )


if __name__ == "__main__":
    main()
