"""The routed path: one `RoutedRequest` from the fence to its end, and the retry rule.

Routed: `POST /v1/completions` and `/v1/chat/completions`. admit: the body is read and
validated once for `model` and the prompt (proxy/body.py); the request waits at the adapter
fence while its adapter is being loaded (fleet/fence.py: forwarded only once every live
replica acknowledged it, only to a replica that holds it), then is counted by the fence and the
retry budget. key: routing gets one `RouteKey` (routing/keys.py). pick: the policy picks one of
the fleet's kept candidates (`Fleet.routable`); the key is dropped at once (a stream holds no
copy of the prompt's parsed forms). send: the body goes out byte for byte and the answer
streams back untouched, `Fleet.started`/`finished` counting the request around it. settle: the
retry rule (proxy/retry.py) judges the outcome; an answer passed on has its cached tokens
accounted (`account`, proxy/usage.py). With no replica to take it, the answer is 503
with `Retry-After`, naming why the replicas are out (never vLLM's 404: a name the fleet served
still exists; before any replica has listed its models, whether a name exists is unknown).

Two paths for a routed completion, one rule. The general path is a Task (`handle`, then
`completion` and its retry loop `attempts`). THE FAST PATH (`handle_now`) is the same steps
run from the parser callback that completed the request, for the common case only: an
authenticated routed POST whose body reads without error, for a model the fence admits without
waiting, sent to the chosen replica on an idle pooled connection with a free slot
(`UpstreamPool.take_now`); the answer is relayed by protocol callbacks and the request ends in
`RoutedRequest.ended`, with no Task, coroutine or Future. Whenever a precondition does not hold it
declines before any side effect (the general path then does everything), or, once routed, hands
the request over to the general path at the step it reached (`ClientConnection.hand_over`):
the forward itself when the replica has no idle connection; and every end but a complete
answer passed on (a failure, a held-back 5xx or 404, a re-send on a fresh connection) goes
through the same outcome rule (`settle`) and retry loop as the general path, so nothing the
general path retries is lost on the fast one.

Retries: the data plane's whole rule is proxy/retry.py's `verdict` (http/upstream.py adds only
the re-send of a request that met a pooled connection the replica had closed). A 5xx head is
held back (by its `RoutedRequest`, the sink) only when a retry will be made, otherwise it
reaches the client as the replica sent it; a 404 for a live adapter is always held back, and
with no retry left the router answers itself (`lost_adapter`).
Once a head has been passed on, nothing is retried: a stream that vLLM begins with a 200 and
then fails in error frames is the client's to retry. Every routed outcome is reported to the
health monitor (fleet/health.py): failures and 5xx count against the replica's circuit breaker
and wake its health check; a 4xx never counts against a replica.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from lora_router.config import Config
from lora_router.fleet.fence import AdapterFence, FenceRefusal
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.health import HealthMonitor
from lora_router.fleet.refusals import FleetRefusal, no_replica_in_service
from lora_router.fleet.replica import Replica
from lora_router.http.auth import authenticate
from lora_router.http.errors import HTTPError
from lora_router.http.exchange import Exchange, UpstreamError
from lora_router.http.headers import upstream_request_head
from lora_router.http.request import Request
from lora_router.http.server import ClientConnection
from lora_router.http.upstream import UpstreamConnection
from lora_router.observe.metrics import RequestStats
from lora_router.proxy.answers import (
    exchange_failed,
    fence_error,
    fleet_error,
    lost_adapter,
    no_replica_for,
)
from lora_router.proxy.body import Completion, CompletionReader
from lora_router.proxy.retry import (
    Outcome,
    RetryBudget,
    Verdict,
    counted,
    most_failing,
    verdict,
)
from lora_router.proxy.usage import predicted_cached_tokens, reported_cached_tokens
from lora_router.routing.keys import Lineages, RouteKey, Seeds, completion_key
from lora_router.routing.policy import Policy

log = logging.getLogger(__name__)

# The routed paths, and whether each is the chat API.
ROUTED = {b"/v1/completions": False, b"/v1/chat/completions": True}


class RoutedRequest:
    """One routed request from the fence to its end, in one object: what the retry loop
    carries; the client connection as the current attempt's answer is written into it (the
    retry rule's sink); and, on THE FAST PATH, its exchange, whose end the replica
    connection's callbacks tell (`ended`) or the client's (`lost`).

    As the sink: a head the retry rule (module docstring) sends elsewhere is swallowed with its
    body (`diverted` holds its status): nothing has reached the client, so the request can go
    to another replica. Any other head, and everything after it, goes straight to the client.
    The rule is asked only for a 404 or a 5xx head, so an answer that is passed on costs one
    comparison. `pick` resets `diverted` and `write` after an attempt that diverted.
    """

    __slots__ = (
        "adapter",
        "app",
        "chat",
        "conn",
        "diverted",
        "ex",
        "held",
        "model",
        "on_upstream",
        "prompt",
        "replica",
        "request",
        "seeds",
        "started",
        "tokens",
        "tried",
        "upstream",
        "write",
    )

    def __init__(
        self,
        app: RoutedPath,
        request: Request,
        conn: ClientConnection,
        chat: bool,
        model: str | None,
        adapter: bool,
        seeds: Seeds,
    ) -> None:
        self.app = app
        self.request = request
        self.conn = conn
        self.chat = chat
        self.model = model
        self.adapter = adapter
        self.seeds = seeds
        self.tried: list[Replica] = []
        # The adapter it is counted under at the fence until its head passes or it ends
        # (fleet/fence.py).
        self.held = model if adapter else None
        self.on_upstream = conn.on_upstream
        # The current attempt, set by `pick`: its replica, prompt tokens to compute, sink state
        # and, for a counted answer, the prompt's tokens (proxy/usage.py; 0: not counted).
        self.replica: Replica | None = None
        self.tokens = 0
        self.prompt = 0
        self.diverted = 0
        self.write: Callable[[bytes | memoryview], None] = conn.write
        # THE FAST PATH's, set by `handle_now`: its exchange and connection.
        self.ex: Exchange | None = None
        self.upstream: UpstreamConnection | None = None
        self.started = 0.0  # loop time it passed the fence (`admit`)

    @property
    def keep_alive(self) -> bool:
        return self.conn.keep_alive

    def head(self, status: int, data: bytes, body: memoryview | None = None) -> None:
        if (status >= 500 or (status == 404 and self.adapter)) and self.app.diverts(
            status, self.model, self.adapter, self.tried
        ):
            self.diverted = status
            self.write = _drop
            return
        if self.held is not None:
            self.app.fence.release(self.held)
            self.held = None
        self.conn.head(status, data, body)

    def release(self, fence: AdapterFence) -> None:
        """The request ended: its fence count goes, unless a passed head released it."""
        held, self.held = self.held, None
        if held is not None:
            fence.release(held)

    def ended(self, error: UpstreamError | None) -> None:
        """THE FAST PATH's exchange is over: a complete answer passed on ends the request here,
        anything else goes to the general path's outcome rule and retry loop."""
        app, conn, replica, ex = self.app, self.conn, self.replica, self.ex
        assert replica is not None and ex is not None
        self.ex = None  # it refers back to this object (its sink): no cycle past the end
        app.fleet.finished(replica, self.tokens)
        how: How = error
        if error is None:
            conn.keep_alive = conn.keep_alive and ex.client_keep_alive
            if not self.diverted:
                app.health.report_status(replica, conn.status, self.model)
                # `release` and `RouterApp._observe`, written out: this is every fast request's
                # end.
                held, self.held = self.held, None
                if held is not None:
                    app.fence.release(held)
                app.stats.observe(
                    app.labels.get(self.request.path, "other"),
                    conn.status,
                    conn.replica,
                    self.started,
                    app._loop.time(),
                    conn.first_byte_at,
                )
                if self.prompt:
                    app.account(self, ex)
                conn.answered()
                return
        elif error.retryable:
            how = ex  # nothing received on a reused connection: the pool's retry rule
        work = app.attempts(self, None, how)
        conn.hand_over(app._observed(self.request, conn, self.started, work))

    def lost(self) -> None:
        """The client went away while THE FAST PATH's exchange ran: stop the replica's work,
        count the request as the general path's cancellation does (499)."""
        app, ex, replica, upstream = self.app, self.ex, self.replica, self.upstream
        if ex is not None:
            assert replica is not None and upstream is not None
            if self.prompt:
                app.account(self, ex, ended=False)
            replica.pool.abandon(upstream, ex)
            self.ex = None
            app.fleet.finished(replica, self.tokens)
            self.release(app.fence)
            app._observe(self.request, self.conn, self.started, self.conn.status or 499)


def _drop(data: bytes | memoryview) -> None:
    pass


class _Pick:
    """An attempt yet to be chosen (`_PICK`): the retry loop picks a replica first."""


class _Send:
    """How a picked attempt goes on: not sent yet (`_SEND`)."""


_PICK = _Pick()
_SEND = _Send()
# How an attempt went: answered (None, maybe held back by its sink), failed, or to be sent
# (`_SEND`, or an Exchange to re-send on a fresh connection, the pool's retry rule).
How = UpstreamError | Exchange | _Send | None


class RoutedPath:
    """The routed path's steps, on the app that wires them (dispatch.py's `RouterApp`, which
    sets every attribute below at start): admit (`admit`: the fence's count and the budget's,
    then the key, routing/keys.py), pick (`pick`), send (`send`), settle (`settle`, the retry
    rule); `attempts` runs them on the general path, `handle_now` and `RoutedRequest.ended` on
    THE FAST PATH."""

    config: Config
    fleet: Fleet
    policy: Policy
    fence: AdapterFence
    health: HealthMonitor
    stats: RequestStats
    reader: CompletionReader
    budget: RetryBudget
    labels: dict[bytes, str]
    block_size: int
    lineages: Lineages
    _loop: asyncio.AbstractEventLoop
    _debug: bool
    _keyed: bool
    _authorization: bytes | None
    _new_request_id: Callable[[], bytes]

    async def _observed(
        self, request: Request, conn: ClientConnection, started: float, work: Awaitable[None]
    ) -> None:
        """`work` answers `request`; count it once it has."""
        try:
            try:
                await work
            except FenceRefusal as refusal:
                raise fence_error(refusal) from None
            except FleetRefusal as refusal:
                raise fleet_error(refusal) from None
        except HTTPError as exc:
            # Answered by the router itself after this returns (unless a stream had begun).
            self._observe(request, conn, started, conn.status or exc.status)
            raise
        except asyncio.CancelledError:
            self._observe(request, conn, started, conn.status or 499)  # the client went away
            raise
        self._observe(request, conn, started, conn.status)

    def handle_now(self, request: Request, conn: ClientConnection) -> bool:
        """THE FAST PATH (module docstring), called from the client connection's parser
        callback: True when it took the request. It declines, having done nothing, unless the
        request is an authenticated routed POST with a body that reads and a model the fence
        admits now; then routes it here, and writes it upstream at once if the chosen
        replica's pool has an idle connection, else hands it over to the general path."""
        chat = ROUTED.get(request.path)
        if chat is None or request.method != b"POST":
            return False
        try:
            if self._keyed:
                authenticate(request, self.config)
            fields = self.reader.read(request.body, chat=chat)
        except HTTPError:
            return False  # the general path gives the same answer
        if not self.fence.admits(fields.model):
            return False
        started = self._loop.time()
        conn.replica = b"-"
        job, key = self.admit(request, conn, chat, fields, started)
        del fields
        try:
            replica = self.pick(job, key)
        except HTTPError:  # no replica for it: the general path answers (its 503)
            conn.hand_over(self._observed(request, conn, started, self.attempts(job, key)))
            return True
        del key
        upstream = replica.pool.take_now()
        if upstream is None:  # no idle connection: the general path connects or queues
            conn.hand_over(self._observed(request, conn, started, self.attempts(job, None, _SEND)))
            return True
        job.upstream = upstream
        head = self._request_head(request, replica)
        job.ex = replica.pool.send_now(
            upstream, head + request.body, job, job.ended, http11=request.http11
        )
        # After the write, not before: none of this decides where the request goes or what it
        # carries, and it now runs while the replica works, not in the request's latency. Its
        # end cannot come first: the replica's answer and a client leaving are both told by
        # later callbacks.
        self.fleet.started(replica, job.tokens)
        conn.replica = replica.label
        conn.on_lost = job.lost
        return True

    def _observe(self, request: Request, conn: ClientConnection, started: float, code: int) -> None:
        route = self.labels.get(request.path, "other")
        self.stats.observe(
            route, code, conn.replica, started, self._loop.time(), conn.first_byte_at
        )

    def _request_head(self, request: Request, replica: Replica) -> bytes:
        """The head `request` goes to `replica` with (http/headers.py), on either path."""
        return upstream_request_head(
            request.method,
            replica.target_prefix + request.target,
            request.headers,
            host=replica.host_header,
            client_ip=request.client_ip,
            body_length=len(request.body),
            authorization=self._authorization,
            new_request_id=self._new_request_id,
        )

    # -- routed -----------------------------------------------------------------------------

    async def completion(self, request: Request, conn: ClientConnection, chat: bool) -> None:
        fields = self.reader.read(request.body, chat=chat)  # validated whole, or a 400
        model = fields.model
        # The fence: passes at once for the base model and live adapters; waits while the
        # adapter's load is being broadcast; raises vLLM's 404 for unknown names.
        if not self.fence.admits(model):
            assert model is not None
            if not self.fleet.base_models and not self.fleet.live():
                # No replica has listed what it serves yet: the name may well be the base
                # model; whether it exists is unknown, so not vLLM's 404 but "not now".
                raise fleet_error(no_replica_in_service(self.fleet, self.config))
            await self.fence.wait(model)
        job, key = self.admit(request, conn, chat, fields, self._loop.time())
        del fields  # the key holds the prompt now, and only until a replica is chosen
        await self.attempts(job, key)

    def admit(
        self, request: Request, conn: ClientConnection, chat: bool, fields: Completion, now: float
    ) -> tuple[RoutedRequest, RouteKey]:
        """Past the fence (at loop time `now`): the request's routing key, counted by the retry
        budget and, for an adapter, held at the fence."""
        model = fields.model
        adapter = model is not None and model not in self.fleet.base_models
        # Placed by the adapter's lineage, not its version: a later turn under vN+1 follows
        # its conversation (routing/keys.py).
        seeds = self.lineages.seeds(model, adapter)
        key = completion_key(fields, seeds, self.block_size)
        self.budget.request(now)
        job = RoutedRequest(self, request, conn, chat, model, adapter, seeds)
        job.started = now
        if job.held is not None:
            # Counted as admitted under its name until answered, in the same step as the fence
            # let it through: an unload waits for it before it is broadcast (fleet/fence.py).
            self.fence.hold(job.held)
        return job, key

    async def attempts(
        self, job: RoutedRequest, key: RouteKey | None, how: How | _Pick = _PICK
    ) -> None:
        """The retry loop (module docstring). `how`: how an attempt the fast path handed over
        (on `job.replica`) went, `_PICK` if there is none."""
        answer: Exchange | None = None  # the last attempt's, once sent
        try:
            while True:
                if how is _PICK:
                    replica = self.pick(job, key)
                    key = None
                    how = _SEND
                else:
                    assert job.replica is not None
                    replica = job.replica
                if how is _SEND or isinstance(how, Exchange):
                    try:
                        resend = how if isinstance(how, Exchange) else None
                        answer = await self.send(
                            job.request, job.conn, replica, job, job.tokens, resend
                        )
                        how = None
                    except UpstreamError as exc:
                        how = exc.with_traceback(None)  # its frames would hold `how`: a cycle
                assert how is None or isinstance(how, UpstreamError)
                if self.settle(job, replica, how):
                    if answer is not None and job.prompt:
                        self.account(job, answer)
                    return
                how = _PICK
        finally:
            job.release(self.fence)

    def pick(self, job: RoutedRequest, key: RouteKey | None) -> Replica:
        """The next attempt's replica (raises the 503 when none can take it), set on `job`
        with the attempt's tokens and a fresh sink state."""
        model, tried = job.model, job.tried
        routable = self.fleet.routable(model, tried)
        if not routable:
            raise no_replica_for(self.fleet, model, tried, self.config)
        if key is None:  # a retry: the body is still here, its prompt was validated
            fields = self.reader.read(job.request.body, chat=job.chat)
            key = completion_key(fields, job.seeds, self.block_size)
        wire = key.wire
        decision = self.policy.choose(key, routable)
        # The stream that follows may last minutes: it must not hold the prompt's ids, packed
        # bytes and chain (issue 16); `decision` keeps the ints it needs.
        del key
        replica = decision.replica
        # Counted only for one token-id prompt (its wire key): its token count is exact.
        job.prompt = decision.prompt if wire is not None else 0
        if self._debug:  # one line per decision, only when asked (--log-level debug)
            log.debug("%s -> replica %d (%s)", model or "base model", replica.rid, decision.kind)
        replica.breaker.begin()
        tried.append(replica)
        job.replica = replica
        job.tokens = decision.tokens
        if job.diverted:  # the last attempt's head was held back: this one's goes through
            if job.diverted != 404 and counted(self._failing(None), replica.breaker.failures > 0):
                self.budget.spend(self._loop.time())
            job.diverted = 0
            job.write = job.conn.write
        return replica

    def settle(self, job: RoutedRequest, replica: Replica, failure: UpstreamError | None) -> bool:
        """The outcome of one attempt, by the retry rule (retry.py): True when the request is
        answered, False for another attempt; raises the router's own answer."""
        if failure is not None:
            self.health.report_failure(replica)
            outcome = Outcome.TRANSPORT if failure.retryable else Outcome.UNSAFE
            if not self._retried(job.tried, outcome):
                raise exchange_failed(replica, failure)
            return False
        if not job.diverted:
            self.health.report_status(replica, job.conn.status, job.model)
            return True
        if job.diverted != 404:  # a 5xx held back: the rule granted the retry
            self.health.report_status(replica, job.diverted)
            self.budget.made(Outcome.STATUS_5XX)
            return False
        model = job.model
        assert model is not None
        self.health.report_missing_adapter(replica, model)
        if not self._retried(job.tried, Outcome.LOST_ADAPTER):
            raise lost_adapter(model, job.tried, self.fence.state(model))
        return False

    def _retried(self, tried: list[Replica], outcome: Outcome) -> bool:
        """The retry rule for a failure that costs the replicas nothing: retried (and counted
        by reason) while attempts are left."""
        rule = verdict(outcome, 0, len(tried), self.config.retries, False, True, False, False)
        if rule is Verdict.ANSWER:
            return False
        self.budget.made(outcome)
        return True

    def diverts(self, status: int, model: str | None, adapter: bool, tried: list[Replica]) -> bool:
        """The retry rule (retry.py) for a replica's 404 or 5xx head: hold it back and try
        another replica? Called before any byte of the answer reached the client; held back
        only if it will be retried, so with no replica left the client gets this answer rather
        than the router's 503."""
        if status == 404:
            return adapter  # the router answers a lost adapter itself, retried or not
        fleet = self.fleet
        rule = verdict(
            Outcome.STATUS_5XX,
            status,
            len(tried),
            self.config.retries,
            fleet.pause.paused,
            bool(fleet.routable(model, tried)),
            self._failing(tried[-1]),
            self.budget.room(self._loop.time()),
        )
        if rule is Verdict.DENIED:
            self.budget.denied += 1
        return rule is Verdict.FREE or rule is Verdict.COUNTED

    def _failing(self, just_failed: Replica | None) -> bool:
        """Whether most of the live fleet is failing (retry.py), `just_failed` counted as
        failing: its failure is not reported yet."""
        live = self.fleet.live()
        return most_failing(
            sum(1 for r in live if r.breaker.failures or r is just_failed), len(live)
        )

    async def forward_one(self, request: Request, conn: ClientConnection) -> None:
        """A read-only route (or a --forward-path): one replica answers, as a single server
        would."""
        routable = self.fleet.routable(None)
        if not routable:
            raise no_replica_for(self.fleet, None, (), self.config)
        replica = min(routable, key=lambda r: r.in_flight)
        try:
            await self.send(request, conn, replica, conn)
        except UpstreamError as exc:
            raise exchange_failed(replica, exc) from None

    async def send(
        self,
        request: Request,
        conn: ClientConnection,
        replica: Replica,
        sink: ClientConnection | RoutedRequest,
        tokens: int = 0,
        resend: Exchange | None = None,
    ) -> Exchange:
        """One exchange with `replica`, on the general path, returned once over; `resend`: a
        fast exchange to send again on a fresh connection (the pool's retry rule), its bytes as
        they were."""
        if resend is None:
            # head + body as an expression: held by the exchange alone, until the first
            # response byte (http/upstream.py).
            head = self._request_head(request, replica)
            ex = Exchange(sink, head + request.body, request.method == b"HEAD", request.http11)
            forwarding = replica.pool.forward(ex)
        else:
            ex = resend
            forwarding = replica.pool.resend(resend)
        self.fleet.started(replica, tokens)
        conn.replica = replica.label
        try:
            keep_alive = await forwarding
        except asyncio.CancelledError:  # the client went away
            if isinstance(sink, RoutedRequest) and sink.prompt:
                self.account(sink, ex, ended=False)
            raise
        finally:
            self.fleet.finished(replica, tokens)
        conn.keep_alive = conn.keep_alive and keep_alive
        return ex

    def account(self, job: RoutedRequest, answer: Exchange, ended: bool = True) -> None:
        """A counted request's answer passed on (`ended`), or left by its client: its cached
        tokens, predicted against reported (proxy/usage.py), and whether it shows a whole block
        computed."""
        replica = job.replica
        if job.conn.status != 200 or replica is None:
            return
        reported = reported_cached_tokens(answer.tail, answer.prior, answer.earlier)
        if reported is None:  # the prediction is kept only beside a report (`CacheAccount`)
            if ended:
                self.stats.cached.record(replica.label, job.seeds.lineage, 0, None)
            return
        predicted = predicted_cached_tokens(job.prompt, job.tokens, self.block_size)
        self.stats.cached.record(replica.label, job.seeds.lineage, predicted, reported)
        # vLLM reports whole blocks cached: a block's worth more in the prompt is a block it
        # computed and announced, if it publishes KV events (fleet/kv_events.py, silence).
        if job.prompt - reported >= self.block_size and job.started > replica.computed_at:
            replica.computed_at = job.started
