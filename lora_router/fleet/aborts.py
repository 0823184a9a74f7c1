"""Aborts: vLLM's `/abort_requests` and `/inference/v1/abort_requests`, sent to every replica.

An abort names requests by their external id, which vLLM forms from the client's
`X-Request-Id` (the router passes it on unchanged, http/headers.py): `cmpl-<id>-<i>` for the
i-th prompt of a completion, `chatcmpl-<id>` for a chat completion. The router does not keep
which replica runs which id (a retry may have moved it), so an abort goes to every replica in
service: an id a replica does not know is harmless there (vLLM aborts nothing and answers as
it does for any id). The body was checked first, as vLLM checks it (proxy/body.py's
`abort_ids`), and goes to the replicas as the client sent it.

- **Not a broadcast** (broadcast.py): not serialized, not behind the adapter fence, never
  queued behind a load or a pause, since an abort is meant now; every call has the
  `--control-timeout` deadline (client.py), so a silent replica costs an abort that long.
- **Where**: every replica in service, and, best effort (`--health-timeout`; their failures
  never decide, their successes are counted and named), the members out of service that still
  run routed requests (`Fleet.stranded`): a draining replica may be decoding the very request.
- **Whatever the client does**: the calls run in a task of their own, so a client that leaves
  mid-abort does not leave it sent to some replicas only.
- **Bounded**: at most `MAX_RUNNING` aborts at once. Each keeps its client's body (at most
  routes.py's `CONTROL_BODY_BYTES`) until its calls end, up to `--control-timeout` on a silent
  replica, whether its client stays or not, so neither the connection cap nor the request-body
  budget bounds them; past the cap an abort is refused at once (503, `Retry-After`).
- **The answer**: 200 when every replica in service answered 2xx: on `/abort_requests` vLLM's
  `{"status": "aborted", "aborted": N}` (N: with ids, the number of ids, as one replica counts
  them; for "abort all", the sum of every replica's count), on the scale-out route vLLM's empty
  200. Otherwise the most telling failure, as the broadcasts report theirs
  (refusals.py's `replica_failure`): a replica's own refusal first (a 4xx before the rest:
  dev mode off, with its fix, or scale-out disabled, say what to do), passed on with its
  status and the replica named, and the replicas that did abort; else an unreachable one, 503.
- A replica that does not answer is **not ejected**: an abort changes no fleet state a
  replay would restore, and the health checks judge the replica (health.py).

Which requests an abort ends, and how they end, is each replica's doing: vLLM ends an aborted
completion as described in docs/operating.md#aborts.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import orjson

from lora_router.config import Config
from lora_router.fleet.broadcast import Answer, Reply
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.refusals import (
    Unavailable,
    named,
    no_replica_in_service,
    replica_failure,
)
from lora_router.fleet.replica import Replica
from lora_router.http.headers import REPLICA_HEADER

log = logging.getLogger(__name__)

Call = Callable[..., Coroutine[Any, Any, Answer]]  # ReplicaClient.call
MAX_RUNNING = 64  # aborts at once, at most (module docstring)


class Aborts:
    """The abort fan-out (module docstring); `call` is the replica client's."""

    def __init__(self, config: Config, fleet: Fleet, call: Call) -> None:
        self.config = config
        self.fleet = fleet
        self.call = call
        self._tasks: set[asyncio.Task[Reply]] = set()  # running aborts, kept until they end

    async def abort(self, path: str, body: bytes, ids: list[str] | None) -> Reply:
        """`body` (checked, naming `ids`, None: all) on `path` to every replica in service."""
        if len(self._tasks) >= MAX_RUNNING:
            raise Unavailable(
                f"Cannot abort requests: {len(self._tasks)} aborts are still running, the "
                f"router's cap ({MAX_RUNNING}); retry once they have ended.",
                1.0,
            )
        targets = self.fleet.live()
        if not targets:
            raise no_replica_in_service(self.fleet, self.config)
        task = asyncio.get_running_loop().create_task(self._send(path, body, ids, targets))
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return await asyncio.shield(task)

    def _done(self, task: asyncio.Task[Reply]) -> None:
        self._tasks.discard(task)
        if not task.cancelled():
            task.exception()  # the client may have left: its error is not "never retrieved"

    async def _send(
        self, path: str, body: bytes, ids: list[str] | None, targets: Sequence[Replica]
    ) -> Reply:
        quick = self.config.health_timeout  # best effort: never the client's wait
        answers, extra = await asyncio.gather(
            asyncio.gather(*(self.call(r, "POST", path, body=body) for r in targets)),
            asyncio.gather(
                *(
                    self.call(r, "POST", path, body=body, timeout=quick)
                    for r in self.fleet.stranded()
                )
            ),
        )
        done = [a for a in answers if 200 <= a.status < 300]
        failed = [a for a in answers if not 200 <= a.status < 300]
        if failed:
            # The most telling first: a replica's own 4xx, its other answers, then no answer.
            failed.sort(key=lambda a: (a.status == 0, a.status // 100 != 4))
            what = "Cannot abort requests"
            if done:
                what += f" on every replica (aborted on {named([a.replica for a in done])})"
            refusal = replica_failure(failed[0], what, path)
            log.warning("%s: %s", path, refusal.message)
            raise refusal
        done += [a for a in extra if 200 <= a.status < 300]  # counted, when they answered
        headers = [(REPLICA_HEADER, b",".join(a.replica.label for a in done))]
        first = done[0]
        doc = first.parsed()
        if not first.body or not isinstance(doc, dict):
            return Reply(first.status, first.body, headers)  # the scale-out route's empty 200
        if ids is None:  # "abort all": each replica counted its own
            docs = [a.parsed() for a in done]
            counts = [d.get("aborted") if isinstance(d, dict) else None for d in docs]
            if all(type(n) is int for n in counts):
                doc["aborted"] = sum(n for n in counts if n is not None)
        return Reply(
            first.status, orjson.dumps(doc), [(b"content-type", b"application/json"), *headers]
        )
