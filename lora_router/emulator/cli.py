"""`lora-router-emulator` / `python -m lora_router.emulator`: run one emulated replica.

The flags are named after `vllm serve`'s where one exists (`--max-loras`, `--max-lora-rank`,
`--api-key`, `--block-size`, ...); the rest set the timing model and the faults in force at
start. Faults can be changed later over HTTP: `POST /emulator/faults` with a JSON object of
switches (`GET` shows them), `POST /emulator/restart` forgets every adapter.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import ssl
import sys
from collections.abc import Sequence

import uvloop

from lora_router.command import HelpFormatter, Parser, first_signal, interrupted
from lora_router.emulator.config import PROFILES, SUPPORTED_VERSIONS, EmulatorConfig
from lora_router.emulator.faults import Faults
from lora_router.emulator.kv_events import KVEventsConfig
from lora_router.emulator.server import start_emulator

# The end of `--help`: how the emulator is used with the router.
EXAMPLES = """\
examples:
  lora-router-emulator --port 9001 &    two replicas to put a router in front of
  lora-router-emulator --port 9002 --mount-lag 2 &
  lora-router --replicas http://127.0.0.1:9001,http://127.0.0.1:9002 --no-token
  curl -s localhost:9001/emulator/faults -d '{"dead": true}'    a fault, at run time
"""


def build_parser() -> argparse.ArgumentParser:
    c, f = EmulatorConfig(), Faults()  # the defaults, written once
    p = Parser(
        prog="lora-router-emulator",
        description="An emulated vLLM replica (LoRA runtime updating + dev mode), no GPU "
        "needed.\nFlags named like vllm serve's mean what they mean there.",
        epilog=EXAMPLES,
        formatter_class=HelpFormatter,
    )
    g = p.add_argument_group("listening")
    g.add_argument("--host", default=c.host, help="address to listen on")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* (default: none, nothing asked)",
    )
    g.add_argument(
        "--ssl-certfile",
        default=None,
        help="serve https with this certificate (default: plain http)",
    )
    g.add_argument(
        "--ssl-keyfile",
        default=None,
        help="the certificate's private key (default: read from --ssl-certfile)",
    )
    g.add_argument(
        "--fast",
        action="store_true",
        help="pre-rendered answers on a raw protocol (for benchmarks)",
    )

    g = p.add_argument_group("model and vLLM version")
    g.add_argument("--model", default=c.model, help="the served model's name (vllm serve MODEL)")
    g.add_argument(
        "--max-model-len", type=int, default=c.max_model_len, help="context length in tokens"
    )
    g.add_argument(
        "--vllm-version",
        choices=SUPPORTED_VERSIONS,
        default=c.vllm_version,
        help="the vLLM release line whose answers to reproduce: 0.32, the one the docs and "
        "tests/vllm were checked against; 0.27 and 0.33 where they differ from it (pausing, "
        "keep-alive comments, prefix-cache keys, length checks; see emulator/config.py)",
    )
    g.add_argument(
        "--max-lora-rank", type=int, default=c.max_lora_rank, help="largest adapter rank loaded"
    )
    g.add_argument(
        "--max-loras", type=int, default=c.max_loras, help="adapters a batch may use (GPU slots)"
    )
    g.add_argument(
        "--max-cpu-loras",
        type=int,
        default=c.max_cpu_loras,
        help="adapters kept loaded; beyond it the least recently used is evicted "
        "(default: --max-loras, as vLLM)",
    )
    g.add_argument("--no-lora", action="store_true", help="serve without --enable-lora")
    g.add_argument(
        "--no-runtime-lora-updating",
        action="store_true",
        help="as without VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 (adapter routes 404)",
    )
    g.add_argument(
        "--no-dev-mode",
        action="store_true",
        help="as without VLLM_SERVER_DEV_MODE=1 (/pause, /resume ... 404)",
    )
    g.add_argument(
        "--enable-scale-out",
        action="store_true",
        help="as vLLM's --enable-scale-out (/inference/v1/abort_requests; else 403)",
    )
    g.add_argument(
        "--no-prompt-tokens-details",
        action="store_true",
        help="as without --enable-prompt-tokens-details (usage.prompt_tokens_details is null)",
    )
    g.add_argument(
        "--sse-keep-alive-interval",
        type=float,
        default=c.sse_keepalive_s,
        help="seconds between ': keep-alive' comments on an idle stream, 0: never "
        "(default: never on 0.32, 15 on 0.33; 0.27 sends none)",
    )

    g = p.add_argument_group("engine model")
    g.add_argument("--block-size", type=int, default=c.block_size, help="tokens per KV block")
    g.add_argument(
        "--cache-blocks", type=int, default=c.cache_blocks, help="prefix-cache capacity in blocks"
    )
    g.add_argument(
        "--kv-events-config",
        type=KVEventsConfig.parse,
        default=None,
        metavar="JSON",
        help="publish KV-cache events over ZMQ as vLLM 0.32 does, e.g. "
        '\'{"enable_kv_cache_events":true,"endpoint":"tcp://*:5557"}\' (default: off)',
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=c.max_num_seqs, help="sequences running at once"
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=c.max_num_batched_tokens,
        help="tokens one engine step computes at most (decodes first, then prefill chunks)",
    )
    g.add_argument(
        "--profile",
        choices=sorted(PROFILES),
        default=None,
        help="measured step costs (tiny-cpu: vLLM's CPU build on the tier's tiny model); "
        "the three cost flags below override its values (default: every cost 0)",
    )
    g.add_argument(
        "--prefill-s-per-token",
        type=float,
        default=None,
        help=f"seconds per prompt token not found in the prefix cache (default: "
        f"{c.prefill_s_per_token})",
    )
    g.add_argument(
        "--decode-s-per-token",
        type=float,
        default=None,
        help=f"seconds a step takes to decode one sequence (default: {c.decode_s_per_token})",
    )
    g.add_argument(
        "--decode-s-per-seq",
        type=float,
        default=None,
        help=f"seconds each further decoding sequence adds to a step (default: "
        f"{c.decode_s_per_seq})",
    )
    g.add_argument(
        "--speed",
        type=float,
        default=c.speed,
        help="this replica's relative speed: every step cost is divided by it (0.5: half speed)",
    )
    g.add_argument(
        "--adapter-load-s",
        type=float,
        default=c.adapter_load_s,
        help="time to re-read an evicted adapter",
    )
    g.add_argument(
        "--mean-output-tokens",
        type=int,
        default=c.mean_output_tokens,
        help="mean completion length before the end-of-sequence token",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=c.seed,
        help="makes the samples of requests that carry no seed the same from run to run",
    )

    g = p.add_argument_group("faults (also at run time: POST /emulator/faults)")
    g.add_argument(
        "--mount-lag",
        type=int,
        default=f.mount_lag,
        help="first K load attempts of each path answer 404 'No adapter found'",
    )
    g.add_argument(
        "--load-failures",
        type=int,
        default=f.load_failures,
        help="the next N loads answer 500 (-1: all)",
    )
    g.add_argument(
        "--load-delay", type=float, default=f.load_delay_s, help="seconds every load takes"
    )
    g.add_argument(
        "--error-rate", type=float, default=f.error_rate, help="share of completions answered 5xx"
    )
    g.add_argument(
        "--error-status",
        type=int,
        default=f.error_status,
        help="the status of the completions --error-rate fails",
    )
    g.add_argument(
        "--error-seed",
        type=int,
        default=f.error_seed,
        help="makes the sequence of failed completions reproducible (default: none, a new "
        "sequence each run)",
    )
    g.add_argument(
        "--stall",
        action="store_true",
        help='completions hang until released (POST /emulator/faults {"stall":false})',
    )
    g.add_argument(
        "--crash-after-frames",
        type=int,
        default=f.crash_after_frames,
        help="cut streams after N SSE frames, non-streamed answers before they are sent "
        "(default: never)",
    )
    g.add_argument("--dead", action="store_true", help="engine dead: /health answers 503")
    g.add_argument(
        "--restart-every",
        type=float,
        default=None,
        help="restart (forgetting adapters) every S seconds (default: never)",
    )
    return p


def config_from_args(args: argparse.Namespace) -> EmulatorConfig:
    context = None
    if args.ssl_certfile:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    faults = Faults(
        mount_lag=args.mount_lag,
        load_failures=args.load_failures,
        load_delay_s=args.load_delay,
        error_rate=args.error_rate,
        error_status=args.error_status,
        error_seed=args.error_seed,
        stall=args.stall,
        crash_after_frames=args.crash_after_frames,
        dead=args.dead,
    )
    costs = PROFILES[args.profile] if args.profile else EmulatorConfig().step_costs
    return EmulatorConfig(
        host=args.host,
        port=args.port,
        ssl=context,
        api_key=args.api_key,
        model=args.model,
        max_model_len=args.max_model_len,
        vllm_version=args.vllm_version,
        enable_lora=not args.no_lora,
        runtime_lora_updating=not args.no_runtime_lora_updating,
        dev_mode=not args.no_dev_mode,
        enable_scale_out=args.enable_scale_out,
        prompt_tokens_details=not args.no_prompt_tokens_details,
        max_lora_rank=args.max_lora_rank,
        max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras,
        block_size=args.block_size,
        cache_blocks=args.cache_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        prefill_s_per_token=_given(args.prefill_s_per_token, costs.prefill_s_per_token),
        decode_s_per_token=_given(args.decode_s_per_token, costs.decode_s_per_token),
        decode_s_per_seq=_given(args.decode_s_per_seq, costs.decode_s_per_seq),
        speed=args.speed,
        adapter_load_s=args.adapter_load_s,
        mean_output_tokens=args.mean_output_tokens,
        seed=args.seed,
        sse_keepalive_s=args.sse_keep_alive_interval,
        fast=args.fast,
        kv_events_config=args.kv_events_config,
        faults=faults,
        record_requests=False,
    )


def _given(flag: float | None, default: float) -> float:
    return default if flag is None else flag


async def run(config: EmulatorConfig, restart_every: float | None) -> signal.Signals:
    """Serve until SIGINT or SIGTERM, then stop; the signal that ended it (one that arrives
    during the start stops the emulator as soon as it has started)."""
    stopped = first_signal(signal.SIGINT, signal.SIGTERM)
    emulator = await start_emulator(config)
    mode = "fast" if config.fast else "full"
    print(
        f"lora-router-emulator ({mode}, vLLM {config.release}) serving {config.model} "
        f"on {emulator.url}",
        flush=True,
    )
    try:
        while not stopped.done():
            try:
                await asyncio.wait_for(asyncio.shield(stopped), timeout=restart_every)
            except TimeoutError:
                await emulator.restart()
                print("restarted: every adapter forgotten", flush=True)
    finally:
        await emulator.stop()
    return stopped.result()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        config = config_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"lora-router-emulator: {exc}", file=sys.stderr)
        return 2
    try:
        ended_by = uvloop.run(run(config, args.restart_every))
    except OSError as exc:
        print(f"lora-router-emulator: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the loop caught the signals
        ended_by = signal.SIGINT
    return interrupted("lora-router-emulator") if ended_by == signal.SIGINT else 0
