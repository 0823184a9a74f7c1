"""What the affinity table costs per anchor, in process: RSS and hash tables as prompts fill it.

    python bench/anchor_bytes.py [--prompts 200000,400000,500000] [--table 200000]
                                 [--tokens 1000] [--compare REV[,REV]] [--out FILE]

A `PrefixAffinity` of the default table size in front of 2 replicas routes distinct token-id
prompts (differing from their first token, so every one is a new family) as the
routed path (proxy/routed.py) does: the JSON body read and validated by `CompletionReader`, its
`RouteKey` built by `completion_key`,
`choose`. After each step it reports the process's RSS over its RSS before the first prompt,
that figure per anchor held, and the bytes of the policy's and the table's hash tables
(`sys.getsizeof` of every dict among their attributes). With no request handling around it,
this is the table's own cost; bench/overhead.py `--table-only` measures the router process.

Each tree (this one, and `git archive REV` of each `--compare` revision) runs in a process of
its own, one after the other: RSS is not a timing, so the machine's load does not move it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from lib.procs import source_tree

ROOT = Path(__file__).resolve().parents[1]
MODEL = "trl-policy-v1"


def rss_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096


def table_bytes(policy: object) -> int:
    """The hash tables of the policy and its affinity table: every dict attribute of theirs."""
    total = 0
    for owner in (policy, policy.table):  # type: ignore[attr-defined]
        names = getattr(type(owner), "__slots__", ()) or vars(owner)
        for name in names:
            value = getattr(owner, name, None)
            if isinstance(value, dict):
                total += sys.getsizeof(value)
    return total


def child(args: argparse.Namespace) -> None:
    from lora_router.proxy.body import CompletionReader
    from lora_router.routing.keys import Lineages, completion_key
    from lora_router.routing.policy import Candidates, PrefixAffinity

    class Rep:
        __slots__ = ("in_flight", "in_flight_tokens", "name")

        def __init__(self, name: str) -> None:
            self.name, self.in_flight, self.in_flight_tokens = name, 0, 0

    reps = [Rep(f"http://127.0.0.1:{8000 + i}") for i in range(2)]
    policy = PrefixAffinity(table_size=args.table)
    policy.set_members(reps)
    routable = Candidates(reps)
    reader = CompletionReader(args.tokens + 8)
    seeds = Lineages().seeds(MODEL, True)
    rest = ", ".join(str((i * 7919) % 151_000) for i in range(3, args.tokens))
    before = rss_bytes()
    routed = 0
    rows = []
    for target in args.prompts:
        while routed < target:
            lead = f"1, {routed % 100_000}, {routed // 100_000}"
            body = f'{{"model": "{MODEL}", "prompt": [{lead}, {rest}], "seed": {routed}}}'
            key = completion_key(reader.read(body.encode(), chat=False), seeds, 16)
            if policy.choose(key, routable).kind != "fresh":
                raise SystemExit("a distinct prompt was not routed as fresh")
            routed += 1
        held = len(policy.table)
        grown = rss_bytes() - before
        rows.append(
            {"prompts": routed, "anchors": held, "rss": grown, "tables": table_bytes(policy)}
        )
    print(json.dumps(rows))


def run_tree(tree: Path, args: argparse.Namespace) -> list[dict[str, int]]:
    argv = [sys.executable, __file__, "--child", "--table", str(args.table)]
    argv += ["--tokens", str(args.tokens), "--prompts", ",".join(map(str, args.prompts))]
    out = subprocess.run(
        argv,
        env={**os.environ, "PYTHONPATH": str(tree)},
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", default="200000,400000,500000")
    parser.add_argument("--table", type=int, default=200_000)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--compare", default="", help="git revisions to measure too")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.prompts = [int(n) for n in args.prompts.split(",")]
    if args.child:
        return child(args)
    trees: dict[str, Path] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rev in filter(None, args.compare.split(",")):
            trees[rev] = source_tree(rev, Path(tmp) / rev)
        trees["this tree"] = ROOT
        results = {name: run_tree(tree, args) for name, tree in trees.items()}
    lines = [
        "# Affinity table bytes per anchor (bench/anchor_bytes.py)",
        "",
        f"`python bench/anchor_bytes.py {' '.join(sys.argv[1:])}`",
        "",
        f"python {sys.version.split()[0]}, {args.tokens:,}-token token-id prompts, all distinct, "
        f"affinity table of {args.table:,} anchors. RSS over the process's RSS before the first "
        "prompt; per anchor: that over the anchors held; hash tables: `sys.getsizeof` of the "
        "policy's and the table's dicts.",
        "",
        "| tree | prompts | anchors | RSS grown MiB | bytes per anchor | hash tables MiB |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, rows in results.items():
        for row in rows:
            lines.append(
                f"| {name} | {row['prompts']:,} | {row['anchors']:,} | {row['rss'] / 2**20:.1f} | "
                f"{row['rss'] / row['anchors']:.0f} | {row['tables'] / 2**20:.1f} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
