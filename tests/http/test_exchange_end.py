"""An exchange lets its answer's last reads go in the pass the answer ends in, after its
`on_end` read them (http/exchange.py): held until the awaiting Task resumed, the reads of many
answers grew the heap and handed it back every pass (bench/results/onepath-ab)."""

from __future__ import annotations

import asyncio

import pytest

from lora_router.http.exchange import Exchange


class Sink:
    keep_alive = True

    def head(self, status: int, data: bytes, body: memoryview | None = None) -> bool:
        return True

    def write(self, data: bytes | memoryview) -> None: ...

    def on_upstream(self, transport: asyncio.Transport | None) -> None: ...


async def test_the_last_reads_are_read_at_the_end_then_let_go() -> None:
    ex = Exchange(Sink(), b"POST / HTTP/1.1\r\n\r\n", head_only=False, http11=True)
    ex.done = asyncio.get_running_loop().create_future()
    ex.earlier, ex.prior, ex.tail = b"a", b"b", b"c"
    seen: list[tuple[bytes, bytes, bytes]] = []
    ex.on_end = lambda e: seen.append((e.earlier, e.prior, e.tail))
    ex.end(None)
    assert seen == [(b"a", b"b", b"c")]
    assert (ex.earlier, ex.prior, ex.tail) == (b"", b"", b"")
    assert ex.done.done()  # in the same call: nothing waits for the Task to resume


async def test_an_end_reader_that_fails_still_ends_the_exchange() -> None:
    # A bug in `on_end` (the pace rule once divided by zero there) raises into the replica
    # connection's callback; the request it ends is answered all the same, never left waiting.
    ex = Exchange(Sink(), b"POST / HTTP/1.1\r\n\r\n", head_only=False, http11=True)
    ex.done = asyncio.get_running_loop().create_future()
    ex.tail = b"c"

    def fails(e: Exchange) -> None:
        raise ZeroDivisionError

    ex.on_end = fails
    with pytest.raises(ZeroDivisionError):
        ex.end(None)
    assert ex.done.done() and ex.done.result() is True
    assert ex.tail == b""
