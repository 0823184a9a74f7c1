"""The cork: what the router writes during one pass of the event loop leaves at the pass's end.

Under load, one pass of the loop runs the callbacks of many readable connections. Written the
moment it is ready, each request to a replica and each answer to a client would leave between
the work on the next ones, and each write would wake a peer that had gone back to sleep; held
to the end of the pass, the writes leave back to back (docs/design/overhead.md#the-cork
measures both).

Rules:
- every write to a client connection (http/server.py) and every request to a replica
  (http/upstream.py) goes through the cork, so a transport's bytes leave in the order they were
  given (one list, flushed in order);
- `write` and `writelines`: the first of a pass goes at once (nothing is held before it, so a
  lone request never waits) and opens the pass, whose end it schedules (`call_soon`: after the
  callbacks of the pass); those that follow in the pass are held until then, up to HELD_BYTES:
  the write that would pass it sends what is held, then itself, at once (large answers held
  through a pass would make the allocator grow and shrink the heap each pass: page faults);
- `write_through`, for the body bytes of an answer already begun, flushes what is held and
  writes at once: a client that reads slowly pauses its replica before the next read (the
  transports' flow control), and no more than one read of an answer is ever held;
- whatever ends a corked transport by the router's hand (close, half-close) calls `flush`
  first, so no byte is held past the end of its transport; a transport closed meanwhile by an
  abort or its peer drops what it was given, as a write to it would have.

One cork a loop (`cork_for`): every connection of the loop writes at the same pass's end.
Cost: one `call_soon` a pass, and a list append a held write; nothing is copied.
Never: reorder a transport's bytes, or hold a write into the next pass.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Sequence
from typing import Any

HELD_BYTES = 64 * 1024  # the most a pass holds (module docstring)


class Cork:
    """The writes held until the end of the current pass (module docstring)."""

    __slots__ = ("_held", "_held_bytes", "_loop")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        # While a pass is open: (transport, its write or writelines, the argument), in the
        # order they were given; None between passes.
        self._held: list[tuple[asyncio.BaseTransport, Callable[[Any], None], Any]] | None = None
        self._held_bytes = 0

    def write(self, transport: asyncio.Transport, data: bytes | memoryview) -> None:
        self._hold(transport, transport.write, data, len(data))

    def writelines(
        self, transport: asyncio.Transport, chunks: Sequence[bytes | memoryview]
    ) -> None:
        self._hold(transport, transport.writelines, chunks, sum(map(len, chunks)))

    def write_through(self, transport: asyncio.Transport, data: bytes | memoryview) -> None:
        if self._held:
            self.flush()
        transport.write(data)

    def _hold(
        self, transport: asyncio.BaseTransport, send: Callable[[Any], None], data: Any, size: int
    ) -> None:
        held = self._held
        if held is None:  # the pass's first write
            self._held = []
            self._loop.call_soon(self.flush)
            send(data)
        elif self._held_bytes + size > HELD_BYTES:  # the budget spent: all of it leaves now
            self._send_held(held)
            self._held = []
            send(data)
        else:
            held.append((transport, send, data))
            self._held_bytes += size

    def flush(self) -> None:
        """Write everything held, in order, and end the pass (its end, or a transport's)."""
        held, self._held = self._held, None
        if held:
            self._send_held(held)

    def _send_held(
        self, held: list[tuple[asyncio.BaseTransport, Callable[[Any], None], Any]]
    ) -> None:
        self._held_bytes = 0
        for transport, send, data in held:
            if not transport.is_closing():
                send(data)


_CORKS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Cork] = weakref.WeakKeyDictionary()


def cork_for(loop: asyncio.AbstractEventLoop) -> Cork:
    """The loop's cork, made at its first use."""
    cork = _CORKS.get(loop)
    if cork is None:
        cork = _CORKS[loop] = Cork(loop)
    return cork
