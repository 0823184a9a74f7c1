"""A circuit breaker per replica: stop sending real traffic to a replica that keeps failing it.

Three states, as in every breaker since Nygard's *Release It!*:

- **closed**: requests flow; each failure reported by the routed path (connection refused or
  reset, 5xx, timeout) adds one to a run of consecutive failures, each success ends the run;
- **open**: `threshold` consecutive failures open it; for `cooldown` seconds the replica is left
  out of the candidates the routing policy sees (`Fleet.routable`), so a hash policy cannot
  keep sending a key's traffic to it — the known bug of the anchors' hash policies;
- **half-open**: after the cooldown one request (the *trial*) may go through; its success closes
  the breaker, its failure opens it for another cooldown.

The breaker is not the health check: it never ejects a replica (which costs a replay of every
adapter on return) and needs no probe; it only moves traffic away for a while. It is pure
bookkeeping: the caller passes the clock, so tests drive it without sleeping. It must never do
I/O or read the clock itself.
"""

from __future__ import annotations

from collections.abc import Callable

CLOSED = "closed"
OPEN = "open"
HALF_OPEN = "half-open"


class CircuitBreaker:
    """Consecutive-failure breaker with a cooldown and a single half-open trial."""

    __slots__ = (
        "_state",
        "cooldown",
        "failures",
        "on_change",
        "opened_at",
        "opens",
        "threshold",
        "trial",
    )

    def __init__(self, threshold: int, cooldown: float) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self._state = CLOSED
        # Called when it closes or stops being closed (the fleet's kept candidate sets); the
        # time-driven open -> half-open is not announced: the fleet asks `allows` instead.
        self.on_change: Callable[[], None] | None = None
        self.failures = 0  # consecutive failures in the current run
        self.opened_at = 0.0
        self.opens = 0  # times the breaker opened (for metrics)
        self.trial = False  # a half-open trial request is in flight

    @property
    def state(self) -> str:
        return self._state

    @state.setter
    def state(self, state: str) -> None:
        was_closed = self._state == CLOSED
        self._state = state
        if was_closed != (state == CLOSED) and self.on_change is not None:
            self.on_change()

    def allows(self, now: float) -> bool:
        """Whether the routed path may send this replica a request now."""
        if self.state == CLOSED:
            return True
        if self.state == OPEN:
            if now - self.opened_at < self.cooldown:
                return False
            self.state = HALF_OPEN
            self.trial = False
        return not self.trial

    # `begin` and `success` run once per routed request: they read `_state` rather than the
    # property (a call each), and `success` goes through the setter only when the state
    # changes (the setter announces only a change; closed -> closed is none).

    def begin(self) -> None:
        """A request is being sent; in half-open state it is the one trial."""
        if self._state == HALF_OPEN:
            self.trial = True

    def success(self) -> None:
        self.failures = 0
        self.trial = False
        if self._state != CLOSED:
            self.state = CLOSED

    def failure(self, now: float) -> None:
        self.failures += 1
        self.trial = False
        if self.state == HALF_OPEN or self.failures >= self.threshold:
            if self.state != OPEN:
                self.opens += 1
            self.state = OPEN
            self.opened_at = now

    def reset(self) -> None:
        """Forget everything (a replica re-admitted after a replay starts afresh)."""
        self.state = CLOSED
        self.failures = 0
        self.trial = False
