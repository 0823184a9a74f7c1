"""Background cost with the fleet's size: an idle router's CPU per second at 2, 8, 32 and 128
replicas, two lora-router revisions and vllm-router side by side in one run.

    python bench/idle.py                        # base f8cdf5c against this checkout, ~10 min
    python bench/idle.py --base-rev REV --rounds 1 --window 5

Method. One nginx serves every replica port (bench/lib/nginx.py's instant fleet) with `/health`,
`/v1/models`, `/server_info` and, as `/metrics`, a real vLLM 0.32 page
(tests/fleet/data/vllm-0.32-metrics-after-traffic.txt, 75 KB: what the router scrapes from each
replica). No request is routed after start-up (one completion checks the contender answers):
what is left is each router's health checks and `/metrics` scrapes. Per round, per fleet size
(in rotating order), each contender (in rotating order) is started alone, pinned to core 0
(nginx and this script on core 1), given `--settle` seconds (its first health and scrape
rounds come one interval after start), then its CPU (/proc, the whole process) is read over
`--window` seconds, and it is stopped. Contenders: lora-router at the base revision
(`git archive REV`, run with PYTHONPATH), lora-router from this checkout, both at their defaults
(`--health-interval 2`), and vllm-router at its defaults (`--log-level warning`). The report
gives medians over rounds (min-max), the branch/base ratio within each round, and the load
average before each round; then the time to read the real vLLM page (`parse_report`), base and
branch, each in its own process on core 0, interleaved, median of `--parse-runs`.

Writes bench/results/idle/idle.md and idle.json (with the command, revision and date).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from lib.nginx import nginx_fleet
from lib.overhead_setup import (
    LOAD_CPU,
    MODEL,
    PROXY_CPU,
    BenchFailure,
    Start,
    json_reply,
    launch,
    lora_router_from,
    spread,
    starters,
)
from lib.overhead_windows import rotated
from lib.procs import (
    Procs,
    find_binary,
    free_port,
    git_revision,
    pinned,
    precise_cpu_seconds,
    source_tree,
)

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "tests" / "fleet" / "data" / "vllm-0.32-metrics-after-traffic.txt"
FLEETS = (2, 8, 32, 128)
PARSE = """
import timeit, sys
from lora_router.fleet.telemetry import parse_report
page = open(sys.argv[1], 'rb').read()
parse_report(page, 0.0)
n = 200
print(min(timeit.repeat(lambda: parse_report(page, 0.0), number=n, repeat=5)) / n * 1e6)
"""


def parse_us(src: Path) -> float:
    """Microseconds to read the real vLLM page with `src`'s parser (best of 5 x 200)."""
    out = subprocess.run(
        pinned([sys.executable, "-c", PARSE, str(PAGE)], PROXY_CPU),
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(src)},
        cwd=str(src),
        check=True,
    )
    return float(out.stdout.strip())


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--base-rev", default="f8cdf5c", help="the revision to compare against")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window", type=float, default=10.0, help="seconds of CPU read per run")
    p.add_argument("--settle", type=float, default=3.0, help="seconds after start, unread")
    p.add_argument("--parse-runs", type=int, default=5)
    p.add_argument("--peers-bin", default=str(Path(__file__).parent / ".peers" / "bin"))
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "idle"))
    args = p.parse_args()
    vllm_router = find_binary("vllm-router", Path(args.peers_bin))
    missing = [n for n in ("nginx", "taskset", "git") if not shutil.which(n)]
    if missing or not vllm_router:
        sys.exit(f"bench/idle.py needs nginx, taskset, git and vllm-router; missing: {missing}")
    os.sched_setaffinity(0, {int(LOAD_CPU)})
    command = " ".join(["python", "bench/idle.py", *sys.argv[1:]])
    base = source_tree(args.base_rev, Path(tempfile.mkdtemp(prefix="lora-router-idle-")) / "base")
    contenders: dict[str, Start] = {
        f"lora-router {args.base_rev}": lora_router_from(str(base)),
        "lora-router branch": lora_router_from(str(ROOT)),
        "vllm-router": starters(vllm_router)["vllm-router"],
    }
    names = list(contenders)
    rates: dict[tuple[str, int], list[float]] = {}
    ratios: dict[int, list[float]] = {}
    loads: list[float] = []
    parse: dict[str, list[float]] = {names[0]: [], names[1]: []}
    began = time.monotonic()
    procs = Procs()
    try:
        ports = [free_port() for _ in range(max(FLEETS))]
        nginx_fleet(
            procs, ports, MODEL, json_reply(), "application/json", LOAD_CPU, PAGE.read_bytes()
        )
        for rnd in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for n in rotated(FLEETS, rnd):
                got: dict[str, float] = {}
                for name in rotated(names, rnd):
                    inst = launch(procs, contenders[name], name, ports[:n])
                    assert inst.proc is not None and inst.pid is not None
                    time.sleep(args.settle)
                    cpu = precise_cpu_seconds(inst.pid)
                    time.sleep(args.window)
                    got[name] = (precise_cpu_seconds(inst.pid) - cpu) * 1e3 / args.window
                    procs.stop(inst.proc)
                    print(
                        f"  r{rnd} {n:4d} replicas {name:22} {got[name]:7.2f} ms CPU/s", flush=True
                    )
                for name, rate in got.items():
                    rates.setdefault((name, n), []).append(rate)
                ratios.setdefault(n, []).append(got[names[1]] / max(got[names[0]], 1e-9))
        for rnd in range(args.parse_runs):
            for name in rotated(names[:2], rnd):
                parse[name].append(parse_us(base if name == names[0] else ROOT))
    except BenchFailure as e:
        sys.exit(f"bench/idle.py FAILED, no results written: {e}")
    finally:
        procs.close()
        shutil.rmtree(base, ignore_errors=True)
    report = {
        "command": command,
        "revision": git_revision(),
        "base_revision": args.base_rev,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seconds": round(time.monotonic() - began, 1),
        "load_before_rounds": loads,
        "load_end": os.getloadavg()[0],
        "window_s": args.window,
        "cpu_ms_per_s": {f"{name} @ {n}": spread(v) for (name, n), v in rates.items()},
        "branch_over_base": {str(n): spread(v) for n, v in ratios.items()},
        "parse_real_page_us": {name: spread(v) for name, v in parse.items()},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "idle.json").write_text(json.dumps(report, indent=1) + "\n")
    text = markdown(report, names)
    (out / "idle.md").write_text(text)
    print(text)


def markdown(report: dict[str, object], names: list[str]) -> str:
    cpu = report["cpu_ms_per_s"]
    ratio = report["branch_over_base"]
    parse = report["parse_real_page_us"]
    assert isinstance(cpu, dict) and isinstance(ratio, dict) and isinstance(parse, dict)

    def cell(s: dict[str, float], spec: str = ".1f") -> str:
        return f"{s['median']:{spec}} ({s['min']:{spec}}-{s['max']:{spec}})"

    loads = ", ".join(f"{x:.2f}" for x in report["load_before_rounds"])  # type: ignore[attr-defined]
    lines = [
        "# Idle CPU with the fleet's size (bench/idle.py)",
        "",
        f"Made {report['date']} by `{report['command']}` (git {report['revision']}, base "
        f"{report['base_revision']}), {report['seconds']} s in all, on 2 cores shared with "
        f"other work: 1-minute load average before each round {loads}, "
        f"{report['load_end']:.2f} at the end. Method: the module docstring.",
        "",
        f"CPU per second of an idle router (ms/s, median over rounds (min-max), a "
        f"{report['window_s']:g} s window each), with `/metrics` a real 75 KB vLLM 0.32 page:",
        "",
        "| replicas | " + " | ".join(names) + " | branch / base (same round) |",
        "|---:|" + "---:|" * (len(names) + 1),
    ]
    for n in FLEETS:
        row = [cell(cpu[f"{name} @ {n}"]) for name in names]
        lines.append(f"| {n} | " + " | ".join(row) + f" | {cell(ratio[str(n)], '.2f')} |")
    lines += [
        "",
        "vllm-router checks health every 60 s at its defaults (`--health-check-interval-secs`) "
        "and reads no replica's `/metrics`: a window of its holds a check at most. lora-router "
        "checks every 2 s (`--health-interval`); on the branch an idle replica still gets its "
        "`/health` every interval (passive health needs routed traffic), and `/metrics` is read "
        "from at most 16 replicas per interval (`--scrape-budget`).",
        "",
        "Reading the real vLLM page (`parse_report`, µs, median of runs (min-max), each run "
        "the best of 5 x 200 in its own process on core 0):",
        "",
        "| revision | µs |",
        "|---|---:|",
    ]
    lines += [f"| {name} | {cell(s)} |" for name, s in parse.items()]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
