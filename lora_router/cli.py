"""`lora-router`: the command line, turned into one `Config`, and the process around the server.

Bad flags, an empty or malformed replica list, or a token variable that is not set end the
process at once with one readable line and exit status 2. The token's value is read here, once,
and only ever travels inside `Config.token` (a `Secret`).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import fields
from typing import Any

from lora_router import __version__
from lora_router.command import HelpFormatter, Parser, first_signal, interrupted
from lora_router.config import (
    FD_RESERVE,
    MAX_CONNECTIONS_CAP,
    Config,
    ReplicaAddress,
    Secret,
    secret_from_env,
)
from lora_router.routing.policy import POLICIES

log = logging.getLogger("lora_router")


class UsageError(Exception):
    """A command line that cannot run; the message is the one line the user sees."""


# The end of `--help`: the other commands and the commonest first runs.
EXAMPLES = """\
examples:
  lora-router --demo                    try it: 3 emulated replicas and a short GRPO-shaped run
  lora-router --demo --steps 2          the demo's own flags: lora-router --demo --help
  lora-router --check --replicas http://gpu-1:8000,http://gpu-2:8000 --token-env HF_TOKEN
                                        is this fleet ready for a TRL run? (exit 0: yes)
  lora-router --replicas http://gpu-1:8000,http://gpu-2:8000 --token-env HF_TOKEN
                                        serve on 127.0.0.1:8000: TRL's vllm_server_base_url
  lora-router top --url 127.0.0.1:8000  a live view of a running router (--once: one frame)
  lora-router-emulator --port 9001      one emulated vLLM replica, no GPU (its --help lists
                                        the faults it can inject)
"""


def build_parser() -> argparse.ArgumentParser:
    d = Config(replicas=())
    p = Parser(
        prog="lora-router",
        description="Make N vLLM replicas, retrained live through LoRA adapters, look like one\n"
        "vLLM server: prefix-affinity routing, fenced adapter broadcasts, streaming.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"lora-router {__version__}")

    g = p.add_argument_group("try it, check a fleet")
    g.add_argument(
        "--demo",
        action="store_true",
        help="run a short GRPO-shaped training run through a router in front of 3 emulated "
        "replicas on this machine, then exit (no other flag needed; the routing flags apply "
        "to its router)",
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
        help="comma-separated replica URLs, http:// or https://, optionally with a path "
        "prefix, one per vLLM server (required, except with --demo)",
    )
    g.add_argument(
        "--token-env",
        metavar="NAME",
        help="environment variable holding the replicas' bearer token "
        "(default: none, and then --no-token is required)",
    )
    g.add_argument(
        "--no-token",
        action="store_true",
        help="send no Authorization header to the replicas (not with --token-env)",
    )
    g.add_argument(
        "--ca-file",
        help="extra CA bundle to verify https replicas against (default: the system's CAs)",
    )
    g.add_argument(
        "--replica-hosts",
        metavar="PATTERNS",
        type=_comma_list,
        default=(),
        help="where replicas may be added at run time (the token goes to them): "
        "comma-separated host globs with an optional :PORT (*.hf.jobs, 10.0.0.5:8000) or "
        "networks (10.0.0.0/8), each optionally after the one scheme it admits "
        "(https://*.hf.jobs); names are not resolved, and a network or a glob written like an "
        "IP address (10.0.0.*) admits IP literals only; an https replica is never added as "
        "http (default: only the scheme, host and port of each --replicas URL)",
    )

    g = p.add_argument_group(
        "discovery (members join and leave at run time; needs --replica-hosts)"
    )
    g.add_argument(
        "--replicas-file",
        dest="replicas_files",
        metavar="PATH",
        action="append",
        default=[],
        help="a file of replica URLs, one a line (# comments), re-read when it changes",
    )
    g.add_argument(
        "--replicas-dns",
        metavar="NAME:PORT",
        action="append",
        default=[],
        help="a DNS name whose A/AAAA records are replicas on PORT (a headless Service)",
    )
    g.add_argument(
        "--replicas-srv",
        metavar="NAME",
        action="append",
        default=[],
        help="a DNS name whose SRV records give the replicas' hosts and ports",
    )
    g.add_argument(
        "--dns-server",
        metavar="HOST:PORT",
        default=d.dns_server,
        help="the resolver to ask (default: the system's)",
    )
    g.add_argument(
        "--dns-interval",
        type=float,
        default=d.dns_interval,
        help="seconds between resolutions of --replicas-dns/--replicas-srv",
    )
    g.add_argument(
        "--discovery-grace",
        type=float,
        default=d.discovery_grace,
        help="seconds a member may be missing from every source before it drains and leaves",
    )

    g = p.add_argument_group("listening")
    g.add_argument("--host", default=d.host, help="address to listen on")
    g.add_argument("--port", type=int, default=d.port, help="port to listen on")
    g.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="environment variable holding the key clients must send as a bearer "
        "token; needed to listen beyond loopback; GET /health and /ping stay open. TRL sends "
        "no key: keep the router on the trainer's loopback (default: none, no key asked)",
    )
    g.add_argument(
        "--insecure-listen",
        action="store_true",
        help="allow listening beyond loopback without --api-key-env",
    )
    g.add_argument(
        "--forward-path",
        metavar="PATH",
        action="append",
        dest="forward_paths",
        help="forward this path, any method, to one replica as it is (repeatable; e.g. "
        "/v1/embeddings); not a path the router routes, broadcasts, refuses or answers itself "
        "(default: none, only vLLM's read-only routes are forwarded)",
    )

    g = p.add_argument_group("routing")
    g.add_argument(
        "--policy",
        choices=POLICIES,
        default=d.policy,
        help="how completions pick a replica (kv: prefix, with new families sent where "
        "the replicas' KV events say their prefix is)",
    )
    g.add_argument(
        "--kv-events",
        default=d.kv_events,
        metavar="WHERE",
        help="with --policy kv, where replicas publish KV events: auto (each replica's "
        "/kv_event_sources), off, or tcp://{host}:PORT[,tcp://{host}:REPLAY_PORT]",
    )
    g.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per KV block for routing keys (default: the replicas' "
        "cache_config.block_size, else 16)",
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
    g.add_argument(
        "--move-price",
        type=int,
        default=d.move_price,
        help="a family's first later turn leaves its home for the next replica on the "
        "family's ring path when the home holds more work (prompt tokens to compute, plus "
        "800 per request in flight) by more than this many times the turn's prompt tokens, "
        "plus 800 (0: later turns stay up to the follow cap)",
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
    g.add_argument(
        "--pace",
        action=argparse.BooleanOptionalAction,
        default=d.pace,
        help="weigh each replica by its decode step (vllm:inter_token_latency_seconds on its "
        "/metrics) and deal a slower one fewer new prompt families (a fleet with a slow GPU); "
        "on by default, --no-pace deals every replica alike",
    )
    g.add_argument(
        "--session-ttl",
        type=float,
        default=d.session_ttl,
        metavar="SECONDS",
        help="a session named by X-Session-ID (prime-rl, SkyRL, NeMo Gym; TRL sends none) is "
        "forgotten after this long without a request; POST /finish_session releases it sooner",
    )
    g.add_argument(
        "--max-sessions",
        type=int,
        default=d.max_sessions,
        help="sessions kept at most (about 250 bytes each); one more forgets the least "
        "recently used",
    )

    g = p.add_argument_group("timeouts (seconds)")
    g.add_argument(
        "--connect-timeout",
        type=float,
        default=d.connect_timeout,
        help="time to open a connection to a replica",
    )
    g.add_argument(
        "--first-byte-timeout",
        type=float,
        default=d.first_byte_timeout,
        help="wait for a replica's whole response head from the send (long prefills, "
        "/pause?mode=wait), and at most this long for one of its --max-upstream-connections",
    )
    g.add_argument(
        "--idle-timeout",
        type=float,
        default=d.idle_timeout,
        help="wait between two response bytes of a replica, counted while the client reads; a "
        "client that reads nothing of its answer this long is dropped",
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
    limits = {  # each an int flag of the same name as its Config field
        "max_body_bytes": "largest request body a client may send (413 beyond)",
        "max_header_bytes": "largest request head a client may send (431 beyond)",
        "max_headers": "most header fields in one request (431 beyond)",
        "max_connections": f"open client connections (default: {MAX_CONNECTIONS_CAP:,}, or "
        f"less where `ulimit -n` would run out first: half of the open-file limit less "
        f"{FD_RESERVE}, as each may hold a connection to a replica; here %(default)s)",
        "max_buffered_bytes": "request body bytes held at once over all client connections, "
        "each body counted from its head (its Content-Length) until its answer begins (503 "
        "with Retry-After beyond; at least --max-body-bytes)",
        "max_prompt_tokens": "most token ids a completion may carry, a batch's prompts counted "
        "together (400 beyond); text and chat prompts are routed on their first 4 bytes a "
        "token of it and forwarded whole",
        "max_upstream_connections": "requests in flight to one replica; more wait for one, at "
        "most --first-byte-timeout, then are tried on another replica (503 when none is left)",
        "control_connections": "control-plane connections open to one replica at once (health "
        "checks, listings, broadcasts, scrapes); more calls wait for one",
        "max_replicas": "members at once, from --replicas, discovery and POST /router/replicas "
        "(beyond: a discovered member waits for room, an added one is refused 409)",
    }
    for name, text in limits.items():
        g.add_argument("--" + name.replace("_", "-"), type=int, default=getattr(d, name), help=text)
    g.add_argument(
        "--retries",
        type=int,
        default=d.retries,
        help="other replicas tried when one fails, or answers 5xx, before a byte reached the "
        "client",
    )
    g.add_argument(
        "--retry-budget",
        type=float,
        default=d.retry_budget,
        metavar="SHARE",
        help="counted retries of a 5xx (made while most of the fleet fails, or onto a failing "
        "replica) allowed below this share of the routed requests of the last 10 s (10 per "
        "10 s always are), so a sick fleet is not hammered; a retry off one sick replica onto "
        "a healthy one is free",
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
        "--control-timeout",
        type=float,
        default=d.control_timeout,
        help="longest a replica may take to answer one control call (pause, resume, unload, "
        "reset, one load attempt); one that does not is ejected and the call goes on without "
        "it (raise it for /pause?mode=wait, which waits for the requests running)",
    )
    g.add_argument(
        "--unload-stale",
        metavar="PATTERN",
        help="at start, unload adapters matching this glob (e.g. 'trl-policy-*') "
        "left on reused replicas (default: unload nothing)",
    )
    g.add_argument(
        "--unload-wait",
        type=float,
        default=d.unload_wait,
        help="longest an unload waits for the requests admitted under the name to be answered "
        "before it is broadcast (the client is answered at once meanwhile)",
    )
    g.add_argument(
        "--down-replica-policy",
        choices=("replay", "fail"),
        default=d.down_replica_policy,
        help="a replica down during a load: proceed and replay on return, or fail",
    )

    g = p.add_argument_group("health")
    g.add_argument(
        "--min-replicas",
        type=int,
        default=d.min_replicas,
        help="/health answers 503 while fewer replicas are in service (for an operator who "
        "would rather stop the trainer than train on fewer GPUs)",
    )
    g.add_argument(
        "--health-interval",
        type=float,
        default=d.health_interval,
        help="seconds between two active /health checks of a replica",
    )
    g.add_argument(
        "--health-timeout",
        type=float,
        default=d.health_timeout,
        help="seconds a /health check may take before it counts as failed",
    )
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
        "--stall-timeout",
        type=float,
        default=d.stall_timeout,
        help="seconds a serving replica may compute no token (its /metrics) while the router "
        "holds requests on it and the fleet is not paused, before it is ejected as stalled (an "
        "engine that hangs while its /health answers); it returns once it answers a one-token "
        "completion (0: never); also the longest silence of a stream under way on a replica "
        "out of service (0: --idle-timeout)",
    )
    g.add_argument(
        "--breaker-failures",
        type=int,
        default=d.breaker_failures,
        help="consecutive request failures that open a replica's circuit breaker",
    )
    g.add_argument(
        "--breaker-cooldown",
        type=float,
        default=d.breaker_cooldown,
        help="seconds an open circuit breaker waits before letting one request try",
    )
    g.add_argument(
        "--scrape-budget",
        type=int,
        default=d.scrape_budget,
        help="replicas whose /metrics are read per health interval, round robin (a report is "
        "at most ceil(replicas / budget) intervals old)",
    )

    g = p.add_argument_group("visibility")
    g.add_argument(
        "--log-level",
        default=d.log_level,
        choices=("debug", "info", "warning", "error"),
        help="how much the router logs (debug: one line per routing decision)",
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
    try:
        urls = (args.replicas or "").split(",")
        replicas = tuple(ReplicaAddress.parse(u) for u in urls if u.strip())
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if not replicas and not (args.replicas_files or args.replicas_dns or args.replicas_srv):
        # Asked first: which replicas comes before how to reach them.
        raise UsageError(
            "--replicas is required: a comma-separated list of replica URLs (or name a "
            "--replicas-file, --replicas-dns or --replicas-srv; lora-router --demo tries it "
            "without any)"
        )
    token = api_key = Secret("")
    if args.token_env and args.no_token:
        raise UsageError("--token-env and --no-token contradict each other: give one of them")
    try:
        if args.token_env:
            token = secret_from_env("--token-env", args.token_env, environ)
        elif not args.no_token:
            raise UsageError("give --token-env NAME (the replicas' bearer token) or --no-token")
        if args.api_key_env:
            api_key = secret_from_env("--api-key-env", args.api_key_env, environ)
        # Every other Config field is a flag of the same name.
        given = vars(args)
        flags = {f.name: given[f.name] for f in fields(Config) if f.name not in _DERIVED}
        lists: dict[str, Any] = {name: tuple(given[name] or ()) for name in _LISTS}
        config = Config(
            replicas=replicas,
            token=token,
            token_env=args.token_env or "",
            api_key=api_key,
            **lists,
            **flags,
        )
    except ValueError as exc:  # each message names the flag
        raise UsageError(str(exc)) from None
    return config


# Parsed or read from the environment, not taken as they are.
_LISTS = ("forward_paths", "replicas_files", "replicas_dns", "replicas_srv")  # repeatable flags
_DERIVED = frozenset({"replicas", "token", "token_env", "api_key", *_LISTS})


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(p.strip() for p in text.split(",") if p.strip())


async def serve_until_signal(config: Config) -> signal.Signals:
    """Run the router until SIGTERM/SIGINT, then drain in-flight requests; the signal.

    The signals are caught from before start-up: one that arrives while the router is still
    discovering its replicas abandons the start and stops what was started. Once it serves,
    the first signal says what the stop waits for; a second exits at once (status 130)."""
    from lora_router.runtime import RouterRuntime

    runtime = RouterRuntime(config)
    received = first_signal(signal.SIGTERM, signal.SIGINT)
    starting = asyncio.ensure_future(runtime.start())
    await asyncio.wait((starting, received), return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await runtime.stop()
        return received.result()
    starting.result()  # a ListenError ends the command here
    sig = await received
    again = first_signal(signal.SIGTERM, signal.SIGINT)
    requests, broadcasts = runtime.in_flight()
    waits = f"{requests} request(s) and {broadcasts} control call(s) in flight"
    if sig == signal.SIGTERM:
        log.info("stopping: no new connections; %s get up to %gs", waits, config.shutdown_grace)
    elif requests or broadcasts:  # Ctrl-C at a terminal: say what it waits for, and the way out
        print(
            f"lora-router: stopping: waiting up to {config.shutdown_grace:g} s "
            f"(--shutdown-grace) for {waits}; Ctrl-C again to exit now",
            file=sys.stderr,
            flush=True,
        )
    stopping = asyncio.ensure_future(runtime.stop(grace=config.shutdown_grace))
    await asyncio.wait((stopping, again), return_when=asyncio.FIRST_COMPLETED)
    if not stopping.done():  # a second signal: exit at once, nothing more is awaited
        logging.shutdown()
        os._exit(interrupted("lora-router"))
    stopping.result()
    return sig


def demo_router_flags(
    parser: argparse.ArgumentParser, args: argparse.Namespace, allowed: Sequence[str]
) -> dict[str, object]:
    """The routing flags given with `--demo` (the `allowed` Config fields), checked like a
    real fleet's; UsageError for any other flag, which the demo would otherwise ignore."""
    defaults = vars(parser.parse_args([]))
    given = [k for k, v in vars(args).items() if k != "demo" and v != defaults[k]]
    other = [k for k in given if k not in allowed]
    if other:
        shown = ", ".join("--" + k.replace("_", "-") for k in other)
        flags = ", ".join("--" + k.replace("_", "-") for k in allowed)
        raise UsageError(
            f"--demo starts its own emulated replicas and router, so {shown} "
            f"{'has' if len(other) == 1 else 'have'} no meaning there; besides its own flags "
            f"(lora-router --demo --help) it takes only the routing flags ({flags})"
        )
    # The same checks as for a real fleet, on a stand-in replica list.
    stand_in = argparse.Namespace(
        **{**vars(args), "replicas": "http://127.0.0.1:9", "no_token": True}
    )
    build_config(stand_in, {})
    return {k: getattr(args, k) for k in given}


def run_demo(parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    """`lora-router --demo ...`: the demo's own flags (its usage line) and the routing flags
    its router takes, in any order; `--help` after `--demo` is the demo's."""
    from lora_router.tools import demo_command as demo

    own, rest = demo.build_parser().parse_known_args([a for a in argv if a != "--demo"])
    routing = demo_router_flags(parser, parser.parse_args([*rest, "--demo"]), demo.ROUTER_FLAGS)
    return demo.demo_command(own, router=routing)


def main(argv: Sequence[str] | None = None) -> int:
    """Every command of `lora-router`; Ctrl-C ends any of them with one line and status 130."""
    try:
        return _command(sys.argv[1:] if argv is None else list(argv))
    except KeyboardInterrupt:
        return interrupted("lora-router")


def _command(argv: list[str]) -> int:
    if argv[:1] == ["top"]:  # a subcommand; every other form is the router's own flags
        from lora_router.tools.top import main as top

        return top(argv[1:])
    parser = build_parser()
    try:
        if "--demo" in argv:
            return run_demo(parser, argv)
        args = parser.parse_args(argv)
        config = build_config(args, os.environ)
    except UsageError as exc:
        print(f"lora-router: error: {exc}", file=sys.stderr)
        return 2
    if args.check:
        from lora_router.tools.check import run_check

        return run_check(config)
    logging.basicConfig(
        level=config.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    import uvloop

    from lora_router.runtime import ListenError

    try:
        ended_by = uvloop.run(serve_until_signal(config))
    except ListenError as exc:
        print(f"lora-router: error: {exc}", file=sys.stderr)
        return 2
    return interrupted("lora-router") if ended_by == signal.SIGINT else 0


if __name__ == "__main__":
    sys.exit(main())
