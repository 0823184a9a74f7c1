"""What routing one request costs, with no I/O, as the fleet grows: microseconds per call.

    python bench/route_cost.py [--replicas 2,8,32,128] [--tokens 512] [--table 200000]
                               [--rounds 3] [--tokens-in-flight] [--compare REV[,REV]]
                               [--no-tree] [--out bench/results/route_cost.md]

For each fleet size, a real `Fleet` (replicas with the adapter acknowledged, 20-40 requests in
flight each) and a `PrefixAffinity` whose affinity table is filled to its cap with GRPO-like
prompts (a shared template plus a problem, placed on random replicas), so lookups and
evictions run at their steady-state cost. Three figures, each the fastest of 35 repeats of 200
calls, in CPU time of the process (the machine is shared: wall time and the slower repeats
measure the neighbours too):

Without `--tokens-in-flight` the requests in flight carry no prompt tokens, so replicas with
equal in-flight counts tie for a fresh prompt (about 6 of 128) and dealing settles each tie
by ring order: the costliest case for `HashRing.first_of`. With it, ties are as rare as they
are under real prompts.

- *routable*: `Fleet.routable(model)` alone, the routed path's "who may take it?";
- *fresh*: a prompt nobody sent before, as proxy/routed.py routes it: its key built from a validated
  `Completion` (ids packed by validation), the policy's choice among the routable replicas
  (its chain computed and the table scanned, a new family dealt);
- *known*: a sibling of a prompt routed before (the G samples of a GRPO prompt), from its raw
  JSON text alone (the wire key).

The fresh and known figures exclude `routable`, which is timed on its own. With `--compare
REV` the same script measures `git archive REV` of this repository too; each round runs one
process per tree, trees alternating, and the table shows the medians over rounds and the
ratios (each tree against the first REV, and each size against the smallest fleet).
`--no-tree` leaves the working tree out. A revision's API is detected
(before `keys.completion_key`: `wire_key` + `choose_known`, then `prompt_key` + `choose`).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import random
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import timeit
from array import array
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODEL = "trl-policy-v2"
CASES = ("routable", "fresh", "known")
NUMBER, REPEATS = 200, 35


def per_call_us(fn: Callable[[], object]) -> float:
    # CPU time of this process, and the fastest repeat: on a shared machine, wall time and
    # the slower repeats measure the neighbours too.
    timer = timeit.Timer(fn, timer=time.process_time)
    return min(timer.repeat(number=NUMBER, repeat=REPEATS)) / NUMBER * 1e6


async def measure(n: int, args: argparse.Namespace, seed: int) -> dict[str, float]:
    """One fleet size's figures, in the lora_router on sys.path."""
    body = importlib.import_module("lora_router.proxy.body")
    config_mod = importlib.import_module("lora_router.config")
    fleet_mod = importlib.import_module("lora_router.fleet.fleet")
    keys = importlib.import_module("lora_router.routing.keys")
    policy_mod = importlib.import_module("lora_router.routing.policy")

    rng = random.Random(seed)
    addresses = tuple(
        config_mod.ReplicaAddress.parse(f"http://replica-{i}.internal:8000") for i in range(n)
    )
    fleet = fleet_mod.Fleet(config_mod.Config(replicas=addresses))
    policy = policy_mod.PrefixAffinity(table_size=args.table)
    fleet.on_members = policy.set_members
    if hasattr(fleet, "on_load"):  # the policy keeps dealing ranks: it reads the members' loads
        policy.set_members(fleet.replicas)
        fleet.on_load = policy.load_changed
    else:
        policy.set_members([r.name for r in fleet.replicas])
    for r in fleet.replicas:
        r.adapters[MODEL] = "/adapters/v2"
        load = rng.randrange(20, 40)
        prompts = [rng.randrange(100, 1000) if args.tokens_in_flight else 0 for _ in range(load)]
        if hasattr(fleet, "started"):
            for tokens in prompts:
                fleet.started(r, tokens)
        else:
            r.in_flight, r.in_flight_tokens = load, sum(prompts)
    seeds = keys.Lineages().seeds(MODEL, True)
    template = array("I", rng.randbytes(4 * 300))
    names = [r.name for r in fleet.replicas]
    for _ in range(args.table):
        filler = template + array("I", rng.randbytes(4 * rng.randrange(20, 200)))
        policy.table.record(keys.prompt_key(None, filler, seed=seeds.token), rng.choice(names))

    def completion(raw: bytes, ids: array[int] | None) -> Any:
        return body.Completion(MODEL, raw, ids, None, False)

    def prompt() -> tuple[bytes, array[int]]:
        ids = template + array("I", rng.randbytes(4 * (args.tokens - len(template))))
        return ("[" + ",".join(map(str, ids)) + "]").encode(), ids

    if hasattr(keys, "completion_key"):

        def route(c: Any, routable: Any) -> Any:
            return policy.choose(keys.completion_key(c, seeds, 16), routable)

    else:  # 4c13cbf: the wire key first, then the block key and the whole policy

        def route(c: Any, routable: Any) -> Any:
            wire = keys.wire_key(None, c.raw_tokens, seed=seeds.wire)
            decision = policy.choose_known(wire, routable)
            if decision is None:
                key = keys.prompt_key(None, c.token_ids(), 16, seed=seeds.token)
                decision = policy.choose(key, routable, wire)
            return decision

    routable = fleet.routable(MODEL)
    known = completion(*prompt())
    route(known, routable)
    sibling = completion(known.raw_tokens, None)
    fresh = iter([completion(*prompt()) for _ in range(NUMBER * REPEATS)])
    before = policy.counts.as_dict()
    figures = {
        "routable": per_call_us(lambda: fleet.routable(MODEL)),
        "known": per_call_us(lambda: route(sibling, routable)),
        "fresh": per_call_us(lambda: route(next(fresh), routable)),  # evicts the known one
    }
    after = policy.counts.as_dict()
    made = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    calls = NUMBER * REPEATS
    if made != {"fresh": calls, "sibling": calls}:  # else a figure measures something else
        raise SystemExit(f"the cases were not routed as named: {made}")
    fleet.close()
    return figures


def child(args: argparse.Namespace) -> None:
    sys.path.insert(0, str(args.tree))
    out = {}
    for n in args.sizes:
        out[str(n)] = asyncio.run(measure(n, args, seed=n))
    print(json.dumps(out))


def run_tree(tree: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    command = [
        sys.executable,
        __file__,
        "--child",
        "--tree",
        str(tree),
        "--replicas",
        ",".join(map(str, args.sizes)),
        "--tokens",
        str(args.tokens),
        "--table",
        str(args.table),
        *(["--tokens-in-flight"] if args.tokens_in_flight else []),
    ]
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    return json.loads(done.stdout)


def export(rev: str, into: Path) -> Path:
    """`git archive rev lora_router` unpacked under `into`."""
    tree = into / rev
    tree.mkdir()
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", "--format=tar", rev, "lora_router"],
        check=True,
        capture_output=True,
    ).stdout
    tar_path = into / f"{rev}.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(tree, filter="data")
    return tree


def report(runs: dict[str, list[dict[str, dict[str, float]]]], args: argparse.Namespace) -> str:
    trees = list(runs)
    med = {
        tree: {
            (n, case): statistics.median(r[str(n)][case] for r in rounds)
            for n in args.sizes
            for case in CASES
        }
        for tree, rounds in runs.items()
    }
    lines = [
        f"`{' '.join(['python', 'bench/route_cost.py', *sys.argv[1:]])}`",
        "",
        f"python {sys.version.split()[0]}, {args.tokens}-token token-id prompts, affinity table "
        f"of {args.table} anchors, {args.rounds} rounds (one process per tree per round, trees "
        "alternating); microseconds per call, medians over rounds.",
        "",
    ]
    head = "| case | replicas | " + " | ".join(f"{t} µs | vs 2" for t in trees)
    if len(trees) >= 2:
        head += " | " + " | ".join(f"{t} / {trees[0]}" for t in trees[1:])
    lines += [head + " |", "|" + "---|" * head.count("|")]
    for case in CASES:
        for n in args.sizes:
            cells = []
            for t in trees:
                cells.append(
                    f"{med[t][n, case]:.2f} | {med[t][n, case] / med[t][args.sizes[0], case]:.2f}"
                )
            row = f"| {case} | {n} | " + " | ".join(cells)
            for t in trees[1:]:
                row += f" | {med[t][n, case] / med[trees[0]][n, case]:.2f}"
            lines.append(row + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--replicas", default="2,8,32,128", help="fleet sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--table", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--tokens-in-flight",
        action="store_true",
        help="give each request in flight 100-1000 prompt tokens (else 0: replicas with equal "
        "in-flight counts tie, the costliest case for dealing's ring-order tie-break)",
    )
    parser.add_argument(
        "--compare", metavar="REV[,REV]", help="also measure these git revisions (first: the base)"
    )
    parser.add_argument("--no-tree", action="store_true", help="measure only the revisions")
    parser.add_argument("--out", type=Path, help="write the markdown table here too")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tree", type=Path, default=ROOT, help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.sizes = [int(n) for n in args.replicas.split(",")]
    if args.child:
        child(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        revs = args.compare.split(",") if args.compare else []
        trees = {rev: export(rev, Path(tmp)) for rev in revs}
        if not args.no_tree:
            trees["this tree"] = ROOT
        runs: dict[str, list[dict[str, dict[str, float]]]] = {t: [] for t in trees}
        for i in range(args.rounds):
            order = list(trees) if i % 2 == 0 else list(reversed(trees))  # interleaved
            for name in order:
                runs[name].append(run_tree(trees[name], args))
                print(f"round {i + 1}/{args.rounds}: {name} done", file=sys.stderr)
    text = report(runs, args)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
