"""The emulator's tokenizer and its deterministic "model": which tokens a request generates.

Tokenizer (documented, so tests can predict prompt lengths):
- text -> ids: the UTF-8 bytes of the text, one token per byte (ids 0..255). A text prefix is
  therefore a token prefix, so prefix caching behaves for text prompts as for token ids.
- ids -> text: ids below 256 are bytes (decoded as UTF-8, invalid sequences replaced); the three
  Qwen special tokens below print as their names; every other id is the word " " + its letters
  in base 26 (so `tokens` in logprobs are distinct per id and decoded text reads as words).
- chat: the Qwen2.5 ChatML template, `<|im_start|>{role}\\n{content}<|im_end|>\\n` per message
  and `<|im_start|>assistant\\n` to prompt the answer, with the special tokens as single ids.

Generation: a sample is fully determined by (adapter key, prompt ids, seed, sample index); two
samples that differ in any of them differ. Its natural length is drawn from an exponential
distribution around `mean_output_tokens`; when that is shorter than `max_tokens` the sample ends
with EOS and finish reason "stop", else "length". Temperature 0 is greedy: seed and index are
ignored, every sample of a prompt is the same. Logprobs are plausible: the sampled token's
logprob and the alternatives' probabilities sum to at most 1.

Pure functions: no I/O, no clock.
"""

from __future__ import annotations

import math
import random
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

ENDOFTEXT = 151643  # Qwen2.5's EOS (and pad) token
IM_START = 151644
IM_END = 151645
VOCAB_SIZE = 151936
SPECIAL_TOKENS = {ENDOFTEXT: "<|endoftext|>", IM_START: "<|im_start|>", IM_END: "<|im_end|>"}
# Generated tokens are words: never bytes (which may be half a UTF-8 character) or specials.
_FIRST_WORD = 256
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def tokenize(text: str) -> list[int]:
    """Text -> token ids: one id per UTF-8 byte."""
    return list(text.encode("utf-8"))


def token_text(token_id: int) -> str:
    """The text of one token as it appears in logprobs `tokens` (specials by name)."""
    if token_id < _FIRST_WORD:
        return bytes([token_id]).decode("utf-8", errors="replace")
    special = SPECIAL_TOKENS.get(token_id)
    if special is not None:
        return special
    n = token_id - _FIRST_WORD
    letters = []
    while True:
        n, digit = divmod(n, 26)
        letters.append(_LETTERS[digit])
        if n == 0:
            break
    return " " + "".join(reversed(letters))


def detokenize(token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    """Token ids -> text; runs of byte tokens are decoded together as UTF-8."""
    parts: list[str] = []
    pending = bytearray()
    for token_id in token_ids:
        if token_id < _FIRST_WORD:
            pending.append(token_id)
            continue
        if pending:
            parts.append(pending.decode("utf-8", errors="replace"))
            pending.clear()
        if token_id in SPECIAL_TOKENS and skip_special_tokens:
            continue
        parts.append(token_text(token_id))
    if pending:
        parts.append(pending.decode("utf-8", errors="replace"))
    return "".join(parts)


def message_text(content: object) -> str:
    """The text of a chat message's `content`: a string or a list of `{"type":"text"}` parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    raise ValueError("message content must be a string or a list of content parts")


def apply_chat_template(messages: Sequence[dict[str, object]]) -> list[int]:
    """ChatML prompt ids for `messages`, ending with the assistant generation prompt."""
    ids: list[int] = []
    newline = tokenize("\n")
    for message in messages:
        ids.append(IM_START)
        ids += tokenize(f"{message.get('role', 'user')}\n{message_text(message.get('content'))}")
        ids.append(IM_END)
        ids += newline
    ids.append(IM_START)
    ids += tokenize("assistant\n")
    return ids


@dataclass(slots=True)
class SampledToken:
    """One generated token with its logprob and the top alternatives (best first)."""

    token_id: int
    logprob: float
    alternatives: list[tuple[int, float]]


@dataclass(slots=True)
class Sample:
    """One generated sequence; `finish_reason` is "stop" (ended with EOS) or "length"."""

    tokens: list[SampledToken]
    finish_reason: str

    @property
    def token_ids(self) -> list[int]:
        return [t.token_id for t in self.tokens]


def sample_seed(
    adapter_key: str, prompt: Sequence[int], seed: int, index: int, greedy: bool
) -> int:
    """The RNG seed of one sample: a hash of everything that must make siblings differ."""
    h = xxhash.xxh3_64()
    h.update(adapter_key.encode("utf-8"))
    h.update(b"\0")
    h.update(array("I", prompt).tobytes())  # ids are validated to lie in the vocabulary
    if not greedy:
        h.update(seed.to_bytes(8, "little", signed=True))
        h.update(index.to_bytes(4, "little"))
    return h.intdigest()


def generate(
    adapter_key: str,
    prompt: Sequence[int],
    *,
    seed: int,
    index: int,
    max_tokens: int,
    top_logprobs: int = 0,
    greedy: bool = False,
    ignore_eos: bool = False,
    mean_output_tokens: int = 64,
) -> Sample:
    """Generate one sample deterministically; see the module docstring for the rules."""
    rng = random.Random(sample_seed(adapter_key, prompt, seed, index, greedy))
    natural = 1 + int(rng.expovariate(1.0 / max(1, mean_output_tokens)))
    stops = not ignore_eos and natural <= max_tokens
    length = natural if stops else max_tokens
    tokens: list[SampledToken] = []
    for position in range(length):
        token_id = ENDOFTEXT if stops and position == length - 1 else _word(rng)
        tokens.append(_with_logprobs(rng, token_id, top_logprobs))
    return Sample(tokens=tokens, finish_reason="stop" if stops else "length")


def _word(rng: random.Random) -> int:
    return rng.randrange(_FIRST_WORD, ENDOFTEXT)


def _with_logprobs(rng: random.Random, token_id: int, top: int) -> SampledToken:
    # Probability of the sampled token, skewed towards confident choices as in a real model.
    p_sampled = max(1e-6, 1.0 - rng.random() ** 0.5)
    logprob = math.log(p_sampled)
    alternatives: list[tuple[int, float]] = []
    if top > 0:
        remaining = 1.0 - p_sampled
        seen = {token_id}
        for _ in range(top):
            # Each alternative takes a share of what is left, so the total stays below 1.
            share = remaining * rng.uniform(0.2, 0.6)
            remaining -= share
            alt = _word(rng)
            while alt in seen:
                alt = _word(rng)
            seen.add(alt)
            alternatives.append((alt, math.log(max(share, 1e-12))))
        alternatives.sort(key=lambda pair: pair[1], reverse=True)
    return SampledToken(token_id=token_id, logprob=logprob, alternatives=alternatives)
