"""`LazyTimer`: one event-loop timer per connection, moved only when a deadline comes earlier.

A connection's deadline changes several times per request (headers, body, first response byte,
idle between bytes, idle in the pool). Moving a loop timer each time would cost more than the
rest of a request's bookkeeping, so the owner keeps its deadline as a plain number and asks the
timer to wake it *by* some time: the timer moves only when that is earlier than its scheduled
wake-up. When it fires, the owner compares the deadline current then with the clock and, if it
is still ahead, asks again. A steady stream of requests thus costs no timer call at all.

A timer whose owner, each time it is woken, either asks again (`due`) or closes stays pending
from its first `arm` until the owner closes. Such an owner, once it armed the timer, never
needs `arm` for a limit of at least the horizon (it would do nothing) and may skip the call:
http/upstream.py's connections do, in and from the pool. (The client connection may not: it
lets the timer lapse while a request is answered.)
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class LazyTimer:
    """The timer of one connection. It never sleeps longer than `horizon`, so a deadline at
    least that far away never needs it moved: the wake-up already due finds it (`due`)."""

    __slots__ = ("_callback", "_handle", "_horizon", "_loop", "_wake")

    def __init__(
        self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None], horizon: float
    ) -> None:
        self._loop = loop
        self._callback = callback
        self._horizon = horizon
        self._handle: asyncio.TimerHandle | None = None
        self._wake = 0.0

    def arm(self, base: float, limit: float) -> None:
        """The owner's deadline is now `base + limit` (loop time): wake it by then, or within
        the horizon. The usual case, a long limit with a wake-up pending, costs nothing."""
        if limit < self._horizon or self._handle is None:
            self._wake_by(base + min(limit, self._horizon))

    def due(self, now: float, deadline: float) -> bool:
        """In the callback: whether `deadline` has passed; if not, sleep towards it again."""
        if now < deadline:
            self._wake_by(min(deadline, now + self._horizon))
            return False
        return True

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def close(self) -> None:
        """Cancel for good (the owner's connection is lost). The callback is dropped: it refers
        back to the owner, a cycle only the cycle collector would free."""
        self.cancel()
        self._callback = _closed

    def _wake_by(self, when: float) -> None:
        if self._handle is None or when < self._wake:
            if self._handle is not None:
                self._handle.cancel()
            self._wake = when
            self._handle = self._loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._callback()


def _closed() -> None:
    pass
