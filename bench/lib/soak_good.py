"""The soak bench's good traffic (bench/soak.py): a GRPO-shaped client, as TRL drives a run.

A trainer loop syncs every `sync_every` s: `POST /pause?mode=keep` -> write trl-policy-vN
(atomic rename) -> `POST /v1/load_lora_adapter` -> `POST /resume` -> unload v(N-3) (its files
removed after), as lora_router/tools/demo.py and bench/lib/faults_trainer.py do. Meanwhile
`concurrency / G` group workers each send a prompt's G samples at once (G separate
`/v1/completions`, each its own seed, naming the version current when sent; every fourth group
streamed), then the next prompt: `concurrency` requests in flight, steadily.

An attempt is *ok* (200 and a whole answer: lora_router.tools.demo.check_answer), *retryable*
(503 with Retry-After: the router's documented "come back" answer when a limit binds, e.g.
--max-connections or --max-buffered-bytes), *cut* (a 200 whose body broke off: what a replica
cutting a stream gives, which the router must never retry), or *other* (any other status, a
transport error, an attempt timeout). A request is retried as TRL's client does, after 1, 2,
4 s, at most 3 times, and is *lost* if its last attempt is not ok. Every non-ok attempt is kept
with its time, status, replica and detail.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from lora_router.emulator import write_adapter
from lora_router.testbed import grpo_trace
from lora_router.tools.demo import check_answer

BACKOFF_S = (1.0, 2.0, 4.0)
ATTEMPT_TIMEOUT_S = 60.0
CONTROL_TIMEOUT_S = 60.0
KEEP_VERSIONS = 3
REPLICA_HEADER = "x-lora-router-replica"


@dataclass(slots=True)
class Done:
    """One good request (all its attempts)."""

    started: float
    ended: float
    ok: bool
    stream: bool
    attempts: int
    kinds: tuple[str, ...]  # each attempt's kind


@dataclass(slots=True)
class Bad:
    """A non-ok attempt, kept whole for the report."""

    at: float
    kind: str
    status: int
    replica: str
    stream: bool
    detail: str


@dataclass(slots=True)
class GoodClient:
    url: str
    adapters: Path
    concurrency: int = 24
    group: int = 8
    max_tokens: int = 32
    sync_every: float = 10.0
    seed: int = 0
    done: list[Done] = field(default_factory=list)
    bad: list[Bad] = field(default_factory=list)
    controls: list[dict[str, Any]] = field(default_factory=list)  # every control call
    version: int = 0
    sent: int = 0
    _stop: asyncio.Event = field(default_factory=asyncio.Event)

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        """Until `stop()`: the trainer and the group workers; then the requests in flight end
        (each bounded by its attempts' timeouts and back-offs)."""
        rng = random.Random(self.seed)
        spec = grpo_trace.TraceSpec(steps=100_000, group_size=self.group, seed=self.seed)
        trace = grpo_trace.generate(spec)
        connector = aiohttp.TCPConnector(limit=self.concurrency + 8)
        async with aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        ) as http:
            await self.sync(http)  # v1 before the first rollout

            async def trainer() -> None:
                while not self._stop.is_set():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._stop.wait(), self.sync_every)
                    if not self._stop.is_set():
                        await self.sync(http)

            async def worker(index: int) -> None:
                n = 0
                while not self._stop.is_set():
                    request = next(trace)
                    while request.sample != 0:
                        request = next(trace)
                    stream = (index + n) % 4 == 0
                    n += 1
                    await asyncio.gather(
                        *(
                            self.request(http, request.tokens, rng.randrange(2**31), stream)
                            for _ in range(self.group)
                        )
                    )

            workers = max(1, self.concurrency // self.group)
            await asyncio.gather(trainer(), *(worker(i) for i in range(workers)))

    async def sync(self, http: aiohttp.ClientSession) -> None:
        n = self.version + 1
        await self.control(http, "/pause?mode=keep")
        name = f"trl-policy-v{n}"
        final = self.adapters / name
        staging = self.adapters / f".{name}.tmp"
        write_adapter(staging, rank=1)
        os.replace(staging, final)
        await self.control(
            http, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(final)}
        )
        await self.control(http, "/resume")
        self.version = n
        old = n - KEEP_VERSIONS
        if old >= 1:
            await self.control(http, "/v1/unload_lora_adapter", {"lora_name": f"trl-policy-v{old}"})
            shutil.rmtree(self.adapters / f"trl-policy-v{old}", ignore_errors=True)

    async def control(self, http: aiohttp.ClientSession, path: str, body: object = None) -> None:
        started = time.time()
        status, detail = 0, ""
        try:
            async with http.post(
                self.url + path, json=body, timeout=aiohttp.ClientTimeout(total=CONTROL_TIMEOUT_S)
            ) as resp:
                status = resp.status
                text = await resp.text()
                if status != 200:
                    detail = text.strip()[:300]
        except (aiohttp.ClientError, TimeoutError) as exc:
            detail = f"{type(exc).__name__}: {exc}"
        self.controls.append(
            {"at": started, "s": round(time.time() - started, 3), "path": path,
             "status": status, "detail": detail}
        )  # fmt: skip

    async def request(
        self, http: aiohttp.ClientSession, prompt: list[int], seed: int, stream: bool
    ) -> None:
        self.sent += 1
        started = time.time()
        kinds: list[str] = []
        for attempt in range(len(BACKOFF_S) + 1):
            kind = await self.attempt(http, prompt, seed, stream)
            kinds.append(kind)
            if kind == "ok" or attempt == len(BACKOFF_S):
                break
            await asyncio.sleep(BACKOFF_S[attempt])
        self.done.append(
            Done(started, time.time(), kinds[-1] == "ok", stream, len(kinds), tuple(kinds))
        )

    async def attempt(
        self, http: aiohttp.ClientSession, prompt: list[int], seed: int, stream: bool
    ) -> str:
        body: dict[str, Any] = {
            "model": f"trl-policy-v{self.version}",
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 1.0,
            "n": 1,
            "return_token_ids": True,
            "logprobs": 0,
            "seed": seed,
        }
        if stream:
            body["stream"] = True
        at = time.time()
        status, replica, retry_after = 0, "", False
        chunks: list[bytes] = []
        try:
            async with http.post(
                self.url + "/v1/completions",
                data=orjson.dumps(body),
                headers={"content-type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=ATTEMPT_TIMEOUT_S),
            ) as resp:
                status = resp.status
                replica = resp.headers.get(REPLICA_HEADER, "")
                retry_after = "retry-after" in resp.headers
                async for chunk in resp.content.iter_any():
                    chunks.append(chunk)
        except (aiohttp.ClientError, TimeoutError) as exc:
            kind = "cut" if status == 200 else "other"
            self.bad.append(Bad(at, kind, status, replica, stream, f"{type(exc).__name__}: {exc}"))
            return kind
        raw = b"".join(chunks)
        problem = check_answer(status, raw, stream)
        if problem is None:
            return "ok"
        if status == 503 and retry_after:
            kind = "retryable"
        elif status == 200:
            kind = "cut"
        else:
            kind = "other"
        self.bad.append(Bad(at, kind, status, replica, stream, problem[:300]))
        return kind
