"""Discovery under training load: a replica joins through `--replicas-file`, another leaves.

    python bench/discovery.py                    # 3 rounds, ~2 min; bench/results/discovery.*
    python bench/discovery.py --rounds 1 --out /tmp/d

Set-up, per round. Four emulated vLLM replicas, each its own process started through
bench/faults.py (`faults.py replica`: `lora-router-emulator` plus an access log, one line per
answered request: arrival, end, path, status, model or adapter name), with the fault bench's
timing model (8 sequences, 4 ms a token, 0.3 s adapter loads). The real router (`python -m
lora_router.cli --replicas-file F --replica-hosts 127.0.0.1 --no-token --discovery-grace 1` and
the fault bench's health flags) starts with the file naming three of them; the fourth runs but
is not named. `/router/replicas` is polled every 20 ms.

Workload: bench/lib/faults_trainer.py's trainer, which drives the router as TRL 1.16's
AsyncGRPOTrainer does (lora_router/testbed/grpo_trace.py prompts: a shared template, problems of
40-400 token ids; every step `POST /pause?mode=keep`, a new `trl-policy-vN` written and loaded,
`/resume`, v(N-3) unloaded; S = 8 prompts x G = 8 requests, each with its own seed, naming the
version current when it is sent; TRL's client retries), made multi-turn as a tool-calling
rollout is (`--turns`, 3): each sample's next turn sends its previous prompt, the token ids the
replica returned and a tool message, naming the version current then; the last turn streams.
A *family* is a prompt group (its G conversations).

Episodes: at `--join-at` s the file is replaced atomically (write aside, rename) naming the
fourth replica too (the join); at `--leave-at` s it is replaced again without replica 1 (the
leave); the run stops at `--run` s and every rollout is waited for.

Measured, per round (the result file gives medians over rounds):
- *lost*: rollouts (turns) not answered 200 after the client's retries, and attempts that
  failed at all;
- *join to serving*: file written -> the joiner's first completion (its access log), and ->
  the first poll showing it admitted; that every adapter live then (loaded, as the trainer
  saw, and not yet unloaded) was loaded on it before its first completion arrived, and that
  no completion ever reached it naming an adapter it had not loaded;
- *families moved on the join*: of the families with turns both before and after the join
  (its first completion), the share whose later turns went to another replica than their
  conversation's previous turn, against 1/N for consistent hashing; the same share across an
  instant 3 s before the join (no change of membership: what the router's move rule moves
  anyway); and the share of new families (first turn after the join, before the leave) dealt
  to the joiner, against 1/(N+1);
- *leave*: file written -> the first poll showing it draining, -> the last completion that
  arrived at it, -> gone from the fleet; that the requests it held when it began draining
  were answered 200, and that none arrived after it was gone.

The bench fails (exit 1) when a request is lost or an attempt is not answered 200, the joiner
serves before its replay, or the leaver gets work after it is gone.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
from lib.faults_setup import FAULTS, Settings, read_access_log
from lib.faults_trainer import Rollout, Trainer
from lib.procs import Procs, free_port, git_revision, wait_port
from xxhash import xxh3_64_intdigest

RESULTS = Path(__file__).resolve().parent / "results"
COMPLETIONS = "/v1/completions"
LOAD = "/v1/load_lora_adapter"
POLL_S = 0.02
CONTROL_INSTANT_S = 3.0  # the no-change control: this long before the join


def settings(seed: int) -> Settings:
    return Settings(
        replicas=4, prompts=8, group=8, max_tokens=24, episodes=[], down=0.0, window=0.0,
        max_run=0.0, health_interval=0.5, health_timeout=1.0, health_failures=2,
        health_successes=2, retries=2, load_delay=0.3, seed=seed,
    )  # fmt: skip


@dataclass(slots=True)
class Turn:
    family: int
    sample: int
    turn: int
    record: Rollout


class ToolTrainer(Trainer):
    """The fault bench's trainer with multi-turn rollouts (module docstring)."""

    def __init__(self, turns: int, *args: Any) -> None:
        super().__init__(*args)
        self.turns = turns
        self.log: list[Turn] = []
        self._samples: dict[int, int] = {}
        self._tool = random.Random(self.settings.seed + 1)

    async def rollout(self, n: int, prompt: list[int], seed: int, stream: bool) -> Rollout:
        family = xxh3_64_intdigest(str(prompt).encode())
        sample = self._samples[family] = self._samples.get(family, -1) + 1
        record = Rollout(n, stream)
        for turn in range(self.turns):
            last = turn == self.turns - 1
            record = await super().rollout(n, prompt, seed, stream and last)
            self.log.append(Turn(family, sample, turn, record))
            if not record.ok or last:
                break
            tool = [self._tool.randrange(151_000) for _ in range(self._tool.randint(10, 60))]
            prompt = prompt + record.attempts[-1].completion + tool
            seed = self.rng.randrange(2**31)  # TRL draws a seed for every turn
        return record


@dataclass(slots=True)
class Round:
    ports: list[int]
    members: Path
    logs: list[Path]
    polls: list[tuple[float, dict[str, dict[str, Any]]]] = field(default_factory=list)
    written: dict[str, float] = field(default_factory=dict)


def write_members(path: Path, urls: list[str]) -> float:
    aside = path.with_suffix(".new")
    aside.write_text("# written by bench/discovery.py\n" + "".join(f"{u}\n" for u in urls))
    os.replace(aside, path)
    return time.time()


async def poll(http: aiohttp.ClientSession, url: str, rnd: Round, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(aiohttp.ClientError, TimeoutError, ValueError):
            async with http.get(url + "/router/replicas") as resp:
                doc = await resp.json()
            rnd.polls.append((time.time(), {r["url"]: r for r in doc["replicas"]}))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), POLL_S)


async def one_round(args: argparse.Namespace, index: int, procs: Procs) -> dict[str, Any]:
    cfg = settings(args.seed + index)
    tmp = procs.tmp / f"round-{index}"
    (tmp / "adapters").mkdir(parents=True)
    ports = [free_port() for _ in range(4)]
    rnd = Round(ports, tmp / "replicas", [tmp / f"replica-{i}.access" for i in range(4)])
    for i, port in enumerate(ports):
        procs.start(
            [
                sys.executable, str(FAULTS), "replica", "--port", str(port),
                "--access-log", str(rnd.logs[i]), *cfg.replica_flags(i),
            ]
        )  # fmt: skip
    for port in ports:
        wait_port(port)
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    write_members(rnd.members, urls[:3])
    router_port = free_port()
    procs.start(
        [
            sys.executable, "-m", "lora_router.cli", "--replicas-file", str(rnd.members),
            "--replica-hosts", "127.0.0.1", "--no-token", "--port", str(router_port),
            "--discovery-grace", str(args.grace), *cfg.router_flags(),
        ]
    )  # fmt: skip
    wait_port(router_port)
    router = f"http://127.0.0.1:{router_port}"
    trainer = ToolTrainer(args.turns, cfg, router, tmp / "adapters")
    stop_polls = asyncio.Event()
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the three named replicas serve
            async with http.get(router + "/router/replicas") as resp:
                doc = await resp.json()
            if sum(r["admitted"] for r in doc["replicas"]) == 3:
                break
            await asyncio.sleep(0.1)
        poller = asyncio.create_task(poll(http, router, rnd, stop_polls))
        t0 = time.monotonic()
        driving = asyncio.create_task(trainer.drive(http, lambda: time.monotonic() - t0 > args.run))
        await asyncio.sleep(args.join_at)
        rnd.written["join"] = write_members(rnd.members, urls)
        await asyncio.sleep(t0 + args.leave_at - time.monotonic())
        rnd.written["leave"] = write_members(rnd.members, [urls[0], *urls[2:]])
        await driving
        await asyncio.sleep(0.5)
        stop_polls.set()
        await poller
    return analyse(rnd, trainer, urls)


def _first_poll(rnd: Round, after: float, test: Any) -> float | None:
    return next((t for t, doc in rnd.polls if t >= after and test(doc)), None)


def _live_at(trainer: Trainer, t: float) -> set[str]:
    """Adapters the trainer had seen loaded (200) before `t` and had not begun to unload. Syncs
    load v1, v2 ... in order and unload v1, v2 ... in order (three versions behind)."""
    loads = [c for c in trainer.controls if c.what == LOAD]
    unloads = [c for c in trainer.controls if c.what.startswith("/v1/unload")]
    live = {f"trl-policy-v{i + 1}" for i, c in enumerate(loads) if c.status == 200 and c.ended < t}
    return live - {f"trl-policy-v{i + 1}" for i, c in enumerate(unloads) if c.started < t}


def analyse(rnd: Round, trainer: ToolTrainer, urls: list[str]) -> dict[str, Any]:
    joiner, leaver = urls[3], urls[1]
    logs = [read_access_log(p) for p in rnd.logs]
    by_rid: dict[str, str] = {}
    for _, doc in rnd.polls:
        for url, r in doc.items():
            by_rid[str(r["id"])] = url
    turns = [t for t in trainer.log if t.record.attempts]
    attempts = [a for t in turns for a in t.record.attempts]
    failed_attempts = [a for a in attempts if a.kind != "ok"]
    lost = [t for t in turns if not t.record.ok]
    problems: list[str] = []
    if lost:
        problems.append(f"{len(lost)} requests lost after retries")
    if failed_attempts:  # every request is to be answered 200 the first time
        problems.append(f"{len(failed_attempts)} attempts not answered 200")

    # -- join ----------------------------------------------------------------------------
    written = rnd.written["join"]
    joined = [a for a in logs[3] if a.path == COMPLETIONS]
    first = min(joined, key=lambda a: a.arrived) if joined else None
    admitted = _first_poll(rnd, written, lambda d: d.get(joiner, {}).get("admitted"))
    loads = {a.name: a.ended for a in logs[3] if a.path == LOAD and a.status == 200}
    missing: list[str] = []
    if first is None:
        problems.append("the joiner never served")
    else:
        missing = sorted(
            n for n in _live_at(trainer, first.arrived) if loads.get(n, 1e18) > first.arrived
        )
        if missing:
            problems.append(f"the joiner served before it had {missing}")
    early = [a for a in joined if loads.get(a.name, 1e18) > a.arrived or a.status == 404]
    if early:
        problems.append(f"{len(early)} completions reached the joiner before it had their adapter")

    def replica_of(t: Turn) -> str:
        return by_rid.get(t.record.attempts[-1].replica, "?")

    def moved_across(instant: float) -> tuple[int, int, int]:
        """(families spanning `instant`, moved, moved to the joiner)."""
        spans: dict[int, bool] = {}
        to_joiner: set[int] = set()
        convo: dict[tuple[int, int], list[Turn]] = {}
        for t in turns:
            if t.record.ok:
                convo.setdefault((t.family, t.sample), []).append(t)
        for (family, _), chain in convo.items():
            chain.sort(key=lambda t: t.turn)
            before = [t for t in chain if t.record.attempts[-1].started < instant]
            after = [t for t in chain if t.record.attempts[-1].started >= instant]
            if not before or not after:
                continue
            home = replica_of(before[-1])
            went = {replica_of(t) for t in after}
            spans[family] = spans.get(family, False) or went != {home}
            if joiner in went - {home}:
                to_joiner.add(family)
        return len(spans), sum(spans.values()), len(to_joiner)

    join_instant = first.arrived if first else written
    spanning, moved, moved_to_joiner = moved_across(join_instant)
    c_spanning, c_moved, _ = moved_across(join_instant - CONTROL_INSTANT_S)
    leave_written = rnd.written["leave"]
    firsts: dict[int, Turn] = {}
    for t in turns:
        if t.turn == 0 and t.record.ok:
            start = t.record.attempts[-1].started
            if join_instant <= start < leave_written:
                firsts.setdefault(t.family, t)
    new_families = len(firsts)
    dealt_joiner = sum(1 for t in firsts.values() if replica_of(t) == joiner)

    # -- leave ---------------------------------------------------------------------------
    draining = _first_poll(
        rnd, leave_written, lambda d: leaver not in d or d[leaver]["state"] == "draining"
    )
    gone = _first_poll(rnd, leave_written, lambda d: leaver not in d)
    at_leaver = [a for a in logs[1] if a.path == COMPLETIONS]
    last_new = max((a.arrived for a in at_leaver), default=0.0)
    held = [a for a in at_leaver if draining and a.arrived < draining < a.ended]
    if any(a.status != 200 for a in held):
        problems.append("a request held by the leaver was not answered 200")
    if gone is None:
        problems.append("the leaver never left")
    elif any(a.arrived > gone for a in at_leaver):
        problems.append("the leaver got a request after it was gone")

    return {
        "requests": len(turns),
        "attempts": len(attempts),
        "failed_attempts": len(failed_attempts),
        "failed_kinds": sorted({f"{a.kind} {a.status} {a.detail}"[:120] for a in failed_attempts}),
        "lost": len(lost),
        "syncs": sum(1 for c in trainer.controls if c.what == LOAD),
        "join_to_first_completion_s": (first.arrived - written) if first else None,
        "join_to_admitted_s": (admitted - written) if admitted else None,
        "joiner_completions": len(joined),
        "live_at_first_completion": sorted(_live_at(trainer, first.arrived)) if first else [],
        "joiner_missing_at_first": missing,
        "joiner_early_completions": len(early),
        "families_spanning_join": spanning,
        "families_moved_on_join": moved,
        "families_moved_to_joiner": moved_to_joiner,
        "families_spanning_control": c_spanning,
        "families_moved_control": c_moved,
        "new_families_after_join": new_families,
        "new_families_dealt_joiner": dealt_joiner,
        "leave_to_draining_s": (draining - leave_written) if draining else None,
        "leave_to_last_arrival_s": last_new - leave_written,
        "leave_to_gone_s": (gone - leave_written) if gone else None,
        "held_by_leaver_at_drain": len(held),
        "held_by_leaver_answered_200": sum(1 for a in held if a.status == 200),
        "problems": problems,
    }


def _med(rounds: list[dict[str, Any]], key: str) -> float:
    values = [r[key] for r in rounds if r[key] is not None]
    return statistics.median(values) if values else float("nan")


def _share(rounds: list[dict[str, Any]], part: str, whole: str) -> float:
    shares = [r[part] / r[whole] for r in rounds if r[whole]]
    return statistics.median(shares) if shares else float("nan")


def report(results: dict[str, Any]) -> str:
    rounds = results["rounds"]
    n = 3
    lines = [
        "# Discovery: join and leave under TRL-shaped load",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Revision: `{results['revision']}`; {results['cpus']} CPUs (shared); script: "
        "bench/discovery.py (its docstring gives the set-up and what each figure is). "
        f"Medians over {len(rounds)} rounds; every round's figures are in discovery.json.",
        "",
        f"Verdict: **{'PASS' if results['ok'] else 'FAIL'}**"
        + ("" if results["ok"] else f" ({'; '.join(results['problems'])})"),
        "",
        "| What | Figure |",
        "|---|---|",
        f"| requests (turns) sent, all rounds | {sum(r['requests'] for r in rounds)} |",
        f"| requests lost after retries, all rounds | {sum(r['lost'] for r in rounds)} |",
        f"| attempts that failed, all rounds | {sum(r['failed_attempts'] for r in rounds)} |",
        f"| weight syncs (adapter loads) per round | {_med(rounds, 'syncs'):.0f} |",
        f"| join: file written -> joiner's first completion | "
        f"{_med(rounds, 'join_to_first_completion_s'):.2f} s |",
        f"| join: file written -> first poll showing it admitted | "
        f"{_med(rounds, 'join_to_admitted_s'):.2f} s |",
        f"| joiner's completions before it had their adapter, all rounds | "
        f"{sum(r['joiner_early_completions'] for r in rounds)} |",
        f"| existing families moved on the join (1/N = {1 / n:.2f}) | "
        f"{_share(rounds, 'families_moved_on_join', 'families_spanning_join'):.2f} |",
        f"| of which to the joiner | "
        f"{_share(rounds, 'families_moved_to_joiner', 'families_spanning_join'):.2f} |",
        f"| families moved across an instant {CONTROL_INSTANT_S:g} s before it (no change) | "
        f"{_share(rounds, 'families_moved_control', 'families_spanning_control'):.2f} |",
        f"| new families dealt to the joiner (1/(N+1) = {1 / (n + 1):.2f}) | "
        f"{_share(rounds, 'new_families_dealt_joiner', 'new_families_after_join'):.2f} |",
        f"| leave: file written -> draining | {_med(rounds, 'leave_to_draining_s'):.2f} s |",
        f"| leave: file written -> last request to reach it | "
        f"{_med(rounds, 'leave_to_last_arrival_s'):.2f} s |",
        f"| leave: file written -> gone from the fleet | {_med(rounds, 'leave_to_gone_s'):.2f} s |",
        f"| requests it held when draining began / answered 200, all rounds | "
        f"{sum(r['held_by_leaver_at_drain'] for r in rounds)} / "
        f"{sum(r['held_by_leaver_answered_200'] for r in rounds)} |",
        "",
        "Per round: families spanning the join "
        + ", ".join(str(r["families_spanning_join"]) for r in rounds)
        + "; new families after it "
        + ", ".join(str(r["new_families_after_join"]) for r in rounds)
        + ".",
        "",
    ]
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    rounds = []
    for i in range(args.rounds):
        procs = Procs()
        try:
            rounds.append(await one_round(args, i, procs))
        finally:
            procs.close()
        r = rounds[-1]
        print(json.dumps({k: v for k, v in r.items() if not isinstance(v, list)}), flush=True)
        if r["problems"]:
            print("problems:", r["problems"], flush=True)
    return rounds


def run(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--join-at", type=float, default=6.0)
    parser.add_argument("--leave-at", type=float, default=14.0)
    parser.add_argument("--run", type=float, default=22.0)
    parser.add_argument("--grace", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--out", type=Path, default=RESULTS / "discovery")
    args = parser.parse_args(argv)
    rounds = uvloop.run(main(args))
    problems = sorted({p for r in rounds for p in r["problems"]})
    results = {
        "command": " ".join(["python bench/discovery.py", *argv]),
        "revision": git_revision(),
        "cpus": os.cpu_count(),
        "ok": not problems,
        "problems": problems,
        "rounds": rounds,
    }
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(report(results))
    print(report(results))
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
