"""The simulated vLLM engine: what one replica knows and how long its work takes.

It ties together the pieces a router's decisions act on — the adapter registry and slots
(`adapters`), the prefix cache (`prefix_cache`), the batch scheduler (`scheduler`) and the
deterministic model (`tokens`) — with the capacity model of `batching`: the sequences the
scheduler admitted advance together, one engine step at a time, a single task (`_step_loop`)
planning each step and sleeping its duration, then waking the sequences it gave tokens to. So
a cache hit makes a request faster, a growing batch makes every step slower, and a full batch
(`max_num_seqs`) makes a request wait. With every cost 0 (the default) steps take no time and
an answer comes at once. Steps shorter than 2 ms are run back to back and slept as one, so
fine-grained costs do not turn into one event-loop wake-up per token.

Each sequence carries its request's external id, as vLLM forms it from `X-Request-Id`
(serving.py), which `/abort_requests` names (`abort`).

It also owns the pause state of vLLM's dev-mode endpoints:
- `abort` aborts every sequence in flight (they finish with reason "abort");
- `wait` returns once every sequence in flight has finished;
- `keep` freezes sequences in place until `/resume`.
New requests while paused are queued at the door (0.27, 0.32: "all pause modes queue new
adds"), except on 0.33 in abort/wait mode, where they are rejected (`GenerationPaused`).

This is the object tests assert on (`emu.state`). It never touches sockets; the only outside
read is the optional re-read of an evicted adapter through the injected `read_adapter`. What
its cache stores, evicts and clears goes, as vLLM's KV events, to `kv_sink` when one is set
(the server's publisher, kv_events.py): one batch per cache change.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from lora_router.emulator import tokens
from lora_router.emulator.adapter_files import (
    AdapterInvalid,
    AdapterNotFound,
    AdapterSpec,
    read_adapter,
)
from lora_router.emulator.adapters import Adapter, AdapterRegistry, AdapterSlots
from lora_router.emulator.batching import InterTokenLatency, Progress, plan_step
from lora_router.emulator.config import EmulatorConfig
from lora_router.emulator.kv_events import (
    AllBlocksCleared,
    KVCacheEvent,
    removed_events,
    stored_events,
)
from lora_router.emulator.prefix_cache import PrefixCache, block_hashes
from lora_router.emulator.scheduler import Aborted, Scheduler, Seq

PAUSE_MODES = ("abort", "wait", "keep")
# Below this, sleeping per step costs more in event-loop overhead than it models.
_MIN_SLEEP_S = 0.002


class UnknownModel(Exception):
    """The request names a model that is neither the base model nor a registered adapter."""


class GenerationPaused(Exception):
    """vLLM 0.33 in abort/wait pause mode rejects new requests."""


class EngineDead(Exception):
    """The engine died (injected, or an evicted adapter's files vanished)."""


@dataclass(slots=True)
class SampleJob:
    """One sample to generate: its scheduler entry, prompt, cache keys and planned tokens."""

    seq: Seq
    prompt: list[int]
    prompt_hashes: list[int]
    extra_keys: tuple[str, ...]
    sample: tokens.Sample
    cached_tokens: int = 0
    emitted: int = 0
    finish_reason: str | None = None


@dataclass(slots=True)
class EngineCounters:
    """What happened to requests, for tests and `/emulator/state`."""

    finished: int = 0  # samples that ran to "stop" or "length"
    aborted: int = 0  # samples aborted by /pause?mode=abort
    cancelled: int = 0  # HTTP requests whose client went away before the answer was complete
    rejected_paused: int = 0  # requests refused with 503 while paused (0.33)
    prompt_tokens: int = 0
    generated_tokens: int = 0


@dataclass(slots=True)
class _PauseState:
    paused: bool = False
    mode: str | None = None
    resumed: asyncio.Event = field(default_factory=asyncio.Event)
    stepping: asyncio.Event = field(default_factory=asyncio.Event)  # clear: paused in keep mode


class Engine:
    """One replica's engine state; replaced wholesale when the replica restarts."""

    def __init__(self, config: EmulatorConfig) -> None:
        self.config = config
        self.registry = AdapterRegistry()
        self.slots = AdapterSlots(config.max_loras, config.cpu_loras)
        self.cache = PrefixCache(config.block_size, config.cache_blocks)
        self.scheduler = Scheduler(config.max_num_seqs, config.max_loras)
        self.counters = EngineCounters()
        # Each generated token's time since the sequence's previous one, from the steps' own
        # clock (`_step_loop`): vLLM's `vllm:inter_token_latency_seconds` (batching.py).
        self.inter_token_latency = InterTokenLatency()
        self.crashed: str | None = None  # why the engine died, if it did
        self.sleeping = False
        self.queued_while_paused = 0  # requests waiting at the door for /resume
        self._pause = _PauseState()
        self._pause.resumed.set()
        self._pause.stepping.set()
        self._frozen: set[Seq] = set()
        self._holding: dict[Seq, SampleJob] = {}  # samples in the batch, holding KV blocks
        self._progress: dict[Seq, Progress] = {}  # the batch's work, in admission order
        self._stepper: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._rng = random.Random(config.seed)
        self.load_locks: dict[str, asyncio.Lock] = {}
        # Where KV events go (kv_events.py), if the replica publishes them.
        self.kv_sink: Callable[[list[KVCacheEvent]], None] | None = None

    # --- what tests read -------------------------------------------------------------------

    @property
    def adapters(self) -> dict[str, str]:
        """Registered adapters: name -> the path they were loaded from."""
        return {a.name: a.path for a in self.registry.all()}

    @property
    def paused(self) -> bool:
        return self._pause.paused

    @property
    def pause_mode(self) -> str | None:
        return self._pause.mode

    @property
    def cancelled(self) -> int:
        return self.counters.cancelled

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + self.queued_while_paused

    @property
    def kv_cache_usage(self) -> float:
        """The share of the KV block pool held by samples in the batch, as vLLM's block pool
        reports it (`1 - free / total`).

        A real server's free queue includes cached blocks no request holds (they are reused or
        evicted on demand), so an idle replica reports 0 however full its prefix cache is. A
        sample holds the blocks of its prompt and of what it generated so far, the partial last
        block included; siblings share their prompt's full blocks, counted once.
        """
        if self.config.cache_blocks == 0:
            return 0.0
        shared: set[int] = set()
        own = 0
        block_size = self.config.block_size
        for job in self._holding.values():
            held = -(-(len(job.prompt) + job.emitted) // block_size)
            shared.update(job.prompt_hashes)
            own += held - len(job.prompt_hashes)
        return min(1.0, (len(shared) + own) / self.config.cache_blocks)

    # --- adapters --------------------------------------------------------------------------

    def register(self, name: str, path: str, spec: AdapterSpec, inplace: bool) -> Adapter:
        """Record a successful load; the weights enter the CPU cache as add_lora puts them."""
        if inplace and name in self.registry:
            adapter = self.registry.replace(name, path, spec)
            self.slots.forget(adapter.lora_id)
        else:
            adapter = self.registry.add(name, path, spec)
        self.slots.load(adapter.lora_id)
        return adapter

    def unregister(self, name: str) -> Adapter | None:
        # The weights stay in the slots until LRU evicts them, as in vLLM.
        return self.registry.remove(name)

    def resolve_model(self, name: object) -> Adapter | None:
        """None for the base model, the adapter for a LoRA name; `UnknownModel` otherwise."""
        if name is None or name == self.config.model:
            return None
        if isinstance(name, str):
            adapter = self.registry.get(name)
            if adapter is not None:
                return adapter
        raise UnknownModel(str(name))

    def served_names(self) -> list[str]:
        """What vLLM lists as "Valid aliases" in its unknown-model 404: the base model's
        names, not the adapters (a real 0.32 server)."""
        return [self.config.model]

    def extra_keys(self, adapter: Adapter | None) -> tuple[str, ...]:
        """Prefix-cache extra keys: the adapter name (0.27) or name and path (0.32 on)."""
        if adapter is None:
            return ()
        if not self.config.since("0.32"):
            return (adapter.name,)
        return (adapter.name, adapter.path)

    # --- generation ------------------------------------------------------------------------

    def draw_seed(self) -> int:
        """A seed for an unseeded request: siblings differ, a replayed run repeats."""
        return self._rng.getrandbits(63)

    def new_job(
        self,
        request_id: str,
        adapter: Adapter | None,
        prompt: list[int],
        prompt_hashes: list[int],
        sample: tokens.Sample,
    ) -> SampleJob:
        seq = Seq(
            request_id=request_id,
            lora_id=adapter.lora_id if adapter else None,
            lora_name=adapter.name if adapter else None,
            lora_path=adapter.path if adapter else None,
        )
        return SampleJob(
            seq=seq,
            prompt=prompt,
            prompt_hashes=prompt_hashes,
            extra_keys=self.extra_keys(adapter),
            sample=sample,
        )

    async def enter(self) -> None:
        """The door every new request passes: queue or refuse while paused."""
        if self.crashed is not None:
            raise EngineDead(self.crashed)
        while self._pause.paused:
            if self.config.since("0.33") and self._pause.mode in ("abort", "wait"):
                self.counters.rejected_paused += 1
                raise GenerationPaused
            self.queued_while_paused += 1
            try:
                await self._pause.resumed.wait()
            finally:
                self.queued_while_paused -= 1

    async def run(
        self, job: SampleJob, emit: Callable[[list[tokens.SampledToken]], Awaitable[None]]
    ) -> str:
        """Schedule, prefill and decode one sample, passing tokens to `emit` as they come.

        Returns the finish reason. Cancellation (the client went away) propagates; the
        sequence leaves the batch either way.
        """
        seq = job.seq
        self._idle.clear()
        try:
            await self.scheduler.admit(seq)
            self._holding[seq] = job
            if seq.lora_id is not None:
                await self._activate_adapter(seq)
            job.cached_tokens = self.cache.lookup(job.prompt_hashes, len(job.prompt))
            # vLLM v1 registers a prompt's blocks as soon as they are allocated, so a sibling
            # scheduled right after this one already hits them.
            self._insert(job, job.prompt, job.prompt_hashes)
            self.counters.prompt_tokens += len(job.prompt)
            planned = job.sample.tokens
            progress = Progress(len(job.prompt) - job.cached_tokens, len(planned))
            self._progress[seq] = progress
            self._start_stepping()
            while job.emitted < len(planned):
                if self._pause.paused and self._pause.mode == "keep":
                    await self._freeze(seq)
                if seq.aborted:
                    raise Aborted
                if progress.granted == job.emitted:
                    await seq.sleep_until_woken()  # the step loop wakes it with tokens
                    continue
                chunk = planned[job.emitted : progress.granted]
                job.emitted = progress.granted
                self.counters.generated_tokens += len(chunk)
                await emit(chunk)
            job.finish_reason = job.sample.finish_reason
            self.counters.finished += 1
            self._cache_output(job)
        except Aborted:
            job.finish_reason = "abort"
            self.counters.aborted += 1
        finally:
            self._progress.pop(seq, None)
            self.scheduler.release(seq)
            self._holding.pop(seq, None)
            self._frozen.discard(seq)
            if not self.scheduler.in_flight():
                self._idle.set()
        return job.finish_reason

    def note_cancelled(self) -> None:
        self.counters.cancelled += 1

    def _start_stepping(self) -> None:
        if self._stepper is None or self._stepper.done():
            self._stepper = asyncio.get_running_loop().create_task(self._step_loop())

    async def _step_loop(self) -> None:
        """Run engine steps while the batch has work (batching.py plans and times each).

        Steps are planned back to back until they add up to `_MIN_SLEEP_S` (or the work runs
        out), slept as one, and only then are the sequences they advanced woken: a token is
        never seen before the time that computes it has passed. The steps keep their own
        clock: each ends at the previous one's end plus its duration, not at the previous
        wake-up plus it, so the event loop's late timers (uvloop's are rounded to the
        millisecond) do not add up over a busy period. Paused in keep mode, no step runs
        until `/resume`."""
        costs = self.config.step_costs
        budget = self.config.max_num_batched_tokens
        loop = asyncio.get_running_loop()
        ends = loop.time()  # when the last step planned ends
        while True:
            if not self._pause.stepping.is_set():
                await self._pause.stepping.wait()
                ends = loop.time()
            start = max(ends, loop.time() - _MIN_SLEEP_S)
            elapsed = 0.0
            advanced: dict[Progress, None] = {}
            decoded: list[tuple[list[Progress], float]] = []  # each step's decoders, its end
            while elapsed < _MIN_SLEEP_S:
                work = [p for p in self._progress.values() if not p.done]
                if not work:
                    break
                step, moved = plan_step(work, budget)
                elapsed += costs.step_s(step.decoding, step.prefill_tokens)
                advanced.update(dict.fromkeys(moved))
                decoded.append((moved[: step.decoding], start + elapsed))
            if not advanced:
                return
            if elapsed > 0:
                ends = start + elapsed
                await asyncio.sleep(ends - loop.time())
            for decoders, end in decoded:  # observed once their time has passed
                self.inter_token_latency.decoded(decoders, end)
            for seq, progress in list(self._progress.items()):
                if progress in advanced:
                    seq.wake()

    async def _activate_adapter(self, seq: Seq) -> None:
        assert seq.lora_id is not None
        if self.slots.needs_read(seq.lora_id):
            try:
                read_adapter(seq.lora_path or "")
            except (AdapterNotFound, AdapterInvalid) as exc:
                # vLLM re-reads an evicted adapter from its path; gone files kill the engine.
                self.crashed = f"re-reading evicted adapter {seq.lora_name!r} failed: {exc}"
                raise EngineDead(self.crashed) from exc
            await self._sleep(seq, self.config.adapter_load_s)
        self.slots.activate(seq.lora_id, self.scheduler.running_loras())

    def _cache_output(self, job: SampleJob) -> None:
        # The last generated token never had its KV computed, so it cannot fill a block.
        computed = job.prompt + job.sample.token_ids[: job.emitted - 1]
        if len(computed) >= len(job.prompt) + self.config.block_size:
            self._insert(
                job, computed, block_hashes(computed, self.config.block_size, job.extra_keys)
            )

    def _insert(self, job: SampleJob, tokens: list[int], hashes: list[int]) -> None:
        """Cache a chain's blocks, and publish what that stored and evicted."""
        added, evicted = self.cache.insert(hashes)
        sink = self.kv_sink
        if sink is not None and (added or evicted):
            seq = job.seq
            size = self.config.block_size
            events = stored_events(tokens, hashes, added, size, seq.lora_id, seq.lora_name)
            sink(events + removed_events(evicted))

    def _clear_cache(self) -> None:
        self.cache.clear()
        if self.kv_sink is not None:  # vLLM reports every reset that succeeds
            self.kv_sink([AllBlocksCleared()])

    async def _sleep(self, seq: Seq, seconds: float) -> None:
        if seconds <= 0 or seq.aborted:
            return
        loop = asyncio.get_running_loop()
        handle = loop.call_later(seconds, seq.wake)
        try:
            await seq.sleep_until_woken()
        finally:
            handle.cancel()

    async def _freeze(self, seq: Seq) -> None:
        self._frozen.add(seq)
        try:
            while self._pause.paused and self._pause.mode == "keep" and not seq.aborted:
                await seq.sleep_until_woken()
        finally:
            self._frozen.discard(seq)

    # --- dev-mode control ------------------------------------------------------------------

    async def pause(self, mode: str, clear_cache: bool) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}")
        self._pause.paused = True
        self._pause.mode = mode
        self._pause.resumed.clear()
        if mode == "keep":
            self._pause.stepping.clear()
        else:
            self._pause.stepping.set()
        if mode == "abort":
            for seq in self.scheduler.in_flight() + list(self._frozen):
                seq.abort()
        elif mode == "wait":
            await self._idle.wait()
        elif mode == "keep":
            # No step runs, and every sequence freezes where it is; the cache is kept
            # ("ignored when keep").
            for seq in self.scheduler.running:
                seq.wake()
            return
        if clear_cache:
            self._clear_cache()

    def resume(self) -> None:
        self._pause.paused = False
        self._pause.mode = None
        self._pause.resumed.set()
        self._pause.stepping.set()
        for seq in list(self._frozen):
            seq.wake()

    def reset_prefix_cache(self) -> bool:
        """False while running sequences hold blocks, as vLLM answers; the caller retries."""
        if self.scheduler.running:
            return False
        self._clear_cache()
        return True

    def abort(self, request_ids: list[str] | None) -> int:
        """`/abort_requests`: abort the sequences of these external request ids (None: every
        one in flight, queued, running or frozen), without pausing; an id no sequence has is
        ignored, as in vLLM. They end with reason "abort", as a pause in abort mode ends them.
        Returns how many sequences were aborted."""
        wanted = None if request_ids is None else set(request_ids)
        hit = [
            seq
            for seq in dict.fromkeys(self.scheduler.in_flight() + list(self._frozen))
            if wanted is None or seq.request_id in wanted
        ]
        for seq in hit:
            seq.abort()
        return len(hit)

    def abort_all(self) -> None:
        """Abort every sequence and stop stepping (the replica is going down)."""
        for seq in self.scheduler.in_flight() + list(self._frozen):
            seq.abort()
        if self._stepper is not None:
            self._stepper.cancel()
