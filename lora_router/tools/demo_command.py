"""`lora-router --demo`'s command line: its own flags, the routing flags it passes on, Ctrl-C.

`lora-router --demo` (cli.py) takes the flags of `build_parser` (the demo's usage line) and the
routing flags of `ROUTER_FLAGS` for the demo's router, in any order; every other router flag is
refused there, since the demo would ignore it. The run itself is demo.py,
its closing table demo_report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import textwrap
from collections.abc import Mapping, Sequence
from typing import Any, TextIO

from lora_router.command import HelpFormatter, Parser, interrupted
from lora_router.routing import POLICIES
from lora_router.tools.demo import DemoError, DemoPlan, run
from lora_router.tools.demo_report import summary

# The router flags `lora-router --demo` passes to the demo's router; any other router flag has
# no meaning there (it is refused, not ignored).
ROUTER_FLAGS = (
    "policy",
    "block_size",
    "load_factor",
    "load_slack",
    "move_price",
    "vnodes",
    "affinity_table_size",
)


def build_parser() -> argparse.ArgumentParser:
    d = DemoPlan()
    shown = ", ".join("--" + f.replace("_", "-") for f in ROUTER_FLAGS if f != "policy")
    p = Parser(
        prog="lora-router --demo",
        description="A GRPO-shaped run through a router in front of emulated replicas.",
        epilog=textwrap.fill(
            f"It also takes the router's other routing flags ({shown}) for its router; "
            "lora-router --help describes them.",
            width=78,
        ),
        formatter_class=HelpFormatter,
        allow_abbrev=False,  # an abbreviation may mean a router flag
    )
    p.add_argument(
        "--replicas", type=int, default=d.replicas, help="emulated vLLM replicas to start"
    )
    p.add_argument("--steps", type=int, default=d.steps, help="adapter versions to train")
    p.add_argument("--prompts", type=int, default=d.prompts, help="prompts per step")
    p.add_argument("--group", type=int, default=d.group, help="samples per prompt (G)")
    p.add_argument(
        "--max-tokens", type=int, default=d.max_tokens, help="max_tokens of every completion"
    )
    p.add_argument(
        "--mount-lag",
        type=int,
        default=d.mount_lag,
        help="load attempts of each adapter the last replica answers 404 before its files "
        "appear (as on a network bucket); the router retries them",
    )
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=d.policy,
        help="the router's routing policy (compare prefix with round-robin)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def run_demo(
    argv: Sequence[str] | None = None,
    out: TextIO | None = None,
    router: Mapping[str, Any] | None = None,
) -> int:
    """The demo run on its own flags only (`lora-router --demo` adds the routing flags)."""
    return demo_command(build_parser().parse_args(argv if argv is not None else []), out, router)


def demo_command(
    args: argparse.Namespace,
    out: TextIO | None = None,
    router: Mapping[str, Any] | None = None,
) -> int:
    """The `--demo` command, its flags parsed: run, print the summary, return 0 when every
    request succeeded. `router`: routing flags given to `lora-router --demo` (checked there),
    for its router. Ctrl-C stops the run and everything it started."""
    routing = dict(router or {})
    policy = routing.pop("policy", args.policy)
    if min(args.replicas, args.steps, args.prompts, args.group, args.max_tokens) < 1:
        print("lora-router --demo: sizes must be at least 1", file=sys.stderr)
        return 2
    plan = DemoPlan(
        replicas=args.replicas,
        steps=args.steps,
        prompts=args.prompts,
        group=args.group,
        max_tokens=args.max_tokens,
        mount_lag=max(0, args.mount_lag),
        policy=policy,
        routing=tuple(sorted(routing.items())),
    )
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        result = asyncio.run(run(plan, progress=None if args.no_progress else sys.stderr))
    except DemoError as exc:
        print(f"lora-router --demo: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return interrupted("lora-router --demo")
    print(summary(result), file=out or sys.stdout)
    return 0 if result.ok else 1
