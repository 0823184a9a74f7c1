"""`LazyTimer`: one event-loop timer per connection, moved only when a deadline comes earlier.

A connection's deadline changes several times per request (headers, body, first response byte,
idle between bytes, idle in the pool). Moving a loop timer each time would cost more than the
rest of a request's bookkeeping, so the owner keeps its deadline as a plain number and asks the
timer to wake it *by* some time: the timer moves only when that is earlier than its scheduled
wake-up. When it fires, the owner compares the deadline current then with the clock and, if it
is still ahead, asks again. A steady stream of requests thus costs no timer call at all.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


class LazyTimer:
    __slots__ = ("_callback", "_handle", "_loop", "_wake")

    def __init__(self, loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
        self._loop = loop
        self._callback = callback
        self._handle: asyncio.TimerHandle | None = None
        self._wake = 0.0

    @property
    def pending(self) -> bool:
        """Whether a wake-up is scheduled."""
        return self._handle is not None

    def wake_by(self, when: float) -> None:
        """Make sure the callback runs no later than `when` (loop time)."""
        if self._handle is None or when < self._wake:
            if self._handle is not None:
                self._handle.cancel()
            self._wake = when
            self._handle = self._loop.call_at(when, self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _fire(self) -> None:
        self._handle = None
        self._callback()
