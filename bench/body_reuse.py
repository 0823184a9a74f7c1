"""What `CompletionReader`'s memory of recent bodies buys on the traffic TRL 1.16 sends.

TRL's rollout worker gives every request its own `seed` (async_rollout_worker.py,
`_generate_one_turn`), so the G samples of a prompt are G different bodies around one prompt.
This measures, in one process and interleaved round by round, the per-request cost of reading
such bodies three ways: through `CompletionReader` (the cache), through `read_completion`
alone (no cache), and through `CompletionReader` with byte-identical bodies (the traffic the
cache was written for, which TRL does not send). Medians of the rounds; µs per body.

    python bench/body_reuse.py [--rounds 9] [--groups 512] [--tokens 512]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable

from lora_router.body import CompletionReader, read_completion

G = 8


def trl_body(prompt: list[int], seed: int) -> bytes:
    """TRL 1.16's /v1/completions payload, encoded as aiohttp's `json=` encodes it."""
    payload = {
        "model": "trl-policy-v3",
        "prompt": prompt,
        "max_tokens": 1024,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": seed,
    }
    return json.dumps(payload).encode()


def bodies(groups: int, tokens: int, seeded: bool, rng: random.Random) -> list[bytes]:
    out = []
    for _ in range(groups):
        prompt = [rng.randrange(151_000) for _ in range(tokens)]
        fixed = rng.getrandbits(63)
        out += [trl_body(prompt, rng.getrandbits(63) if seeded else fixed) for _ in range(G)]
    return out


def per_body(read: Callable[[bytes], object], batch: list[bytes]) -> float:
    started = time.perf_counter()
    for body in batch:
        read(body)
    return (time.perf_counter() - started) / len(batch) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--groups", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    rng = random.Random(7)
    seeded = bodies(args.groups, args.tokens, True, rng)
    identical = bodies(args.groups, args.tokens, False, rng)
    limit = 1 << 20
    results: dict[str, list[float]] = {"cache, TRL bodies": [], "no cache, TRL bodies": []}
    results["cache, identical bodies"] = []
    hits: dict[str, int] = {}
    for _ in range(args.rounds):
        reader = CompletionReader(limit)
        results["cache, TRL bodies"].append(per_body(lambda b: reader.read(b, chat=False), seeded))
        hits["cache, TRL bodies"] = reader.hits
        results["no cache, TRL bodies"].append(
            per_body(lambda b: read_completion(b, chat=False, max_prompt_tokens=limit), seeded)
        )
        reader = CompletionReader(limit)
        results["cache, identical bodies"].append(
            per_body(lambda b: reader.read(b, chat=False), identical)
        )
        hits["cache, identical bodies"] = reader.hits
    base = statistics.median(results["no cache, TRL bodies"])
    print(f"{args.groups} groups x G={G}, {args.tokens}-token prompts, {args.rounds} rounds")
    print(f"{'reading':<26} {'median µs/body':>15} {'vs no cache':>12} {'cache hits':>11}")
    for name, values in results.items():
        median = statistics.median(values)
        shown = hits.get(name, 0)
        print(f"{name:<26} {median:>15.2f} {median / base:>11.2f}x {shown:>11}")


if __name__ == "__main__":
    main()
