"""`lora-router`: the command line, turned into one `Config`, and the process around the server.

Bad flags, an empty or malformed replica list, or a token variable that is not set end the
process at once with one readable line and exit status 2. The token's value is read here, once,
and only ever travels inside `Config.token` (a `Secret`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import signal
import ssl
import sys
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import NoReturn

from lora_router import __version__
from lora_router.config import Config, ReplicaAddress, Secret
from lora_router.routing.keys import Lineages
from lora_router.routing.policy import POLICIES

log = logging.getLogger("lora_router")


class UsageError(Exception):
    """A command line that cannot run; the message is the one line the user sees."""


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag costs one line (not the whole usage) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    d = Config(replicas=())
    p = _Parser(
        prog="lora-router",
        description="Make N vLLM replicas, retrained live through LoRA adapters, look like one "
        "vLLM server: prefix-affinity routing, fenced adapter broadcasts, streaming.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"lora-router {__version__}")

    g = p.add_argument_group("try it, check a fleet")
    g.add_argument(
        "--demo",
        action="store_true",
        help="run a short GRPO-shaped training run through a router in front of 3 emulated "
        "replicas on this machine, then exit (no other flag needed)",
    )
    g.add_argument(
        "--check",
        action="store_true",
        help="probe every replica for what would break a TRL run, print a table, "
        "exit 0 only if the fleet is ready",
    )
    g.add_argument(
        "--max-staleness",
        type=int,
        default=d.max_staleness,
        help="the trainer's max_staleness; --check wants max_loras >= it + 2",
    )

    g = p.add_argument_group("replicas and credentials")
    g.add_argument(
        "--replicas",
        help="comma-separated replica URLs, http:// or https://, optionally with a path prefix",
    )
    g.add_argument(
        "--token-env",
        metavar="NAME",
        help="environment variable holding the replicas' bearer token",
    )
    g.add_argument(
        "--no-token", action="store_true", help="send no Authorization header to the replicas"
    )
    g.add_argument("--ca-file", help="extra CA bundle to verify https replicas against")

    g = p.add_argument_group("listening")
    g.add_argument("--host", default=d.host, help="address to listen on")
    g.add_argument("--port", type=int, default=d.port, help="port to listen on")
    g.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="environment variable holding the key clients must send as a bearer "
        "token (required to listen beyond loopback; GET /health and /ping stay open)",
    )
    g.add_argument(
        "--insecure-listen",
        action="store_true",
        help="allow listening beyond loopback without --api-key-env",
    )

    g = p.add_argument_group("routing")
    g.add_argument(
        "--policy",
        choices=POLICIES,
        default=d.policy,
        help="how completions pick a replica",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV block (default: the replicas' cache_config.block_size, else 16)",
    )
    g.add_argument(
        "--load-factor",
        type=float,
        default=d.load_factor,
        help="epsilon of consistent hashing with bounded loads: no replica takes "
        "more than (1+eps) times the mean in-flight requests by affinity",
    )
    g.add_argument(
        "--load-slack",
        type=int,
        default=d.load_slack,
        help="requests in flight a replica may take above the mean even when that exceeds "
        "(1+eps) times it: lets the G samples of a prompt meet on one replica when few "
        "requests are in flight",
    )
    g.add_argument("--vnodes", type=int, default=d.vnodes, help="virtual nodes per replica")
    g.add_argument(
        "--affinity-table-size",
        type=int,
        default=d.affinity_table_size,
        help="prompts remembered for affinity (LRU)",
    )
    g.add_argument(
        "--lineage-pattern",
        default=d.lineage_pattern,
        metavar="REGEX",
        help="matches a whole adapter name; its (?P<lineage>...) group names the family that "
        "placement follows across versions (default: TRL's {lora_name}-v{N}, so trl-policy-v7 "
        "is placed as trl-policy); names it does not match are their own lineage",
    )

    g = p.add_argument_group("timeouts (seconds)")
    g.add_argument("--connect-timeout", type=float, default=d.connect_timeout)
    g.add_argument(
        "--first-byte-timeout",
        type=float,
        default=d.first_byte_timeout,
        help="wait for a replica's first response byte (long prefills, /pause?mode=wait)",
    )
    g.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout,
        help="wait between two response bytes of a replica",
    )
    g.add_argument(
        "--fence-timeout",
        type=float,
        default=d.fence_timeout,
        help="how long a request waits for its adapter's load to finish",
    )
    g.add_argument(
        "--header-timeout",
        type=float,
        default=d.header_timeout,
        help="time a client has to send its request headers",
    )
    g.add_argument(
        "--body-timeout",
        type=float,
        default=d.body_timeout,
        help="time a client has to send its request body",
    )
    g.add_argument(
        "--keepalive-timeout",
        type=float,
        default=d.keepalive_timeout,
        help="idle time before a client connection is closed",
    )
    g.add_argument(
        "--upstream-idle-timeout",
        type=float,
        default=d.upstream_idle_timeout,
        help="idle time before a pooled replica connection is closed",
    )
    g.add_argument(
        "--shutdown-grace",
        type=float,
        default=d.shutdown_grace,
        help="on SIGTERM, time in-flight requests get to finish",
    )

    g = p.add_argument_group("limits")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes)
    g.add_argument("--max-header-bytes", type=int, default=d.max_header_bytes)
    g.add_argument("--max-headers", type=int, default=d.max_headers)
    g.add_argument(
        "--max-connections", type=int, default=d.max_connections, help="open client connections"
    )
    g.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens)
    g.add_argument(
        "--max-upstream-connections",
        type=int,
        default=d.max_upstream_connections,
        help="requests in flight to one replica",
    )
    g.add_argument(
        "--retries",
        type=int,
        default=d.retries,
        help="other replicas tried when one fails before answering anything",
    )

    g = p.add_argument_group("adapter broadcasts")
    g.add_argument(
        "--load-retry-interval",
        type=float,
        default=d.load_retry_interval,
        help="retry interval while a replica's mount has not caught up",
    )
    g.add_argument(
        "--load-deadline",
        type=float,
        default=d.load_deadline,
        help="give up on an adapter load after this long (answered 504)",
    )
    g.add_argument(
        "--unload-stale",
        metavar="PATTERN",
        help="at start, unload adapters matching this glob (e.g. 'trl-policy-*') "
        "left on reused replicas",
    )
    g.add_argument(
        "--down-replica-policy",
        choices=("replay", "fail"),
        default=d.down_replica_policy,
        help="a replica down during a load: proceed and replay on return, or fail",
    )

    g = p.add_argument_group("health")
    g.add_argument("--health-interval", type=float, default=d.health_interval)
    g.add_argument("--health-timeout", type=float, default=d.health_timeout)
    g.add_argument(
        "--health-failures",
        type=int,
        default=d.health_failures,
        help="failed checks before a replica is ejected",
    )
    g.add_argument(
        "--health-successes",
        type=int,
        default=d.health_successes,
        help="passed checks before an ejected replica is re-admitted",
    )
    g.add_argument(
        "--breaker-failures",
        type=int,
        default=d.breaker_failures,
        help="consecutive request failures that open a replica's circuit breaker",
    )
    g.add_argument("--breaker-cooldown", type=float, default=d.breaker_cooldown)

    g = p.add_argument_group("visibility")
    g.add_argument(
        "--log-level", default=d.log_level, choices=("debug", "info", "warning", "error")
    )
    g.add_argument(
        "--status-interval",
        type=float,
        default=d.status_interval,
        help="seconds between one-line status summaries in the log (0: never)",
    )
    return p


def build_config(args: argparse.Namespace, environ: Mapping[str, str]) -> Config:
    """Turn parsed flags into a Config, or raise UsageError with the line the user sees."""
    if not args.replicas or not args.replicas.strip(","):
        raise UsageError("--replicas is required: a comma-separated list of replica URLs")
    try:
        replicas = tuple(ReplicaAddress.parse(u) for u in args.replicas.split(",") if u.strip())
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not replicas:
        raise UsageError("--replicas is required: a comma-separated list of replica URLs")
    if len({r.name for r in replicas}) != len(replicas):
        raise UsageError("--replicas lists the same replica twice")
    token = Secret("")
    if args.token_env:
        if not environ.get(args.token_env):
            raise UsageError(f"--token-env {args.token_env}: that variable is not set or empty")
        token = Secret(environ[args.token_env])
    elif not args.no_token:
        raise UsageError("give --token-env NAME (the replicas' bearer token) or --no-token")
    api_key = Secret("")
    if args.api_key_env:
        if not environ.get(args.api_key_env):
            raise UsageError(f"--api-key-env {args.api_key_env}: that variable is not set or empty")
        api_key = Secret(environ[args.api_key_env])
    if not _is_loopback(args.host) and not api_key and not args.insecure_listen:
        raise UsageError(
            f"--host {args.host} is reachable beyond this machine: give --api-key-env NAME "
            "so clients must authenticate, or --insecure-listen"
        )
    if args.ca_file:
        if not os.path.isfile(args.ca_file):
            raise UsageError(f"--ca-file {args.ca_file}: no such file")
        try:
            ssl.create_default_context(cafile=args.ca_file)
        except (ssl.SSLError, ValueError, OSError):
            raise UsageError(
                f"--ca-file {args.ca_file}: not a PEM bundle of CA certificates"
            ) from None
    if not 0 <= args.port <= 65535:
        raise UsageError("--port must be between 0 and 65535 (0: any free port)")
    seconds = (
        "connect_timeout",
        "first_byte_timeout",
        "idle_timeout",
        "fence_timeout",
        "header_timeout",
        "body_timeout",
        "keepalive_timeout",
        "upstream_idle_timeout",
        "load_retry_interval",
        "load_deadline",
        "health_interval",
        "health_timeout",
        "breaker_cooldown",
    )
    for name in seconds:
        value = getattr(args, name)
        if not (math.isfinite(value) and value > 0):
            raise UsageError(f"--{name.replace('_', '-')} must be a positive number of seconds")
    for name in ("shutdown_grace", "status_interval"):
        value = getattr(args, name)
        if not (math.isfinite(value) and value >= 0):
            raise UsageError(f"--{name.replace('_', '-')} must be 0 or more seconds")
    positive = (
        "vnodes",
        "affinity_table_size",
        "max_body_bytes",
        "max_header_bytes",
        "max_headers",
        "max_connections",
        "max_prompt_tokens",
        "max_upstream_connections",
        "health_failures",
        "health_successes",
        "breaker_failures",
    )
    for name in positive:
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if args.block_size is not None and args.block_size <= 0:
        raise UsageError("--block-size must be positive")
    if args.load_slack < 0:
        raise UsageError("--load-slack must be 0 or more")
    try:
        Lineages(args.lineage_pattern)
    except ValueError as exc:
        raise UsageError(f"--lineage-pattern: {exc}") from None
    if not (math.isfinite(args.load_factor) and args.load_factor > 0):
        raise UsageError("--load-factor must be positive")
    if args.max_staleness < 0:
        raise UsageError("--max-staleness must be 0 or more")
    if args.retries < 0:
        raise UsageError("--retries must be 0 or more")
    # Every other Config field is a flag of the same name.
    given = vars(args)
    flags = {f.name: given[f.name] for f in fields(Config) if f.name not in _DERIVED}
    return Config(replicas=replicas, token=token, api_key=api_key, **flags)


_DERIVED = frozenset({"replicas", "token", "api_key"})  # parsed or read from the environment


def _is_loopback(host: str) -> bool:
    return host in ("localhost", "::1") or host.startswith("127.")


async def serve_until_signal(config: Config) -> None:
    """Run the router until SIGTERM/SIGINT, then drain in-flight requests and return."""
    from lora_router.runtime import RouterRuntime

    runtime = RouterRuntime(config)
    await runtime.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("stopping: no new connections; in-flight requests get %gs", config.shutdown_grace)
    await runtime.stop(grace=config.shutdown_grace)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.demo:
        from lora_router.demo import run_demo

        return run_demo()
    try:
        config = build_config(args, os.environ)
    except UsageError as exc:
        print(f"lora-router: error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        from lora_router.check import run_check

        return run_check(config)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import uvloop

    try:
        uvloop.run(serve_until_signal(config))
    except OSError as exc:
        print(
            f"lora-router: error: cannot listen on {config.host}:{config.port}: {exc.strerror}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
