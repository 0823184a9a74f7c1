"""`lora-router --demo`: the whole mission on one machine, in seconds, with no GPU.

It starts N emulated vLLM replicas in this process (a timing model, a prefix cache, and mount
lag on the last one, so an adapter load there needs retries the way a network bucket does), a
router in front of them, writes LoRA adapters to a temporary directory, and drives a short
GRPO-shaped run over real HTTP as TRL 1.16's AsyncGRPOTrainer does (docs/trl-guide.md):

- start: `GET /health`, `GET /server_info?config_format=json` (LoRA on, enough slots, DP 1),
  `GET /v1/models` (the base model first, with its `max_model_len`);
- each step N: `POST /pause?mode=keep` → write `trl-policy-vN` (atomic rename) →
  `POST /v1/load_lora_adapter` → `POST /resume` → unload `v(N-5)` once N > max_staleness + 1,
  and delete the directory of `v(N-6)`;
- rollouts: S prompts x G = 8 separate `/v1/completions` requests, the same token-id prompt
  (chat-templated, sharing that prefix with the other prompts), `n` 1, `return_token_ids`,
  `logprobs` 0, and each its own `seed`, as TRL 1.16 sends them (so the G bodies differ); every
  fourth group is streamed (SSE) to show that streams pass through untouched.

Two liberties, both to exercise the router rather than to flatter it. The first two groups of
each step are sent *eagerly*, naming `vN` while its load is still being broadcast (TRL names it
once the load returned; another client, or a faster worker, might not). That is what the
version fence is for: the router holds those requests until every replica holds `vN`. And, as
in an asynchronous trainer, the next sync starts while half of the previous step's rollouts are
still in flight, so `pause?mode=keep` freezes real work.

At the end a table says what happened (demo_report.py): requests per replica, affinity (the
share of siblings that ran on their group's majority replica), the prefix-cache hit rate read
from each replica's `/metrics`, fence waits, loads and their time. The demo exits 1 if any
request failed.

This module is a client of the router, never a part of it: it reads the router's behaviour
from HTTP answers only (the `x-lora-router-replica` header says which replica answered).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import aiohttp
import orjson
from tqdm import tqdm

from lora_router.config import Config, ReplicaAddress
from lora_router.emulator import Emulator, EmulatorConfig, Faults, start_emulator, write_adapter
from lora_router.emulator.prefix_cache import PrefixCache, block_hashes
from lora_router.emulator.tokens import apply_chat_template
from lora_router.runtime import RouterRuntime

REPLICA_HEADER = "x-lora-router-replica"
BLOCK_SIZE = 16  # the emulated replicas' KV block size (vLLM's default)
EAGER_DELAY = 0.05  # seconds between sending a load and the eager requests naming it
# Qwen2.5-Math's system prompt: with the chat template around it, the prefix all prompts share.
SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."
# Problem statements are a few of these sentences: a few hundred tokens each, like GSM8K/MATH.
_SENTENCES = (
    "A train leaves the station at {a} km/h and a second one follows {b} minutes later.",
    "Let n be the smallest positive integer such that n^2 + {a}n + {b} is divisible by {c}.",
    "A bag holds {a} red marbles, {b} blue marbles and {c} green marbles.",
    "Two marbles are drawn at random without replacement.",
    "The perimeter of a rectangle is {a} cm and its area is {b} square centimetres.",
    "Each of the {a} students shakes hands with every other student exactly once.",
    "A sequence starts with {a} and {b}, and every later term is the sum of the two before it.",
    "The price of a book rises by {a} percent, then falls by {b} percent.",
    "A circle of radius {a} is inscribed in a square, and a smaller square in the circle.",
    "Find the remainder when {a}^{b} is divided by {c}.",
    "How many ordered pairs of integers satisfy the conditions above?",
    "Express the answer as a common fraction in lowest terms.",
)


@dataclass(frozen=True, slots=True)
class DemoPlan:
    """The size of the run; the defaults finish in a few seconds on one core."""

    replicas: int = 3
    steps: int = 7
    prompts: int = 12  # S: prompts per step
    group: int = 8  # G: samples per prompt, separate requests (same prompt, own seeds)
    max_tokens: int = 32
    stream_every: int = 4  # every k-th group is streamed
    eager_groups: int = 2  # groups per step sent while their adapter is still loading
    max_staleness: int = 4
    mount_lag: int = 2  # load attempts per path the last replica answers 404 before it sees it
    policy: str = "prefix"  # the router's --policy
    seed: int = 1234
    # Other routing flags given with `lora-router --demo` (Config field -> value).
    routing: tuple[tuple[str, Any], ...] = ()


@dataclass(slots=True)
class ReplicaStats:
    name: str
    requests: int = 0
    cache_queries: float = 0.0
    cache_hits: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cache_hits / self.cache_queries if self.cache_queries else 0.0


@dataclass(slots=True)
class DemoResult:
    """What happened, as the client saw it plus each replica's `/metrics`."""

    plan: DemoPlan
    replicas: list[ReplicaStats]
    requests: int = 0
    streamed: int = 0
    failures: list[str] = field(default_factory=list)
    affinity: float = 0.0
    ideal_hit_rate: float = 0.0  # one replica with an unbounded cache, siblings one by one
    fence_waits: list[float] = field(default_factory=list)  # seconds, one per held request
    load_times: list[float] = field(default_factory=list)
    unloads: int = 0
    wall: float = 0.0
    # The router's `routing_accuracy` (observe/accuracy.py): cached prompt tokens it predicted
    # and those the replicas reported, over the answers that carried a report.
    predicted_cached: int = 0
    reported_cached: int = 0
    counted: int = 0  # answers both figures cover (none when the policy predicts nothing)

    @property
    def hit_rate(self) -> float:
        queries = sum(r.cache_queries for r in self.replicas)
        return sum(r.cache_hits for r in self.replicas) / queries if queries else 0.0

    @property
    def ok(self) -> bool:
        return not self.failures


@dataclass(slots=True)
class _Step:
    version: int
    load_sent: float = 0.0
    load_done: float | None = None
    load_sent_event: asyncio.Event = field(default_factory=asyncio.Event)
    load_finished: asyncio.Event = field(default_factory=asyncio.Event)


class DemoError(Exception):
    """A call of the TRL sequence got an answer TRL would treat as fatal."""


# --- the run --------------------------------------------------------------------------------


async def run(plan: DemoPlan, progress: TextIO | None = sys.stderr) -> DemoResult:
    """Start replicas and router, drive the run, stop everything; return what happened."""
    workdir = Path(tempfile.mkdtemp(prefix="lora-router-demo-"))
    emulators: list[Emulator] = []
    runtime: RouterRuntime | None = None
    cancelled = False
    try:
        for i in range(plan.replicas):
            lagging = i == plan.replicas - 1 and plan.replicas > 1
            emulators.append(
                await start_emulator(
                    EmulatorConfig(
                        port=0,
                        max_lora_rank=8,
                        block_size=BLOCK_SIZE,
                        max_loras=plan.max_staleness + 2,
                        prefill_s_per_token=20e-6,
                        decode_s_per_token=1e-3,
                        mean_output_tokens=plan.max_tokens // 2,
                        max_num_seqs=64,
                        seed=plan.seed + i,
                        faults=Faults(mount_lag=plan.mount_lag if lagging else 0),
                    )
                )
            )
        addresses = tuple(ReplicaAddress.parse(e.url) for e in emulators)
        runtime = RouterRuntime(
            Config(
                replicas=addresses,
                port=0,
                load_retry_interval=0.15,
                load_deadline=30.0,
                fence_timeout=30.0,
                health_interval=0.5,
                max_staleness=plan.max_staleness,
                policy=plan.policy,
                **dict(plan.routing),
                log_level="warning",
                status_interval=0.0,
            )
        )
        await runtime.start()
        if progress is not None:
            print(
                f"lora-router demo: a router on {runtime.url} in front of {plan.replicas} "
                f"emulated vLLM replicas; {plan.steps} syncs, {plan.prompts} prompts x "
                f"{plan.group} samples per step",
                file=progress,
            )
        result = DemoResult(plan=plan, replicas=[ReplicaStats(a.name) for a in addresses])
        started = time.perf_counter()
        await _Run(plan, runtime.url, workdir, result, progress).drive()
        result.wall = time.perf_counter() - started
        await _read_cache_metrics(result, [e.url for e in emulators], runtime.url)
        return result
    except asyncio.CancelledError:  # Ctrl-C: stopping now fails what is in flight, on purpose
        cancelled = True
        raise
    finally:
        # An interrupted run's own teardown is no news: its warnings are not shown.
        with _logging_off() if cancelled else contextlib.nullcontext():
            if runtime is not None:
                await runtime.stop()
            for emulator in emulators:
                await emulator.stop()
        shutil.rmtree(workdir, ignore_errors=True)


@contextlib.contextmanager
def _logging_off() -> Iterator[None]:
    logging.disable(logging.CRITICAL)
    try:
        yield
    finally:
        logging.disable(logging.NOTSET)


class _Run:
    """The trainer and its rollout worker, talking to the router like TRL does."""

    http: aiohttp.ClientSession  # open for the duration of `drive`

    def __init__(
        self,
        plan: DemoPlan,
        url: str,
        workdir: Path,
        result: DemoResult,
        progress: TextIO | None,
    ) -> None:
        self.plan = plan
        self.url = url
        self.adapter_root = workdir / ".vllm_lora"
        self.result = result
        self.progress = progress
        self.rng = random.Random(plan.seed)
        self.placements: list[list[str]] = []  # the replica of each sample, per group
        self.trace: list[tuple[int, list[int]]] = []  # (version, prompt) per group, as sent
        self.bar: tqdm[Any] | None = None

    async def drive(self) -> None:
        plan = self.plan
        total = plan.steps * plan.prompts * plan.group
        timeout = aiohttp.ClientTimeout(total=60)
        connector = aiohttp.TCPConnector(limit=0)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as http:
            self.http = http
            await self.start_up()
            with tqdm(
                total=total,
                unit="req",
                desc="GRPO demo",
                file=self.progress,
                disable=self.progress is None,
                leave=False,
                dynamic_ncols=True,
                mininterval=0.2,
            ) as bar:
                self.bar = bar
                rollouts: list[asyncio.Task[None]] = []
                half_done: asyncio.Event | None = None
                try:
                    for n in range(1, plan.steps + 1):
                        if half_done is not None:
                            await half_done.wait()  # async trainer: sync while rollouts run
                        step = _Step(version=n)
                        half_done = asyncio.Event()
                        rollouts.append(asyncio.create_task(self.rollouts(step, half_done)))
                        await self.sync(step)
                        bar.set_postfix_str(f"trl-policy-v{n} live")
                    await asyncio.gather(*rollouts)
                finally:
                    for task in rollouts:  # a fatal sync error leaves rollouts behind
                        task.cancel()
                    await asyncio.gather(*rollouts, return_exceptions=True)
        self.result.affinity = _affinity(self.placements)
        self.result.ideal_hit_rate = _ideal_hit_rate(self.trace, self.plan.group)

    async def start_up(self) -> None:
        """TRL's start: poll /health, read /server_info and /v1/models."""
        deadline = time.monotonic() + 30
        while True:
            async with self.http.get(self.url + "/health") as resp:
                if resp.status == 200:
                    break
            if time.monotonic() > deadline:
                raise DemoError(f"/health answered {resp.status} for 30 s")
            await asyncio.sleep(0.2)
        info = await self.get_json("/server_info?config_format=json")
        vllm = info.get("vllm_config") or {}
        lora = vllm.get("lora_config")
        if not lora:
            raise DemoError("server_info: lora_config is null (LoRA disabled)")
        if lora.get("max_loras", 0) < self.plan.max_staleness + 2:
            raise DemoError(f"server_info: max_loras {lora.get('max_loras')} is too small")
        dp = (vllm.get("parallel_config") or {}).get("data_parallel_size", 1)
        if dp != 1:
            raise DemoError(f"server_info: data_parallel_size is {dp}")
        models = await self.get_json("/v1/models")
        if not models["data"] or models["data"][0].get("max_model_len") is None:
            raise DemoError("/v1/models: entry 0 is not the base model")

    async def sync(self, step: _Step) -> None:
        """pause → save vN → load vN → resume → unload v(N-5), delete v(N-6)."""
        n = step.version
        await self.control("POST", "/pause?mode=keep")
        name = f"trl-policy-v{n}"
        path = self.save_adapter(name)
        step.load_sent = time.perf_counter()
        load = asyncio.create_task(
            self.control(
                "POST",
                "/v1/load_lora_adapter",
                {"lora_name": name, "lora_path": str(path), "load_inplace": False},
            )
        )
        step.load_sent_event.set()
        try:
            await load
        finally:
            step.load_done = time.perf_counter()
            step.load_finished.set()
        self.result.load_times.append(step.load_done - step.load_sent)
        await self.control("POST", "/resume")
        old = n - self.plan.max_staleness - 1
        if old >= 1:
            # TRL ignores this answer; the demo does too, but counts it.
            async with self.http.post(
                self.url + "/v1/unload_lora_adapter", json={"lora_name": f"trl-policy-v{old}"}
            ) as resp:
                await resp.read()
                self.result.unloads += resp.status == 200
        if old - 1 >= 1:
            shutil.rmtree(self.adapter_root / f"trl-policy-v{old - 1}", ignore_errors=True)

    def save_adapter(self, name: str) -> Path:
        """Write the adapter under a temporary name and rename it into place, as TRL does."""
        final = self.adapter_root / name
        staging = self.adapter_root / f".{name}.tmp"
        write_adapter(staging, rank=1)
        os.replace(staging, final)
        return final.resolve()

    async def rollouts(self, step: _Step, half_done: asyncio.Event) -> None:
        """S prompts x G samples naming vN, every sample its own request.

        The first `eager_groups` groups go out while vN is still loading (they wait at the
        fence); the others once the load has returned, as TRL sends them.
        """
        plan = self.plan
        prompts = [self.new_prompt() for _ in range(plan.prompts)]
        eager = min(plan.eager_groups, len(prompts))
        done = 0

        async def one_group(index: int, prompt: list[int]) -> None:
            nonlocal done
            stream = plan.stream_every > 0 and index % plan.stream_every == 0
            seeds = [self.rng.randrange(2**31) for _ in range(plan.group)]
            self.trace.append((step.version, prompt))
            placed = await asyncio.gather(
                *(self.sample(step, prompt, seed, stream) for seed in seeds)
            )
            self.placements.append([p for p in placed if p is not None])
            done += 1
            if done * 2 >= len(prompts):
                half_done.set()

        await step.load_sent_event.wait()
        # The load request is on its way; give it a moment to reach the router first (a name
        # the router has never heard of is answered 404 at once, as vLLM would).
        await asyncio.sleep(EAGER_DELAY)
        tasks = [asyncio.create_task(one_group(i, prompts[i])) for i in range(eager)]
        await step.load_finished.wait()
        tasks += [asyncio.create_task(one_group(i, prompts[i])) for i in range(eager, len(prompts))]
        await asyncio.gather(*tasks)
        half_done.set()

    def new_prompt(self) -> list[int]:
        """A chat-templated problem as token ids: shared template, then its own statement."""
        rng = self.rng
        picks = rng.sample(_SENTENCES, rng.randint(3, 6))
        problem = " ".join(
            p.format(a=rng.randrange(3, 99), b=rng.randrange(3, 99), c=rng.randrange(3, 99))
            for p in picks
        )
        messages: list[dict[str, object]] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": problem},
        ]
        return apply_chat_template(messages)

    async def sample(self, step: _Step, prompt: list[int], seed: int, stream: bool) -> str | None:
        """One rollout request; returns the replica that answered, or None on failure."""
        body: dict[str, Any] = {
            "model": f"trl-policy-v{step.version}",
            "prompt": prompt,
            "max_tokens": self.plan.max_tokens,
            "temperature": 1.0,
            "top_p": 1.0,
            "top_k": -1,
            "repetition_penalty": 1.0,
            "n": 1,
            "return_token_ids": True,
            "logprobs": 0,
            "seed": seed,
        }
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        sent = time.perf_counter()
        result = self.result
        try:
            async with self.http.post(
                self.url + "/v1/completions",
                data=orjson.dumps(body),
                headers={"content-type": "application/json"},
            ) as resp:
                replica = resp.headers.get(REPLICA_HEADER, "?")
                raw = await resp.read()
                problem = check_answer(resp.status, raw, stream)
        except (aiohttp.ClientError, TimeoutError) as exc:
            replica, problem = "?", f"{type(exc).__name__}: {exc}"
        if step.load_done is None or sent < step.load_done:
            # Sent while its adapter was still being loaded: the fence held it until then.
            await step.load_finished.wait()
            assert step.load_done is not None
            result.fence_waits.append(max(0.0, step.load_done - sent))
        result.requests += 1
        result.streamed += stream
        if self.bar is not None:
            self.bar.update(1)
        if problem is not None:
            result.failures.append(f"trl-policy-v{step.version} on replica {replica}: {problem}")
            return None
        index = int(replica) if replica.isdigit() else -1
        if 0 <= index < len(result.replicas):
            result.replicas[index].requests += 1
        return replica

    async def control(self, method: str, path: str, body: object = None) -> None:
        """A control call; anything but 200 is fatal, as it is for TRL."""
        async with self.http.request(method, self.url + path, json=body) as resp:
            text = await resp.text()
            if resp.status != 200:
                raise DemoError(f"{method} {path} answered {resp.status}: {text.strip()[:300]}")

    async def get_json(self, path: str) -> dict[str, Any]:
        async with self.http.get(self.url + path) as resp:
            if resp.status != 200:
                raise DemoError(f"GET {path} answered {resp.status}")
            data = orjson.loads(await resp.read())
        if not isinstance(data, dict):
            raise DemoError(f"GET {path} is not a JSON object")
        return data


def check_answer(status: int, raw: bytes, stream: bool) -> str | None:
    """None if the answer is what TRL needs, else why not."""
    if status != 200:
        return f"HTTP {status}: {raw[:200].decode('utf-8', 'replace')}"
    if stream:
        frames = [f for f in raw.split(b"\n\n") if f.startswith(b"data: ")]
        if not frames or frames[-1] != b"data: [DONE]":
            return "stream did not end with data: [DONE]"
        for frame in frames[:-1]:
            if b'"error"' in frame[:20]:
                return f"error frame: {frame[:200].decode('utf-8', 'replace')}"
        return None
    try:
        choice = orjson.loads(raw)["choices"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        return f"not a completion: {raw[:200].decode('utf-8', 'replace')}"
    if not choice.get("token_ids"):
        return "no choices[0].token_ids"
    if not (choice.get("logprobs") or {}).get("token_logprobs"):
        return "no choices[0].logprobs.token_logprobs"
    return None


def _affinity(placements: Sequence[Sequence[str]]) -> float:
    """Share of samples that ran on their group's majority replica."""
    total = sum(len(g) for g in placements)
    on_majority = sum(Counter(g).most_common(1)[0][1] for g in placements if g)
    return on_majority / total if total else 0.0


def _ideal_hit_rate(trace: Sequence[tuple[int, list[int]]], group: int) -> float:
    """The best hit rate any routing could reach on this trace: every group's samples on one
    replica whose cache forgets nothing, served one after the other. Only the first sample of a
    prompt has to compute the part no earlier prompt shares with it."""
    cache = PrefixCache(BLOCK_SIZE, capacity=1 << 62)
    for version, prompt in trace:
        hashes = block_hashes(prompt, BLOCK_SIZE, (f"trl-policy-v{version}",))
        for _ in range(group):
            cache.lookup(hashes, len(prompt))
            cache.insert(hashes)
    return cache.hits / cache.queries if cache.queries else 0.0


async def _read_cache_metrics(result: DemoResult, urls: Sequence[str], router: str) -> None:
    async with aiohttp.ClientSession() as http:
        for stats, url in zip(result.replicas, urls, strict=True):
            async with http.get(url + "/metrics") as resp:
                text = await resp.text()
            stats.cache_queries = _metric_sum(text, "vllm:prefix_cache_queries")
            stats.cache_hits = _metric_sum(text, "vllm:prefix_cache_hits")
        async with http.get(router + "/router/status") as resp:
            accuracy = (await resp.json())["routing_accuracy"]
        result.predicted_cached = accuracy["predicted_cached_tokens"]
        result.reported_cached = accuracy["reported_cached_tokens"]
        result.counted = accuracy["answers"]


def _metric_sum(exposition: str, name: str) -> float:
    """Sum of a counter's samples (`name` or `name_total`, any labels) in Prometheus text."""
    total = 0.0
    for line in exposition.splitlines():
        if not line.startswith(name):
            continue
        metric, _, value = line.rpartition(" ")
        bare = metric.split("{", 1)[0]
        if bare in (name, name + "_total"):
            total += float(value)
    return total
