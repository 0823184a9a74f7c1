"""A replica's life cycle: the one place a replica's service state changes.

Every replica is in exactly one state:

- **joining**: added at run time, never served yet; waits for its health checks and its replay;
- **replaying**: answers its health checks and is being brought to the fleet's state (every live
  adapter loaded, stale names unloaded, the pause state applied: replay.py); it serves nothing,
  but load broadcasts that start meanwhile ride along to it, best effort;
- **serving**: takes routed requests and broadcasts (the only state `Fleet.routable` and
  `Fleet.live` accept);
- **ejected**: out of service (failed health checks, unreachable during a broadcast, it lost
  live adapters: a restart, or its engine computed nothing while holding requests: health.py's
  stall rule); re-admitted through a replay once its health checks pass;
- **backing-off**: ejected because its last replay did not stick (it lacked a live adapter again
  soon after it was re-admitted, or it answers "already loaded" for a name its listing does not
  show: a URL that is a load balancer), or because its last replay failed for want of an answer
  in time (`hung`: its health checks pass while a control route hangs, and each replay would
  wait out the call's deadline again); not replayed before `readmit_at` (the wait doubles with
  each such replay, from one health interval up to `MAX_BACKOFF_S`) unless no other replica
  serves; a replica that stays in service for a while starts afresh;
- **draining**: an operator is removing it: nothing new, it leaves once its requests are done;
- **gone**: removed from the fleet.

```
  joining ──replay_begins──▶ replaying ──replay_succeeded──▶ serving
     ▲                          │  ▲                          │
     │               replay_failed │ replay_begins            │ eject / restarted
     │              eject          │ (back-off over)          │ listing_lacks (not the last)
     │                 ▼           │                          ▼
     │              ejected / backing-off ◀───────────────────┘
  any state but gone ──drain──▶ draining ──remove──▶ gone
```

Health checks (health.py), replays (replay.py) and broadcasts (broadcast.py) report *events*
by calling these methods; they never set a state themselves. A method returns whether its
event changed anything; an event the current state does not accept (a replay finishing for a
replica ejected meanwhile, an eject of a draining replica) is refused: it returns False and
leaves the state as it was. A listing alone never ejects the last serving replica
(`listing_lacks` with no other replica serving is refused, counted in `listing_kept`).

Nothing waits for the answers of a replica the router has stopped counting on; two signals
say when, one for each plane:

- *given up* (ejected, backing-off or gone): `given_up` is an event set when it enters one of
  those states, and a fresh, unset one each time it comes back, so a broadcast waiting for one
  of its answers stops waiting then (replica_loads.py's `unless_given_up`);
- *leaves service* (`eject` while serving or replaying, and so `restarted` and
  `listing_lacks`: each counted in `ejections`): it is told to `on_leave` with the reason, once;
  the fleet wires it to the replica's pool (`UpstreamPool.withdraw`), which ends the routed
  requests still waiting there for an answer, so they are retried elsewhere at once rather than
  wait out `--first-byte-timeout` on a replica that is known to be out (fleet/fleet.py), and,
  when it was ejected as stalled, the answers begun there too (http/upstream.py's rule).
  Draining is not leaving service in this sense: a drained replica finishes what it has.

Pure bookkeeping, like breaker.py: the caller passes the clock; no I/O, no tasks. It must never
let a replica serve without a replay that succeeded after its last ejection.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)

MAX_BACKOFF_S = 300.0  # the longest wait before re-admitting a replica whose replays do not stick
# A replica re-admitted this many health intervals ago (or more than its back-off) that lacks a
# live adapter restarted anew; sooner, its replay did not stick.
_STICK_INTERVALS = 8


class State(enum.Enum):
    JOINING = "joining"
    REPLAYING = "replaying"
    SERVING = "serving"
    EJECTED = "ejected"
    BACKING_OFF = "backing-off"
    DRAINING = "draining"
    GONE = "gone"


# Out of service but still a member: health checks watch it and a replay may bring it back.
OUT = frozenset({State.JOINING, State.EJECTED, State.BACKING_OFF})
# The router has given up on it: nothing waits for its answers any longer (`given_up`).
GIVEN_UP = frozenset({State.EJECTED, State.BACKING_OFF, State.GONE})


class Lifecycle:
    """One replica's state and the events that move it (module docstring)."""

    __slots__ = (
        "_given_up",
        "_state",
        "admitted_at",
        "ejections",
        "interval",
        "last_error",
        "listing_kept",
        "on_change",
        "on_leave",
        "readmit_at",
        "slips",
        "who",
    )

    def __init__(self, who: str, interval: float, state: State = State.JOINING) -> None:
        self.who = who  # how log lines name the replica
        self.interval = interval  # the health interval: the back-off's unit
        self._state = state
        self._given_up = asyncio.Event()
        if state in GIVEN_UP:
            self._given_up.set()
        # Called after every transition (the fleet's kept candidate sets, fleet/fleet.py).
        self.on_change: Callable[[], None] | None = None
        # Called with the reason, and whether its engine stalled, when it leaves service
        # (module docstring).
        self.on_leave: Callable[[str, bool], None] | None = None
        self.last_error = ""  # why it was last ejected or refused admission
        self.ejections = 0  # times it left service (for metrics)
        self.admitted_at = 0.0  # when its last replay ended in admission
        self.slips = 0  # replays in a row that did not stick
        self.readmit_at = 0.0  # not replayed before this (back-off)
        self.listing_kept = 0  # times a listing alone would have ejected it as the last one

    @property
    def state(self) -> State:
        return self._state

    @state.setter
    def state(self, state: State) -> None:
        # Written only by the event methods below.
        if state is not self._state:
            self._state = state
            if state in GIVEN_UP:
                self._given_up.set()
            elif self._given_up.is_set():
                self._given_up = asyncio.Event()  # back: a new wait for the next time
            if self.on_change is not None:
                self.on_change()

    @property
    def given_up(self) -> asyncio.Event:
        """Set once it is ejected, backing off or gone (module docstring); a waiter keeps the
        event it got when its wait began."""
        return self._given_up

    @property
    def serving(self) -> bool:
        return self.state is State.SERVING

    @property
    def member(self) -> bool:
        """Still in the fleet and not being removed: watched, replayed when it answers."""
        return self.state not in (State.DRAINING, State.GONE)

    # -- events -----------------------------------------------------------------------------

    def eject(self, reason: str, *, stalled: bool = False) -> bool:
        """It failed (health checks, unreachable during a broadcast; `stalled`: its engine
        computes nothing): out of service. A replica already out of service keeps its state
        (and its back-off) and records the reason."""
        state = self.state
        if state in (State.SERVING, State.REPLAYING):
            self.ejections += 1
            log.warning("ejecting %s: %s", self.who, reason)
            self.state = State.EJECTED
            if self.on_leave is not None:
                self.on_leave(reason, stalled)
        elif state not in OUT:
            return False
        self.last_error = reason
        return True

    def restarted(self, now: float, reason: str) -> bool:
        """A serving replica lost live adapters (a 404 for one, or its listing): it restarted,
        or, when it was re-admitted only recently, its replay did not stick (back-off)."""
        if self.state is not State.SERVING:
            return False
        self.eject(reason)
        stuck_for = max(_STICK_INTERVALS * self.interval, self.backoff())
        if self.admitted_at and now - self.admitted_at < stuck_for:
            self._slip(now)
        else:
            self.slips = 0
            self.readmit_at = 0.0
        return True

    def listing_lacks(self, now: float, reason: str, others_serving: bool) -> bool:
        """Its `/v1/models` lacks live adapters. As `restarted`, except that a listing alone never
        takes the last serving replica out of service (refused; counted in `listing_kept`)."""
        if self.state is State.SERVING and not others_serving:
            self.listing_kept += 1
            return False
        return self.restarted(now, reason)

    def replay_begins(self, now: float, others_serving: bool) -> bool:
        """It answers its health checks: bring it to the fleet's state. Refused while it backs
        off and another replica serves."""
        state = self.state
        if state is State.BACKING_OFF and now < self.readmit_at and others_serving:
            return False
        if state not in OUT:
            return False
        self.state = State.REPLAYING
        return True

    def replay_succeeded(self, now: float) -> bool:
        """Its replay completed (under the broadcast lock): it serves from now on."""
        if self.state is not State.REPLAYING:
            return False
        self.state = State.SERVING
        self.admitted_at = now
        self.last_error = ""
        return True

    def replay_failed(
        self, now: float, reason: str, unlisted: bool = False, hung: bool = False
    ) -> bool:
        """Its replay failed; `unlisted`: it answers "already loaded" for a name its listing does
        not show, so its replay did not stick; `hung`: a request of its replay got no answer in
        time. Either backs off."""
        state = self.state
        if state is State.REPLAYING:
            self.state = State.EJECTED
        elif state not in OUT:
            return False
        self.last_error = reason
        if unlisted or hung:
            self._slip(now)
        return True

    def drain(self) -> bool:
        """An operator removes it: nothing new from now on."""
        if not self.member:
            return False
        self.state = State.DRAINING
        return True

    def remove(self) -> bool:
        """It left the fleet for good."""
        if self.state is State.GONE:
            return False
        self.state = State.GONE
        return True

    # -- the back-off -----------------------------------------------------------------------

    def _slip(self, now: float) -> None:
        self.slips += 1
        self.state = State.BACKING_OFF
        self.readmit_at = now + self.backoff()

    def backoff(self) -> float:
        """The wait before its next replay, after `slips` replays in a row that did not stick."""
        return min(self.interval * 2**self.slips, MAX_BACKOFF_S)
