"""Fault tolerance under training load: replicas killed and restarted empty, a replica answering
500, an unload with its rollouts in flight and a replica whose listing hides its adapters, in
the middle of a GRPO-shaped run through the router.

    python bench/faults.py                      # five episodes, ~2 min in all
    python bench/faults.py --episodes rollout   # one kill, mid-rollout
    python bench/faults.py --keep-logs /tmp/f   # also keep the router's and replicas' logs

Set-up. Three emulated vLLM replicas, each its own process (so a kill is a real process death:
SIGKILL, every socket reset by the kernel), with a modest timing model: 8 sequences at once, 4
ms per generated token (~24 tokens a completion), 20 us per uncached prompt token, and a 0.3 s
adapter load (`--load-delay`; loads of different names run concurrently). Each replica is the
emulator's own code started through this file (`faults.py replica ...`, which takes every
`lora-router-emulator` flag) with one addition: an access log, one line per answered request
(arrival, end, method, path, status, model or adapter name), written with one unbuffered `write`
so a SIGKILL loses nothing already answered. The emulator exposes no count of its 404s; this log
is where "a request for an adapter reached a replica that did not hold it" shows. The router is
the real command, `python -m lora_router.cli --replicas ... --no-token --port P
--health-interval 0.5 --health-timeout 1 --health-failures 2 --health-successes 2 --retries 2
--max-upstream-connections 8 --load-retry-interval 0.1 --load-deadline 20 --fence-timeout 30
--log-level info` (the thresholds are the router's defaults; the interval is short enough for a
run of seconds; 8 upstream connections per replica, as many as it runs sequences, so the rest
queue in the router between the fence and the replica: the window of the unload race).
`--port-base P` puts every process on P, P+1... A fourth, spare replica (never in the fleet) is
used at the end to time one replay by hand. Nothing is pinned to a core.

Workload, driven like TRL's AsyncGRPOTrainer (lora_router/testbed/grpo_trace.py prompts: a 23-token
template, problems of 40-400 token ids): each step N, `POST /pause?mode=keep` -> write trl-policy-vN
(atomic rename) -> `POST /v1/load_lora_adapter` -> `POST /resume` -> unload v(N-3) without waiting
for its rollouts -> rollouts name vN, as TRL does (three or four versions live); then S = 16 prompts
x G = 8 separate `/v1/completions` requests, each with its own seed and naming the version current
when it is sent, as TRL's rollout worker reads it (token-id prompts, 48 max tokens, logprobs; every
fourth group streamed). As in an asynchronous trainer, step N+1's sync starts once half of step N's
groups are done. A rollout attempt that fails (non-2xx, a connection error, a body cut short) is
retried by the client as TRL's client does, after 1, 2, 4 s, at most 3 times; a failed load ends the
run (TRL would die of it) and is reported.

Faults. Episodes start at 10, 26, 42 ... s, on replicas 1, 2, 1 ... (default: `rollout`, `load`,
`5xx`, `unload`, `listing`; `5xx-all` on demand). A kill SIGKILLs one replica — `rollout`: while
rollouts are in flight and no sync is under way; `load`: 0.1 s into an adapter load broadcast,
so the victim dies in the middle of a load — waits `--down` s, and starts it again, empty, on
the same port. `5xx`: the replica answers 500 to every completion for `--down` s while its
/health stays 200 (`POST /emulator/faults {"error_rate": 1}`); `5xx-all`: every replica does, a
fleet-wide failure, whose retries the router's budget bounds. `unload`: the next sync, just
before it names vN, sends a last burst of 48 rollouts naming v(N-1) (the worker names the
current version until the trainer moves on), names vN, and 50 ms later unloads v(N-1) while its
rollouts are in flight and queued in the router. `listing`: for 10 s every other /v1/models
answer of the replica lists no adapter and it accepts loads of names it holds (a load balancer
over two vLLM servers: `{"hide_adapters": 2}`); the episode lasts until it serves again.
`/router/replicas` is polled every 10 ms around each fault (50 ms otherwise); the router's log
is read at the end.

Measured, per episode:
- time to eject: kill -> first poll showing the victim out of service (the previous poll's
  sending time is the lower bound), and kill -> the router's "ejecting" log line (ms stamps);
- time to re-admit: the new process listening -> first poll showing it admitted (and the
  router's "back in service" line); split, from the new process's access log, into the health
  wait (listening -> the /health answer that completed `--health-successes`) and the replay
  (-> admitted), with the replay's rounds of loads (a round: loads that overlap in time);
  against one replay of the live adapters done by hand on the spare replica (its /v1/models,
  the K live adapters loaded concurrently, /v1/models again, /resume: the calls of the
  router's replay), median of 3;
- the slowest trainer call (other than loads) that overlapped the re-admission: a replay's
  last pass holds the broadcast lock, so trainer broadcasts can wait behind it;
- that every live adapter was on the restarted replica before its first completion, and that
  no completion reached it before the router admitted it;
- throughput (successful rollouts per second, by completion time) `--window` s before the
  kill, from kill to re-admission, and `--window` s after; the victim's share after.
Over the whole run: failed attempts by kind — *status* (answered non-2xx: only a status line
and an error body reached the client, so another replica could have taken it if one was live),
*cut* (a 200 whose body broke off: bytes had reached the client, which the router must never
retry; how many had no SSE data frame yet is counted), *transport* (no answer from the router
at all) — client retries, rollouts lost after all retries, trainer calls not answered 200,
404s and 5xx answered by the replicas, and ejections of replicas that were not killed.

Soft episodes report: attempts and client-visible 5xx during the `5xx` window against the
replica's own 500s; the unloaded version's rollouts in flight when the unload was sent and how
each was answered, and the unload's duration; the listing victim's ejections during the
episode against the bound an exponential back-off allows (2 + log2(10 s / interval)), the
flaps the router counted, the fewest replicas serving and the time back in service.

Targets (issue 14): client-visible 5xx: 0 (every rollout attempt over the run); no 404 after an
unload (no attempt answered 404, and every rollout of the unloaded version in flight when its
unload was sent answered 200); the listing flap bounded (ejections within the bound, never an
empty fleet, back in service once the fault is lifted). Targets (issue 6): no failed rollout
that a retry to another replica could have saved (no *status* or *transport* failure while
another replica was live, no failed trainer call); ejection within 2 health intervals;
re-admission within one replay of the live adapters, read as: listening -> admitted within the
wait the health flags impose on a replica that comes back (`--health-successes` intervals) plus
one replay by hand. The literal reading (listening -> admitted within one replay, health checks
included) cannot be met by an interval-based check and is reported alongside.

Writes bench/results/faults.json and faults.md (with the command and date); exits 1 when a
target is missed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lib.faults_report import (
    analyse_episode,
    analyse_failures,
    analyse_replicas,
    analyse_soft,
    markdown,
    parse_router_log,
    targets,
)
from lib.faults_setup import (
    KEEP_VERSIONS,
    START_TIMEOUT_S,
    Cluster,
    Episode,
    Prober,
    Settings,
    serve_replica,
)
from lib.faults_trainer import (
    KILLS,
    SOFT,
    EpisodeRun,
    Trainer,
    inject,
    reference_replay,
)
from lib.procs import Procs, git_revision

HERE = Path(__file__).resolve().parent


async def measure(settings: Settings, cluster: Cluster, adapters: Path) -> dict[str, Any]:
    timeout = aiohttp.ClientTimeout(total=None)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
        await _wait_router(http, cluster.router_url)
        trainer = Trainer(settings, cluster.router_url, adapters)
        prober = Prober(http, cluster.router_url)
        probe_task = asyncio.create_task(prober.run())
        t0 = time.time()
        runs: list[EpisodeRun] = []
        done = asyncio.Event()

        async def faults() -> None:
            try:
                runs.extend(
                    await inject(settings.episodes, cluster, trainer, prober, t0, settings.down)
                )
            finally:
                done.set()

        def stop() -> bool:
            now = time.time()
            if now - t0 > settings.max_run:
                return True
            if not done.is_set():
                return False
            last = max((r.admitted or r.killed for r in runs), default=t0)
            return now >= last + settings.window

        fault_task = asyncio.create_task(faults())
        try:
            await trainer.drive(http, stop)
            await fault_task
        finally:
            fault_task.cancel()
            prober.stop()
            await asyncio.gather(fault_task, probe_task, return_exceptions=True)
        wall = time.time() - t0
        async with http.get(cluster.router_url + "/router/status") as resp:
            router_status = await resp.json()
    router_log = cluster.router_log()
    events = parse_router_log(router_log)
    replayed = max((e.adapters for e in events if e.kind == "back"), default=KEEP_VERSIONS)
    ref = await reference_replay(
        f"http://127.0.0.1:{cluster.spare_port}", adapters, max(1, replayed)
    )
    replay_ref = statistics.median(ref)
    kills = [r for r in runs if r.episode.phase in KILLS]
    episodes = [
        analyse_episode(r, settings, cluster, trainer, prober, events, replay_ref, t0)
        for r in kills
    ]
    soft = [
        analyse_soft(r, settings, cluster, trainer, prober, events, router_status, t0)
        for r in runs
        if r.episode.phase in SOFT
    ]
    # An ejection is expected only of a kill's victim shortly after the kill, or of a listing
    # episode's victim while it lasts.
    listing = [r for r in runs if r.episode.phase == "listing"]
    unexpected = [
        asdict(e)
        for e in events
        if e.kind == "eject"
        and not any(
            r.rid == e.rid and -0.01 <= e.at - r.killed <= 2 * settings.health_interval + 1
            for r in kills
        )
        and not any(r.rid == e.rid and r.killed <= e.at <= (r.admitted or r.ended) for r in listing)
    ]
    attempts = [a for r in trainer.rollouts for a in r.attempts]
    failures = analyse_failures(trainer, prober, settings.replicas)
    replicas = analyse_replicas(cluster)
    controls = [asdict(c) for c in trainer.controls if c.status != 200]
    return {
        "wall_s": round(wall, 1),
        "steps": trainer.step,
        "replay_reference_s": [round(t, 4) for t in ref],
        "episodes": episodes,
        "soft_episodes": soft,
        # A fleet-wide 5xx (`5xx-all`) reaches the client by design: counted in its episode.
        "client_visible_5xx": sum(
            a.status >= 500
            for a in attempts
            if not any(
                r.episode.phase == "5xx-all" and r.killed <= a.started <= r.ended + 1 for r in runs
            )
        ),
        "client_404s": sum(a.status == 404 for a in attempts),
        "router_retries": router_status.get("retries", {}),
        "failures": failures,
        "replicas": replicas,
        "control_failures": controls,
        "training_stopped": trainer.stopped,
        "unexpected_ejections": unexpected,
        "prober": {"polls": prober.polls, "errors": prober.errors},
        "router_log_events": [asdict(e) for e in events],
    }


async def _wait_router(http: aiohttp.ClientSession, url: str) -> None:
    deadline = time.time() + START_TIMEOUT_S
    while time.time() < deadline:
        with contextlib.suppress(aiohttp.ClientError):
            async with http.get(url + "/health") as resp:
                if resp.status == 200:
                    return
        await asyncio.sleep(0.1)
    raise RuntimeError(f"the router at {url} did not become healthy")


def parse_episodes(text: str, replicas: int) -> list[Episode]:
    """`rollout,load` -> kills at 10 s and 26 s, on replicas 1 and 2 (then 1 again ...)."""
    out = []
    for i, phase in enumerate(p.strip() for p in text.split(",") if p.strip()):
        if phase not in (*KILLS, *SOFT):
            known = ", ".join((*KILLS, *SOFT))
            raise argparse.ArgumentTypeError(f"unknown episode {phase!r} ({known})")
        out.append(Episode(phase, 1 + i % max(1, replicas - 1), 10.0 + 16.0 * i))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["replica"]:
        return serve_replica(args_list[1:])
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--episodes",
        default="rollout,load,5xx,unload,listing",
        help="in order: rollout, load (kills), 5xx, unload, listing",
    )
    p.add_argument("--down", type=float, default=4.0, help="seconds a killed replica stays down")
    p.add_argument("--window", type=float, default=6.0, help="throughput window before/after")
    p.add_argument("--max-run", type=float, default=130.0, help="hard cap on the run (s)")
    p.add_argument(
        "--port-base", type=int, default=0, help="ports from here (replicas, spare, router)"
    )
    p.add_argument("--prompts", type=int, default=16, help="S: prompts per step")
    p.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--load-delay", type=float, default=0.3, help="each adapter load (s)")
    p.add_argument("--health-interval", type=float, default=0.5)
    p.add_argument("--health-timeout", type=float, default=1.0)
    p.add_argument("--health-failures", type=int, default=2)
    p.add_argument("--health-successes", type=int, default=2)
    p.add_argument("--retries", type=int, default=2, help="the router's --retries")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(HERE / "results"))
    p.add_argument("--keep-logs", metavar="DIR", help="copy the router and replica logs here")
    args = p.parse_args(args_list)
    replicas = 3
    settings = Settings(
        replicas=replicas,
        prompts=args.prompts,
        group=args.group,
        max_tokens=args.max_tokens,
        episodes=parse_episodes(args.episodes, replicas),
        down=args.down,
        window=args.window,
        max_run=args.max_run,
        health_interval=args.health_interval,
        health_timeout=args.health_timeout,
        health_failures=args.health_failures,
        health_successes=args.health_successes,
        retries=args.retries,
        load_delay=args.load_delay,
        seed=args.seed,
        port_base=args.port_base,
    )
    procs = Procs()
    adapters = Path(tempfile.mkdtemp(prefix="faults-bench-", dir=procs.tmp))
    started = time.time()
    with procs.run(args.keep_logs):
        cluster = Cluster(settings, procs)
        cluster.start()
        result = asyncio.run(measure(settings, cluster, adapters))
    report: dict[str, Any] = {
        "command": " ".join(["python bench/faults.py", *args_list]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "git": git_revision(),
        "machine": {"cpus": os.cpu_count()},
        "total_s": round(time.time() - started, 1),
        "settings": {
            **{k: v for k, v in asdict(settings).items() if k != "episodes"},
            "episodes": [asdict(e) for e in settings.episodes],
        },
        "router_flags": settings.router_flags(),
        "replica_flags": settings.replica_flags(0),
        **result,
    }
    report["targets"] = targets(report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "faults.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / "faults.md").write_text(markdown(report))
    print(markdown(report))
    return 0 if all(t["met"] for t in report["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
