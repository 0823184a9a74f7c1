"""The fault bench's trainer, driven like TRL's AsyncGRPOTrainer, and the faults it injects
(kills, a replica answering 500, an early unload, a flapping listing)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from lora_router.emulator import write_adapter
from lora_router.testbed import grpo_trace
from lora_router.tools.demo import check_answer

from .faults_setup import (
    ATTEMPT_TIMEOUT_S,
    BACKOFF_S,
    CONTROL_TIMEOUT_S,
    EARLY_BURST,
    EARLY_UNLOAD_DELAY_S,
    FAST_POLL_S,
    KEEP_VERSIONS,
    LISTING_S,
    LOAD_KILL_OFFSET_S,
    PHASE_WAIT_S,
    REPLICA_HEADER,
    SLOW_POLL_S,
    Cluster,
    Episode,
    Prober,
    Settings,
    wait_listening,
)

# --- the trainer ----------------------------------------------------------------------------


@dataclass(slots=True)
class Attempt:
    started: float
    ended: float
    status: int  # 0: no status line reached the client
    replica: str  # the x-lora-router-replica header, "" if none
    kind: str  # ok | status | cut | transport
    detail: str = ""
    frames: int = 0  # SSE data frames received (streams)
    model: str = ""  # the adapter the attempt named (the version read when it was sent)
    completion: list[int] = field(default_factory=list)  # its token ids (whole answers only)


@dataclass(slots=True)
class Rollout:
    step: int
    stream: bool
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return bool(self.attempts) and self.attempts[-1].kind == "ok"


@dataclass(slots=True)
class ControlCall:
    started: float
    ended: float
    what: str
    status: int
    detail: str = ""


class TrainingStopped(Exception):
    """A load TRL would treat as fatal."""


class Trainer:
    """Syncs adapters and sends rollouts through the router the way TRL does."""

    def __init__(self, settings: Settings, url: str, adapters: Path) -> None:
        self.settings = settings
        self.url = url
        self.adapters = adapters
        self.rng = random.Random(settings.seed)
        self.rollouts: list[Rollout] = []
        self.controls: list[ControlCall] = []
        self.client_retries = 0
        self.stopped = ""  # why the run stopped early, if it did
        self.loading = asyncio.Event()  # set while a load broadcast is in flight
        self.load_started = 0.0
        self.syncing = False
        self.step = 0
        self.version = 0  # the version rollouts name, read at each request (TRL's worker)
        # An `unload` episode asks the next sync to also unload the version it supersedes,
        # while that version's rollouts are still in flight; the sync reports it here.
        self.early_unload: asyncio.Future[tuple[str, ControlCall]] | None = None
        self.unloaded: set[int] = set()
        self.extra: list[asyncio.Task[Rollout]] = []  # rollouts outside the steps (`unload`)
        spec = grpo_trace.TraceSpec(
            steps=10_000,  # generated lazily, one step at a time
            prompts_per_step=settings.prompts,
            group_size=settings.group,
            seed=settings.seed,
        )
        self._trace = grpo_trace.generate(spec)
        self._http: aiohttp.ClientSession | None = None

    async def drive(self, http: aiohttp.ClientSession, stop: Callable[[], bool]) -> None:
        self._http = http
        tasks: dict[int, asyncio.Task[None]] = {}
        halves: dict[int, asyncio.Event] = {}
        try:
            n = 0
            while not stop():
                n += 1
                if n > 1:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(halves[n - 1].wait(), CONTROL_TIMEOUT_S)
                    if stop():
                        break
                try:
                    await self.sync(n, tasks)
                except TrainingStopped as exc:
                    self.stopped = str(exc)  # what TRL would die of; reported, run ends
                    break
                halves[n] = asyncio.Event()
                tasks[n] = asyncio.create_task(self.step_rollouts(n, halves[n]))
            await asyncio.gather(*tasks.values(), *self.extra)
        finally:
            for task in (*tasks.values(), *self.extra):
                task.cancel()
            await asyncio.gather(*tasks.values(), *self.extra, return_exceptions=True)

    async def sync(self, n: int, tasks: dict[int, asyncio.Task[None]]) -> None:
        """pause(keep) -> write vN -> load vN -> resume -> unload v(N-3) -> rollouts name vN,
        as TRL's trainer does (it does not wait for the old version's rollouts)."""
        self.syncing = True
        try:
            await self.control("/pause?mode=keep")
            name = f"trl-policy-v{n}"
            final = self.adapters / name
            staging = self.adapters / f".{name}.tmp"
            write_adapter(staging, rank=1)
            os.replace(staging, final)  # atomic rename, as TRL saves
            self.load_started = time.time()
            self.loading.set()
            try:
                ok = await self.control(
                    "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(final)}
                )
            finally:
                self.loading.clear()
            if not ok:
                raise TrainingStopped(f"loading {name} failed: {self.controls[-1].detail}")
            await self.control("/resume")
            self.step = n
            old = n - KEEP_VERSIONS
            if old >= 1 and old not in self.unloaded:
                self.unloaded.add(old)
                await self.control("/v1/unload_lora_adapter", {"lora_name": f"trl-policy-v{old}"})
            early = self.early_unload
            if early is not None and not early.done() and n >= 2:
                # The worker goes on naming v(N-1) until the trainer moves on: a last burst of
                # its rollouts, which queue in the router behind the others.
                prompt = next(self._trace).tokens
                for _ in range(EARLY_BURST):
                    seed = self.rng.randrange(2**31)
                    self.extra.append(asyncio.create_task(self.rollout(n - 1, prompt, seed, False)))
                await asyncio.sleep(0)  # each has read v(N-1) and is on its way
            self.version = n
            if early is not None and not early.done() and n >= 2:
                self.unloaded.add(n - 1)
                # Requests read the version as they are sent: give the ones already reading
                # v(N-1) a moment to reach the router, so every later one names vN.
                await asyncio.sleep(EARLY_UNLOAD_DELAY_S)
                await self.control("/v1/unload_lora_adapter", {"lora_name": f"trl-policy-v{n - 1}"})
                early.set_result((f"trl-policy-v{n - 1}", self.controls[-1]))
        finally:
            self.syncing = False

    async def control(self, path: str, body: object = None) -> bool:
        assert self._http is not None
        started = time.time()
        status, detail = 0, ""
        try:
            async with self._http.post(
                self.url + path, json=body, timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S)
            ) as resp:
                status = resp.status
                text = await resp.text()
                if status != 200:
                    detail = text.strip()[:300]
        except (aiohttp.ClientError, TimeoutError) as exc:
            detail = f"{type(exc).__name__}: {exc}"
        self.controls.append(ControlCall(started, time.time(), path, status, detail))
        return status == 200

    async def step_rollouts(self, n: int, half: asyncio.Event) -> None:
        """S prompts x G samples naming vN, every sample its own request."""
        prompts: list[list[int]] = []
        for _ in range(self.settings.prompts * self.settings.group):
            request = next(self._trace)
            if request.sample == 0:
                prompts.append(request.tokens)
        done = 0

        async def group(index: int, prompt: list[int]) -> None:
            nonlocal done
            stream = index % 4 == 0
            await asyncio.gather(
                *(
                    self.rollout(n, prompt, self.rng.randrange(2**31), stream)
                    for _ in range(self.settings.group)
                )
            )
            done += 1
            if 2 * done >= len(prompts):
                half.set()

        await asyncio.gather(*(group(i, p) for i, p in enumerate(prompts)))
        half.set()

    async def rollout(self, n: int, prompt: list[int], seed: int, stream: bool) -> Rollout:
        record = Rollout(n, stream)
        self.rollouts.append(record)
        for attempt in range(len(BACKOFF_S) + 1):
            # The version is read at each request, as TRL's rollout worker does.
            result = await self.attempt(self.body(prompt, seed, stream), stream)
            record.attempts.append(result)
            if result.kind == "ok" or attempt == len(BACKOFF_S):
                break
            self.client_retries += 1
            await asyncio.sleep(BACKOFF_S[attempt])
        return record

    def body(self, prompt: list[int], seed: int, stream: bool) -> bytes:
        body: dict[str, Any] = {
            "model": f"trl-policy-v{self.version}",
            "prompt": prompt,
            "max_tokens": self.settings.max_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "n": 1,
            "return_token_ids": True,
            "logprobs": 0,
            "seed": seed,
        }
        if stream:
            body["stream"] = True
        return orjson.dumps(body)

    async def attempt(self, data: bytes, stream: bool) -> Attempt:
        assert self._http is not None
        model = f"trl-policy-v{self.version}"
        started = time.time()
        status, replica = 0, ""
        chunks: list[bytes] = []
        try:
            async with self._http.post(
                self.url + "/v1/completions",
                data=data,
                headers={"content-type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=ATTEMPT_TIMEOUT_S),
            ) as resp:
                status = resp.status
                replica = resp.headers.get(REPLICA_HEADER, "")
                async for chunk in resp.content.iter_any():
                    chunks.append(chunk)
        except (aiohttp.ClientError, TimeoutError) as exc:
            kind = "cut" if status else "transport"
            frames = b"".join(chunks).count(b"data: ")
            return Attempt(
                started, time.time(), status, replica, kind, type(exc).__name__, frames, model
            )
        ended = time.time()
        raw = b"".join(chunks)
        if status != 200:
            return Attempt(started, ended, status, replica, "status", _error_message(raw), 0, model)
        problem = check_answer(status, raw, stream)
        kind = "ok" if problem is None else "cut"
        ids: list[int] = []
        if problem is None and not stream:  # what a later turn's prompt carries on
            ids = orjson.loads(raw)["choices"][0].get("token_ids") or []
        return Attempt(started, ended, status, replica, kind, problem or "", 0, model, ids)


def _error_message(raw: bytes) -> str:
    with contextlib.suppress(orjson.JSONDecodeError, TypeError, KeyError, AttributeError):
        return str(orjson.loads(raw)["error"]["message"])[:300]
    return raw[:300].decode("utf-8", "replace")


# --- faults ---------------------------------------------------------------------------------


@dataclass(slots=True)
class EpisodeRun:
    episode: Episode
    rid: int
    phase_met: bool = False
    killed: float = 0.0
    spawned: float = 0.0
    listening: float = 0.0
    admitted: float = 0.0  # first poll showing it admitted again (0: never)
    incarnation: int = 0  # which access log the restarted process writes
    # Soft faults (5xx, unload, listing): `killed` is when the fault began, `ended` when it
    # was lifted, `admitted` when the episode was over.
    ended: float = 0.0
    unloaded: str = ""  # `unload`: the version unloaded early
    unload_call: ControlCall | None = None


KILLS = ("rollout", "load")
SOFT = ("5xx", "5xx-all", "unload", "listing")


async def inject(
    episodes: Sequence[Episode],
    cluster: Cluster,
    trainer: Trainer,
    prober: Prober,
    t0: float,
    down: float,
) -> list[EpisodeRun]:
    """Run the episodes in order: wait for the set time and phase, kill, wait, restart, wait
    for the router to admit the replica again."""
    runs = []
    for episode in episodes:
        run = EpisodeRun(episode, episode.victim)
        runs.append(run)
        await _sleep_until(t0 + episode.at - 0.3)
        prober.interval = FAST_POLL_S
        await _sleep_until(t0 + episode.at)
        if episode.phase in SOFT:
            await soft_fault(run, cluster, trainer, prober, down)
            prober.interval = SLOW_POLL_S
            continue
        run.phase_met = await _wait_phase(episode.phase, trainer)
        run.killed = cluster.kill(episode.victim)
        await _sleep_until(run.killed + down)
        run.spawned = cluster.restart(episode.victim)
        run.incarnation = cluster.incarnations[episode.victim]
        run.listening = await wait_listening(cluster.ports[episode.victim])
        deadline = time.time() + 30.0
        while time.time() < deadline:
            found = prober.first(run.rid, True, run.listening)
            if found is not None:
                run.admitted = found[1]
                break
            await asyncio.sleep(FAST_POLL_S)
        await asyncio.sleep(0.5)
        prober.interval = SLOW_POLL_S
    return runs


async def soft_fault(
    run: EpisodeRun, cluster: Cluster, trainer: Trainer, prober: Prober, down: float
) -> None:
    """`5xx`: the victim answers 500 to every completion (its /health stays 200) for `down` s;
    `5xx-all`: every replica does.
    `unload`: the next sync also unloads the version it supersedes, with its rollouts in
    flight. `listing`: every other /v1/models answer of the victim lists no adapter (a load
    balancer over two servers) for LISTING_S, then the episode lasts until it serves again."""
    phase, url = run.episode.phase, cluster.url(run.rid)
    run.phase_met = True
    run.killed = time.time()
    if phase == "unload":
        done: asyncio.Future[tuple[str, ControlCall]] = asyncio.get_running_loop().create_future()
        trainer.early_unload = done
        try:
            run.unloaded, call = await asyncio.wait_for(done, CONTROL_TIMEOUT_S)
        except TimeoutError:  # no sync came (the run stopped): reported as a missed phase
            run.phase_met = False
            run.ended = run.admitted = time.time()
            return
        run.unload_call = call
        run.ended = run.admitted = call.ended
        return
    if phase == "5xx-all":  # every replica at once: a fleet-wide failure, for `down` s
        urls = [cluster.url(i) for i in range(len(cluster.ports))]
        await asyncio.gather(*(set_fault(prober.http, u, {"error_rate": 1.0}) for u in urls))
        await asyncio.sleep(down)
        await asyncio.gather(*(set_fault(prober.http, u, {"error_rate": 0.0}) for u in urls))
        run.ended = run.admitted = time.time()
        return
    switch, value = ("error_rate", 1.0) if phase == "5xx" else ("hide_adapters", 2)
    await set_fault(prober.http, url, {switch: value})
    await asyncio.sleep(down if phase == "5xx" else LISTING_S)
    await set_fault(prober.http, url, {switch: 0 if phase == "listing" else 0.0})
    run.ended = time.time()
    if phase == "5xx":
        run.admitted = run.ended
        return
    deadline = run.ended + 60.0
    while time.time() < deadline:
        found = prober.first(run.rid, True, run.ended)
        if found is not None:
            run.admitted = found[1]
            return
        await asyncio.sleep(FAST_POLL_S)


async def set_fault(http: aiohttp.ClientSession, url: str, changes: dict[str, Any]) -> None:
    async with http.post(url + "/emulator/faults", json=changes) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: /emulator/faults answered {resp.status}")


async def _sleep_until(t: float) -> None:
    delay = t - time.time()
    if delay > 0:
        await asyncio.sleep(delay)


async def _wait_phase(phase: str, trainer: Trainer) -> bool:
    """Wait (bounded) for the moment the episode wants; returns whether it came."""
    deadline = time.time() + PHASE_WAIT_S
    while time.time() < deadline:
        # A load that has just started, so the kill lands inside it.
        fresh = time.time() - trainer.load_started < LOAD_KILL_OFFSET_S / 2
        if phase == "load" and trainer.loading.is_set() and fresh:
            await _sleep_until(trainer.load_started + LOAD_KILL_OFFSET_S)
            return trainer.loading.is_set()
        if phase == "rollout" and not trainer.syncing:
            return True
        await asyncio.sleep(0.002)
    return False


async def reference_replay(url: str, adapters: Path, count: int, repeat: int = 3) -> list[float]:
    """One replay of `count` adapters done by hand on an empty replica: what readmit sends
    (its /v1/models, the loads concurrently, /v1/models again, /resume), timed."""
    times = []
    async with aiohttp.ClientSession() as http:

        async def call(method: str, path: str, body: object = None) -> None:
            async with http.request(method, url + path, json=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"spare replica: {method} {path} answered {resp.status}")

        for r in range(repeat):
            names = [f"replay-{r}-{k}" for k in range(count)]
            for name in names:
                write_adapter(adapters / name, rank=1)
            started = time.perf_counter()
            await call("GET", "/v1/models")
            await asyncio.gather(
                *(
                    call(
                        "POST",
                        "/v1/load_lora_adapter",
                        {"lora_name": n, "lora_path": str(adapters / n)},
                    )
                    for n in names
                )
            )
            await call("GET", "/v1/models")
            await call("POST", "/resume")
            times.append(time.perf_counter() - started)
            for name in names:
                await call("POST", "/v1/unload_lora_adapter", {"lora_name": name})
    return times
