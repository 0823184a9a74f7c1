"""Explicit sessions: `X-Session-ID` (vllm-router's header, which prime-rl sends) pins a
conversation to one replica, and `POST /finish_session` releases it. This module owns every
rule of them; proxy/routed.py consults the table per routed request, proxy/dispatch.py answers
`/finish_session`, docs/sessions.md tells clients how to use them.

Rules:
- *The id*: the header's value, 1 to `MAX_ID_BYTES` visible ASCII bytes (0x21-0x7E). An empty
  value is no session (as in vllm-router); any other value, or the header twice, is refused
  (`SessionIdError`, a 400). A request without the header never reads or writes the table:
  it is routed exactly as without this module.
- *Placement*: a session's first request is placed by the policy like any other request, so
  the G samples of a GRPO group (each its own session id, one shared prompt) still meet where
  their prompt is cached (`placed`); the session is then pinned to the replica it went to (`pin`).
- *Stickiness*: a later request is offered to the policy with its pinned replica as the only
  candidate (`narrow`), so the policy's affinity table records the turn where it runs and its
  prompt tokens to compute are the policy's own estimate, as long as that replica is routable
  for this request (serving, its breaker closed, holding the adapter, not yet tried by this
  request: `Fleet.routable`) and not far over the load (`overloaded`). Otherwise the policy
  places it among all the candidates and the session is pinned again where it went
  (`replaced`): a retry after the pinned replica failed moves the session too.
- *Far over the load*: vllm-router's `sticky_least_loaded` sticks whatever the load; here a
  session leaves a replica holding at least `OVERLOAD` times the mean in flight of the other
  candidates (at least 1) plus twice `load_slack` (`overloaded`), where a prefix continuation
  would have spilled long before (the policy's follow cap). Stickiness blind to load lets a
  saturated replica thrash its cache (docs/sessions.md); below that bound the session's
  history cached on its replica is worth more than the queue it waits in, beyond it the
  session recomputes its history once, elsewhere, and stays there.
- *Idle TTL*: a session not routed for `ttl` seconds is forgotten (`expired`). Sessions are
  kept in order of last use and the oldest are checked on every use: O(1) amortised, no timer.
- *Bound*: at most `max_sessions` are kept; pinning one more forgets the least recently used
  (`evicted`); docs/sessions.md gives the memory a session takes.
- *Release*: `finish` forgets a session (`finished`); an unknown or already released id is
  harmless.

Never: I/O, logging, or a clock of its own (the caller gives `clock`, the event loop's).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from urllib.parse import parse_qsl

import orjson

from .contract import Candidates, R

MAX_ID_BYTES = 256  # a trajectory's UUID takes 36
OVERLOAD = 2  # times the follow cap without ε (module docstring, *far over the load*)
_VISIBLE = frozenset(range(0x21, 0x7F))


class SessionIdError(ValueError):
    """A session id the rules refuse (module docstring); the message says why, for the 400."""


def check_id(value: bytes, where: str) -> bytes:
    """`value` if it is a session id, else SessionIdError naming `where` it came from."""
    if len(value) > MAX_ID_BYTES:
        raise SessionIdError(f"{where} is {len(value)} bytes long; at most {MAX_ID_BYTES}.")
    if not _VISIBLE.issuperset(value):
        raise SessionIdError(f"{where} must be visible ASCII characters (no spaces).")
    return value


def header_id(values: Sequence[bytes]) -> bytes | None:
    """The request's session id from the values of its `X-Session-ID` headers (the client's
    parser picks them out: http/request.py's `Request.session`), or None without one (or with
    an empty one); SessionIdError for a value the rules refuse, or the header twice."""
    if not values:
        return None
    if len(values) > 1:
        raise SessionIdError("X-Session-ID is given twice; give it once.")
    if not values[0]:
        return None
    return check_id(values[0], "X-Session-ID")


def finish_id(query: bytes, body: bytes) -> bytes:
    """The id a `POST /finish_session` names: `?session_id=ID` (vllm-router's form), else a JSON
    body `{"session_id": "ID"}`; SessionIdError when neither names one the rules accept."""
    pairs = [
        v
        for k, v in parse_qsl(query.decode("latin-1"), keep_blank_values=True)
        if k == "session_id"
    ]
    if len(pairs) > 1:
        raise SessionIdError("session_id is given twice; give it once.")
    if pairs:
        value = pairs[0].encode("utf-8")
    else:
        try:
            doc = orjson.loads(body) if body.strip() else None
        except orjson.JSONDecodeError:
            doc = None
        raw = doc.get("session_id") if isinstance(doc, dict) else None
        if not isinstance(raw, str):
            raise SessionIdError(
                "Name the session to release: POST /finish_session?session_id=ID "
                '(or a JSON body {"session_id": "ID"}).'
            )
        value = raw.encode("utf-8")
    if not value:
        raise SessionIdError("session_id is empty.")
    return check_id(value, "session_id")


def overloaded(in_flight: int, total: int, n: int, slack: int) -> bool:
    """Whether a replica holding `in_flight` of the `total` requests in flight over `n`
    candidates is too far over the load for a session to stay (module docstring): at least
    OVERLOAD times the others' mean, rounded up and at least 1, plus twice `slack`. A lone
    candidate never is (there is nowhere else to go)."""
    if n < 2:
        return False
    others = max(1, -(-(total - in_flight) // (n - 1)))
    return in_flight >= OVERLOAD * others + 2 * slack


class SessionTable:
    """Sessions and the replica each is pinned to (module docstring), in order of last use."""

    __slots__ = (
        "_pins",
        "clock",
        "evicted",
        "expired",
        "finished",
        "max_sessions",
        "placed",
        "replaced",
        "slack",
        "stuck",
        "ttl",
    )

    def __init__(self, ttl: float, max_sessions: int, slack: int, clock: Callable[[], float]):
        self.ttl = ttl
        self.max_sessions = max_sessions
        self.slack = slack  # the policy's load_slack (`overloaded`)
        self.clock = clock
        # id -> (replica name, loop time of its last use); oldest use first.
        self._pins: OrderedDict[bytes, tuple[str, float]] = OrderedDict()
        self.placed = 0  # first requests of sessions, placed by the policy
        self.stuck = 0  # later requests offered to their pinned replica alone
        self.replaced = 0  # later requests placed again: pin not routable or far over the load
        self.expired = 0
        self.evicted = 0
        self.finished = 0

    def __len__(self) -> int:
        return len(self._pins)

    def narrow(self, session: bytes, routable: Candidates[R]) -> Candidates[R]:
        """The candidates the policy chooses among for a request of `session`: its pinned
        replica alone while the rules keep it there, else all of `routable`. O(1) amortised."""
        self._expire(self.clock())
        pin = self._pins.get(session)
        if pin is None:
            self.placed += 1
            return routable
        replica = routable.get(pin[0])
        if replica is None or overloaded(
            replica.in_flight, routable.in_flight, len(routable), self.slack
        ):
            self.replaced += 1
            return routable
        self.stuck += 1
        return Candidates((replica,), routable.model)

    def pin(self, session: bytes, replica: str) -> None:
        """`session`'s request went to `replica`: pinned there, used now (the least recently
        used session forgotten if that makes one too many). O(1) amortised."""
        pins = self._pins
        pins[session] = (replica, self.clock())
        pins.move_to_end(session)
        if len(pins) > self.max_sessions:
            pins.popitem(last=False)
            self.evicted += 1

    def finish(self, session: bytes) -> bool:
        """Release `session`: whether it was kept (an unknown id is harmless)."""
        if self._pins.pop(session, None) is None:
            return False
        self.finished += 1
        return True

    def _expire(self, now: float) -> None:
        pins, ttl = self._pins, self.ttl
        while pins:
            oldest = next(iter(pins.values()))
            if oldest[1] + ttl > now:
                return
            pins.popitem(last=False)
            self.expired += 1

    def json(self) -> dict[str, object]:
        """The figures `/router/status` shows. Read-only: sessions idle past the TTL but not
        yet dropped (nothing has used the table since) count as expired, not as kept."""
        now = self.clock()
        idle = 0
        for _, used in self._pins.values():
            if used + self.ttl > now:
                break
            idle += 1
        return {
            "count": len(self._pins) - idle,
            "max_sessions": self.max_sessions,
            "ttl_s": self.ttl,
            "placed": self.placed,
            "stuck": self.stuck,
            "replaced": self.replaced,
            "finished": self.finished,
            "expired": self.expired + idle,
            "evicted": self.evicted,
        }
