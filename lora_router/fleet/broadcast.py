"""The broadcaster: adapter broadcasts behind the fence and the fleet-wide dev-mode calls, one at
a time; plus the read-only fan-ins (`/health`, `/v1/models`). Every request to a replica goes
through the replica client (client.py); every change of a replica's service state is an event
reported to its lifecycle (lifecycle.py). Why each rule: docs/design/fleet.md#broadcasts.

- **Serialized**: one broadcast at a time, in arrival order (an `asyncio.Lock`, first come
  first served), each sent to every live replica concurrently, in a task shielded from the
  client: a trainer that disconnects mid-load must not leave the fleet split.
- **Bounded**: at most `MAX_PENDING` broadcasts received and not ended (queued, running, or
  deferred unloads: `pending`). Each keeps its client's body (at most routes.py's
  `CONTROL_BODY_BYTES`) until it ends, whether its client stays or not, so neither the
  connection cap nor the request-body budget bounds them; past the cap a broadcast is
  refused at once (503, `Retry-After`), before the fence hears of it (`_admit`).
- **Load** is all-or-nothing. A 404 "No adapter found" (mount lag) is retried every
  `load_retry_interval` until `load_deadline`, then answered **504, never 404**. Any real
  failure unloads the adapter from the replicas that took it and answers the first failure,
  naming the replica. Success answers vLLM's own body and headers.
- **A replica's copy counts only if this router loaded those files onto it** (`Replica.loaded`,
  digests from adapter_files.py): a "400 already loaded" at another `root` is a conflict; at
  the same root it is present if the router loaded the same files there, else the copy is
  dropped (unload, prefix cache reset) and loaded again.
- **A load of a live name** (the fence's reload, fence.py): the same files answer success with
  nothing sent; other files, or files the router cannot read, are reloaded on every live replica
  behind the fence: drain as for an unload, unload, reset the prefix cache, load.
- **A path the router can judge** is judged first (fleet/adapter_files.py's `path_problem`): a
  relative path, or one missing beside a parent the router sees, is answered 400 at once
  (nothing sent to a replica), not after `--load-deadline`.
- **A load that cannot succeed** is logged when a replica's wait starts and every 30 s, shown
  in `/router/status` and the metrics (`mount_waits`), and abandoned as soon as the client that
  asked disconnects.
- **Unload**: the fence stops routing the name when the request arrives; the broadcast waits
  until every request admitted under it has its response head or ended (at most
  `--unload-wait`), then in its turn drops it everywhere; 404 "cannot be found" counts as done.
  The wait is outside the lock (other broadcasts go on meanwhile), and with requests admitted
  under the name unanswered the client is answered at once, as vLLM answers an unload: the
  name is gone for new requests, and those admitted finish (a *deferred* unload). A load of
  the name waits for its deferred unloads to go out first.
- **Pause / resume / reset_prefix_cache** go out with the query string intact; 200 only when
  every replica answered 200. A resume also reaches, best effort, replicas out of service that
  still run routed requests (ejected, or draining while paused). The pause last asked for is
  kept (`Fleet.pause`) and replayed onto replicas that come back; `syncs` times pause → resume.
- A replica unreachable during a broadcast is ejected (health.py re-admits it with a replay).
  For loads `--down-replica-policy` decides the rest: `replay` (default) proceeds with the live
  replicas; `fail` refuses a load while any member replica is down or unreachable.
- **Every broadcast ends in bounded time**: each request to a replica within
  `--control-timeout` (client.py), a load within `--load-deadline`. A replica that does not
  answer in time counts as unreachable (above), so a hung replica costs one broadcast at most
  that long, and the trainer is answered: a pause, resume or reset within `--control-timeout`,
  an unload within that, a load within `--load-deadline` plus the rollback's
  `--control-timeout`, its files read within `FILES_READ_IN` (on a hung mount: loaded as
  files the router cannot read, `_read_files`). A broadcast waits only for its targets, the
  replicas serving when it starts: one of them that the router gives up on meanwhile (its
  health checks eject it) is not waited for any longer and counts as unreachable
  (replica_loads.py's `unless_given_up`), and a load's riders (replicas replaying) are never
  waited for. A replica the running broadcast has waited on for `SLOW_ANSWER_S` or more (vLLM
  answers a control call within about a second) is named: in `/router/status`
  (`waiting_for`: the call and for how long), and in a warning when another operation queues
  behind it.
- **Stopping** (`close`): broadcasts not yet started are refused, but for a deferred unload
  (its client was told it is done: it goes out once drained); a load under way is
  abandoned (mount waits end at once, as when its client leaves), then every running broadcast
  gets up to `--control-timeout` to reach its consistent end (complete, or rolled back) before
  it is cancelled: SIGTERM never leaves a load half done on purpose.

Read-only calls: `/health` and `/ping` ask every live replica; `/v1/models` comes from one
healthy replica, filtered to the names that passed the fence, base model first.

Refusals are values (refusals.py) naming the replica by index and URL; the bearer token never
appears in a message or a log line. This module must never let a name become live before
every live replica acknowledged it, and never run two broadcasts at once.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from lora_router.config import Config
from lora_router.fleet.adapter_files import MAX_SECONDS, path_problem, read_digest
from lora_router.fleet.client import Answer as ReplicaAnswer
from lora_router.fleet.fence import (
    RESTARTED_TRAINER_FIX,
    AdapterEntry,
    AdapterFence,
    AdapterState,
    LoadRefused,
)
from lora_router.fleet.fleet import Fleet, PauseIntent
from lora_router.fleet.lifecycle import OUT, State
from lora_router.fleet.readiness import load_failure
from lora_router.fleet.refusals import (
    Conflict,
    FleetRefusal,
    Invalid,
    Misbehaved,
    ReplicaRefused,
    TimedOut,
    Unavailable,
    named,
    no_replica_in_service,
    reason,
    replica_failure,
)
from lora_router.fleet.replica import Replica
from lora_router.fleet.replica_loads import (
    FAILED,
    LOAD,
    Outcome,
    ReplicaLoads,
    failure_rank,
    forget,
    no_answer,
    unless_given_up,
)
from lora_router.fleet.telemetry import SyncClock
from lora_router.http.headers import HOP_BY_HOP, REPLICA_HEADER

log = logging.getLogger(__name__)

_JSON = (b"content-type", b"application/json")
PATH_JUDGED_IN = 1.0  # seconds a load's path may take to judge (a hung mount is not judged)
# Seconds a load's files may take to read (`_read_files`): the read's own limit and a margin.
FILES_READ_IN = MAX_SECONDS + 5.0
SLOW_ANSWER_S = 2.0  # a replica a broadcast waits on this long is named (module docstring)
# Broadcasts received and not ended, at most (module docstring); TRL has one at a time.
MAX_PENDING = 64
Answer = ReplicaAnswer[Replica]
W = TypeVar("W")
# Headers of a replica's answer that describe its connection or framing, not the message; the
# router frames its own answer.
_NOT_COPIED = HOP_BY_HOP | {b"content-length", REPLICA_HEADER}


@dataclass(slots=True)
class Reply:
    """A whole answer the router sends for a control route."""

    status: int
    body: bytes
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)


class Broadcaster:
    """Broadcasts, one at a time, and the read-only fan-ins (module docstring), made of the
    per-replica adapter calls it is given (`loads`, replica_loads.py)."""

    def __init__(
        self, config: Config, loads: ReplicaLoads, fleet: Fleet, fence: AdapterFence
    ) -> None:
        self.config = config
        self.loads = loads
        self.call = loads.client.call
        self.fleet = fleet
        self.fence = fence
        # The broadcast lock: held by every broadcast, and by the last step of a replay, so a
        # replica is admitted between two broadcasts, never during one.
        self.lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._abandon: dict[asyncio.Task[Any], asyncio.Event] = {}  # a running load's switch
        # Name -> its unloads not yet broadcast that the client was answered for (deferred).
        self._deferred: dict[str, set[asyncio.Task[Reply]]] = {}
        self.unloads_deferred = 0  # unloads answered before their broadcast, since start
        self.stopping = False
        self.received = 0  # broadcasts received since start
        self.pending = 0  # broadcasts received and not yet ended (queued, running or deferred)
        # Plain counters for metrics: (operation, outcome) -> count / seconds.
        self.counts: Counter[tuple[str, str]] = Counter()
        self.seconds: dict[tuple[str, str], float] = {}
        self.syncs = SyncClock()  # pause -> resume intervals, for status and metrics
        self._unread = 0  # loads whose files the router could not read (each its own identity)
        # (replica, call) -> loop time it was sent: a running broadcast's unanswered calls.
        self._waits: dict[tuple[Replica, str], float] = {}

    async def close(self) -> None:
        """The router is stopping: refuse what has not started, abandon the loads, give the
        rest `--control-timeout` to end consistently, then cancel (module docstring)."""
        self.stopping = True
        await self.loads.close()  # rides: nothing waits for them
        for event in self._abandon.values():
            event.set()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=self.config.control_timeout)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)

    def _admit(self, op: str) -> None:
        """A broadcast arrives: refused past `MAX_PENDING` pending (module docstring), before
        anything else is done for it."""
        if self.pending >= MAX_PENDING:
            raise Unavailable(
                f"Cannot {op}: {self.pending} control operations are queued or running, the "
                f"router's cap ({MAX_PENDING}); retry once they have ended.",
                1.0,
            )

    def _check_running(self, op: str) -> None:
        """In a broadcast's turn: refuse to start one once the router is stopping."""
        if self.stopping:
            raise Unavailable(f"Cannot {op}: the router is stopping.")

    def _start(
        self, op: Coroutine[Any, Any, Reply], abandoned: asyncio.Event | None = None
    ) -> asyncio.Task[Reply]:
        """Run a broadcast in its own task, started in arrival order, whatever happens to the
        client (its outcome is recorded by the op, `_record`)."""
        self.received += 1
        self.pending += 1
        task = asyncio.get_running_loop().create_task(op)
        self._tasks.add(task)
        if abandoned is not None:
            self._abandon[task] = abandoned
        task.add_done_callback(self._done)
        return task

    async def _queue(
        self, op: Coroutine[Any, Any, Reply], abandoned: asyncio.Event | None = None
    ) -> Reply:
        """`_start` a broadcast and answer with its reply.

        If the client disconnects, `abandoned` is set: the broadcast still runs to a
        consistent end, but a load stops retrying replicas that cannot see the adapter."""
        task = self._start(op, abandoned)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            if abandoned is not None and not task.done():
                abandoned.set()
            raise

    def _done(self, task: asyncio.Task[Reply]) -> None:
        self.pending -= 1
        self._tasks.discard(task)
        self._abandon.pop(task, None)
        if not task.cancelled():
            task.exception()  # the client may have left: its error is not "never retrieved"

    def _record(
        self, op: str, outcome: str, started: float, subject: str = "", detail: str = ""
    ) -> None:
        seconds = asyncio.get_running_loop().time() - started
        self.counts[op, outcome] += 1
        self.seconds[op, outcome] = self.seconds.get((op, outcome), 0.0) + seconds
        # A few lines per weight sync: loads and unloads are what an operator looks for.
        level = logging.WARNING if outcome in ("failed", "error") else logging.INFO
        if level == logging.INFO and op not in ("load", "unload"):
            level = logging.DEBUG
        what = f"{op} {subject}".strip()
        why = f": {detail}" if detail else ""
        log.log(level, "%s: %s in %.3f s%s", what, outcome, seconds, why)

    # -- loads ------------------------------------------------------------------------------

    async def load(self, name: str, path: str, inplace: bool, body: bytes) -> Reply:
        """`POST /v1/load_lora_adapter` (its fields read from `body`, which goes to the replicas
        as it is), all-or-nothing on the live replicas."""
        if not os.path.isabs(path):  # judged before the fence hears of it: no I/O
            problem = path_problem(path)
            assert problem is not None
            raise Invalid(f"Cannot load adapter '{name}': lora_path '{path}' {problem}.")
        self._admit(f"load adapter '{name}'")
        # At arrival, not in its turn: completions naming it from now on wait at the fence.
        try:
            entry = self.fence.begin_load(name, path, inplace)
        except LoadRefused as refusal:
            log.warning("load %r: refused: %s", name, refusal.message)
            raise
        self._note_queue(f"load {name!r}")
        abandoned = asyncio.Event()
        # The files are read from arrival on, while the load waits for its turn, so that no
        # directory, however large or slow, is read under the lock from its start
        # (adapter_files.py bounds the read itself); the turn stays the arrival order.
        files = asyncio.ensure_future(_read_files(path))
        op = self._load_op(entry, name, path, body, abandoned, files)
        return await self._queue(op, abandoned)

    async def _load_op(
        self,
        entry: AdapterEntry,
        name: str,
        path: str,
        body: bytes,
        abandoned: asyncio.Event,
        reading: asyncio.Future[tuple[str | None, str | None]],
    ) -> Reply:
        started = asyncio.get_running_loop().time()
        ok, failure, outcome = False, "the router stopped", "error"
        try:
            deferred = self._deferred.get(name)
            if deferred:  # the name's deferred unloads go out before it is loaded again
                await asyncio.wait(list(deferred))
            async with self.lock:
                self._check_running(f"load adapter '{name}'")
                problem, files = await reading
                if problem is not None:
                    raise Invalid(f"Cannot load adapter '{name}': lora_path '{path}' {problem}.")
                if entry.state is AdapterState.LIVE:
                    # It joined a load that went live before its turn (or that a later unload
                    # superseded, which then decides): the same files need nothing more.
                    if (files is not None and files == entry.files) or not self.fence.current(
                        entry
                    ):
                        ok, outcome = True, "same_files"
                        return _loaded_reply(name, None, self._holders(name))
                    self.fence.finish_load(entry, True)
                    entry = self.fence.begin_load(name, path, False)  # a reload
                if entry.replacing:
                    if files is not None and files == entry.held:
                        entry.files = files
                        ok, outcome = True, "same_files"
                        return _loaded_reply(name, None, self._holders(name))
                    log.warning(
                        "load %r: the fleet already serves this name, and %s: reloading it on "
                        "every replica (completions under it wait until it is loaded everywhere)",
                        name,
                        _why_reload(entry, files, path),
                    )
                if files is None:
                    self._unread += 1
                    files = f"unread:{self._unread}"  # matches no other load's files
                entry.files = files
                reply = await self._broadcast_load(entry, name, path, body, abandoned)
                ok, outcome = True, "reloaded" if entry.replacing else "ok"
                return reply
        except FleetRefusal as exc:
            failure, outcome = exc.message, "failed"
            raise
        finally:
            self.fence.finish_load(entry, ok, failure)
            self._record("load", outcome, started, repr(name), "" if ok else failure)

    def _holders(self, name: str) -> list[Replica]:
        return [r for r in self.fleet.live() if name in r.adapters]

    async def _broadcast_load(
        self, entry: AdapterEntry, name: str, path: str, body: bytes, abandoned: asyncio.Event
    ) -> Reply:
        fleet, digest, replace = self.fleet, entry.files, entry.replacing
        if self.config.down_replica_policy == "fail":
            down = [r for r in fleet.replicas if r.state in OUT or r.state is State.REPLAYING]
            if down:
                raise Unavailable(
                    f"Cannot load adapter '{name}': {named(down)} "
                    f"{'is' if len(down) == 1 else 'are'} out of service"
                    f"{reason(down[0])} and --down-replica-policy is 'fail'.",
                )
        targets = fleet.live()
        if not targets:
            raise Unavailable(f"Cannot load adapter '{name}': no replica is in service.")
        if replace:
            # As for an unload: requests admitted under the old weights are answered first.
            await self._drain(name, f"reload {name!r}")
        # The slowest replica decides when the name goes live, so its clock starts first:
        # requests go out in the order of the replicas' last load times, slowest first (with
        # eight replicas, the last one sent starts about a millisecond after the first).
        targets.sort(key=lambda r: r.load_seconds, reverse=True)
        deadline = asyncio.get_running_loop().time() + self.config.load_deadline
        loads = self.loads
        # Replicas in the middle of a replay ride along, best effort (replica_loads.py's
        # `ride`): the broadcast neither waits for them nor reads their answers, but what they
        # accept is theirs when their replay's final pass runs (fleet/replay.py), so that pass
        # does not load it again under the lock. A reload takes none: their replay's final
        # pass finds their copy is not these files.
        if not replace:
            for rider in fleet.replicas:
                if rider.state is State.REPLAYING:
                    loads.ride(rider, name, path, body, digest, deadline, abandoned)
        job = loads.replace_on if replace else loads.load_on
        outcomes = await asyncio.gather(
            *(
                self._wait_for(
                    r,
                    f"load '{name}'",
                    job(r, name, path, body, digest, deadline, abandoned),
                    no_answer,
                )
                for r in targets
            )
        )
        for o in outcomes:
            if o.kind == "down":
                assert o.answer is not None  # a "down" outcome carries its answer (status 0)
                failure = o.answer.failure(LOAD)
                _unreachable(o.replica, f"during the load of '{name}': {failure}")
        accepted = [o for o in outcomes if o.kind in ("loaded", "present")]
        failed = [o for o in outcomes if o.kind in FAILED]
        if self.config.down_replica_policy == "fail":
            failed += [o for o in outcomes if o.kind == "down"]
        if accepted and not failed:
            accepted.sort(key=lambda o: o.replica.rid)
            for o in accepted:
                o.replica.adapters[name] = path
            first = next((o.answer for o in accepted if o.kind == "loaded"), None)
            return _loaded_reply(name, first, [o.replica for o in accepted])
        # All or nothing: take it back from every replica that may hold it now (after a failed
        # reload, from all: none may keep the old weights under the name). A replica that
        # timed out may still finish its load later; that copy is reloaded by the next load of
        # the name (the router has no record of it), or unloaded by a replay (a rider's copy:
        # by its replay's final pass, as the name is not live).
        may_hold = ("loaded", "present", "timeout", "abandoned")
        rolled_back = await loads.unload_from(
            name, [o.replica for o in outcomes if replace or o.kind in may_hold]
        )
        for a in rolled_back:
            if a.status == 0:  # it may hold the name: its replay on return drops it
                _unreachable(a.replica, f"during the rollback of '{name}': {a.error}")
        if not failed:
            down = [o.replica for o in outcomes]
            raise Unavailable(f"Cannot load adapter '{name}': {named(down)} could not be reached.")
        raise _load_failure(name, path, min(failed, key=failure_rank), self.config)

    def _note_queue(self, op: str) -> None:
        """Say why an operation will wait, when what it waits behind is a load that a
        replica cannot see yet (a mistyped path waits the whole --load-deadline), or a replica
        that has not answered the running broadcast (module docstring)."""
        if not self.lock.locked():
            return
        if self.loads.mount_waits:
            wait, seconds = max(self.loads.mount_wait_seconds(), key=lambda ws: ws[1])
            log.warning(
                "%s waits for load %r: %s has answered 'No adapter found' for %.0f s (it ends "
                "at --load-deadline, or when the client that asked for the load disconnects)",
                op,
                wait.name,
                wait.replica.describe(),
                seconds,
            )
            return
        slow = max(self.waiting_for(), key=lambda w: w[2], default=None)
        if slow is not None:
            replica, what, waited = slow
            log.warning(
                "%s waits: %s has not answered %s for %.0f s (it is ejected at "
                "--control-timeout, %g s, or when its health checks fail)",
                op,
                replica.describe(),
                what,
                waited,
                self.config.control_timeout,
            )

    # -- unloads ----------------------------------------------------------------------------

    async def unload(self, name: str, body: bytes) -> Reply:
        """`POST /v1/unload_lora_adapter` (`name` read from `body`): unroutable at once, then
        dropped everywhere; answered at once while requests admitted under it are unanswered
        (deferred, module docstring)."""
        self._admit(f"unload adapter '{name}'")
        entry = self.fence.begin_unload(name)
        held = self.fence.held(name)
        if not held:
            self._note_queue(f"unload {name!r}")
            return await self._queue(self._unload_op(entry, name, body, answered=False))
        task = self._start(self._unload_op(entry, name, body, answered=True))
        deferred = self._deferred.setdefault(name, set())
        deferred.add(task)
        task.add_done_callback(lambda done: self._undefer(name, done))
        self.unloads_deferred += 1
        log.info(
            "unload %r: answered now, broadcast once the %d request(s) admitted under it are "
            "answered (at most --unload-wait, %g s)",
            name,
            held,
            self.config.unload_wait,
        )
        # vLLM's own answer: the name is gone for new requests; those admitted finish.
        return _unloaded_reply(name, [])

    async def _drain(self, name: str, op: str) -> None:
        """Wait until every request admitted under `name` is answered, at most
        `--unload-wait`; past it, `op` goes on, and says how many were not."""
        left = await self.fence.drain(name, self.config.unload_wait)
        if left:
            log.warning(
                "%s: %d request(s) admitted under the name still unanswered after %g s "
                "(--unload-wait); going on",
                op,
                left,
                self.config.unload_wait,
            )

    def deferred(self) -> list[str]:
        """The names whose unload was answered and is not broadcast yet (they drain)."""
        return sorted(self._deferred)

    def _undefer(self, name: str, task: asyncio.Task[Reply]) -> None:
        deferred = self._deferred.get(name)
        if deferred is not None:
            deferred.discard(task)
            if not deferred:
                del self._deferred[name]

    async def _unload_op(
        self, entry: AdapterEntry, name: str, body: bytes, answered: bool
    ) -> Reply:
        started = asyncio.get_running_loop().time()
        outcome, detail = "failed", ""
        try:
            # Outside the lock: other broadcasts go on while the name drains (a load of this
            # name waits for its deferred unloads, `_load_op`).
            await self._drain(name, f"unload {name!r}")
            async with self.lock:
                if not answered:  # an answered one goes out even while stopping
                    self._check_running(f"unload adapter '{name}'")
                targets = self.fleet.live()
                if not targets:
                    raise Unavailable(f"Cannot unload adapter '{name}': no replica in service.")
                known = bool(entry.path) or any(name in r.adapters for r in self.fleet.replicas)
                answers = await asyncio.gather(
                    *(self._ask(r, "/v1/unload_lora_adapter", body=body) for r in targets)
                )
                for a in answers:
                    if a.status in (200, 404):
                        forget(a.replica, name)
                    elif a.status == 0:
                        # Its replay on return drops the name (it mirrors the fleet).
                        failure = a.failure("/v1/unload_lora_adapter")
                        _unreachable(a.replica, f"during an unload: {failure}")
                failed = [a for a in answers if a.status not in (200, 404, 0)]
                if failed:
                    raise replica_failure(failed[0], f"Cannot unload adapter '{name}'")
                done = [a for a in answers if a.status == 200]
                if not done and not known:
                    # Nobody knew it: the answer a single vLLM gives for an unknown name.
                    first = next((a for a in answers if a.status == 404), None)
                    if first is not None:
                        outcome = "unknown"
                        return Reply(
                            404, first.body, _copied_headers(first.headers, [first.replica])
                        )
                outcome = "ok"
                if done:
                    return Reply(
                        200, done[0].body, _copied_headers(done[0].headers, _replicas(done))
                    )
                return _unloaded_reply(name, _replicas(answers))
        except FleetRefusal as exc:
            detail = exc.message
            raise
        finally:
            self.fence.finish_unload(entry)
            self._record("unload", outcome, started, repr(name), detail)

    # -- pause, resume, reset_prefix_cache --------------------------------------------------

    async def dev_broadcast(self, op: str, path: str, query: str, body: bytes) -> Reply:
        """`/pause`, `/resume`, `/reset_prefix_cache` on every live replica, query intact."""
        self._admit(op)
        self._note_queue(path)
        return await self._queue(self._dev_op(op, path, query, body))

    async def _dev_op(self, op: str, path: str, query: str, body: bytes) -> Reply:
        started = asyncio.get_running_loop().time()
        outcome, detail = "failed", ""
        try:
            async with self.lock:
                self._check_running(op)
                # Remembered as asked, before the outcome: replays converge on the trainer's
                # latest wish, whichever replicas failed this time.
                if op == "pause":
                    self.fleet.pause = PauseIntent(known=True, query=query)
                    self.syncs.pause(time.monotonic())
                elif op == "resume":
                    self.fleet.pause = PauseIntent(known=True)
                targets = self.fleet.live()
                if not targets:
                    raise Unavailable(f"Cannot {op}: no replica is in service.")
                # A replica taken out of service while paused, with requests still running on
                # it (ejected for its listing, or draining), is resumed too, best effort: else
                # they would wait, paused, for its replay or until it is removed.
                stranded = [] if op != "resume" else self.fleet.stranded()
                quick = self.config.health_timeout  # best effort: never the trainer's wait
                answers, _ = await asyncio.gather(
                    asyncio.gather(
                        *(self._ask(r, path, query=query, body=body or None) for r in targets)
                    ),
                    asyncio.gather(
                        *(self.call(r, "POST", path, query=query, timeout=quick) for r in stranded)
                    ),
                )
                for a in answers:
                    if a.status == 0:
                        _unreachable(a.replica, f"during /{op}: {a.failure(path)}")
                failed = [a for a in answers if a.status not in (200, 0)]
                if failed:
                    raise replica_failure(failed[0], f"/{op} failed", path)
                done = [a for a in answers if a.status == 200]
                if not done:
                    raise Unavailable(f"Cannot {op}: {named(targets)} could not be reached.")
                outcome = "ok"
                payload = done[0].body
                if op == "reset_prefix_cache":
                    # vLLM answers success=false while blocks are held; the fleet succeeded
                    # only if every replica did.
                    docs = [a.parsed() for a in done]
                    success = all(isinstance(d, dict) and d.get("success") is True for d in docs)
                    payload = orjson.dumps({"success": success})
                return Reply(200, payload, _copied_headers(done[0].headers, _replicas(done)))
        except FleetRefusal as exc:
            detail = exc.message
            raise
        finally:
            if op == "resume":  # the sync ends when the fleet was told to go on, whatever came
                self.syncs.resume(time.monotonic())
            self._record(op, outcome, started, detail=detail)

    async def _ask(
        self, replica: Replica, path: str, *, body: bytes | None = None, query: str = ""
    ) -> Answer:
        """A broadcast's POST to one of its replicas: its answer, or status 0 once the router
        gives up on that replica (replica_loads.py's `unless_given_up`)."""
        call = self.call(replica, "POST", path, query=query, body=body)
        return await self._wait_for(replica, path, call, lambda answer: answer)

    async def _wait_for(
        self,
        replica: Replica,
        what: str,
        work: Coroutine[Any, Any, W],
        instead: Callable[[Answer], W],
    ) -> W:
        """A broadcast's wait for one of its replicas (`what` it asked): shown while it lasts
        (`waiting_for`), and over when the router gives up on the replica (`unless_given_up`)."""
        key = (replica, what)
        self._waits[key] = asyncio.get_running_loop().time()
        try:
            return await unless_given_up(replica, work, instead)
        finally:
            self._waits.pop(key, None)

    def waiting_for(self) -> list[tuple[Replica, str, float]]:
        """Each replica the running broadcast has waited on for `SLOW_ANSWER_S` or more: what
        it asked, for how long."""
        now = asyncio.get_running_loop().time()
        waits = [(r, what, now - since) for (r, what), since in self._waits.items()]
        return [w for w in waits if w[2] >= SLOW_ANSWER_S]

    # -- read-only --------------------------------------------------------------------------

    async def health(self, path: str) -> Reply:
        """`/health`, `/ping`: 200 only when every live replica answers 200, at least
        `--min-replicas` are live, and one of them at least can take part in a weight sync
        (readiness.py: else the trainer's first sync would fail); a 503 names why."""
        targets = self.fleet.live()
        if not targets:
            raise no_replica_in_service(self.fleet, self.config)
        if len(targets) < self.config.min_replicas:
            out = [r for r in self.fleet.replicas if r.life.member and not r.live]
            why = f" ({named(out[:1])} out of service{reason(out[0])})" if out else ""
            raise Unavailable(
                f"{len(targets)} replica(s) in service, fewer than --min-replicas "
                f"{self.config.min_replicas}{why}.",
                self.config.health_interval,
            )
        if all(r.unready for r in targets):
            first = targets[0]
            raise Unavailable(
                f"No replica in service can take part in a weight sync: {first.describe()}: "
                f"{first.unready[0]}."
            )
        answers = await asyncio.gather(
            *(self.call(r, "GET", path, timeout=self.config.health_timeout) for r in targets)
        )
        bad = next((a for a in answers if a.status != 200), None)
        if bad is not None:
            raise Unavailable(f"{bad.replica.describe()} is not healthy: {bad.failure(path)}.")
        return Reply(200, b"", _copied_headers([], _replicas(answers)))

    async def models(self) -> Reply:
        """`/v1/models` from one healthy replica, listing only names that passed the fence."""
        candidates = sorted(self.fleet.routable(None), key=lambda r: r.in_flight)
        if not candidates:
            raise Unavailable("No replica is in service.")
        last: Answer | None = None
        for replica in candidates[:3]:  # a few tries, never the whole fleet
            answer = await self.call(
                replica, "GET", "/v1/models", timeout=max(self.config.health_timeout, 1.0)
            )
            doc = answer.parsed() if answer.status == 200 else None
            if isinstance(doc, dict) and isinstance(doc.get("data"), list):
                cards = [c for c in doc["data"] if isinstance(c, dict)]
                doc["data"] = self._fenced_cards(cards)
                headers = [_JSON, (REPLICA_HEADER, replica.label)]
                return Reply(200, orjson.dumps(doc), headers)
            last = answer
        assert last is not None
        raise replica_failure(last, "Cannot list models")

    def _fenced_cards(self, cards: list[dict[str, Any]]) -> list[dict[str, Any]]:
        base = [c for c in cards if not c.get("parent")]
        by_id = {c.get("id"): c for c in cards if c.get("parent")}
        parent = base[0].get("id") if base else None
        out = list(base)  # entry 0 must be the base model: TRL reads its max_model_len
        for name, entry in self.fence.live().items():
            card = by_id.get(name)
            if card is None:
                # Every admitted replica holds every live name; this is only reached if one
                # was changed behind the router's back. Describe it as vLLM would.
                card = {
                    "id": name,
                    "object": "model",
                    "owned_by": "vllm",
                    "root": entry.path,
                    "parent": parent,
                    "max_model_len": None,
                }
            out.append(card)
        return out


async def _read_files(path: str) -> tuple[str | None, str | None]:
    """A load's directory as the router sees it: why it cannot be the adapter the load means
    (`path_problem`, judged within a second: a mount that hangs is not judged), else its
    files' digest (None: the router cannot tell). Off the event loop.

    Both waits have a deadline, as the load's turn awaits this under the broadcast lock: the
    digest within `FILES_READ_IN`, else None (files unread: different from any others). The
    read bounds its own time only between two reads of a file (adapter_files.py); a read,
    open or stat that never returns (a hung network mount) is left to its thread, and the
    load goes on without the digest instead of holding every broadcast behind it."""
    try:
        problem = await asyncio.wait_for(asyncio.to_thread(path_problem, path), PATH_JUDGED_IN)
    except TimeoutError:
        problem = None
    if problem is not None:
        return problem, None
    try:
        return None, await asyncio.wait_for(asyncio.to_thread(read_digest, path), FILES_READ_IN)
    except TimeoutError:
        log.warning(
            "the files at %s were not read within %g s (a hung mount?): loaded as files the "
            "router cannot read",
            path,
            FILES_READ_IN,
        )
        return None, None


def _unreachable(replica: Replica, during: str) -> None:
    """A replica of a broadcast gave no answer: out of service (replayed when it answers).
    One already out of service (ejected by its health checks while the broadcast waited, and
    maybe replaying since) keeps its state and the reason it was given."""
    if replica.live:
        replica.life.eject(f"unreachable {during}")


def _copied_headers(
    headers: Sequence[tuple[bytes, bytes]], acked: Sequence[Replica]
) -> list[tuple[bytes, bytes]]:
    """A replica's end-to-end headers (vLLM's own, e.g. no Content-Type on a load's plain
    text), plus which replicas acknowledged."""
    out = [(k.lower(), v) for k, v in headers if k.lower() not in _NOT_COPIED]
    out.append((REPLICA_HEADER, b",".join(r.label for r in acked)))
    return out


def _replicas(answers: Sequence[Answer]) -> list[Replica]:
    return [a.replica for a in answers]


def _unloaded_reply(name: str, acked: Sequence[Replica]) -> Reply:
    """vLLM's answer to an unload, from the router (no replica's answer to copy); which
    replicas acknowledged it only if any has yet (a deferred one: none)."""
    text = f"Success: LoRA adapter '{name}' removed successfully."
    return Reply(200, text.encode(), _copied_headers([], acked) if acked else [])


def _loaded_reply(name: str, answer: Answer | None, acked: Sequence[Replica]) -> Reply:
    if answer is not None:
        return Reply(200, answer.body, _copied_headers(answer.headers, acked))
    text = f"Success: LoRA adapter '{name}' added successfully."
    return Reply(200, text.encode(), _copied_headers([], acked))


def _why_reload(entry: AdapterEntry, files: str | None, path: str) -> str:
    if files is None:
        return f"the router cannot read its files at {path}"
    if entry.held is None:
        return "it was on the replicas when this router started (its files are unknown)"
    if entry.held.startswith("unread:"):
        return "the router could not read its files when it loaded it"
    return "its files differ from the ones the router loaded under it"


def _load_failure(name: str, path: str, o: Outcome, config: Config) -> FleetRefusal:
    who = o.replica.describe()
    if o.kind == "timeout":
        return TimedOut(
            f"{who} did not load adapter '{name}' within {config.load_deadline:g} s "
            f"(--load-deadline); last answer: {o.detail}",
        )
    if o.kind == "abandoned":
        return Unavailable(
            f"The client that asked to load adapter '{name}' disconnected while {who} still "
            f"answered 'No adapter found' for {o.detail}; the load was abandoned.",
        )
    if o.kind == "down":
        return Unavailable(f"Cannot load adapter '{name}': {who} is unreachable: {o.detail}")
    if o.kind == "reset":
        return Misbehaved(
            f"Cannot reload adapter '{name}': {who} did not reset its prefix cache "
            f"({o.detail}); the router resets it so that no KV computed with the previous "
            "weights is served. Start the replica with VLLM_SERVER_DEV_MODE=1.",
        )
    if o.kind == "conflict":
        assert o.answer is not None  # vLLM's 400 "already loaded"
        held = f"from '{o.detail}'" if o.detail else "at a path its /v1/models does not show"
        return Conflict(
            f"{who} answered: {o.answer.message()} It holds it {held}, not '{path}'. "
            f"{RESTARTED_TRAINER_FIX}",
        )
    assert o.answer is not None
    if o.answer.status == 404:  # never "No adapter found" (retried, then 504)
        failure = load_failure(o.answer.failure(LOAD), o.replica.unready)
        return ReplicaRefused(f"Cannot load adapter '{name}': {who}: {failure}.", 404)
    return replica_failure(o.answer, f"Cannot load adapter '{name}'")
