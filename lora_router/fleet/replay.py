"""Bringing a replica to the fleet's state: discovery at start, and the replay before it serves.

- `Replay.discover` reads every configured replica once at start: its `/v1/models` (base model,
  adapters already registered) and `/server_info` (LoRA limits, KV block size), both parsed by
  the replica client (client.py). It warns when the replicas disagree on a fact of
  `client.AGREEMENT` (base model, `max_lora_rank`, `max_loras`, block size), with the fix, as
  replays and re-reads do when a replica's facts make a new disagreement appear
  (`Fleet.disagreements`, shown in `/router/status`); clears
  names matching `--unload-stale` (a reused replica still holding `trl-policy-v1` from an
  earlier run would make TRL's first load fail with "already loaded"); and makes live the
  adapters found on *every* answering replica at the same path (static `--lora-modules`).
  A replica that does not answer is ejected; health.py brings it in later with a replay.
- *The KV block size* the router keys prompts by (`block_size`): `--block-size` when given;
  else the one every replica answering at start reports (`/server_info`'s
  `cache_config.block_size`); else, while none is known (no replica answered at start, or
  they disagreed), the first one a replica reports when it is re-admitted or, admitted at
  start without its `/server_info` (a timeout, a 5xx), when it is read again (`reread`, at its
  next passing health check), passed to `on_block_size` once. Until then the caller keys by
  vLLM's default (16): a guess.
- `Replay.readmit` makes a replica mirror the fleet — every live adapter loaded (with the same
  mount-lag retries as a broadcast, and the trainer's own load request; a copy it already holds
  counts only if the router loaded the fleet's files there, broadcast.py), every other name
  unloaded, the fleet's pause intent applied — and reports the outcome to the replica's
  lifecycle, which alone admits it. The long part runs outside the broadcast lock, so a
  trainer's call never waits behind a replay: the loads, the unloads, the pause intent, and
  the loads that rode to it on broadcasts meanwhile (replica_loads.py's `ride`, collected
  there). A final pass under the lock catches up with whatever changed meanwhile and admits
  the replica between two broadcasts, so it can neither miss one nor see half of one.

What the final pass holds the lock for: a listing, the loads and unloads of what changed
since the first pass, and the pause intent only if the trainer changed it since it was applied
(then within `--health-timeout`, not `--control-timeout`); the whole pass within
`--load-deadline`. A replay whose request got no answer in time (`HungError`: a replica whose
health checks pass while a control route hangs) fails, and the replica backs off before its next
replay (lifecycle.py), so a hang is met outside the lock, and at most once per back-off under it.

It is given the replica client, the fleet, the fence, the broadcast lock and the per-replica
load and unload (`ReplicaLoads`) explicitly. This module must never admit a replica whose
replay did not complete, nor unload a name the fleet serves from a replica that is serving.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
from collections.abc import Callable, Sequence
from dataclasses import replace

from lora_router.config import Config
from lora_router.fleet.client import Facts, ReplicaClient
from lora_router.fleet.failure import Cause, Failure
from lora_router.fleet.fence import AdapterFence
from lora_router.fleet.fleet import Fleet, PauseIntent
from lora_router.fleet.leftovers import Leftovers
from lora_router.fleet.lifecycle import State
from lora_router.fleet.readiness import load_failure, loras_needed, seen_in, sync_problems
from lora_router.fleet.replica import Replica
from lora_router.fleet.replica_loads import LOAD, Outcome, ReplicaLoads

log = logging.getLogger(__name__)


class ReplayError(Exception):
    """A replica could not be brought to the fleet's state; it stays out of service."""


class HungError(ReplayError):
    """A request of the replay got no answer in time: the replica backs off (lifecycle.py)."""


def failed(what: str, failure: Failure) -> ReplayError:
    """The replay failed at `what` for `failure`; a HungError if the replica did not answer in
    time."""
    kind = HungError if failure.cause is Cause.TIMEOUT else ReplayError
    return kind(f"{what}: {failure}")


class UnlistedError(ReplayError):
    """The replica answers that an adapter is already loaded, yet its `/v1/models` does not list
    it: its listing contradicts its loads (a load balancer over several servers?)."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"it answers that adapter '{name}' is already loaded, but its /v1/models does not "
            "list it"
        )
        self.name = name


class Replay:
    """Discovery and re-admission, over the replica client (module docstring)."""

    def __init__(
        self,
        config: Config,
        client: ReplicaClient,
        fleet: Fleet,
        fence: AdapterFence,
        lock: asyncio.Lock,
        loads: ReplicaLoads,
    ) -> None:
        self.config = config
        self.client = client
        self.fleet = fleet
        self.fence = fence
        self.lock = lock  # the broadcast lock (broadcast.py)
        self.loads = loads
        self.block_size: int | None = config.block_size  # known (module docstring), else None
        self.on_block_size: Callable[[int], None] | None = None
        self._discovered = False  # `discover` has read every replica (`_note_facts`)
        # The replica whose final pass holds the broadcast lock, and since when (loop time).
        self.holding: tuple[Replica, float] | None = None

    def _known_adapter(self, name: str) -> bool:
        """Whether the fence knows `name` as an adapter: never a base model (fleet.py)."""
        return self.fence.state(name) is not None

    # -- start ------------------------------------------------------------------------------

    async def discover(self) -> int | None:
        """Read every replica at start; returns the KV block size if it is known (module
        docstring)."""
        fleet = self.fleet
        results = await asyncio.gather(*(self._probe(r) for r in fleet.replicas))
        self._discovered = True
        up: list[tuple[Replica, Facts]] = []
        for replica, (facts, error) in zip(fleet.replicas, results, strict=True):
            if facts is None:
                replica.life.eject(error)
            else:
                up.append((replica, facts))
        for replica, facts in up:
            if facts.lora is False:
                log.warning("%s runs without LoRA (lora_config is null)", replica.describe())
        for what in fleet.disagreements():
            log.warning("%s", what)
        serving = [r for r, _ in up]
        if self.config.unload_stale:
            await self._unload_stale(serving, self.config.unload_stale)
        self._warn_leftovers(serving)
        self._adopt_static(serving)
        sizes = {f.block_size for _, f in up} - {None}
        if self.block_size is None and len(sizes) == 1:
            self.block_size = sizes.pop()
        return self.block_size

    async def _probe(self, replica: Replica) -> tuple[Facts | None, str]:
        """One replica's models and server info, or why it failed."""
        held = await self.client.listing(replica)
        if isinstance(held, Failure):
            return None, f"at start: {held}"
        replica.adapters = dict(held.adapters)
        replica.facts = held
        self.fleet.listed(replica, held.bases, self._known_adapter)
        info = await self._read_info(replica, held)
        if isinstance(info, Failure):
            if info.cause is not Cause.DEV_MODE:  # else named by the readiness warning
                log.warning("%s: %s", replica.describe(), info)
            return held, ""
        return info, ""

    async def _read_info(self, replica: Replica, listed: Facts | None = None) -> Facts | Failure:
        """`replica`'s `/server_info`, its readiness noted; a failure other than dev mode's
        404 marks it to be read again (`Replica.info_unread`, `reread`)."""
        info = await self.client.server_info(replica, listed)
        self._note_readiness(replica, info)
        if isinstance(info, Facts):
            self._note_facts(replica, info)
        replica.info_unread = isinstance(info, Failure) and info.cause is not Cause.DEV_MODE
        return info

    async def reread(self, replica: Replica) -> None:
        """Read a serving replica's `/server_info` again (health.py asks at each passing check
        while `Replica.info_unread`): a replica admitted without it may be the one that says
        the block size (module docstring)."""
        self._learn_block_size(replica, await self._read_info(replica))

    def _learn_block_size(self, replica: Replica, info: Facts | Failure) -> None:
        """The block size `replica` reports, if none is known yet (module docstring)."""
        if self.block_size is None and isinstance(info, Facts) and info.block_size is not None:
            self.block_size = info.block_size
            log.info("KV block size %d, as %s reports it", info.block_size, replica.describe())
            if self.on_block_size is not None:
                self.on_block_size(info.block_size)

    def _note_facts(self, replica: Replica, facts: Facts) -> None:
        """Record what `replica` said of itself (facts read without a listing keep its last
        listing's base names), and warn of each disagreement of the fleet's
        (`Fleet.disagreements`) that this makes appear. At start the whole fleet's are logged
        once, after every replica has said (`discover`)."""
        if not facts.bases and replica.facts is not None:
            facts = replace(facts, bases=replica.facts.bases)
        if not self._discovered:
            replica.facts = facts
            return
        before = set(self.fleet.disagreements())
        replica.facts = facts
        for what in self.fleet.disagreements():
            if what not in before:
                log.warning("%s", what)

    def _note_readiness(self, replica: Replica, info: Facts | Failure) -> None:
        """Record whether `replica` can take part in a weight sync (readiness.py), from its
        `/server_info` (`info`), and say so when that changes: a standing warning, never a
        reason to keep it out."""
        problems = tuple(sync_problems(seen_in(info), loras_needed(self.config.max_staleness)))
        for problem in problems:
            if problem not in replica.unready:
                log.warning(
                    "%s cannot take part in a weight sync: %s (it serves completions; TRL's "
                    "syncs fail while it is in the fleet)",
                    replica.describe(),
                    problem,
                )
        if replica.unready and not problems:
            log.info("%s can take part in weight syncs", replica.describe())
        replica.unready = problems

    async def _unload_stale(self, replicas: Sequence[Replica], pattern: str) -> None:
        jobs = [(r, n) for r in replicas for n in r.adapters if fnmatch.fnmatchcase(n, pattern)]
        for replica, name in jobs:
            answers = await self.loads.unload_from(name, [replica])
            if answers[0].status in (200, 404):
                log.info("--unload-stale: unloaded %r from %s", name, replica.describe())

    def _warn_leftovers(self, replicas: Sequence[Replica]) -> None:
        """Say which replica holds names the trainer's loads would collide with (leftovers.py),
        and the fix, once at start: TRL's first load of such a name would fail."""
        config = self.config
        judge = Leftovers.of(
            [list(r.adapters) for r in replicas], config.unload_stale, config.lineage_pattern
        )
        for replica in replicas:
            for what, fix, note in judge.judge(sorted(replica.adapters)):
                if not note:
                    log.warning(
                        "%s holds %s; for a new run, fix: %s (a trainer resuming against these "
                        "replicas needs nothing)",
                        replica.describe(),
                        what,
                        fix,
                    )

    def _adopt_static(self, replicas: Sequence[Replica]) -> None:
        if not replicas:
            return
        everywhere = set.intersection(*(set(r.adapters) for r in replicas))
        seen = set().union(*(set(r.adapters) for r in replicas))
        for name in sorted(seen):
            roots = {r.adapters.get(name) for r in replicas}
            if name in everywhere and len(roots) == 1:
                path = next(iter(roots)) or ""
                self.fence.mark_live(name, path)
                log.info("adapter %r (%s) is on every replica: serving it", name, path)
            else:
                where = ", ".join(r.describe() for r in replicas if name in r.adapters)
                log.warning(
                    "adapter %r is not on every replica at the same path (held by %s): not "
                    "served until it is loaded through the router",
                    name,
                    where,
                )

    # -- re-admission -----------------------------------------------------------------------

    async def readmit(self, replica: Replica) -> None:
        """Bring a replica in state *replaying* to the fleet's state, then report its success
        to its lifecycle (which admits it); raises ReplayError.

        Loads being broadcast meet it from both sides, best effort: a broadcast that starts
        while it replays sends it its load (a ride, broadcast.py), and its first pass includes
        the loads under way when it starts. A version that goes live meanwhile is then already
        loaded when the final pass runs under the broadcast lock, so that pass — and the
        trainer's next call queued behind it — does not wait for a whole adapter load."""
        config, loads = self.config, self.loads
        loads.drop_rides(replica)
        self._learn_block_size(replica, await self._read_info(replica))
        await self._converge(replica, final=False)
        applied = self.fleet.pause
        await self._replay_pause(replica, applied, config.control_timeout)
        self._check_rides(replica, await loads.settle(replica))
        async with self.lock:
            loop = asyncio.get_running_loop()
            since = loop.time()
            self.holding = (replica, since)
            try:
                async with asyncio.timeout(config.load_deadline):
                    # Rides of the broadcasts that ran since (none starts while this holds it).
                    self._check_rides(replica, await loads.settle(replica))
                    await self._converge(replica, final=True)
                    if self.fleet.pause != applied:
                        await self._replay_pause(replica, self.fleet.pause, config.health_timeout)
            except (TimeoutError, HungError) as exc:
                deadline = f"--load-deadline ({config.load_deadline:g} s)"
                why = str(exc) or f"it did not end within {deadline}"
                raise HungError(
                    f"{why} (in its final pass, which held the broadcast lock for "
                    f"{loop.time() - since:.1f} s)"
                ) from None
            finally:
                self.holding = None
            self._check_replaying(replica)
            replica.life.replay_succeeded(asyncio.get_running_loop().time())
            replica.breaker.reset()

    def _check_replaying(self, replica: Replica) -> None:
        """Raise unless the replica is still replaying (its replay may go on)."""
        if replica.state is not State.REPLAYING:
            if not replica.life.member:
                raise ReplayError("it was removed from the fleet")
            raise ReplayError(f"it was ejected during its replay: {replica.life.last_error}")

    def _check_rides(self, replica: Replica, rides: list[Outcome]) -> None:
        """A load that rode to the replica and got no answer fails its replay now, outside the
        final pass (which would wait for that load again under the lock); any other outcome is
        settled by the final pass's listing."""
        self._check_replaying(replica)  # else a ride ended because it was given up on
        for o in rides:
            if o.kind == "down" and o.answer is not None:
                raise failed("a load broadcast meanwhile got no answer", o.answer.failure(LOAD))

    async def _converge(self, replica: Replica, *, final: bool) -> None:
        held = await self.client.listing(replica)
        if isinstance(held, Failure):
            raise failed("its /v1/models", held)
        fleet, fence, loads = self.fleet, self.fence, self.loads
        facts = held if replica.facts is None else replace(replica.facts, bases=held.bases)
        self._note_facts(replica, facts)
        fleet.listed(replica, held.bases, self._known_adapter)
        replica.adapters = dict(held.adapters)
        replica.loaded = {n: d for n, d in replica.loaded.items() if n in held.adapters}
        live = fence.live()
        # Names it holds that the fleet does not serve (or at another path) go: a replica
        # mirrors the fleet. Outside the lock, names with a broadcast under way are left to the
        # final pass.
        extra = [
            n
            for n, root in held.adapters.items()
            if (n not in live or live[n].path != root) and (final or fence.state(n) is None)
        ]
        unloads = await asyncio.gather(*(loads.unload_from(n, [replica]) for n in extra))
        for answers in unloads:
            if answers[0].status not in (200, 404):
                path = "/v1/unload_lora_adapter"
                raise failed("unloading a stale adapter failed", answers[0].failure(path))
        # Missing, too: a copy at the right path whose files this router did not load there
        # (load_on drops it and loads the files again). Names found at start have no digest.
        missing = [
            (n, e)
            for n, e in live.items()
            if replica.adapters.get(n) != e.path
            or (e.files is not None and replica.loaded.get(n) != e.files)
        ]
        # Outside the lock, the loads a broadcast is carrying out (or has queued) join this
        # pass too, best effort: a replica that came back while a version was being broadcast
        # then holds it when the final pass runs, so its replay is one round of loads, not two.
        # What does not go live is unloaded by the final pass, like any name the fleet does
        # not serve.
        ahead = (
            [] if final else [(e.name, e) for e in fence.loading() if e.name not in held.adapters]
        )
        if not missing and not ahead:
            return
        deadline = asyncio.get_running_loop().time() + self.config.load_deadline
        outcomes = await asyncio.gather(
            *(
                loads.load_on(replica, n, e.path, e.body, e.files, deadline)
                for n, e in missing + ahead
            )
        )
        for i, ((name, entry), o) in enumerate(zip(missing + ahead, outcomes, strict=True)):
            if o.kind in ("loaded", "present"):
                replica.adapters[name] = entry.path
            elif i >= len(missing):
                pass  # one a broadcast is carrying: the final pass settles it
            elif o.kind == "conflict" and not o.detail:
                raise UnlistedError(name)
            elif o.answer is not None and o.kind in ("down", "failed"):  # the replica's answer
                failure = load_failure(o.answer.failure(LOAD), replica.unready)
                raise failed(f"replaying adapter '{name}' failed", failure)
            else:
                raise ReplayError(f"replaying adapter '{name}' failed ({o.kind}): {o.detail}")

    async def _replay_pause(self, replica: Replica, pause: PauseIntent, timeout: float) -> None:
        """Apply the pause intent `pause`, waiting at most `timeout` for the answer."""
        if not pause.known:
            return
        path = "/pause" if pause.query is not None else "/resume"
        answer = await self.client.call(
            replica, "POST", path, query=pause.query or "", timeout=timeout
        )
        if answer.status != 200:
            raise failed(f"replaying the pause state ({path}) failed", answer.failure(path))
