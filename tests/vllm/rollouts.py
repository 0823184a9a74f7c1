"""TRL-shaped rollouts kept flowing through a router from a thread while a test changes the
fleet: each worker sends one token-id completion at a time (40 random prompt tokens, its own
seed, 2 tokens back, as TRL's rollout worker asks), and every answer is recorded with the replica
that served it. An answer cut short (its head passed on, its body never came: a replica killed
under it) is a transport failure TRL retries; it is recorded apart, with when it happened."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import aiohttp


class Rollouts:
    def __init__(self, url: str, model: str, seed: int, workers: int = 3) -> None:
        self.statuses: list[tuple[int, str]] = []  # (status, x-lora-router-replica)
        self.cut: list[tuple[str, float]] = []  # (replica, monotonic time)
        self._url, self._model, self._workers = url, model, workers
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(),))

    def __enter__(self) -> Rollouts:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive(), "the rollouts did not stop within 120 s"

    def served_by(self, replica: str, since: int = 0) -> bool:
        return any(h == replica for _, h in self.statuses[since:])

    async def _run(self) -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
            await asyncio.gather(*(self._worker(session) for _ in range(self._workers)))

    async def _worker(self, session: aiohttp.ClientSession) -> None:
        rng = self._rng
        while not self._stop.is_set():
            body = {
                "model": self._model,
                "prompt": rng.choices(range(3, 480), k=40),
                "max_tokens": 2,
                "n": 1,
                "return_token_ids": True,
                "logprobs": 0,
                "seed": rng.getrandbits(63),
            }
            async with session.post(self._url + "/v1/completions", json=body) as r:
                replica = r.headers.get("x-lora-router-replica", "")
                try:
                    await r.read()
                except aiohttp.ClientPayloadError:
                    self.cut.append((replica, time.monotonic()))
                    continue
                self.statuses.append((r.status, replica))
