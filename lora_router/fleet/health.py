"""Fleet health: active checks, passive reports, and the replays that bring replicas back.

This module decides *when* a replica's state should change and reports that as an event to the
replica's lifecycle (lifecycle.py), which alone changes it. It is given the replica client, the
fleet, the fence and the replay (replay.py) explicitly. What a routed answer proves, and how
soon a restart shows: docs/design/fleet.md#health.

Each replica's watcher task asks its `/health` every `health_interval` (bounded by
`health_timeout`):
- a serving replica that fails `health_failures` checks in a row is **ejected**; one that
  passes is also asked its `/v1/models`: lacking an adapter that was live before the question,
  it restarted (vLLM keeps adapters in process memory) and is ejected at once, then replayed;
  answering it as no vLLM does (a failure of cause `NOT_VLLM`, failure.py: no model list, or
  an answer over client.py's cap), it is ejected, and its replays keep it out until it lists
  as vLLM does; and, while its `/server_info` has not been read (it failed when the router
  started), it is asked that too (replay.py's `reread`);
- a serving replica whose engine hangs while its `/health` passes is ejected as **stalled**:
  its reports (telemetry.py's `Report.still_since`) show no prompt or generated token for
  `stall_timeout` seconds while the router held requests on it, the fleet not paused. Its
  requests that have received nothing are then retried elsewhere, and its streams under way
  are cut (the withdrawal rule, http/upstream.py), rather than wait out `--first-byte-timeout`
  and `--idle-timeout`. `/health` tests vLLM's
  API server, not its engine, so before such a replica is replayed it must also answer a
  one-token completion within `control_timeout` (`_engine_answers`); until it does it stays
  out, saying why;
- an ejected replica that passes `health_successes` checks in a row is **re-admitted** through
  a replay (replay.py); only then does it become routable. While it is out and failing, its
  checks space out, doubling after each failure up to `DOWN_SPACING_MAX` intervals: dead
  members cost little while idle, and one that comes back is seen within that many.

**Passive health** (`report_status`): a serving replica's check uses what its routed answers
proved since the previous check began:
- a whole 2xx answer skips its `/health` probe for that interval and ends its run of failed
  checks; a 4xx counts for nothing; a 5xx or a transport failure is a failure;
- its `/v1/models` listing is skipped only when a 2xx came for an adapter its last listing
  showed, with that name's fence entry unchanged since; the first check after a re-admission
  always lists; a suspect replica is always probed; an idle one is checked as before;
- a connection refused or reset, a timeout or a 5xx counts against the circuit breaker
  (breaker.py) and marks the replica *suspect*, which wakes its watcher: one failed check then
  ejects it. A 404 for an adapter the fence says is live is a restart: ejected at once and
  replayed. A 503 while the fleet is paused is vLLM refusing work on purpose, never counted.

A replica that stays out of service is logged at a bounded rate, whatever keeps it out (a
failed check, a failed replay) and however it joined (`--replicas`, discovery, the API): a
WARNING when the reason is new, then at most once every `OUT_LOG_INTERVAL` seconds while the
same reason repeats, with the count of the failures not logged (a rejected token answers every
check: one line per check would bury the log; a member that never answers must still show).

A replay that did not stick (the replica lacks a live adapter again soon after re-admission, or
answers "already loaded" for a name its listing does not show) puts its lifecycle in back-off
(lifecycle.py); one warning names the replica and what it lacks, `listing_flaps` counts it. So
does a replay that failed because the replica did not answer in time (replay.py's `HungError`);
the line that says it stays out says when its next replay may start.

Operators add and remove replicas at run time (`add`, `remove`): an added replica's host is
resolved and any alias it makes warned of (`locate`, aliases.py), and it is replayed before it
serves; a removed one stops taking requests at once and leaves the fleet when its in-flight
requests are done (or after `shutdown_grace`). The adapters a member listed as its own when it
joined (a routed answer for one proves nothing: a restart brings it back) are kept per member
and leave with it: however many members come and go, and whatever they list, what is kept is
bounded by the members at once.

This module must never change a replica's state but through its lifecycle's events, nor run
two re-admissions of one replica at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterable, Sequence

import orjson

from lora_router.config import Config, ReplicaAddress
from lora_router.fleet.aliases import resolve
from lora_router.fleet.client import ReplicaClient
from lora_router.fleet.failure import Cause, Failure
from lora_router.fleet.fence import AdapterEntry, AdapterFence, AdapterState
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.lifecycle import State
from lora_router.fleet.replay import HungError, Replay, ReplayError, UnlistedError
from lora_router.fleet.replica import Replica

log = logging.getLogger(__name__)

OUT_LOG_INTERVAL = 300.0  # seconds between two lines about a replica kept out for one reason
DOWN_SPACING_MAX = 8  # health intervals between checks of an out-of-service, failing replica


class _Watch:
    """The watcher state of one replica."""

    __slots__ = (
        "answered",
        "down",
        "failures",
        "lock",
        "out_logged",
        "out_quiet",
        "out_reason",
        "proof",
        "stalled",
        "successes",
        "suspect",
        "task",
        "verified",
        "wake",
    )

    def __init__(self) -> None:
        self.wake = asyncio.Event()
        self.lock = asyncio.Lock()  # one re-admission at a time
        self.failures = 0
        self.successes = 0
        self.down = 0  # failed checks in a row while out of service: its checks space out
        self.suspect = False
        # The last failed replay logged: its reason, when, and the failures since not logged.
        self.out_reason = ""
        self.out_logged = 0.0
        self.out_quiet = 0
        self.task: asyncio.Task[None] | None = None
        # Passive health (module docstring), since the current check began: a routed 2xx came,
        # and the last adapter of `verified` one came for. `verified`: the live adapters its
        # last listing showed, with their fence entries then.
        self.answered = False
        self.proof: str | None = None
        self.verified: dict[str, AdapterEntry] = {}
        # Ejected as stalled: a one-token completion must be answered before its replay.
        self.stalled = False


class HealthMonitor:
    """Watchers for every replica, passive reports, membership changes."""

    def __init__(
        self,
        config: Config,
        client: ReplicaClient,
        fleet: Fleet,
        fence: AdapterFence,
        replay: Replay,
    ) -> None:
        self.config = config
        self.client = client
        self.fleet = fleet
        self.fence = fence
        self.replay = replay
        self._watches: dict[Replica, _Watch] = {}
        # Plain counters for metrics.
        self.checks = 0
        self.check_failures = 0
        self.readmissions = 0
        self.readmission_failures = 0
        self.restarts_detected = 0
        # Replica id -> times ejected as stalled; a removed member's go to `departed_stalls`.
        self.stalls: Counter[int] = Counter()
        self.departed_stalls = 0
        # Checks of serving replicas that routed 2xx answers made unneeded (module docstring).
        self.probes_skipped = 0
        self.listings_skipped = 0
        self.listing_flaps: Counter[int] = Counter()  # replica id -> replays that did not stick
        # Told of every restart found (the KV-event subscriber drops what the replica held).
        self.on_restart: Callable[[Replica], None] | None = None
        # Adapters some member held on its own when it joined: a restart brings them back, so
        # an answer for one proves no adapter is held (passive health). Counted per member
        # (`_own_of`, what each one listed), so a member's names leave with it (`_disown`):
        # bounded by the members and a listing's cap (client.py), however often they change.
        self._own: Counter[str] = Counter()
        self._own_of: dict[Replica, frozenset[str]] = {}

    # -- life cycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Watch every replica; called once discovery has read what each one holds."""
        for replica in self.fleet.replicas:
            self._owns(replica, replica.adapters)
            self._watch(replica)

    async def stop(self) -> None:
        tasks = [w.task for w in self._watches.values() if w.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._watches.clear()

    def _watch(self, replica: Replica) -> _Watch:
        watch = self._watches.get(replica)
        if watch is None:
            watch = self._watches[replica] = _Watch()
            watch.task = asyncio.get_running_loop().create_task(self._run(replica, watch))
        return watch

    # -- passive reports from the routed path -----------------------------------------------

    def report_status(self, replica: Replica, status: int, model: str | None = None) -> None:
        """The status line a replica answered a whole routed request for `model` with (None:
        the request named no model). O(1): it runs once per routed request."""
        if status >= 500:
            if status == 503 and self.fleet.pause.paused:
                return  # paused on purpose (vLLM 0.33 abort/wait modes refuse new work)
            self.report_failure(replica)
            return
        replica.breaker.success()
        if status < 300:
            watch = self._watches.get(replica)
            if watch is not None:
                watch.answered = True
                if model in watch.verified:
                    watch.proof = model

    def report_missing_adapter(self, replica: Replica, model: str) -> None:
        """A replica answered 404 for `model`. If the fence still says it is live, the replica
        lost it (a restart between two checks): out of service until replayed."""
        if self.fence.state(model) is not AdapterState.LIVE or not replica.live:
            return  # the name was being unloaded: the replica is right
        self._restarted(replica, f"answered 404 for live adapter {model!r} (restarted?)", [model])

    def report_failure(self, replica: Replica) -> None:
        """A routed request failed on this replica (refused, reset, timeout, 5xx)."""
        replica.breaker.failure(asyncio.get_running_loop().time())
        watch = self._watches.get(replica)
        if watch is not None:
            watch.suspect = True
            watch.wake.set()

    @property
    def listing_kept(self) -> int:
        """Times a listing alone would have ejected the last serving replica (refused)."""
        return sum(r.life.listing_kept for r in self.fleet.replicas)

    def _restarted(
        self, replica: Replica, reason: str, lost: list[str], *, listing: bool = False
    ) -> bool:
        """A serving replica lost live adapters (`listing`: only its `/v1/models` says so): it
        restarted. Since it answers, it is back already: replayed at the next check, not after
        the success threshold — unless its last replay did not stick (its lifecycle backs
        off). Returns False when its lifecycle refused the event."""
        life, slips = replica.life, replica.life.slips
        now = asyncio.get_running_loop().time()
        if listing:
            left = life.listing_lacks(now, reason, self.fleet.others_serving(replica))
        else:
            left = life.restarted(now, reason)
        if not left:
            return False
        self.restarts_detected += 1
        if self.on_restart is not None:
            self.on_restart(replica)
        self._note_slip(replica, slips, lost)
        watch = self._watches.get(replica)
        if watch is not None:
            watch.successes = self.config.health_successes
            watch.verified = {}
            watch.wake.set()
        return True

    def _note_slip(self, replica: Replica, slips_before: int, lost: list[str]) -> None:
        """Count and (the first time) explain a replay that did not stick."""
        life = replica.life
        if life.slips <= slips_before:
            return
        self.listing_flaps[replica.rid] += 1
        if life.slips == 1:
            shown = ", ".join(lost[:3]) + (" ..." if len(lost) > 3 else "")
            log.warning(
                "%s accepted the replay of %s but does not show it (its /v1/models or its "
                "answers lack it): is its URL a load balancer over several vLLM servers? Give "
                "each server its own --replicas URL. Re-admitting it with a back-off (%g s, "
                "doubling)",
                replica.describe(),
                shown,
                life.backoff(),
            )

    # -- the watcher ------------------------------------------------------------------------

    async def _run(self, replica: Replica, watch: _Watch) -> None:
        loop = asyncio.get_running_loop()
        interval = self.config.health_interval
        # Early checks (on a passive report) are spaced at least this much, so a burst of
        # failing requests costs a few probes a second, not one per request.
        min_gap = min(interval / 4, 0.1)
        last = loop.time()  # discovery (or the admin route) has just looked at it
        while replica.life.member:
            # Woken by a passive report or at the interval's end. A timer that sets the event,
            # not `wait_for`: that wraps the wait in a Task of its own per interval, the most
            # of what an idle watcher costs once routed answers skip its probe (with 128
            # replicas, 64 wake-ups a second).
            spacing = interval * min(1 << min(watch.down, 16), DOWN_SPACING_MAX)
            timer = loop.call_at(last + spacing, watch.wake.set)
            try:
                await watch.wake.wait()
            finally:
                timer.cancel()
            gap = last + min_gap - loop.time()
            if gap > 0:
                await asyncio.sleep(gap)
            watch.wake.clear()
            last = loop.time()
            try:
                await self._check(replica, watch)
            except Exception:  # a watcher must outlive any one bad answer
                log.exception("health check of %s failed unexpectedly", replica.describe())

    async def _check(self, replica: Replica, watch: _Watch) -> None:
        # What routed traffic proved since the previous check began; from here on, answers
        # count for the next one.
        answered, proof = watch.answered, watch.proof
        watch.answered, watch.proof = False, None
        if not replica.live:
            watch.verified = {}  # it is replayed before it serves: a listing comes first
        elif answered and not watch.suspect:
            self.probes_skipped += 1
            watch.failures = 0
            if proof is not None and self.fence.live().get(proof) is watch.verified.get(proof):
                self.listings_skipped += 1
            else:
                await self._lost_adapters(replica, watch)
            await self._passed(replica)
            return
        config = self.config
        self.checks += 1
        answer = await self.client.call(replica, "GET", "/health", timeout=config.health_timeout)
        ok = answer.status == 200
        if not ok:
            self.check_failures += 1
        if replica.live:
            if not ok:
                watch.successes = 0
                watch.failures += 1
                if watch.failures >= config.health_failures or watch.suspect:
                    replica.life.eject(str(answer.failure("/health")))
                watch.suspect = False
                return
            watch.failures = 0
            watch.suspect = False
            if self._stalled(replica, watch):
                return
            await self._lost_adapters(replica, watch)
            await self._passed(replica)
            return
        watch.failures = 0
        if not ok:
            watch.successes = 0
            watch.down += 1
            if replica.state is not State.REPLAYING:  # out already: this records why
                failure = str(answer.failure("/health"))
                replica.life.eject(failure)
                self._log_out(replica, watch, failure, asyncio.get_running_loop().time())
            return
        watch.down = 0
        watch.successes += 1
        if watch.successes >= config.health_successes:
            if watch.stalled and not await self._engine_answers(replica, watch):
                return
            await self.admit(replica)

    def _stalled(self, replica: Replica, watch: _Watch) -> bool:
        """Eject a serving replica whose reports show it still for `stall_timeout` (module
        docstring); whether it was."""
        timeout, report = self.config.stall_timeout, replica.report
        if timeout <= 0 or report is None or report.still_since is None:
            return False
        still = report.at - report.still_since
        if still < timeout:
            return False
        reason = (
            f"stalled: it computed no token for {still:.0f} s while the router held "
            f"{replica.in_flight} request(s) on it, though its /health answers (an engine that "
            "hangs); it returns once it answers a one-token completion: restart it"
        )
        if not replica.life.eject(reason, stalled=True):
            return False
        self.stalls[replica.rid] += 1
        watch.stalled = True
        watch.successes = 0
        return True

    async def _engine_answers(self, replica: Replica, watch: _Watch) -> bool:
        """Whether a replica ejected as stalled answers a one-token completion of its base
        model within `control_timeout`; if not, it stays out, saying why."""
        facts = replica.facts
        model = facts.base_model if facts is not None else None
        probe: dict[str, object] = {"prompt": [0], "max_tokens": 1}
        if model is not None:
            probe["model"] = model
        answer = await self.client.call(
            replica, "POST", "/v1/completions", body=orjson.dumps(probe)
        )
        if 200 <= answer.status < 300:
            watch.stalled = False
            return True
        watch.successes = 0
        why = (
            f"ejected as stalled, its /health answers but a one-token completion got "
            f"{answer.summary()}: restart it"
        )
        replica.life.eject(why)
        self._log_out(replica, watch, why, asyncio.get_running_loop().time())
        return False

    async def _passed(self, replica: Replica) -> None:
        """A serving replica passed its check: its `/server_info`, if it could not be read
        before, is read again (replay.py's `reread`)."""
        if replica.info_unread and replica.live:
            await self.replay.reread(replica)

    async def _lost_adapters(self, replica: Replica, watch: _Watch) -> None:
        """Take a serving replica that lacks an adapter live before we asked out of service;
        else note what its listing showed (`verified`, for passive health)."""
        fence = self.fence
        before = fence.live()
        watch.verified = {}
        if not before:
            return
        held = await self.client.listing(replica)
        if isinstance(held, Failure):
            if held.cause is Cause.NOT_VLLM and replica.live:
                replica.life.eject(f"its /v1/models: {held}")
            return
        if not replica.live:
            return
        lost = [
            n
            for n, entry in before.items()
            if held.adapters.get(n) != entry.path and fence.state(n) is AdapterState.LIVE
        ]
        if not lost:
            own = self._own
            watch.verified = {
                n: e for n, e in before.items() if held.adapters.get(n) == e.path and n not in own
            }
            return
        shown = ", ".join(lost[:3]) + (" ..." if len(lost) > 3 else "")
        reason = f"restarted: it no longer holds {shown}"
        kept = replica.life.listing_kept
        left = self._restarted(replica, reason, lost, listing=True)
        if not left and kept == 0 and replica.life.listing_kept == 1:
            # The last serving replica: its listing alone never takes the fleet out of service.
            log.warning(
                "%s does not list live adapter(s) %s; it is the last replica in service, "
                "so it keeps serving (a restart would show as a 404 on its next request)",
                replica.describe(),
                ", ".join(lost[:3]),
            )

    # -- admission --------------------------------------------------------------------------

    async def admit(self, replica: Replica) -> bool:
        """Replay the fleet's state onto a replica that answers, then let it serve."""
        watch = self._watch(replica)
        async with watch.lock:
            if replica.live:
                return True
            life = replica.life
            loop = asyncio.get_running_loop()
            started = loop.time()
            first = life.state is State.JOINING  # added by discovery or the API, never served
            if not life.replay_begins(started, self.fleet.others_serving(replica)):
                return False  # backing off while others serve, or no longer a member
            try:
                await self.replay.readmit(replica)
            except ReplayError as exc:
                slips, now = life.slips, loop.time()
                unlisted, hung = isinstance(exc, UnlistedError), isinstance(exc, HungError)
                life.replay_failed(now, f"replay failed: {exc}", unlisted=unlisted, hung=hung)
                if isinstance(exc, UnlistedError):
                    self._note_slip(replica, slips, [exc.name])
                self.readmission_failures += 1
                watch.successes = 0
                why = f"replay failed: {exc}"
                if hung and life.state is State.BACKING_OFF:
                    why += f" (its replays back off: the next in {life.readmit_at - now:g} s)"
                self._log_out(replica, watch, why, now)
                return False
            self.readmissions += 1
            watch.out_reason, watch.out_quiet = "", 0
            watch.verified = {}  # nothing it answers proves its adapters before a listing does
            watch.successes = 0
            watch.failures = 0
            watch.down = 0
            watch.suspect = False
            log.info(
                "%s %s (%d adapters replayed in %.2f s)",
                replica.describe(),
                "joins the fleet" if first else "is back in service",
                len(replica.adapters),
                life.admitted_at - started,
            )
            return True

    def _log_out(self, replica: Replica, watch: _Watch, reason: str, now: float) -> None:
        """A failed replay, logged at a bounded rate (module docstring)."""
        if reason == watch.out_reason and now - watch.out_logged < OUT_LOG_INTERVAL:
            watch.out_quiet += 1
            return
        since = (
            f" ({watch.out_quiet} more time(s) for this reason since the last line)"
            if watch.out_quiet and reason == watch.out_reason
            else ""
        )
        log.warning("%s stays out of service: %s%s", replica.describe(), reason, since)
        watch.out_reason, watch.out_logged, watch.out_quiet = reason, now, 0

    # -- membership -------------------------------------------------------------------------

    async def add(self, address: ReplicaAddress, origin: str) -> Replica:
        """A replica added at run time (by `origin`): watched at once, serving after its
        replay."""
        replica = self.fleet.add(address, origin)
        self._watch(replica)
        await self.locate([replica])
        answer = await self.client.call(
            replica, "GET", "/health", timeout=self.config.health_timeout
        )
        if answer.status == 200:
            held = await self.client.listing(replica)
            if not isinstance(held, Failure):
                self._owns(replica, held.adapters)
            await self.admit(replica)
        else:
            replica.life.eject(str(answer.failure("/health")))
        return replica

    def _owns(self, replica: Replica, names: Iterable[str]) -> None:
        """The adapters `replica` held on its own when it joined (`_own`), in place of any
        it was recorded with before; nothing once it was removed."""
        self._disown(replica)
        if not replica.life.member:
            return
        kept = self._own_of[replica] = frozenset(names)
        self._own.update(kept)

    def _disown(self, replica: Replica) -> None:
        """`replica` left: the names it alone held on its own count no more."""
        kept = self._own_of.pop(replica, None)
        if kept:
            self._own -= Counter(kept)  # a name no member holds any more is dropped

    async def locate(self, replicas: Sequence[Replica]) -> None:
        """Resolve the hosts of `replicas`, members that just joined (every member at start),
        at once into their `addresses`, and warn of each alias they are part of (aliases.py,
        `Fleet.aliases`)."""
        timeout = self.config.health_timeout
        found = await asyncio.gather(*(resolve(r.address, timeout) for r in replicas))
        for replica, addresses in zip(replicas, found, strict=True):
            replica.addresses = addresses
        for what in self.fleet.aliases(involving=replicas):
            log.warning("%s", what)

    async def remove(self, replica: Replica) -> bool:
        """Drain and remove a replica; returns whether its requests finished in time."""
        replica.life.drain()  # routable() and broadcasts skip it from now on
        watch = self._watches.pop(replica, None)
        if watch is not None and watch.task is not None:
            watch.task.cancel()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.shutdown_grace
        # in_flight is a plain counter written by the request path; polling it at a short
        # fixed step is the simplest exact wait, and it is bounded by the grace period.
        while replica.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.02)
        drained = replica.in_flight == 0
        self.fleet.remove(replica)
        self._disown(replica)
        # What is counted per member leaves with it (only the total of its stalls stays).
        self.departed_stalls += self.stalls.pop(replica.rid, 0)
        self.listing_flaps.pop(replica.rid, None)
        log.info("%s removed from the fleet (drained: %s)", replica.describe(), drained)
        return drained
