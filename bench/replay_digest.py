"""Decision-for-decision digest of a tree's routing policy, for refactors that must not change it.

Runs TREE's own bench/replay.py (its traces, its `PrefixRouter`: the policy with its defaults)
on every trace at 2, 3 and 8 replicas over trace seeds 0 to `--seeds` - 1, and prints one line
per cell: the decisions made, the policy's counts by kind and a hash of every `Decision`
(replica, kind, tokens) in order, with each request's replica and the simulated end time. Two
trees place identically exactly when their outputs are equal:

    mkdir -p /tmp/base && git archive BASE | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base python bench/replay_digest.py /tmp/base > /tmp/base.txt
    PYTHONPATH=$PWD python bench/replay_digest.py . > /tmp/new.txt
    diff /tmp/base.txt /tmp/new.txt && echo identical

PYTHONPATH must name TREE too, so that its `lora_router` is the one measured (checked).
Pure computation: about 3 minutes for the 210 cells of 10 seeds.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import sys
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("tree", type=Path, help="the source tree whose policy is replayed")
    p.add_argument("--seeds", type=int, default=10, help="trace seeds 0 to N - 1 (default 10)")
    args = p.parse_args(argv)
    tree = args.tree.resolve()
    sys.path.insert(0, str(tree / "bench"))
    import lora_router

    if not Path(lora_router.__file__).resolve().is_relative_to(tree):
        sys.exit(f"lora_router comes from {lora_router.__file__}: set PYTHONPATH={tree}")
    replay: Any = importlib.import_module("replay")
    traces = getattr(replay, "traces", None) or replay.bench  # bench/routing.py before #29
    timing = traces.Timing()
    for trace in traces.TRACES:
        for n in (2, 3, 8):
            for seed in range(args.seeds):
                reqs = replay.requests_of(trace, n, seed, timing)
                router = replay.PrefixRouter()
                log: list[tuple[str, str, int]] = []
                choose = router.policy.choose

                def logged(key: Any, routable: Any, choose: Any = choose, log: Any = log) -> Any:
                    decision = choose(key, routable)
                    log.append((decision.replica.name, decision.kind, decision.tokens))
                    return decision

                router.policy.choose = logged
                placed, _, _, end = replay.replay(reqs, n, router, timing, 0.003, 1.3)
                digest = hashlib.sha256(repr((log, placed, end)).encode()).hexdigest()[:16]
                counts = router.policy.counts.as_dict()
                print(trace, n, seed, len(log), counts, digest, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
