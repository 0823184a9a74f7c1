"""What `--policy kv` costs: per routed request, and per KV event ingested, in process.

    python bench/kv_index_cost.py [--held 1000,100000] [--replicas 8] [--tokens 1024]
                                  [--requests 4000] [--rounds 5] [--out FILE]

Routing: new families (every prompt distinct, so each one takes the fresh path, the only one
`kv` changes) routed by `PrefixAffinity` without and with its `KvLookup` over one fleet, the index
holding `--held` blocks in all, spread over the replicas, a quarter of the prompts sharing a
held prefix of half their blocks. Each request is keyed as the routed path keys it
(`keys.prompt_key` under the lineage's seed) and `choose`n; the figure is the median over
`--rounds` of the mean per request, so its difference is what the KV lookup adds. `longest`
alone is timed on the same chains.

Ingest: vLLM-shaped batches (emulator/kv_events.py's structs, one BlockStored of 16 blocks
each, then as many BlockRemoved) encoded with msgspec as vLLM does, then decoded and filed as
the subscriber does (fleet/kv_events.py): batches, events and blocks per second.

One process, one core; the machine's other load moves the figures, which the result file says
with the load average seen.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import msgspec

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lora_router.emulator.kv_events import BlockRemoved, BlockStored, EventBatch  # noqa: E402
from lora_router.fleet.kv_wire import Removed, Stored, decode  # noqa: E402
from lora_router.routing.keys import Lineages, RouteKey, prompt_key  # noqa: E402
from lora_router.routing.kv_index import LIVE, KvIndex  # noqa: E402
from lora_router.routing.kv_policy import KvLookup  # noqa: E402
from lora_router.routing.policy import Candidates, PrefixAffinity  # noqa: E402

BLOCK = 16
MODEL = "trl-policy-v1"
LINEAGES = Lineages()
SEED = LINEAGES.seeds(MODEL, True).token


class Member:
    __slots__ = ("in_flight", "in_flight_tokens", "name")

    def __init__(self, name: str) -> None:
        self.name = name
        self.in_flight = 0
        self.in_flight_tokens = 0


def root(lora: str | None) -> int:
    return LINEAGES.seeds(lora, lora is not None).token


def filled_index(members: list[Member], held: int, rnd: random.Random) -> tuple[KvIndex, list]:
    """An index holding `held` blocks over `members` (chains of 64 blocks), and the chains."""
    index = KvIndex(root, BLOCK)
    chains = []
    n = 0
    while n < held:
        name = members[len(chains) % len(members)].name
        tokens = [rnd.randrange(100_000) for _ in range(64 * BLOCK)]
        blocks = min(64, held - n)
        hashes = [rnd.getrandbits(64) for _ in range(blocks)]
        index.stored(name, hashes, None, tokens[: blocks * BLOCK], BLOCK, MODEL)
        chains.append(tokens[: blocks * BLOCK])
        n += blocks
    for m in members:
        index.set_state(m.name, LIVE)
    return index, chains


def prompts(count: int, tokens: int, chains: list, rnd: random.Random) -> list[list[int]]:
    """Distinct prompts; a quarter start with half the blocks of a held chain."""
    out = []
    for i in range(count):
        prompt = [rnd.randrange(100_000) for _ in range(tokens)]
        if i % 4 == 0 and chains:
            held = rnd.choice(chains)
            half = min(len(held), tokens // 2) // BLOCK * BLOCK
            prompt[:half] = held[:half]
        out.append(prompt)
    return out


def per_request_us(policy: object, members: list[Member], batch: list[list[int]]) -> float:
    routable = Candidates(members, MODEL)
    choose = policy.choose  # type: ignore[attr-defined]
    keys = [prompt_key(None, p, BLOCK, seed=SEED) for p in batch]
    start = time.perf_counter_ns()
    for key in keys:
        choose(RouteKey(lambda key=key: key), routable)
    return (time.perf_counter_ns() - start) / len(batch) / 1000


def routing(held: int, args: argparse.Namespace) -> dict[str, object]:
    rnd = random.Random(held)
    members = [Member(f"http://replica-{i}.internal:8000") for i in range(args.replicas)]
    index, chains = filled_index(members, held, rnd)
    rounds: dict[str, list[float]] = {
        "prefix": [],
        "kv": [],
        "kv_minus_prefix": [],
        "longest": [],
        "longest_whole_chain_held": [],
    }
    held_chains = [prompt_key(None, c, BLOCK, seed=SEED).chain for c in chains[:4000]]
    kv_hits = 0
    for _ in range(args.rounds):
        batch = prompts(args.requests, args.tokens, chains, rnd)
        prefix = PrefixAffinity()
        prefix.set_members(members)
        kv = PrefixAffinity(prefer=KvLookup(index))
        kv.set_members(members)
        # Alternated within the round, so that the machine's load moves both alike.
        rounds["prefix"].append(per_request_us(prefix, members, batch))
        rounds["kv"].append(per_request_us(kv, members, batch))
        rounds["kv_minus_prefix"].append(rounds["kv"][-1] - rounds["prefix"][-1])
        kv_hits += kv.counts.kv
        keyed = [prompt_key(None, p, BLOCK, seed=SEED).chain for p in batch]
        start = time.perf_counter_ns()
        for chain in keyed:
            index.longest(MODEL, chain)
        rounds["longest"].append((time.perf_counter_ns() - start) / len(batch) / 1000)
        start = time.perf_counter_ns()
        for chain in held_chains:
            index.longest(MODEL, chain)
        rounds["longest_whole_chain_held"].append(
            (time.perf_counter_ns() - start) / len(held_chains) / 1000
        )
    median = {k: round(statistics.median(v), 2) for k, v in rounds.items()}
    return {
        "blocks_held": held,
        "replicas": args.replicas,
        "prompt_tokens": args.tokens,
        "requests_per_round": args.requests,
        "us_per_request_prefix": median["prefix"],
        "us_per_request_kv": median["kv"],
        "us_added_by_kv_median_of_rounds": median["kv_minus_prefix"],
        "us_per_longest": median["longest"],
        "us_per_longest_whole_chain_held": median["longest_whole_chain_held"],
        "blocks_per_held_chain": len(held_chains[0]) if held_chains else 0,
        "kv_decisions_share": round(kv_hits / (args.rounds * args.requests), 3),
        "rounds_us": rounds,
    }


def ingest(args: argparse.Namespace) -> dict[str, object]:
    rnd = random.Random(7)
    encode = msgspec.msgpack.Encoder().encode
    payloads = []
    for _ in range(2000):
        hashes = [rnd.getrandbits(64) for _ in range(16)]
        tokens = [rnd.randrange(100_000) for _ in range(16 * BLOCK)]
        stored = BlockStored(hashes, None, tokens, BLOCK, 1, "GPU", MODEL, [(MODEL,)] * 16, 0)
        removed = [BlockRemoved([h], "GPU", 0) for h in hashes]
        payloads.append(encode(EventBatch(time.time(), [stored], 0)))
        payloads.append(encode(EventBatch(time.time(), removed, 0)))
    times = []
    for _ in range(args.rounds):
        index = KvIndex(root, BLOCK)
        index.set_state("r", LIVE)
        start = time.perf_counter_ns()
        for payload in payloads:
            for event in decode(payload).events:
                if isinstance(event, Stored):
                    index.stored(
                        "r",
                        event.block_hashes,
                        event.parent_block_hash,
                        event.token_ids,
                        event.block_size,
                        event.lora_name,
                    )
                elif isinstance(event, Removed):
                    index.removed("r", event.block_hashes)
        times.append((time.perf_counter_ns() - start) / 1e9)
        assert index.held("r") == 0
    seconds = statistics.median(times)
    events = 2000 * (1 + 16)
    return {
        "batches": len(payloads),
        "events": events,
        "blocks_stored_and_removed": 2000 * 16,
        "batches_per_s": round(len(payloads) / seconds),
        "events_per_s": round(events / seconds),
        "blocks_per_s": round(2000 * 16 * 2 / seconds),
        "us_per_block_stored_then_removed": round(seconds / (2000 * 16) * 1e6, 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--held", default="1000,100000")
    p.add_argument("--replicas", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--requests", type=int, default=4000)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--out", default=str(ROOT / "bench/results/kv-index-cost.json"))
    args = p.parse_args()
    command = "python bench/kv_index_cost.py " + " ".join(sys.argv[1:])
    result = {
        "command": command.strip(),
        "python": platform.python_version(),
        "load_average_before": os.getloadavg(),
        "routing": [routing(int(h), args) for h in args.held.split(",")],
        "ingest": ingest(args),
        "load_average_after": os.getloadavg(),
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items()}, indent=1, default=str)[:3000])


if __name__ == "__main__":
    main()
