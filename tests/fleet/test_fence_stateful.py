"""The fence's invariant under random interleavings (hypothesis RuleBasedStateMachine).

Three emulated replicas (drawn mount lag, one possibly slow) behind a router; rules send loads
(some with files that appear late, never, or a replica that fails the load), unloads, pauses,
resumes and completions from an eager client that names a version as soon as it asked for its
load, and let time pass in between. Checked:

- the invariant, at every step (`FenceMonitor`): no completion for an adapter reaches a replica
  that lacks it, or while any live replica lacks it;
- nothing is lost: every request gets an answer, and the answer is the one its history calls
  for (200 for a version whose load succeeded and was not unloaded before the request, vLLM's
  404 otherwise; loads answer 200, 500 or 504, never 404);
- the fleet converges: once the control operations are done, every replica holds exactly the
  versions the router serves, and the pause state asked for last.

Bounded: a few examples of a dozen steps, short deadlines, every wait under a timeout.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
from emulated_fleet import FAST, FenceMonitor, start_router
from helpers import call
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from hypothesis_profiles import scaled

from lora_router.emulator import Emulator, EmulatorConfig, start_emulator, write_adapter
from lora_router.runtime import RouterRuntime

MONITOR: FenceMonitor | None = None  # set by the test function (the patched Engine reports here)

DEADLINE = 0.3  # --load-deadline: files that never appear fail fast
LATE = 0.05  # files that appear after this long (the mount catching up)


@dataclass
class Sent:
    """One completion: what it named, what the history says it should get, its task."""

    model: str | None
    expect_live: bool | None  # None: decided by its load's outcome (it was loading)
    task: asyncio.Task[tuple[int, bytes, Any]]


class FleetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop = uvloop.new_event_loop()
        self.dir = Path(tempfile.mkdtemp(prefix="fence-machine-"))
        self.emus: list[Emulator] = []
        self.rt: RouterRuntime | None = None
        self.client: aiohttp.ClientSession | None = None
        self.n = 0
        self.loads: dict[str, asyncio.Task[tuple[int, bytes, Any]]] = {}
        self.unload_asked: set[str] = set()
        self.control: list[asyncio.Task[tuple[int, bytes, Any]]] = []
        self.sent: list[Sent] = []
        self.paused = False
        self.kinds: dict[str, str] = {}

    # -- plumbing ---------------------------------------------------------------------------

    def run(self, coro: Any, timeout: float = 10.0) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout))

    def spawn(self, method: str, path: str, body: Any = None) -> asyncio.Task[Any]:
        assert self.client is not None and self.rt is not None
        return self.loop.create_task(call(self.client, method, self.rt.url + path, body))

    def broadcast(self, path: str, body: Any = None) -> asyncio.Task[Any]:
        """Send a control request and return once the router has it (its place in the
        queue is then fixed), so later requests arrive after it, as a client's would."""
        assert self.rt is not None and self.rt.broadcaster is not None
        control = self.rt.broadcaster
        seen = control.received
        task = self.spawn("POST", path, body)
        self.control.append(task)

        async def arrived() -> None:
            while control.received == seen and not task.done():
                await asyncio.sleep(0.001)

        self.run(arrived(), timeout=2.0)
        return task

    @property
    def names(self) -> list[str]:
        return list(self.loads)

    # -- set-up -----------------------------------------------------------------------------

    @initialize(
        lag=st.lists(st.integers(0, 2), min_size=3, max_size=3),
        slow=st.sampled_from([None, 0, 1, 2]),
    )
    def start(self, lag: list[int], slow: int | None) -> None:
        assert MONITOR is not None
        MONITOR.violations.clear()
        MONITOR.emulators = []

        async def go() -> None:
            for i in range(3):
                emu = await start_emulator(EmulatorConfig(decode_s_per_token=0.002))
                emu.faults.mount_lag = lag[i]
                if slow == i:
                    emu.faults.load_delay_s = 0.03
                self.emus.append(emu)
            MONITOR.emulators = list(self.emus)
            self.rt = await start_router(
                self.emus,
                # A completion waits at the fence for its load's end, which may come after a
                # queue of earlier loads on a busy machine: never the fence's 503.
                **{
                    **FAST,
                    "load_deadline": DEADLINE,
                    "load_retry_interval": 0.01,
                    "fence_timeout": 60.0,
                },
            )
            MONITOR.router = self.rt
            self.client = aiohttp.ClientSession()

        self.run(go())

    # -- rules ------------------------------------------------------------------------------

    @rule(
        files=st.sampled_from(["ready", "ready", "late", "never", "replica-fails"]),
        replica=st.integers(0, 2),
        eager=st.integers(0, 3),
    )
    def load(self, files: str, replica: int, eager: int) -> None:
        self.n += 1
        name = f"trl-policy-v{self.n}"
        path = self.dir / name
        if files in ("late", "never"):
            # Another machine's mount, as the router sees it: no parent to judge the path by
            # (fleet/adapter_files.py), so the replicas' answers decide.
            path = self.dir / f"mount-{name}" / name
        if files in ("ready", "replica-fails"):
            write_adapter(path)
        elif files == "late":
            self.loop.call_later(LATE, write_adapter, path)
        if files == "replica-fails":
            self.emus[replica].faults.load_failures += 1
        self.kinds[name] = files
        body = {"lora_name": name, "lora_path": str(path), "load_inplace": False}
        self.loads[name] = self.broadcast("/v1/load_lora_adapter", body)
        for _ in range(eager):  # the eager client: names the version right after asking
            self._complete(name)

    @rule(which=st.integers(0, 1000))
    def complete(self, which: int) -> None:
        choices: list[str | None] = [None, *self.names]
        self._complete(choices[which % len(choices)])

    def _complete(self, model: str | None) -> None:
        expect: bool | None
        if model is None:
            expect = True
        elif model in self.unload_asked:
            expect = False
        elif self.loads[model].done():
            expect = self.loads[model].result()[0] == 200
        else:
            expect = None  # waits at the fence; its load decides
        body: dict[str, Any] = {"prompt": [self.n, *range(30)], "max_tokens": 3}
        if model is not None:
            body["model"] = model
        self.sent.append(Sent(model, expect, self.spawn("POST", "/v1/completions", body)))

    def _unloadable(self) -> list[str]:
        busy = {s.model for s in self.sent if not s.task.done()}
        return [
            n
            for n, t in self.loads.items()
            if t.done() and t.result()[0] == 200 and n not in self.unload_asked and n not in busy
        ]

    @rule(which=st.integers(0, 1000))
    def unload(self, which: int) -> None:
        # Not a precondition: which versions are unloadable depends on timing, and hypothesis
        # needs the same draws to lead to the same rules when it replays an example.
        names = self._unloadable()
        if not names:
            return
        name = names[which % len(names)]
        self.unload_asked.add(name)
        self.broadcast("/v1/unload_lora_adapter", {"lora_name": name})

    @rule()
    def pause(self) -> None:
        self.paused = True
        self.broadcast("/pause?mode=keep")

    @rule()
    def resume(self) -> None:
        self.paused = False
        self.broadcast("/resume")

    @rule(ms=st.sampled_from([1, 10, 40]))
    def wait(self, ms: int) -> None:
        self.run(asyncio.sleep(ms / 1000))

    @rule()
    def settle(self) -> None:
        self._settle()

    # -- checks -----------------------------------------------------------------------------

    @invariant()
    def fence_holds(self) -> None:
        assert MONITOR is not None
        assert MONITOR.violations == []

    def _settle(self) -> None:
        """Wait for every control operation, then check the fleet converged."""
        if not self.control:
            return
        self.run(_all(self.control), timeout=10.0)
        # 503: every replica was silent through a load's deadline on a busy machine, so each
        # was ejected as unreachable (fleet/replica_loads.py), and the calls after it found
        # none in service. Never 404.
        answers = (200, 500, 503, 504)
        for name, task in self.loads.items():
            status, data, _ = task.result()
            assert status in answers, (name, status, data)
            if self.kinds[name] == "never":
                assert status != 200
        for task in self.control:
            status, data, _ = task.result()
            assert status in answers, data
        assert self.rt is not None and self.rt.fence is not None
        live = {n for n, t in self.loads.items() if t.result()[0] == 200} - self.unload_asked
        assert set(self.rt.fence.live()) == live
        for emu, replica in zip(
            self.emus, self.rt.fleet.replicas if self.rt.fleet else [], strict=True
        ):
            if not replica.live:
                # Ejected as silent during a load (its machine too slow to answer once before
                # the deadline): its replay on return makes it mirror the fleet (health.py).
                continue
            assert set(emu.state.adapters) == live
            assert set(replica.adapters) == live
            assert emu.state.paused == self.paused

    def teardown(self) -> None:
        try:
            if self.rt is not None:
                if self.paused:
                    self.resume()
                self._settle()
                # Nothing lost: every completion was answered, as its history calls for.
                self.run(_all([s.task for s in self.sent]), timeout=10.0)
                for s in self.sent:
                    status, data, _ = s.task.result()
                    expect = s.expect_live
                    if expect is None:
                        assert s.model is not None
                        expect = self.loads[s.model].result()[0] == 200
                    assert status == (200 if expect else 404), (s.model, status, data)
        finally:
            self.run(self._stop())
            self.loop.close()
            shutil.rmtree(self.dir, ignore_errors=True)

    async def _stop(self) -> None:
        for s in self.sent:
            s.task.cancel()
        if self.client is not None:
            await self.client.close()
        if self.rt is not None:
            await self.rt.stop()
        for emu in self.emus:
            await emu.stop()


async def _all(tasks: list[asyncio.Task[Any]]) -> list[Any]:
    return await asyncio.gather(*tasks)


def test_the_fence_holds_under_random_interleavings(monitor: FenceMonitor) -> None:
    global MONITOR
    MONITOR = monitor
    try:
        run_state_machine_as_test(
            FleetMachine,
            settings=scaled(  # the suite's profile (a run of its own: no collected settings)
                settings(
                    max_examples=30,
                    stateful_step_count=24,
                    deadline=None,
                    suppress_health_check=list(HealthCheck),
                )
            ),
        )
    finally:
        MONITOR = None
