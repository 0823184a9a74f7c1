"""The per-replica adapter calls under every broadcast and replay: load one adapter on one
replica (retrying a mount that has not caught up, until the deadline or until the client that
asked has gone), reconcile a copy already there, unload from some replicas.

The rules (which copy counts, what a "400 already loaded" means, the mount lag's log lines) are
stated in broadcast.py's module docstring; this module holds their per-replica half, with the
loads still waiting for a replica's mount (`mount_waits`, shown in `/router/status`). It
never takes the broadcast lock: its callers (broadcast.py, replay.py), which are given one
`ReplicaLoads`, hold it.

Deadlines: a load on one replica ends by its `deadline` (`--load-deadline` from the start of
the broadcast); each request in it is bounded by `--control-timeout` (client.py). A replica
that gives no answer at all in time is *down* (the caller ejects it), told apart from one that
kept answering "No adapter found" until the deadline (*timeout*, a failed load). A replica the
router gives up on while a call to it waits (ejected by its health checks, removed:
lifecycle.py's `given_up`) is not waited for any longer: the call is cancelled and ends as that
replica gave no answer (`unless_given_up`), so a broadcast goes on with the other replicas at
once, by the same rules as for a replica that is down.

*Rides*: a load broadcast also sends its load to the replicas that are replaying (broadcast.py),
in tasks of their own that no broadcast waits for (`ride`). Each ends by its load's deadline, or
when its replica is given up on; the replay collects their outcomes before its final pass
(`settle`, replay.py); one that ends when its replica no longer replays is dropped, a new
replay drops those of the one before, and `close` cancels them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import orjson

from lora_router.config import Config
from lora_router.fleet.client import Answer as ReplicaAnswer
from lora_router.fleet.client import ReplicaClient
from lora_router.fleet.failure import Cause, Failure
from lora_router.fleet.lifecycle import State
from lora_router.fleet.replica import Replica

log = logging.getLogger(__name__)

Answer = ReplicaAnswer[Replica]
LOAD = "/v1/load_lora_adapter"
_MOUNT_LAG = "No adapter found"
_ALREADY_LOADED = "already been loaded"
W = TypeVar("W")


@dataclass(slots=True)
class Outcome:
    """What one replica did with one adapter load."""

    replica: Replica
    kind: str  # loaded | present | conflict | failed | reset | timeout | abandoned | down
    answer: Answer | None = None
    detail: str = ""


@dataclass(slots=True)
class MountWait:
    """A replica answering "No adapter found" to a load the router keeps retrying."""

    replica: Replica
    name: str
    path: str
    since: float  # loop time of the first such answer
    logged: float  # loop time of the last line logged about it


class ReplicaLoads:
    """Adapter loads and unloads on single replicas (module docstring)."""

    # Seconds between two log lines about a replica that still cannot see an adapter.
    mount_wait_log_interval = 30.0

    def __init__(self, config: Config, client: ReplicaClient) -> None:
        self.config = config
        self.client = client
        # Loads being retried because a replica does not see the files yet: (rid, name) -> wait.
        self.mount_waits: dict[tuple[int, str], MountWait] = {}
        # Replaying replica -> the loads riding to it, running or not collected yet (`ride`).
        self._rides: dict[Replica, set[asyncio.Task[Outcome]]] = {}

    # -- rides ------------------------------------------------------------------------------

    def ride(
        self,
        replica: Replica,
        name: str,
        path: str,
        body: bytes,
        digest: str | None,
        deadline: float,
        abandoned: asyncio.Event | None = None,
    ) -> None:
        """Load `name` on a replaying replica in a task no broadcast waits for (module
        docstring): it ends by `deadline`, or when the replica is given up on."""
        load = self.load_on(replica, name, path, body, digest, deadline, abandoned)
        task = asyncio.get_running_loop().create_task(unless_given_up(replica, load, no_answer))
        self._rides.setdefault(replica, set()).add(task)
        task.add_done_callback(lambda done: self._ended(replica, done))

    def _ended(self, replica: Replica, task: asyncio.Task[Outcome]) -> None:
        """A ride ended: kept for `settle` while its replica replays, else of no use."""
        if replica.state is State.REPLAYING:
            return
        rides = self._rides.get(replica)
        if rides is not None:
            rides.discard(task)
            if not rides:
                del self._rides[replica]
        if not task.cancelled():
            task.exception()  # never "never retrieved"

    async def settle(self, replica: Replica) -> list[Outcome]:
        """The outcomes of the loads that rode to `replica` since its replay began, once every
        one of them has ended (each by its load's deadline)."""
        rides = self._rides.pop(replica, set())
        return list(await asyncio.gather(*rides)) if rides else []

    def drop_rides(self, replica: Replica) -> None:
        """A replay begins: the rides of an earlier one, ended or not, are of no use to it."""
        for task in self._rides.pop(replica, set()):
            task.cancel()

    async def close(self) -> None:
        """The router is stopping: every ride still running is cancelled."""
        tasks = [t for rides in self._rides.values() for t in rides]
        self._rides.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def load_on(
        self,
        replica: Replica,
        name: str,
        path: str,
        body: bytes,
        digest: str | None,
        deadline: float,
        abandoned: asyncio.Event | None = None,
    ) -> Outcome:
        """Load on one replica, retrying mount lag until `deadline`, or until `abandoned` is
        set (the client that asked has gone). `digest`: the files' (None: a name found at
        start, or a load whose turn has not come; a copy already there then counts)."""
        loop = asyncio.get_running_loop()
        last = "no answer"
        started = loop.time()
        key = (replica.rid, name)
        dropped = False  # a copy the router did not load was unloaded (once)
        answered = False  # the replica answered once within this load: it is not hung
        try:
            async with asyncio.timeout_at(deadline):
                while True:  # bounded by the deadline
                    answer = await self.client.call(replica, "POST", LOAD, body=body)
                    answered = True
                    if answer.status == 200:
                        replica.load_seconds = loop.time() - started
                        if digest is not None:
                            replica.loaded[name] = digest
                        return Outcome(replica, "loaded", answer)
                    if answer.status == 0:
                        return no_answer(answer)
                    message = answer.message()
                    if answer.status == 404 and _MOUNT_LAG in message:
                        last = message
                        self._mount_lag(key, replica, name, path, deadline)
                        if abandoned is None:
                            await asyncio.sleep(self.config.load_retry_interval)
                            continue
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(self.config.load_retry_interval):
                                await abandoned.wait()
                        if abandoned.is_set():
                            waited = loop.time() - started
                            return Outcome(replica, "abandoned", None, f"{waited:.1f} s ({last})")
                        continue
                    if answer.status == 400 and _ALREADY_LOADED in message:
                        found = await self._reconcile(replica, name, path, answer, digest)
                        if found.kind != "stale":
                            return found
                        if dropped:  # it was unloaded a moment ago: someone else loads it
                            return Outcome(replica, "failed", answer, message)
                        dropped = True
                        log.warning(
                            "load %r: %s holds a copy of it that this router did not load "
                            "(%s): unloading it and loading the files again",
                            name,
                            replica.describe(),
                            found.detail,
                        )
                        gone = await self._drop_copy(replica, name)
                        if gone is not None:
                            return gone
                        continue
                    return Outcome(replica, "failed", answer, message)
        except TimeoutError:
            if not answered:  # silent from start to deadline: hung, ejected by the caller
                error = f"no answer within {loop.time() - started:.1f} s (--load-deadline)"
                silent = Answer(replica, 0, error=error, transport=Cause.TIMEOUT)
                return Outcome(replica, "down", silent, error)
            return Outcome(replica, "timeout", None, last)
        finally:
            if self.mount_waits.pop(key, None) is not None:
                log.info(
                    "load %r: %s stopped waiting for the adapter files after %.1f s",
                    name,
                    replica.describe(),
                    loop.time() - started,
                )

    def mount_wait_seconds(self) -> list[tuple[MountWait, float]]:
        """Every load still waiting for a replica to see its files, with how long so far."""
        now = asyncio.get_running_loop().time()
        return [(w, now - w.since) for w in self.mount_waits.values()]

    def _mount_lag(
        self, key: tuple[int, str], replica: Replica, name: str, path: str, deadline: float
    ) -> None:
        """Record and log a "No adapter found": once when it starts, then every
        `mount_wait_log_interval` seconds while it lasts."""
        now = asyncio.get_running_loop().time()
        wait = self.mount_waits.get(key)
        if wait is None:
            self.mount_waits[key] = MountWait(replica, name, path, now, now)
            log.info(
                "load %r: %s answers 'No adapter found' for %s (its mount has not caught up?); "
                "retrying every %g s for up to %.0f s (--load-deadline)",
                name,
                replica.describe(),
                path,
                self.config.load_retry_interval,
                deadline - now,
            )
        elif now - wait.logged >= self.mount_wait_log_interval:
            wait.logged = now
            log.warning(
                "load %r: %s still answers 'No adapter found' for %s after %.1f s; giving up "
                "in %.0f s (--load-deadline), or when the client that asked disconnects",
                name,
                replica.describe(),
                path,
                now - wait.since,
                max(deadline - now, 0.0),
            )

    async def _reconcile(
        self, replica: Replica, name: str, path: str, answer: Answer, digest: str | None
    ) -> Outcome:
        """ "Already loaded": present if the replica holds the name at the same path with the
        files this router loaded there; "stale" if at that path with unknown files."""
        held = await self.client.listing(replica)
        if isinstance(held, Failure):
            return Outcome(replica, "failed", answer, answer.message())
        root = held.adapters.get(name)
        if root != path:
            return Outcome(replica, "conflict", answer, root or "")
        recorded = replica.loaded.get(name)
        if digest is None or recorded == digest:
            return Outcome(replica, "present", answer)
        why = "other files" if recorded is not None else "put there by another process"
        return Outcome(replica, "stale", answer, why)

    async def replace_on(
        self,
        replica: Replica,
        name: str,
        path: str,
        body: bytes,
        digest: str | None,
        deadline: float,
        abandoned: asyncio.Event | None = None,
    ) -> Outcome:
        """A reload on one replica: its copy dropped (`_drop_copy`), then the files loaded."""
        try:
            async with asyncio.timeout_at(deadline):
                gone = await self._drop_copy(replica, name)
        except TimeoutError:
            return Outcome(replica, "timeout", None, "its prefix cache could not be reset")
        if gone is not None:
            return gone
        return await self.load_on(replica, name, path, body, digest, deadline, abandoned)

    async def _drop_copy(self, replica: Replica, name: str) -> Outcome | None:
        """Unload `name` from one replica and reset its prefix cache (its KV blocks computed
        with those weights would be hit again under the name); None once done. Runs under its
        caller's deadline: the reset is retried while the replica answers `success: false`."""
        body = orjson.dumps({"lora_name": name})
        answer = await self.client.call(replica, "POST", "/v1/unload_lora_adapter", body=body)
        if answer.status == 0:
            return no_answer(answer)
        if answer.status not in (200, 404):
            return Outcome(replica, "failed", answer, answer.message())
        forget(replica, name)
        while True:  # bounded by the caller's deadline
            # reset_running_requests: vLLM preempts running requests (they are recomputed)
            # instead of refusing while they hold blocks.
            answer = await self.client.call(
                replica, "POST", "/reset_prefix_cache", query="reset_running_requests=true"
            )
            if answer.status == 0:
                return no_answer(answer)
            if answer.status != 200:
                return Outcome(replica, "reset", answer, answer.summary())
            doc = answer.parsed()
            if isinstance(doc, dict) and doc.get("success") is True:
                return None
            await asyncio.sleep(self.config.load_retry_interval)

    async def unload_from(self, name: str, replicas: Sequence[Replica]) -> list[Answer]:
        body = orjson.dumps({"lora_name": name})
        answers = await asyncio.gather(
            *(self.client.call(r, "POST", "/v1/unload_lora_adapter", body=body) for r in replicas)
        )
        for a in answers:
            if a.status in (200, 404):
                forget(a.replica, name)
            else:
                log.warning(
                    "could not unload adapter %r from %s: %s",
                    name,
                    a.replica.describe(),
                    a.message(),
                )
        return list(answers)


async def unless_given_up(
    replica: Replica, work: Awaitable[W], instead: Callable[[Answer], W]
) -> W:
    """`work`'s result, unless the router gives up on `replica` first (module docstring): then
    `work` is cancelled and `instead` turns the answer the replica did not give (status 0, a
    timeout: it did not answer in time) into the result."""
    given_up = replica.life.given_up
    task = asyncio.ensure_future(work)
    waiter = asyncio.ensure_future(given_up.wait())
    try:
        await asyncio.wait((task, waiter), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        waiter.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    error = f"it was ejected while the router waited for its answer ({replica.life.last_error})"
    return instead(Answer(replica, 0, error=error, transport=Cause.TIMEOUT))


def no_answer(answer: Answer) -> Outcome:
    """A load's outcome on a replica that gave no answer (`answer`, status 0)."""
    return Outcome(answer.replica, "down", answer, answer.error)


def forget(replica: Replica, name: str) -> None:
    """The replica no longer holds `name` (unloaded, or unknown to it)."""
    replica.adapters.pop(name, None)
    replica.loaded.pop(name, None)


FAILED = ("conflict", "failed", "reset", "timeout", "abandoned")


def failure_rank(o: Outcome) -> tuple[int, int]:
    # A replica's own refusal explains more than a timeout, which explains more than silence.
    order = {"conflict": 0, "failed": 0, "reset": 0, "timeout": 1, "abandoned": 1, "down": 2}
    return order[o.kind], o.replica.rid
