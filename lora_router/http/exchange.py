"""One exchange with a replica: its per-request state (`Exchange`) and how it can fail
(`UpstreamError`), for the pool that carries it (http/upstream.py).

Rules: an exchange ends once (`Exchange.end`), told to the future its pool awaits. The
request's bytes are held only until the first response byte (`request` becomes b""): a long
stream does not keep them; of the answer, only its last three reads are kept (`tail`, `prior`,
`earlier`: what proxy/usage.py reads). `UpstreamError.retryable` is the one judgement of
whether a failed exchange may be sent again, on a fresh connection (http/upstream.py) or to
another replica (proxy/retry.py): nothing of the answer arrived, and it was not a timeout (the
replica may still be working on it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from lora_router.http.request import ResponseSink


class UpstreamError(Exception):
    """A replica exchange failed.

    `kind` is one of connect, reset, timeout, protocol; withdrawn: the router ended it, the
    replica having left service before it answered (`UpstreamPool.withdraw`); or busy: it was
    never sent, every connection the router may open to the replica staying busy too long
    (http/upstream.py). `received` tells whether any response byte arrived from the replica.
    Whether any reached the client is the client connection's to know (`response_started`):
    if it did, the only thing left is to close that connection.
    """

    def __init__(self, kind: str, message: str, *, received: bool) -> None:
        super().__init__(message)
        self.kind = kind
        self.received = received

    @property
    def retryable(self) -> bool:
        """Safe to send to another replica: the replica failed without answering anything.

        A timeout is not: the replica may still be working on the request (a long prefill).
        """
        return not self.received and self.kind != "timeout"

    @property
    def news(self) -> bool:
        """Whether the failure tells something new of the replica's health (the routed path
        reports it to the health monitor): not when the router withdrew the exchange, as the
        replica had already left service for a failure that was reported, nor when the router's
        own cap held it back (busy: the replica is loaded, not failing)."""
        return self.kind not in ("withdrawn", "busy")


class Exchange:
    """Per-request state of one upstream connection.

    Its end is told once, by `end`, to the `done` future its pool awaits: the answer is
    complete (its result: `client_keep_alive`, whether the client connection may stay open),
    or the UpstreamError. The answer's last reads are let go at that moment, in the pass of the
    loop it ends in: kept until the awaiting Task resumes, a pass later, the reads of many
    answers grow the heap and hand it back every pass (page faults: bench/results/onepath-ab).
    Whoever reads an answer's end (proxy/usage.py) does it in `on_end`, called just before.
    """

    __slots__ = (
        "client_keep_alive",
        "close_delimited",
        "complete",
        "dechunk",
        "done",
        "earlier",
        "ended",
        "head_buf",
        "head_only",
        "head_sent",
        "on_end",
        "prior",
        "received",
        "request",
        "reusable",
        "sink",
        "status",
        "tail",
    )

    def __init__(self, sink: ResponseSink, request: bytes, head_only: bool, http11: bool) -> None:
        self.sink = sink
        self.done: asyncio.Future[bool] | None = None  # set by the pool for each attempt
        self.ended = False
        self.request = request  # head + body, until the first response byte (b"" after)
        self.head_only = head_only
        self.dechunk = not http11  # an HTTP/1.0 client cannot read chunked framing
        self.client_keep_alive = True
        self.head_buf = b""
        self.head_sent = False
        self.status = 0  # of the last head parsed
        self.received = 0  # bytes of the answer read from the replica, its head included
        self.complete = False
        # Whether the connection may carry another request. Never after HEAD: the parser still
        # expects the body the headers announced.
        self.reusable = False
        self.close_delimited = False
        # The answer's last read and the two before it (references, never copies), for what
        # the caller reads of its end (proxy/usage.py).
        self.tail = b""
        self.prior = b""
        self.earlier = b""
        self.on_end: Callable[[Exchange], None] | None = None  # reads the end (class docstring)

    def end(self, error: UpstreamError | None) -> None:
        """The exchange is over (complete, or failed with `error`): tell whoever waits, once."""
        if self.ended:
            return
        self.ended = True
        try:
            if self.on_end is not None:
                self.on_end(self)
        finally:  # a reader of the end that fails (a bug) never leaves the request waiting
            self.tail = self.prior = self.earlier = b""
            done = self.done
            if done is not None and not done.done():
                if error is None:
                    done.set_result(self.client_keep_alive)
                else:
                    done.set_exception(error)
