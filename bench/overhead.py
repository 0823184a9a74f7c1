"""Proxy overhead: lora-router against direct, nginx proxy_pass and the Rust routers, one run.

Method (the one vllm-router documents, and shared/docs/anchors.md uses): replicas that answer
instantly (nginx returning a fixed body), closed loops at concurrency 1 and 64 (wrk), a warm-up
then a timed window; every contender is measured in the same session, interleaved round by
round, and the report quotes medians over rounds and ratios, not single absolute figures. Each
proxy is pinned to core 0; the replicas and wrk share core 1.

Scenarios: one 512-token rollout request sent over and over (`json`, `sse`: every request is a
sibling of the first), and `grpo`, the trainer's real pattern: 4,096 distinct prompts, each sent
as G = 8 identical requests in a row, so one request in eight is a prompt nobody has seen.

Reported per contender and scenario: requests/s, p50/p99 latency and the p50 added over direct,
proxy CPU µs per request (from /proc), peak RSS.

    python bench/overhead.py                       # all contenders that are installed
    python bench/overhead.py --rounds 1 --seconds 2 --only lora-router,nginx

Peers are found on PATH or in --peers-bin (bench/peers.sh installs them into bench/.peers).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (
    Procs,
    cpu_seconds,
    find_binary,
    free_port,
    nginx_proxy,
    nginx_replica,
    peak_rss_mib,
    wait_port,
    wrk,
)

MODEL = "Qwen/Qwen2.5-Math-1.5B"
PROXY_CPU, LOAD_CPU = "0", "1"


def completion_body(tokens: int, stream: bool, text: bool, variant: int = 0) -> bytes:
    """A rollout request; each `variant` is a different prompt from its first token on."""
    prompt: object = (
        f"p{variant} " + " ".join(f"w{i % 997}" for i in range(tokens - 1))
        if text
        else [(i * 7919 + variant * 104_729) % 151_000 for i in range(tokens)]
    )
    body = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 1.0,
        "stream": stream,
    }
    return json.dumps(body).encode()


def json_reply() -> str:
    choice = {
        "index": 0,
        "text": " The answer is 42.",
        "logprobs": None,
        "finish_reason": "length",
        "token_ids": [576, 4226, 374, 220, 19, 17, 13, 151643, 576, 4226, 374, 220, 19, 17, 13, 0],
    }
    reply = {
        "id": "cmpl-bench",
        "object": "text_completion",
        "created": 1_700_000_000,
        "model": MODEL,
        "choices": [choice],
        "usage": {"prompt_tokens": 512, "completion_tokens": 16, "total_tokens": 528},
    }
    return json.dumps(reply, separators=(",", ":"))


def sse_reply(events: int) -> str:
    frames = []
    for i in range(events):
        chunk = {
            "id": "cmpl-bench",
            "object": "text_completion",
            "created": 1_700_000_000,
            "model": MODEL,
            "choices": [{"index": 0, "text": f" t{i}", "logprobs": None, "finish_reason": None}],
        }
        frames.append("data: " + json.dumps(chunk, separators=(",", ":")) + "\n\n")
    frames.append("data: [DONE]\n\n")
    return "".join(frames)


@dataclass
class Contender:
    name: str
    start: Callable[[Procs, int, list[int]], int | None]  # returns the pid to measure
    text_prompts: bool = False
    port: int = 0
    pid: int | None = None


@dataclass
class Sample:
    contender: str
    scenario: str
    round: int
    rps: float
    p50_us: int
    p99_us: int
    errors: int
    cpu_us_per_req: float | None
    added_p50_us: float | None = None


@dataclass
class Report:
    command: str
    date: str
    samples: list[Sample] = field(default_factory=list)
    rss_mib: dict[str, float] = field(default_factory=dict)


def contenders(peers_bin: Path) -> list[Contender]:
    def direct(procs: Procs, port: int, replicas: list[int]) -> int | None:
        return None

    def nginx(procs: Procs, port: int, replicas: list[int]) -> int | None:
        return nginx_proxy(procs, port, replicas, PROXY_CPU).pid

    def lora_router(procs: Procs, port: int, replicas: list[int]) -> int | None:
        urls = ",".join(f"http://127.0.0.1:{p}" for p in replicas)
        argv = [
            sys.executable,
            "-m",
            "lora_router.cli",
            "--replicas",
            urls,
            "--no-token",
            "--port",
            str(port),
            "--log-level",
            "warning",
        ]
        return procs.start(argv, cpus=PROXY_CPU).pid

    found: list[Contender] = [
        Contender("direct", direct),
        Contender("nginx", nginx),
        Contender("lora-router", lora_router),
    ]
    vllm_router = find_binary("vllm-router", peers_bin)
    if vllm_router:

        def start_vllm(procs: Procs, port: int, replicas: list[int]) -> int | None:
            argv = [
                vllm_router,
                "--worker-urls",
                *(f"http://127.0.0.1:{p}" for p in replicas),
                "--policy",
                "consistent_hash",
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                "--log-level",
                "warning",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
            ]
            return procs.start(argv, cpus=PROXY_CPU).pid

        found.append(Contender("vllm-router", start_vllm))
    sglang_router = find_binary("sglang-router", peers_bin)
    if sglang_router:

        def start_sglang(procs: Procs, port: int, replicas: list[int]) -> int | None:
            argv = [
                sglang_router,
                "launch",
                "--worker-urls",
                *(f"http://127.0.0.1:{p}" for p in replicas),
                "--policy",
                "round_robin",
                "--port",
                str(port),
                "--host",
                "127.0.0.1",
                "--log-level",
                "warn",
                "--prometheus-host",
                "127.0.0.1",
                "--prometheus-port",
                str(free_port()),
            ]
            return procs.start(argv, cpus=PROXY_CPU).pid

        # sglang-router rejects token-id prompts on /v1/completions; it gets text prompts.
        found.append(Contender("sglang-router", start_sglang, text_prompts=True))
    return found


SCENARIOS = {  # name: (concurrency, streamed reply, GRPO groups)
    "json c=1": (1, False, False),
    "json c=64": (64, False, False),
    "grpo c=64": (64, False, True),
    "sse c=64": (64, True, False),
}
GROUP = 8  # G: the identical requests of one prompt in the "grpo" scenario
PROMPTS = 4096  # distinct prompts it cycles through, more than any cache here keeps


def run(args: argparse.Namespace) -> Report:
    report = Report(command=" ".join(["python", *sys.argv]), date=time.strftime("%Y-%m-%d %H:%M"))
    chosen = [
        c
        for c in contenders(Path(args.peers_bin))
        if not args.only or c.name in args.only.split(",")
    ]
    print("contenders:", ", ".join(c.name for c in chosen), flush=True)
    bar = tqdm(total=len(SCENARIOS) * args.rounds * len(chosen), unit="run")
    for scenario, (conns, stream, groups) in SCENARIOS.items():
        procs = Procs()
        try:
            reply = sse_reply(args.sse_events) if stream else json_reply()
            ctype = "text/event-stream; charset=utf-8" if stream else "application/json"
            replicas = [free_port(), free_port()]
            for port in replicas:
                nginx_replica(procs, port, reply, ctype, LOAD_CPU)
            for c in chosen:
                c.port = replicas[0] if c.name == "direct" else free_port()
                c.pid = c.start(procs, c.port, replicas)
                try:
                    wait_port(c.port, timeout=60)
                except RuntimeError:
                    sys.exit(f"{c.name} did not start:\n{procs.log_tail(c.pid or 0)}")
            bodies: dict[bool, bytes | list[bytes]] = {
                text: (
                    [completion_body(args.tokens, stream, text, p) for p in range(PROMPTS)]
                    if groups
                    else completion_body(args.tokens, stream, text)
                )
                for text in (False, True)
            }
            for rnd in range(args.rounds):
                order = chosen[rnd % len(chosen) :] + chosen[: rnd % len(chosen)]
                direct_p50: float | None = None
                round_samples = []
                for c in order:
                    url = f"http://127.0.0.1:{c.port}/v1/completions"
                    body = bodies[c.text_prompts]
                    wrk(
                        url,
                        body,
                        connections=conns,
                        seconds=args.warmup,
                        tmp=procs.tmp,
                        cpus=LOAD_CPU,
                        repeat=GROUP,
                    )
                    cpu0 = cpu_seconds(c.pid) if c.pid else 0.0
                    res = wrk(
                        url,
                        body,
                        connections=conns,
                        seconds=args.seconds,
                        tmp=procs.tmp,
                        cpus=LOAD_CPU,
                        repeat=GROUP,
                    )
                    cpu = (
                        (cpu_seconds(c.pid) - cpu0) * 1e6 / max(res.requests, 1) if c.pid else None
                    )
                    sample = Sample(
                        c.name, scenario, rnd, res.rps, res.p50_us, res.p99_us, res.errors, cpu
                    )
                    round_samples.append(sample)
                    if c.name == "direct":
                        direct_p50 = res.p50_us
                    bar.update(1)
                    bar.write(
                        f"  {scenario:10} round {rnd} {c.name:14} {res.rps:9.0f} req/s "
                        f"p50 {res.p50_us:6d} us  p99 {res.p99_us:6d} us  errors {res.errors}"
                        + (f"  cpu {cpu:6.1f} us/req" if cpu is not None else "")
                    )
                for sample in round_samples:
                    if direct_p50 is not None:
                        sample.added_p50_us = sample.p50_us - direct_p50
                report.samples.extend(round_samples)
            for c in chosen:
                if c.pid:
                    report.rss_mib[c.name] = max(
                        report.rss_mib.get(c.name, 0.0), peak_rss_mib(c.pid)
                    )
        finally:
            procs.close()
    bar.close()
    return report


def summarise(report: Report) -> list[dict[str, object]]:
    rows = []
    keys = sorted(
        {(s.scenario, s.contender) for s in report.samples},
        key=lambda k: (list(SCENARIOS).index(k[0]), k[1]),
    )
    for scenario, name in keys:
        mine = [s for s in report.samples if s.scenario == scenario and s.contender == name]
        cpu = [s.cpu_us_per_req for s in mine if s.cpu_us_per_req is not None]
        added = [s.added_p50_us for s in mine if s.added_p50_us is not None]
        rows.append(
            {
                "scenario": scenario,
                "contender": name,
                "rps": statistics.median(s.rps for s in mine),
                "p50_us": statistics.median(s.p50_us for s in mine),
                "p99_us": statistics.median(s.p99_us for s in mine),
                "added_p50_us": statistics.median(added) if added else None,
                "cpu_us_per_req": statistics.median(cpu) if cpu else None,
                "errors": sum(s.errors for s in mine),
                "peak_rss_mib": report.rss_mib.get(name),
            }
        )
    return rows


def markdown(report: Report, rows: list[dict[str, object]]) -> str:
    out = [
        f"# Proxy overhead ({report.date})",
        "",
        f"Command: `{report.command}`",
        "",
        "| scenario | contender | req/s | p50 µs | added p50 µs | p99 µs | CPU µs/req "
        "| peak RSS MiB | errors |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]

    def fmt(v: object, spec: str) -> str:
        return "—" if v is None else format(v, spec)

    for r in rows:
        out.append(
            f"| {r['scenario']} | {r['contender']} | {fmt(r['rps'], ',.0f')} | "
            f"{fmt(r['p50_us'], '.0f')} | {fmt(r['added_p50_us'], '.0f')} | "
            f"{fmt(r['p99_us'], '.0f')} | {fmt(r['cpu_us_per_req'], '.1f')} | "
            f"{fmt(r['peak_rss_mib'], '.0f')} | {r['errors']} |"
        )
    return "\n".join(out) + "\n"


CONTENDER_ORDER = ["direct", "nginx", "lora-router", "vllm-router", "sglang-router"]


def _value(rows: list[dict[str, object]], scenario: str, name: str, field: str) -> float:
    for r in rows:
        if r["scenario"] == scenario and r["contender"] == name and r[field] is not None:
            return float(r[field])  # type: ignore[arg-type]
    return 0.0


def plot(rows: list[dict[str, object]], out: Path) -> None:
    """overhead.png: throughput by contender and scenario; overhead_latency.png: p50 and p99
    latency by contender at concurrency 1 and 64 (the distribution's middle and tail)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    scenarios = list(SCENARIOS)
    names = sorted({str(r["contender"]) for r in rows}, key=CONTENDER_ORDER.index)
    colors = ["#d62728" if n == "lora-router" else "#999" for n in names]
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4.2 * len(scenarios), 3.6))
    for ax, scenario in zip(axes, scenarios, strict=True):
        ax.bar(names, [_value(rows, scenario, n, "rps") for n in names], color=colors)
        ax.set_title(scenario)
        ax.set_ylabel("responses/s" if scenario.startswith("sse") else "requests/s")
        ax.tick_params(axis="x", rotation=35)
    fig.suptitle("Proxy throughput, instant replicas, proxy pinned to one core (median of rounds)")
    fig.tight_layout()
    fig.savefig(out / "overhead.png", dpi=110)
    plt.close(fig)

    latency_scenarios = [s for s in scenarios if s.startswith("json")]
    fig, axes = plt.subplots(1, len(latency_scenarios), figsize=(5.2 * len(latency_scenarios), 3.6))
    width = 0.4
    for ax, scenario in zip(axes, latency_scenarios, strict=True):
        xs = range(len(names))
        p50 = [_value(rows, scenario, n, "p50_us") for n in names]
        p99 = [_value(rows, scenario, n, "p99_us") for n in names]
        ax.bar([x - width / 2 for x in xs], p50, width, label="p50", color="#1f77b4")
        ax.bar([x + width / 2 for x in xs], p99, width, label="p99", color="#ff7f0e")
        ax.set_xticks(list(xs), names, rotation=35)
        ax.set_yscale("log")
        ax.set_ylabel("latency (µs, log scale)")
        ax.set_title(scenario)
        ax.legend()
    fig.suptitle("Request latency through each proxy (median of rounds)")
    fig.tight_layout()
    fig.savefig(out / "overhead_latency.png", dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--sse-events", type=int, default=200)
    p.add_argument("--only", help="comma-separated contender names")
    p.add_argument("--peers-bin", default=str(Path(__file__).parent / ".peers" / "bin"))
    p.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = p.parse_args()
    if not shutil.which("nginx") or not shutil.which("wrk"):
        sys.exit("bench/overhead.py needs nginx and wrk (apt-get install nginx wrk)")
    report = run(args)
    rows = summarise(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "overhead.json").write_text(
        json.dumps(
            {
                "command": report.command,
                "date": report.date,
                "summary": rows,
                "samples": [asdict(s) for s in report.samples],
            },
            indent=1,
        )
    )
    (out / "overhead.md").write_text(markdown(report, rows))
    plot(rows, out)
    print(markdown(report, rows))


if __name__ == "__main__":
    main()
