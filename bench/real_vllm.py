"""Routing quality on real vLLM caches: hit rates from the replicas' own prefix-cache counters.

Real vLLM 0.32 CPU replicas (the tier's tiny model, `tests/vllm/`) serve a small GRPO-shaped
trace built from what TRL 1.16 really sends: token-id prompts, G separate requests per prompt,
each with its own `seed`, `max_tokens` small, all G of a prompt in flight at once and a few
prompts at a time, every request built and posted by TRL's own rollout code. Each contender
routes the same trace to the same replicas, whose prefix caches are reset in between. The hit
rate is `vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total` summed over the
replicas (tokens), against the most the 128-token blocks allow: every full block of a prompt
cached for its G-1 siblings.

Contenders: lora-router prefix, lora-router round-robin, and vllm-router cache_aware and
consistent_hash when a `vllm-router` binary is found (`--vllm-router`, bench/.peers/bin, PATH).
Replicas run without `--api-key` here, since the peers forward no token.

Needs the tier's environment:
`tests/vllm/install.sh && .venv-vllm/bin/python bench/real_vllm.py`
Writes bench/results/real_vllm.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from lib.procs import find_binary, free_port, git_revision  # noqa: E402

from lora_router.testbed.tiny_model import adapter_dir, model_dir  # noqa: E402
from lora_router.testbed.trl_client import LORA_NAME, Rollouts  # noqa: E402
from lora_router.testbed.vllm_harness import BIN, Replica, http, start_replicas, wait_for  # noqa: E402

RESULTS = HERE / "results"
BLOCK = 128
VOCAB = range(3, 480)
ADAPTER = f"{LORA_NAME}-v1"


@dataclass(frozen=True, slots=True)
class Contender:
    key: str
    label: str
    argv: tuple[str, ...]  # the router's command line minus replicas, host and port


@dataclass(slots=True)
class Outcome:
    contender: str
    hits: float
    queries: float
    hit_rate: float
    of_max: float  # hit rate as a fraction of the block-size maximum
    requests_per_replica: list[int]
    seconds: float


def trace(prompts: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.choices(VOCAB, k=length) for _ in range(prompts)]


def contenders(vllm_router: str | None) -> list[Contender]:
    lora = (str(BIN / "lora-router"), "--no-token", "--log-level", "warning")
    found = [
        Contender("lora-prefix", "lora-router prefix", (*lora, "--policy", "prefix")),
        Contender("lora-rr", "lora-router round-robin", (*lora, "--policy", "round-robin")),
    ]
    if vllm_router:
        for policy in ("cache_aware", "consistent_hash"):
            found.append(
                Contender(
                    f"vllm-{policy}",
                    f"vllm-router {policy}",
                    (vllm_router, "--policy", policy, "--log-level", "warning"),
                )
            )
    return found


def command(c: Contender, replicas: list[Replica], port: int) -> list[str]:
    urls = [r.url for r in replicas]
    if c.key.startswith("lora"):
        return [*c.argv, "--replicas", ",".join(urls), "--host", "127.0.0.1", "--port", str(port)]
    metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    return [*c.argv, "--worker-urls", *urls, "--host", "127.0.0.1", "--port", str(port), *metrics]


def reset_caches(replicas: list[Replica]) -> None:
    """Empty every replica's prefix cache (vLLM says false while blocks are in use)."""
    for r in replicas:
        wait_for(
            f"{r.url} /reset_prefix_cache",
            lambda r=r: http("POST", r.url + "/reset_prefix_cache").json() == {"success": True},
            60,
            [r.log],
        )


def load_adapter(replica: Replica, name: str, path: Path) -> None:
    """Load an adapter on the replica directly (not through a router)."""
    body = {"lora_name": name, "lora_path": str(path), "load_inplace": False}
    answer = http("POST", replica.url + "/v1/load_lora_adapter", body)
    assert answer.status == 200, answer.text


def counters(replicas: list[Replica]) -> list[tuple[float, float, float]]:
    return [
        (
            r.metric("vllm:prefix_cache_hits_total"),
            r.metric("vllm:prefix_cache_queries_total"),
            r.metric("vllm:request_success_total"),
        )
        for r in replicas
    ]


async def play(url: str, base: str, prompts: list[list[int]], group: int, waves: int) -> None:
    """The trace as TRL's rollout worker sends it: `waves` prompts at a time, each prompt's
    `group` samples all in flight together, every request with its own seed."""
    rollouts = Rollouts(url, base, version=1, max_tokens=2)
    for start in range(0, len(prompts), waves):
        await rollouts.groups(prompts[start : start + waves], group)


def run_one(
    c: Contender,
    replicas: list[Replica],
    base: str,
    prompts: list[list[int]],
    args: argparse.Namespace,
    logs: Path,
) -> Outcome:
    reset_caches(replicas)
    port = free_port()
    log = logs / f"router-{c.key}.log"
    with log.open("ab") as out:
        router = subprocess.Popen(command(c, replicas, port), stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(
            f"{c.label} /health", lambda: http("GET", url + "/health").status == 200, 60, [log]
        )
        before = counters(replicas)
        started = time.monotonic()
        asyncio.run(play(url, base, prompts, args.group, args.waves))
        seconds = time.monotonic() - started
        after = counters(replicas)
    finally:
        router.terminate()
        router.wait(timeout=30)
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    per_replica = [round(a[2] - b[2]) for a, b in zip(after, before, strict=True)]
    cacheable = (args.prompt_tokens - 1) // BLOCK * BLOCK
    best = (args.group - 1) * cacheable / (args.group * args.prompt_tokens)
    rate = hits / queries if queries else 0.0
    return Outcome(c.label, hits, queries, rate, rate / best, per_replica, seconds)


def write_results(outcomes: list[Outcome], args: argparse.Namespace, note: str) -> None:
    RESULTS.mkdir(exist_ok=True)
    cacheable = (args.prompt_tokens - 1) // BLOCK * BLOCK
    best = (args.group - 1) * cacheable / (args.group * args.prompt_tokens)
    cmd = ".venv-vllm/bin/python bench/real_vllm.py " + " ".join(sys.argv[1:])
    payload = {
        "command": cmd.strip(),
        "revision": git_revision(),
        "replicas": args.replicas,
        "trace": {
            "prompts": args.prompts,
            "prompt_tokens": args.prompt_tokens,
            "group": args.group,
            "prompts_in_flight": args.waves,
            "max_tokens": 2,
            "seed": args.seed,
        },
        "block_size": BLOCK,
        "max_hit_rate": best,
        "vllm_router": note,
        "outcomes": [asdict(o) for o in outcomes],
    }
    (RESULTS / "real_vllm.json").write_text(json.dumps(payload, indent=2) + "\n")
    render(payload)


def render(payload: dict[str, Any]) -> None:
    """bench/results/real_vllm.md from the results' JSON."""
    t = payload["trace"]
    best = payload["max_hit_rate"]
    lines = [
        "# Routing quality on real vLLM caches",
        "",
        f"`{payload['command']}` (revision {payload['revision']}): {payload['replicas']} real "
        f"vLLM 0.32 CPU replicas (tiny Qwen2, block size {payload['block_size']}), "
        f"{t['prompts']} token-id prompts of {t['prompt_tokens']} tokens, G = {t['group']} "
        "requests per prompt each with its own seed (TRL 1.16's own rollout code), "
        f"{t['prompts_in_flight']} prompts in flight at a time, max_tokens {t['max_tokens']}. "
        "Hit rate = prefix_cache_hits / prefix_cache_queries from the replicas' own /metrics; "
        f"the maximum the blocks allow is {best:.4f}.",
        "",
        "| router | hit rate | of the maximum | requests per replica | seconds |",
        "| --- | ---: | ---: | --- | ---: |",
    ]
    for o in payload["outcomes"]:
        lines.append(
            f"| {o['contender']} | {o['hit_rate']:.4f} | {o['of_max']:.3f} | "
            f"{', '.join(map(str, o['requests_per_replica']))} | {o['seconds']:.1f} |"
        )
    lines += [
        "",
        "Requests per replica are the replicas' own `vllm:request_success_total`. Seconds are "
        "not a throughput figure: the replicas share 2 cores (with other work on the machine), "
        "so a router that sends everything to one replica finishes sooner here.",
        "",
        f"vllm-router: {payload['vllm_router']}",
        "",
    ]
    (RESULTS / "real_vllm.md").write_text("\n".join(lines))
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=400)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--waves", type=int, default=4, help="prompts in flight at a time")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--vllm-router", default=None, help="path of a vllm-router binary")
    p.add_argument(
        "--render", action="store_true", help="only rewrite real_vllm.md from real_vllm.json"
    )
    args = p.parse_args(argv)
    if args.render:
        render(json.loads((RESULTS / "real_vllm.json").read_text()))
        return 0

    vllm_router = args.vllm_router or find_binary("vllm-router", HERE / ".peers" / "bin")
    note = (
        f"installed ({vllm_router})"
        if vllm_router
        else "not found (pip install vllm-router, or --vllm-router PATH)"
    )
    root = model_dir()
    base = str(root / "model")
    logs = Path(tempfile.mkdtemp(prefix="real-vllm-bench-"))
    replicas = [
        Replica(model=root / "model", log=logs / f"replica-{i}.log", api_key=None)
        for i in range(args.replicas)
    ]
    outcomes: list[Outcome] = []
    try:
        start_replicas(replicas)
        # The same adapter at the same path on every replica, loaded directly: every contender
        # serves it (lora-router adopts an adapter every replica holds at one path).
        path = shutil.copytree(adapter_dir(root, 0), logs / ".vllm_lora" / ADAPTER)
        for r in replicas:
            load_adapter(r, ADAPTER, Path(path))
        prompts = trace(args.prompts, args.prompt_tokens, args.seed)
        # Warm-up (a replica's first completion takes seconds), outside every measurement.
        asyncio.run(play(replicas[0].url, base, trace(1, 8, 0), 1, 1))
        for r in replicas[1:]:
            asyncio.run(play(r.url, base, trace(1, 8, 0), 1, 1))
        for c in contenders(vllm_router):
            outcome = run_one(c, replicas, base, prompts, args, logs)
            print(f"{c.label}: hit rate {outcome.hit_rate:.4f} ({outcome.of_max:.3f} of max)")
            outcomes.append(outcome)
    finally:
        for r in replicas:
            r.stop()
    write_results(outcomes, args, note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
