"""Proxy overhead: lora-router against direct, nginx proxy_pass and vllm-router, in one run.

Method (the one vllm-router documents, and shared/docs/anchors.md uses): replicas that answer
at once (one nginx listening on every replica port, returning a fixed completion), closed loops
at concurrency 1 and 64 (wrk, one thread), a warm-up then a timed window. Every contender is
measured in the same run, interleaved round by round (the order of scenarios and contenders
rotates each round), and the report quotes medians over rounds with their min-max, and ratios
taken within a round. Each proxy is pinned to core 0; the replicas, wrk and this script share
core 1. The machine is shared: the report records its load average.

The requests are TRL 1.16's (`trl/experimental/async_grpo/async_rollout_worker.py`,
`_generate_one_turn`), byte for byte as aiohttp's `json=` writes them: a token-id prompt,
`max_tokens`, sampling fields, `return_token_ids`, `logprobs: 0` and a `seed` of its own on
every request. wrk builds each body in a Lua script this bench generates. Three traces:
- fresh: every request a prompt nobody has seen (its first tokens count up);
- siblings: each prompt sent as G = 8 requests in a row (a GRPO group), each with its own seed;
  one request in eight is a new prompt;
- sse: siblings with `"stream": true`, to replicas of their own that answer an event stream of
  200 events (one a token, as vLLM streams a completion), relayed as it comes.
lora-router's own decision counts (`/metrics`) must show the trace it was given (nearly all
`fresh` on the fresh trace; one in eight `fresh` on the siblings trace), or the run fails.

Measured:
1. Latency and CPU, 2 replicas, siblings, concurrency 1 and 64, all five contenders: req/s,
   p50/p99, p50 added over direct (same round), proxy CPU µs per request (/proc, the whole
   process tree, during the timed window only).
2. Fleet sweep, 2/8/32/128 replicas, each trace, concurrency 64, the four proxies:
   CPU µs per request and req/s, and per round the ratio of 128 replicas to 2.
3. RSS per open stream: 500, 1,000 and 2,000 SSE streams of 4,096-token prompts held open
   through each proxy to 4 replicas that send a head and a first chunk and then hold (a small
   asyncio server this script starts); RSS before and with the streams open.
4. RSS of lora-router and vllm-router after 100k, 300k and 500k distinct 1,000-token prompts
   (lora-router's default affinity table holds 200,000), the contenders side by side, filled
   step by step in turn; `--table-base REV` adds lora-router at git revision REV, and
   `--table-only` runs this part alone and writes bench/results/table_memory.md.
Then the issue-16 targets, each marked met or not.

Contenders: direct (wrk to a replica), nginx proxy_pass (keep-alive upstreams), the floor
(bench/floor.py: the least a Python proxy on lora-router's runtime, uvloop + httptools, does per
request: pooled keep-alive upstreams, round robin, the response relayed as raw bytes; no routing,
JSON or metrics: what the runtime costs before any of lora-router's work), lora-router at
its defaults (policy prefix), vllm-router at its default policy, cache_aware, with
`--log-level warning` (its per-request INFO line costs it about a quarter of its throughput).
sglang-router is not a contender: it rejects token-id prompts on /v1/completions.

    pip install -e '.[bench]' && apt-get install nginx wrk
    python bench/overhead.py            # the full run (12 minutes before the floor joined)
    python bench/overhead.py --quick    # a smoke run, about 2 minutes (not for the record)

An A/B of two revisions: `--base-tree DIR` adds `lora-router@base`, lora-router run from the
source tree DIR (PYTHONPATH), to every window, interleaved with the others; the report then
has a per-round ratio of the two and is written as overhead-ab.md/.json. With `--fleets 2` and
`--windows-only` it is the latency and CPU windows alone:

    git archive f8cdf5c | tar -x -C /tmp/base
    python bench/overhead.py --base-tree /tmp/base --fleets 2 --windows-only

A contender that fails to start, answers an error, or is shown a trace it does not route as
such stops the run with a non-zero exit: no figure is written from a broken measurement.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.overhead_memory import (
    serve_hold,
    streams,
    table,
)
from lib.overhead_report import (
    Report,
    markdown,
    targets,
    write_table,
)
from lib.overhead_setup import (
    BASE,
    FLEETS,
    LOAD_CPU,
    STREAM_COUNTS,
    TABLE_PROMPTS,
    BenchFailure,
    check_payload,
    start_fleet,
    starters,
)
from lib.overhead_windows import (
    windows,
)
from lib.procs import (
    Procs,
    find_binary,
    git_revision,
)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="a 2-minute smoke run")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--seconds", type=float, default=2.0, help="timed window per contender")
    p.add_argument("--warmup", type=float, default=1.0, help="warm-up before each window")
    p.add_argument("--stream-rounds", type=int, default=1)
    p.add_argument(
        "--base-tree", help=f"a source tree to run {BASE} from, beside lora-router (an A/B)"
    )
    p.add_argument(
        "--fleets",
        type=lambda v: tuple(int(n) for n in v.split(",")),
        default=FLEETS,
        help="fleet sizes of the sweep (default 2,8,32,128)",
    )
    p.add_argument(
        "--windows-only", action="store_true", help="skip the open-stream and table phases"
    )
    p.add_argument("--peers-bin", default=str(Path(__file__).parent / ".peers" / "bin"))
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    p.add_argument("--table-only", action="store_true", help="only the RSS plateau (part 4)")
    p.add_argument("--table-base", metavar="REV", help="part 4 also measures lora-router at REV")
    p.add_argument("--hold-replica", help=argparse.SUPPRESS)  # internal: the holding replica
    args = p.parse_args()
    if args.hold_replica:
        asyncio.run(serve_hold([int(x) for x in args.hold_replica.split(",")]))
        return
    args.streams, args.table = STREAM_COUNTS, TABLE_PROMPTS
    if args.base_tree:
        args.base_tree = str(Path(args.base_tree).resolve())
    if args.quick:
        args.rounds, args.seconds, args.warmup, args.stream_rounds = 1, 1.0, 0.0, 1
        args.table = (5_000, 15_000)
    vllm_router = find_binary("vllm-router", Path(args.peers_bin))
    missing = [n for n in ("nginx", "wrk", "taskset") if not shutil.which(n)]
    if missing or not vllm_router:
        sys.exit(
            f"bench/overhead.py needs nginx, wrk, taskset and vllm-router; missing: "
            f"{', '.join(missing + ([] if vllm_router else ['vllm-router']))} "
            "(apt-get install nginx wrk; pip install -e '.[bench]')"
        )
    os.sched_setaffinity(0, {int(LOAD_CPU)})
    report = Report(
        command=" ".join(["python", "bench/overhead.py", *sys.argv[1:]]),
        revision=git_revision(),
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        base_tree=args.base_tree,
    )
    if args.base_tree:
        report.contenders.append(BASE)
    began = time.monotonic()
    procs = Procs()
    try:
        check_payload()
        start = starters(vllm_router, args.base_tree)
        fleet = start_fleet(procs, 2 if args.table_only else max(args.fleets))
        if args.table_only:
            report.table = table(procs, start, fleet, args)
            return write_table(report, began, Path(args.out), args.quick)
        fleets = {"json": fleet, "sse": start_fleet(procs, max(args.fleets), "sse")}
        report.samples, report.idle, report.load_before_rounds = windows(procs, start, fleets, args)
        if not args.windows_only:
            print("open streams", flush=True)
            report.streams = streams(procs, start, args)
            print("affinity table", flush=True)
            report.table = table(procs, start, fleet, args)
    except BenchFailure as e:
        sys.exit(f"bench/overhead.py FAILED, no results written: {e}")
    finally:
        procs.close()
    report.seconds = time.monotonic() - began
    report.load_end = os.getloadavg()[0]
    goals = targets(report, args.fleets)
    text = markdown(report, args.fleets, goals)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "overhead-ab" if args.base_tree else "overhead-quick" if args.quick else "overhead"
    (out / f"{name}.json").write_text(
        json.dumps({**asdict(report), "targets": goals}, indent=1) + "\n"
    )
    (out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
