"""Admission of sequences into the running batch, as vLLM's scheduler decides it.

At most `max_num_seqs` sequences run at once, and their adapters must fit in `max_loras` GPU
slots: a waiting sequence whose adapter would be one too many is skipped (not blocking the
queue behind it), exactly the rule that makes LoRA affinity matter. Everything else waits in
FIFO order. `Seq.waiter` is the one future a sequence ever sleeps on, so an abort (from
`/pause?mode=abort`) can wake it wherever it is blocked: queued, sleeping or frozen.

No I/O and no clock: the engine decides how long a running sequence takes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass


class Aborted(Exception):
    """The engine aborted the sequence (pause in abort mode, or /abort_requests)."""


@dataclass(slots=True, eq=False)
class Seq:
    """One sample of one request, as the scheduler sees it."""

    request_id: str  # vLLM's external id: what /abort_requests names (serving.py forms it)
    lora_id: int | None = None
    lora_name: str | None = None
    lora_path: str | None = None  # captured when the request came in, as vLLM's LoRARequest
    aborted: bool = False
    waiter: asyncio.Future[None] | None = None

    def wake(self) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def abort(self) -> None:
        self.aborted = True
        self.wake()

    async def sleep_until_woken(self) -> None:
        self.waiter = asyncio.get_running_loop().create_future()
        try:
            await self.waiter
        finally:
            self.waiter = None


class Scheduler:
    """The running set and the waiting queue."""

    __slots__ = ("max_loras", "max_num_seqs", "running", "waiting")

    def __init__(self, max_num_seqs: int, max_loras: int) -> None:
        self.max_num_seqs = max_num_seqs
        self.max_loras = max_loras
        self.running: dict[Seq, None] = {}  # insertion-ordered set
        self.waiting: list[Seq] = []

    def running_loras(self) -> set[int]:
        return {s.lora_id for s in self.running if s.lora_id is not None}

    async def admit(self, seq: Seq) -> None:
        """Return once `seq` runs; raise `Aborted` if it is aborted while waiting."""
        self.waiting.append(seq)
        self._schedule()
        while seq not in self.running:
            if seq.aborted:
                self._drop(seq)
                raise Aborted
            await seq.sleep_until_woken()

    def release(self, seq: Seq) -> None:
        """`seq` finished, was aborted or cancelled: free its place and admit others."""
        self._drop(seq)
        self._schedule()

    def in_flight(self) -> list[Seq]:
        return [*self.running, *self.waiting]

    def _drop(self, seq: Seq) -> None:
        self.running.pop(seq, None)
        if seq in self.waiting:
            self.waiting.remove(seq)

    def _schedule(self) -> None:
        loras = self.running_loras()
        for seq in list(self.waiting):
            if len(self.running) >= self.max_num_seqs:
                break
            if (
                seq.lora_id is not None
                and seq.lora_id not in loras
                and len(loras) >= self.max_loras
            ):
                continue
            self.waiting.remove(seq)
            self.running[seq] = None
            if seq.lora_id is not None:
                loras.add(seq.lora_id)
            seq.wake()
