"""What routing one prompt costs: key + choose, on this machine, in microseconds.

    python bench/route_cost.py [--tokens 4000] [--replicas 8] [--table 200000]

The affinity table is first filled to its cap with GRPO-like prompts (a shared template plus a
problem), so lookups and evictions run at their steady-state cost, and replicas have requests
in flight. The prompt comes as the HTTP layer hands it over: an `array('I')` (validation packs
the ids; that pass is the HTTP layer's and is timed separately as "pack"). Each figure is the
median over 7 rounds of the per-call time.

The routing cases: a *fresh* prompt (unknown: its chain is computed and scanned), a *sibling*
(this exact prompt was routed before, as the G samples of a GRPO prompt are), a *next turn*
(the known prompt plus 300 new tokens: a continuation, each call a different one, so that it is
not a sibling of the previous call's; the prompts name the next adapter version, as a turn after
a weight sync does), and the *sibling fast path* as app.py runs it: the model's placement seed,
one hash of the prompt's raw JSON text (`wire_key`), `choose_known`. "key" builds the key as the
HTTP layer does; "key + chain" also forces the per-block chain, which only a scan of the table
needs.

The script runs against the lora_router of the tree it sits in; copied into another revision's
bench/ it measures that one (before/after figures). Revisions without `keys.Lineages` seed
keys by the full model name, which is what app.py did there.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import timeit
from array import array
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from lora_router.routing import keys
from lora_router.routing.keys import prompt_key, wire_key
from lora_router.routing.policy import PrefixAffinity

MODEL = "trl-policy-v2"
NEXT = "trl-policy-v3"  # the version after a weight sync


@dataclass
class Replica:
    name: str
    in_flight: int = 0
    in_flight_tokens: int = 0


def keyer(model: str) -> tuple[Callable[[array[int]], keys.PromptKey], Callable[[bytes], int]]:
    """(prompt key, wire key) of a request naming the adapter `model`, as app.py builds them."""
    if not hasattr(keys, "Lineages"):  # before lineages: keyed by the full name
        return (lambda ids: prompt_key(model, ids)), (lambda raw: wire_key(model, raw))
    lineages = keys.Lineages()

    def key(ids: array[int]) -> keys.PromptKey:
        return prompt_key(None, ids, seed=lineages.seeds(model, True).token)

    def wire(raw: bytes) -> int:
        return wire_key(None, raw, seed=lineages.seeds(model, True).wire)

    return key, wire


def per_call_us(fn: Callable[[], object], number: int, rounds: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=rounds)) / number * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description="Time key + choose for one prompt.")
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--replicas", type=int, default=8)
    parser.add_argument("--table", type=int, default=200_000)
    parser.add_argument("--template", type=int, default=300)
    args = parser.parse_args()

    rng = random.Random(0)
    reps = [
        Replica(f"http://replica-{i}:8000", rng.randrange(20, 40)) for i in range(args.replicas)
    ]
    policy = PrefixAffinity(table_size=args.table)
    policy.set_members([r.name for r in reps])
    template = [rng.randrange(150_000) for _ in range(args.template)]
    filler_key = keyer("trl-policy-v1")[0]
    for _ in range(args.table):
        filler = template + [rng.randrange(150_000) for _ in range(rng.randrange(20, 200))]
        policy.choose(filler_key(array("I", filler)), reps)
    key, wire = keyer(MODEL)
    next_key = keyer(NEXT)[0]

    def new_prompt(length: int) -> array[int]:
        tail = [rng.randrange(150_000) for _ in range(length - len(template))]
        return array("I", template + tail)

    number, rounds = 1000, 7
    ids = list(new_prompt(args.tokens))
    prompt = array("I", ids)
    fresh = iter([new_prompt(args.tokens) for _ in range(number * rounds)])
    turns = iter(
        [
            array("I", [*ids, *(rng.randrange(150_000) for _ in range(300))])
            for _ in range(number * rounds)
        ]
    )
    raw = ("[" + ",".join(map(str, ids)) + "]").encode()
    policy.choose(key(prompt), reps, wire(raw))  # make it known: its siblings follow
    decisions = policy.counts.as_dict()

    figures = {
        "pack (HTTP layer's validation)": per_call_us(lambda: array("I", ids), number, rounds),
        "key": per_call_us(lambda: key(prompt), number, rounds),
        "key + chain": per_call_us(lambda: key(prompt).chain, number, rounds),
        "key + choose, fresh prompt": per_call_us(
            lambda: policy.choose(key(next(fresh)), reps), number, rounds
        ),
        "key + choose, sibling": per_call_us(
            lambda: policy.choose(key(prompt), reps), number, rounds
        ),
        "wire key + choose_known, sibling fast path": per_call_us(
            lambda: policy.choose_known(wire(raw), reps), number, rounds
        ),
        "key + choose, next turn (+300 tokens, next version)": per_call_us(
            lambda: policy.choose(next_key(next(turns)), reps), number, rounds
        ),
    }
    # Each case must have been routed as named, or its figure measures something else.
    after = policy.counts.as_dict()
    made = {kind: after[kind] - decisions[kind] for kind in after if after[kind] != decisions[kind]}
    calls = number * rounds
    expected = {"fresh": calls, "sibling": 2 * calls, "continuation": calls}
    if not hasattr(keys, "Lineages"):  # the next version's turn is a fresh prompt there
        expected = {"fresh": 2 * calls, "sibling": 2 * calls}
    if made != expected:
        raise SystemExit(f"the cases were not routed as named: {made}")
    print(
        f"python {sys.version.split()[0]}, {args.tokens}-token prompt, {args.replicas} replicas, "
        f"affinity table {len(policy.table)} anchors"
    )
    for name, us in figures.items():
        print(f"  {name:52s} {us:7.1f} us")


if __name__ == "__main__":
    main()
