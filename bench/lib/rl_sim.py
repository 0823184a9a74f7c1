"""bench/rl_replay.py's simulator: rl_clock's client, a router's policy and batching replicas,
one discrete-event loop in simulated time (the module docstring of bench/rl_replay.py says what
is modelled and from where).

Pure computation: no sockets, no clock, no randomness (every tie is broken by the order events
were scheduled in), so the same inputs give the same figures.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from lora_router.emulator.batching import InterTokenLatency, Progress, StepCosts, plan_step
from lora_router.emulator.prefix_cache import PrefixCache, block_hashes
from lora_router.emulator.scheduler import Scheduler, Seq
from lora_router.emulator.tokens import generate as emulator_generate
from lora_router.fleet.pace import Pace, PaceRule
from lora_router.routing.contract import Candidates
from lora_router.routing.keys import Lineages, completion_key
from lora_router.routing.policy import WEIGHT_FULL

from .rl_clock_runs import Fleet
from .routing_runs import eligibility
from .routing_traces import MAX_STALENESS, Item

BLOCK = 16  # the emulator's block size (EmulatorConfig) and the router's default
MIN_SLEEP_S = 0.002  # engine.py's _MIN_SLEEP_S: steps shorter than it are run back to back


@dataclass(slots=True)
class Prompt:
    """What `keys.completion_key` reads of a validated completion (`keys.Prompt`)."""

    raw_tokens: bytes
    ids: list[int]
    text: bytes | None = None

    def token_ids(self) -> list[int]:
        return self.ids


@dataclass(slots=True)
class SimRequest:
    """One trace item as the sim needs it, built once per (trace, fleet size, seed)."""

    index: int
    family: int
    parent: int | None
    version: int
    model: str
    prompt: list[int]
    raw: bytes  # the prompt's JSON text, as the router reads it off the body
    hashes: list[int]  # the prompt's block hashes under its adapter's extra keys
    length: int  # completion tokens (ignore_eos: exactly max_tokens)
    output_hashes: list[int] | None  # `Engine._cache_output`'s chain, None: nothing to add


def adapter_keys(model: str) -> tuple[str, str]:
    """The emulator's prefix-cache extra keys of an adapter (0.32 on: name and path)."""
    return (model, f"/adapters/{model}")


def sim_requests(items: list[Item], prefix: str = "trl-policy-v") -> list[SimRequest]:
    """The trace's items with their prompts, hashes and generated tokens (the emulator's own
    generator, as the replicas answer: multi-turn items carry it as `expected`)."""
    import orjson

    out = []
    for item in items:
        body = orjson.loads(item.body)
        prompt, model, length = body["prompt"], body["model"], body["max_tokens"]
        extra = adapter_keys(model)
        generated = item.expected
        if generated is None:
            generated = emulator_generate(
                model, prompt, seed=body["seed"], index=0, max_tokens=length, ignore_eos=True
            ).token_ids
        # engine.py `_cache_output`: the last generated token never had its KV computed.
        computed = prompt + generated[: length - 1]
        output = None
        if len(computed) >= len(prompt) + BLOCK:
            output = block_hashes(computed, BLOCK, extra)
        out.append(
            SimRequest(
                item.index,
                item.family,
                item.parent,
                item.version,
                model,
                prompt,
                orjson.dumps(prompt),
                block_hashes(prompt, BLOCK, extra),
                length,
                output,
            )
        )
        assert item.version == int(model.removeprefix(prefix))
    return out


@dataclass(slots=True, eq=False)
class Job:
    req: SimRequest
    seq: Seq
    progress: Progress | None = None


@dataclass(slots=True, eq=False)
class Copy:
    """One send of a request to a replica: the policy's, or a hedge's (SimSettings.hedge_s)."""

    req: SimRequest
    rep: SimReplica
    tokens: int  # what the router charged it (`Decision.tokens`; 0 for a hedge)
    job: Job | None = None  # at the replica since its arrival
    live: bool = True  # neither answered nor aborted


class SimReplica:
    """One emulated replica: engine.py's state in simulated time, and the router's counts of
    it (`Replica`: name, in_flight, in_flight_tokens) and its pace (`Paced`)."""

    def __init__(self, index: int, fleet: Fleet) -> None:
        self.index = index
        self.name = f"replica-{index}"
        self.in_flight = 0  # the router's counts (fleet/fleet.py `started` / `finished`)
        self.in_flight_tokens = 0
        self.pace = Pace()
        self.costs = StepCosts(
            fleet.prefill_s_per_token,
            fleet.decode_s_per_token,
            fleet.decode_s_per_seq,
            fleet.speeds[index],
        )
        self.budget = fleet.max_num_batched_tokens
        self.cache = PrefixCache(BLOCK, fleet.cache_blocks)
        self.scheduler = Scheduler(fleet.max_num_seqs, MAX_STALENESS + 2)
        self.itl = InterTokenLatency()
        self.progress: dict[Seq, Progress] = {}  # the batch's work, in admission order
        self.jobs: dict[Seq, Job] = {}
        self.queued: list[Job] = []  # waiting for the scheduler
        self.door: list[Job] = []  # arrived while paused (engine.enter)
        self.deferred: list[Job] = []  # finished while paused: frozen until resume
        self.stepping = False  # a chunk of steps is planned and runs
        self.chunk_decoded: list[tuple[list[Progress], float]] = []
        self.chunk_advanced: set[int] = set()  # id() of the Progress advanced
        self.families: list[int] = []  # each request received, its family (the replica log)
        self.itl_seen = (0.0, 0)  # sum and count at the previous scrape


@dataclass(slots=True)
class Outcome:
    sent_at: float = 0.0
    done_at: float = 0.0
    status: int = 0
    error: str = ""


@dataclass(slots=True)
class SimResult:
    outcomes: dict[int, Outcome]
    replicas: list[SimReplica]
    end: float
    syncs: int = 0
    sync_log: list[tuple[float, float]] = field(default_factory=list)  # client held: from, to
    weight_log: list[tuple[float, str, int]] = field(default_factory=list)
    hedges: int = 0  # copies sent by the hedge
    hedges_won: int = 0  # requests whose hedge answered first
    accepted_lengths: dict[int, int] = field(default_factory=dict)  # each answer's tokens


ARRIVE, CHUNK, ANSWER, SCRAPE, RESUME, HEDGE = range(6)


@dataclass(frozen=True, slots=True)
class SimSettings:
    cap: int  # requests in flight (rl_clock's `in_flight`)
    overhead_s: float = 0.0  # per request: half before the replica has it, half after
    sync_s: float = 0.0  # how long a weight sync pauses every replica
    weights: str = "pace"  # pace | fixed | none
    health_interval: float = 2.0
    router_lead_s: float = 0.2  # router start (the first scrape) before the first send
    # Late binding (a design screened, not lora-router's): the router holds each request until
    # a replica has fewer than its weight's share of max_num_seqs in flight, then sends the
    # oldest held one to the least loaded replica with room for its weight ("any"), or to the
    # policy's choice when that one has room, else the same ("home"); "": every request is
    # sent at once, as lora-router does.
    late: str = ""
    # Hedging (a design screened, not lora-router's): a request on a replica below full weight
    # still unanswered `hedge_s` after its send gets one copy on the full-weight replica with
    # the fewest requests in flight; the first answer is the request's, the other copy is
    # aborted then (its place freed at once). 0: off. The copy's completion length is
    # simulate's `hedge_length` of the request: the same (a seeded sample, reproduced) or a
    # fresh draw (an unseeded sample: a new one).
    hedge_s: float = 0.0


def simulate(
    reqs: Sequence[SimRequest],
    fleet: Fleet,
    policy: Any,
    settings: SimSettings,
    hedge_length: Callable[[SimRequest], int] | None = None,
) -> SimResult:
    """Replay `reqs` through `policy` to `fleet` (module docstring of bench/rl_replay.py).
    `hedge_length`: a hedge copy's completion tokens (None: the request's own)."""
    replicas = [SimReplica(i, fleet) for i in range(fleet.replicas)]
    routable: Candidates[SimReplica] = Candidates(replicas)
    policy.set_members(routable)
    lineages = Lineages()
    weight_log: list[tuple[float, str, int]] = []

    def on_weight(name: str, weight: int) -> None:
        weight_log.append((now, name, weight))
        policy.set_weight(name, weight)

    pace = PaceRule(lambda: replicas, on_weight)
    events: list[tuple[float, int, int, int, int]] = []
    counter = 0

    def push(at: float, kind: int, a: int = 0, b: int = 0) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (at, counter, kind, a, b))

    held: deque[SimRequest] = deque()  # late binding: sent by the client, not yet placed

    def pace_weight(rep: SimReplica) -> int:
        return policy.weight(rep.name) if hasattr(policy, "weight") else WEIGHT_FULL

    ready, children = eligibility(reqs)
    by_index = {r.index: r for r in reqs}
    outcomes: dict[int, Outcome] = {}
    copies: list[Copy] = []  # by copy id
    sends: dict[int, list[Copy]] = {}  # a request's copies
    accepted: dict[int, int] = {}  # a request answered: its completion tokens
    hedges_won = 0  # requests whose hedge copy answered first
    running = 0
    loaded = 1  # v1 is live before the clock starts (rl_clock_runs.run_one)
    paused = False
    pauses: list[tuple[float, float]] = []
    client_blocked = False
    syncs = 0
    sync_from = 0.0
    sync_log: list[tuple[float, float]] = []
    half = settings.overhead_s / 2
    now = 0.0

    # --- a replica (engine.py in simulated time) -------------------------------------------

    def admit_queued(rep: SimReplica) -> None:
        """Whatever the scheduler let in: the prompt looked up and registered, its work added
        (Engine.run after `scheduler.admit`)."""
        running_set = rep.scheduler.running
        still = []
        for job in rep.queued:
            if job.seq not in running_set:
                still.append(job)
                continue
            req = job.req
            cached = rep.cache.lookup(req.hashes, len(req.prompt))
            rep.cache.insert(req.hashes)
            job.progress = Progress(len(req.prompt) - cached, req.length)
            rep.progress[job.seq] = job.progress
            rep.jobs[job.seq] = job
        rep.queued = still

    def start_chunk(rep: SimReplica, start: float) -> None:
        """Engine._step_loop's one pass: steps planned back to back until they add up to
        MIN_SLEEP_S, then slept as one."""
        elapsed = 0.0
        advanced: set[int] = set()
        decoded: list[tuple[list[Progress], float]] = []
        costs, budget = rep.costs, rep.budget
        while elapsed < MIN_SLEEP_S:
            work = [p for p in rep.progress.values() if not p.done]
            if not work:
                break
            step, moved = plan_step(work, budget)
            elapsed += costs.step_s(step.decoding, step.prefill_tokens)
            advanced.update(map(id, moved))
            decoded.append((moved[: step.decoding], start + elapsed))
        if not advanced:
            rep.stepping = False
            return
        rep.stepping = True
        rep.chunk_advanced = advanced
        rep.chunk_decoded = decoded
        push(start + elapsed, CHUNK, rep.index)

    def arrive(rep: SimReplica, job: Job) -> None:
        if paused:
            rep.door.append(job)
            return
        rep.families.append(job.req.family)
        rep.queued.append(job)
        rep.scheduler.waiting.append(job.seq)
        rep.scheduler._schedule()  # what `Scheduler.admit` does, without its waiting
        admit_queued(rep)
        if not rep.stepping:
            start_chunk(rep, now)

    def finish(rep: SimReplica, job: Job) -> None:
        if job.req.output_hashes is not None:
            rep.cache.insert(job.req.output_hashes)
        del rep.progress[job.seq]
        del rep.jobs[job.seq]
        rep.scheduler.release(job.seq)
        admit_queued(rep)
        push(now + half, ANSWER, int(job.seq.request_id))

    def abort(copy: Copy) -> None:
        """The router has closed `copy`'s upstream request: the replica drops it."""
        rep, job = copy.rep, copy.job
        if job is None:
            return
        if job.seq in rep.jobs:
            del rep.progress[job.seq]
            del rep.jobs[job.seq]
            rep.scheduler.release(job.seq)
            admit_queued(rep)
            if not rep.stepping and not paused:
                start_chunk(rep, now)
        for waiting in (rep.queued, rep.door, rep.deferred):
            if job in waiting:
                waiting.remove(job)
        rep.scheduler._drop(job.seq)

    def chunk_end(rep: SimReplica) -> None:
        for decoders, end in rep.chunk_decoded:
            rep.itl.decoded(decoders, end)
        advanced = rep.chunk_advanced
        done = [
            job
            for job in rep.jobs.values()
            if job.progress is not None and id(job.progress) in advanced and job.progress.done
        ]
        rep.stepping = False
        if paused:  # keep mode: no step runs, the finished freeze before they answer
            rep.deferred += done
            return
        start_chunk(rep, now)  # planned before the woken sequences run (Engine._step_loop)
        for job in done:
            finish(rep, job)
        if not rep.stepping:
            start_chunk(rep, now)

    def resume() -> None:
        nonlocal paused
        paused = False
        for rep in replicas:
            if not rep.stepping:
                start_chunk(rep, now)
            deferred, rep.deferred = rep.deferred, []
            for job in deferred:
                finish(rep, job)
            door, rep.door = rep.door, []
            for job in door:
                arrive(rep, job)
            if not rep.stepping:
                start_chunk(rep, now)

    # --- the client (rl_clock_runs.Rollouts over routing_runs.drive) and the router -------

    def sync_done() -> None:
        nonlocal client_blocked, loaded, syncs
        sync_log.append((sync_from, now))
        client_blocked = False
        loaded += 1
        syncs += 1

    def fill() -> None:
        nonlocal running, paused, client_blocked, sync_from
        while ready and running < settings.cap and not client_blocked:
            req = by_index[ready[0]]
            if req.version > loaded:
                # TRL's sync of loaded + 1 through the router: pause, load, resume, then the
                # unload of v(N-5), which lora-router answers at once (it drains its requests
                # in the background: fleet/broadcast.py `unload`).
                client_blocked = True
                sync_from = now
                if settings.sync_s > 0:
                    paused = True
                    pauses.append((now, now + settings.sync_s))
                push(now + settings.sync_s, RESUME)
                return
            heapq.heappop(ready)
            running += 1
            outcomes[req.index] = Outcome(sent_at=now)
            if settings.late:
                held.append(req)
                continue
            send(req, None)
        if settings.late:
            release()

    def room(rep: SimReplica) -> bool:
        share = pace_weight(rep) / WEIGHT_FULL
        return rep.in_flight < max(1, int(fleet.max_num_seqs * share))

    def release() -> None:
        """Late binding: the oldest held requests, while a replica has room."""
        while held:
            free = [r for r in replicas if room(r)]
            if not free:
                return
            send(held.popleft(), free)

    def send(req: SimRequest, free: list[SimReplica] | None) -> None:
        """`req` to the policy's choice, or under late binding (`free`: the replicas with
        room) to the least loaded of them for its weight unless the choice has room ("home")."""
        seeds = lineages.seeds(req.model, True)
        key = completion_key(Prompt(req.raw, req.prompt), seeds, BLOCK)
        decision = policy.choose(key, routable)
        rep = decision.replica
        if free is not None and (settings.late == "any" or rep not in free):
            rep = min(free, key=lambda r: (r.in_flight / max(pace_weight(r), 1), r.index))
        dispatch(Copy(req, rep, decision.tokens))
        if settings.hedge_s > 0:
            push(now + settings.hedge_s, HEDGE, req.index)

    def dispatch(copy: Copy) -> None:
        copies.append(copy)
        sends.setdefault(copy.req.index, []).append(copy)
        rep = copy.rep
        rep.in_flight += 1  # Fleet.started
        rep.in_flight_tokens += copy.tokens
        routable.in_flight += 1
        policy.load_changed(rep)
        push(now + half, ARRIVE, rep.index, len(copies) - 1)

    def hedge(index: int) -> None:
        """SimSettings.hedge_s: a copy of a request still unanswered on a slow replica."""
        if index in accepted or len(sends[index]) > 1:
            return
        (first,) = sends[index]
        full = [r for r in replicas if pace_weight(r) >= WEIGHT_FULL]
        if pace_weight(first.rep) >= WEIGHT_FULL or not full:
            return
        target = min(full, key=lambda r: (r.in_flight, r.index))
        req = first.req
        if hedge_length is not None and (length := hedge_length(req)) != req.length:
            req = replace(req, length=length, output_hashes=None)
        dispatch(Copy(req, target, 0))

    def settle(copy: Copy) -> None:
        """`copy` leaves the router's counts (Fleet.finished)."""
        copy.live = False
        rep = copy.rep
        rep.in_flight -= 1
        rep.in_flight_tokens -= copy.tokens
        routable.in_flight -= 1
        policy.load_changed(rep)

    def answered(copy: Copy) -> None:
        nonlocal running, hedges_won
        index = copy.req.index
        settle(copy)
        accepted[index] = copy.req.length
        hedges_won += copy is not sends[index][0]
        for twin in sends[index]:
            if twin.live:
                abort(twin)
                settle(twin)
        out = outcomes[index]
        out.done_at, out.status = now, 200
        running -= 1
        for child in children.get(index, ()):
            heapq.heappush(ready, child)
        if settings.late:
            release()

    # --- telemetry (fleet/telemetry.py's rounds, fleet/pace.py's rule) ----------------------

    def paused_within(begin: float, end: float) -> float:
        return sum(max(0.0, min(end, b) - max(begin, a)) for a, b in pauses)

    def scrape() -> None:
        for rep in replicas:
            seen_sum, seen_count = rep.itl_seen
            report = _Report(
                settings.health_interval,
                rep.itl.count,
                rep.itl.sum - seen_sum,
                rep.itl.count - seen_count,
            )
            rep.itl_seen = (rep.itl.sum, rep.itl.count)
            pace.scraped(rep, report, now, paused_within(now - settings.health_interval, now))  # type: ignore[arg-type]
        pace.judge(now)

    if settings.weights == "pace":
        push(settings.health_interval - settings.router_lead_s, SCRAPE)
    elif settings.weights == "fixed":
        push(settings.health_interval - settings.router_lead_s, SCRAPE, 1)

    fill()
    total = len(reqs)
    answered_count = 0
    while events and answered_count < total:
        now, _, kind, a, b = heapq.heappop(events)
        if kind == CHUNK:
            chunk_end(replicas[a])
        elif kind == ARRIVE:
            copy = copies[b]
            if copy.live:  # else aborted on its way
                copy.job = Job(copy.req, Seq(request_id=str(b), lora_id=copy.req.version))
                arrive(replicas[a], copy.job)
        elif kind == ANSWER:
            if copies[a].live:
                answered(copies[a])
                answered_count = len(accepted)
                fill()
        elif kind == HEDGE:
            hedge(a)
        elif kind == RESUME:
            resume()
            sync_done()  # the unload is answered at once and drains in the background
            fill()
        elif kind == SCRAPE:
            if a == 1:  # fixed: each replica's speed as a weight, once
                for rep in replicas:
                    pace._set(rep, round(rep.costs.speed * WEIGHT_FULL))  # calls on_weight
            else:
                scrape()
                push(now + settings.health_interval, SCRAPE)
    hedges = len(copies) - len(sends)  # every send past a request's first
    return SimResult(
        outcomes, replicas, now, syncs, sync_log, weight_log, hedges, hedges_won, accepted
    )


@dataclass(frozen=True, slots=True)
class _Report:
    """What `PaceRule.scraped` reads of a `fleet.report.Report`."""

    interval: float
    token_latency_count: float | None
    interval_token_latency: float
    interval_decoded: float


def policy_weights(result: SimResult) -> tuple[list[float], list[int]]:
    """Each replica's weight at the end (as a share of full) and how often it changed."""
    return (
        [r.pace.weight / WEIGHT_FULL for r in result.replicas],
        [r.pace.changes for r in result.replicas],
    )
