"""The routed completion: `POST /v1/completions` and `/v1/chat/completions`, from the fence to
the end of the answer, in its connection's Task (http/server.py runs it).

`CompletionRoute.completion` is the whole walk:
- admit: the body is read and validated once (proxy/body.py); the request waits at the adapter
  fence while its adapter is being loaded (fleet/fence.py), then is counted by the fence and
  the retry budget; routing gets one `RouteKey` (routing/keys.py);
- pick: the policy picks one of the fleet's kept candidates (`Fleet.routable`), or of those
  the session table leaves a request carrying `X-Session-ID` (routing/sessions.py, its rules);
  the key is dropped at once (a stream holds no copy of the prompt's parsed forms);
- send: the body goes out byte for byte and the answer streams back untouched
  (proxy/forward.py);
- settle: the retry rule (proxy/retry.py, its only statement) judges the outcome: another
  attempt, the replica's answer, or the router's own (proxy/answers.py). An answer passed on
  has its cached tokens accounted (proxy/usage.py).

A request's life is one `RoutedRequest`, in one `Stage` at a time, moved only by `move` along
`NEXT` (any other move is a bug, and raises). An answer a replica breaks off once its head has
reached the client (a crash mid-stream) is a *cut stream*: never retried (the client has part
of an answer; a second one would be spliced onto it), so the client's connection is closed
and it sees a truncated answer, never a clean end; it is counted on the replica
(`cut_streams`, in `/router/status` and `/metrics`) and logged with the bytes that came. It is
also the sink of its current attempt's answer: a 404 or 5xx head that the retry rule sends
elsewhere is held back (`diverted` holds its status) and the rest of that answer is not read:
its connection is closed at once (http/upstream.py), so the retry waits neither for a body that
stalls nor for one that never ends; any other head and everything after it goes to the client.
Every routed outcome is reported to the health monitor (fleet/health.py), but a failure that is
no news of the replica (`UpstreamError.news`: an exchange withdrawn because its replica had
already left service).
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections.abc import Callable

from lora_router.config import Config
from lora_router.fleet.fence import AdapterFence
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.health import HealthMonitor
from lora_router.fleet.refusals import no_replica_in_service
from lora_router.fleet.replica import Replica
from lora_router.http.errors import bad_request, model_not_found
from lora_router.http.exchange import Exchange, UpstreamError
from lora_router.http.request import Request
from lora_router.http.server import ClientConnection
from lora_router.observe.metrics import RequestStats
from lora_router.proxy.answers import exchange_failed, fleet_error, lost_adapter, no_replica_for
from lora_router.proxy.body import Completion, CompletionReader
from lora_router.proxy.forward import Forwarder
from lora_router.proxy.retry import Outcome, RetryBudget, Verdict, counted, most_failing, verdict
from lora_router.proxy.usage import predicted_cached_tokens, reported_cached_tokens
from lora_router.routing.keys import Lineages, RouteKey, Seeds, completion_key
from lora_router.routing.policy import Policy
from lora_router.routing.sessions import SessionIdError, SessionTable, header_id

log = logging.getLogger(__name__)

# The routed paths, and whether each is the chat API.
ROUTED = {b"/v1/completions": False, b"/v1/chat/completions": True}


class Stage(enum.IntEnum):
    """Where a routed request is (h11-style: one state, explicit moves, `NEXT`). An IntEnum:
    hashed in C, once per move. Its members are also module names (below), which the request
    path uses: on Python 3.11 an Enum class's attribute goes through `EnumType.__getattr__`,
    five times the cost of a module name (docs/design/overhead.md, one path)."""

    ADMITTED = 0  # past the fence and counted; no attempt on a replica
    SENT = 1  # an attempt is on a replica; nothing of its answer reached the client
    DIVERTED = 2  # that attempt's 404/5xx head was held back: another attempt follows
    PASSED = 3  # a head reached the client: no attempt will follow
    ANSWERED = 4  # the end: the replica's answer was passed on whole
    FAILED = 5  # the end: the router answers itself (or, past a head, closes)
    GONE = 6  # the end: the client went away


ADMITTED, SENT, DIVERTED, PASSED, ANSWERED, FAILED, GONE = Stage

NEXT: dict[Stage, frozenset[Stage]] = {
    ADMITTED: frozenset({SENT, FAILED, GONE}),
    SENT: frozenset({DIVERTED, PASSED, ADMITTED, FAILED, GONE}),
    DIVERTED: frozenset({ADMITTED, FAILED, GONE}),
    PASSED: frozenset({ANSWERED, FAILED, GONE}),
    ANSWERED: frozenset(),
    FAILED: frozenset(),
    GONE: frozenset(),
}


class RoutedRequest:
    """One routed request (module docstring): its stage, what the retry loop carries, and the
    sink its current attempt's answer is written into."""

    __slots__ = (
        "adapter",
        "chat",
        "conn",
        "diverted",
        "held",
        "model",
        "on_upstream",
        "prompt",
        "replica",
        "reported",
        "request",
        "route",
        "seeds",
        "session",
        "stage",
        "started",
        "tokens",
        "tried",
        "write",
    )

    def __init__(
        self,
        route: CompletionRoute,
        request: Request,
        conn: ClientConnection,
        chat: bool,
        model: str | None,
        adapter: bool,
        seeds: Seeds,
        started: float,
    ) -> None:
        self.route = route
        self.request = request
        self.conn = conn
        self.chat = chat
        self.model = model
        self.adapter = adapter
        self.seeds = seeds
        self.session: bytes | None = None  # its X-Session-ID (routing/sessions.py)
        self.started = started  # loop time it passed the fence
        self.stage = ADMITTED
        self.tried: list[Replica] = []
        # The adapter it is counted under at the fence until its head passes or it ends
        # (fleet/fence.py).
        self.held = model if adapter else None
        # The current attempt, set by `CompletionRoute.pick`: its replica, prompt tokens to
        # compute and, for a counted answer, the prompt's tokens (proxy/usage.py; 0: not
        # counted).
        self.replica: Replica | None = None
        self.tokens = 0
        self.prompt = 0
        # The cached tokens the current attempt's answer reported, read at its end (`read_end`).
        self.reported: int | None = None
        self.diverted = 0  # the status of the current attempt's held-back head
        self.write: Callable[[bytes | memoryview], None] = conn.write
        # The client's flow control, for the replica's connection (ResponseSink).
        self.on_upstream = conn.on_upstream

    def move(self, stage: Stage) -> None:
        """The one way to change `stage`: along `NEXT`, or a RuntimeError (a bug)."""
        if stage not in NEXT[self.stage]:
            raise RuntimeError(f"a routed request cannot go from {self.stage} to {stage}")
        self.stage = stage

    # -- the sink (http/request.py's ResponseSink) ------------------------------------------

    @property
    def keep_alive(self) -> bool:
        return self.conn.keep_alive

    def head(self, status: int, data: bytes, body: memoryview | None = None) -> bool:
        if (status >= 500 or (status == 404 and self.adapter)) and self.route.diverts(self, status):
            self.move(DIVERTED)
            self.diverted = status
            return False
        self.move(PASSED)
        if self.held is not None:
            self.release()
        return self.conn.head(status, data, body)

    def read_end(self, ex: Exchange) -> None:
        """The exchange's `on_end` for a counted answer: its report, read from its last reads
        in the pass it ends in, before the exchange lets them go (http/exchange.py)."""
        self.reported = reported_cached_tokens(ex.tail, ex.prior, ex.earlier)

    def release(self) -> None:
        """Its fence count goes, once: when its head passes or it ends."""
        held, self.held = self.held, None
        if held is not None:
            self.route.fence.release(held)


class CompletionRoute:
    """The routed completion's handler (module docstring), built once in runtime.py and held
    in the dispatcher's table."""

    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        policy: Policy,
        fence: AdapterFence,
        health: HealthMonitor,
        stats: RequestStats,
        budget: RetryBudget,
        forwarder: Forwarder,
        block_size: int,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.policy = policy
        self.fence = fence
        self.health = health
        self.stats = stats
        self.budget = budget
        self.forwarder = forwarder
        self.block_size = block_size  # of the replicas' KV cache: prompt keys use it
        self.reader = CompletionReader(config.max_prompt_tokens)
        self.lineages = Lineages(config.lineage_pattern)  # placement keys (routing/keys.py)
        self.loop = asyncio.get_running_loop()
        self.sessions = SessionTable(
            config.session_ttl, config.max_sessions, config.load_slack, self.loop.time
        )
        self.debug = log.isEnabledFor(logging.DEBUG)

    async def completion(self, chat: bool, request: Request, conn: ClientConnection) -> None:
        """Answer one routed completion (of the chat API if `chat`): admit, then attempts until
        the retry rule settles."""
        fields = self.reader.read(request.body, chat=chat)  # validated whole, or a 400
        try:
            session = header_id(request.session)
        except SessionIdError as exc:
            raise bad_request(str(exc), param="X-Session-ID") from None
        model = fields.model
        # The fence: passes at once for the base model and live adapters; waits while the
        # adapter's load is being broadcast; raises vLLM's 404 for unknown names.
        if not self.fence.admits(model):
            assert model is not None
            if not self.fleet.base_models and not self.fleet.live():
                # No replica has listed what it serves yet: the name may well be the base
                # model; whether it exists is unknown, so not vLLM's 404 but "not now".
                raise fleet_error(no_replica_in_service(self.fleet, self.config))
            unshared = self.fleet.unshared_base(model)
            if unshared is not None:  # a base model some replicas lack: never routed
                raise model_not_found(model, unshared)
            await self.fence.wait(model)
        job, first = self.admit(request, conn, chat, fields)
        job.session = session
        key: RouteKey | None = first
        del fields, first  # the key holds the prompt now, and only until a replica is chosen
        try:
            # The retry loop: pick, send, settle, until settled (returns) or refused (raises).
            while True:
                replica = self.pick(job, key)
                key = None
                ex = self.forwarder.exchange(request, replica, job)
                if job.prompt:
                    job.reported = None
                    ex.on_end = job.read_end
                job.move(SENT)
                failure: UpstreamError | None = None
                try:
                    await self.forwarder.send(ex, conn, replica, job.tokens)
                except UpstreamError as exc:
                    failure = exc.with_traceback(None)  # its frames would hold `ex`: a cycle
                    if job.stage is PASSED:
                        self.cut(job, replica, failure, ex.received)
                except asyncio.CancelledError:  # the client went away
                    if job.prompt:
                        self.account(job, ex, ended=False)
                    raise
                if self.settle(job, replica, failure):
                    job.move(ANSWERED)
                    if job.prompt:
                        self.account(job, ex)
                    return
                job.move(ADMITTED)
        except asyncio.CancelledError:
            job.move(GONE)
            raise
        except BaseException:
            job.move(FAILED)
            raise
        finally:
            if job.held is not None:
                job.release()

    def admit(
        self, request: Request, conn: ClientConnection, chat: bool, fields: Completion
    ) -> tuple[RoutedRequest, RouteKey]:
        """Past the fence: the request, counted by the retry budget and, for an adapter, held
        at the fence; and its routing key."""
        model = fields.model
        adapter = model is not None and model not in self.fleet.base_models
        # Placed by the adapter's lineage, not its version: a later turn under vN+1 follows
        # its conversation (routing/keys.py).
        seeds = self.lineages.seeds(model, adapter)
        key = completion_key(fields, seeds, self.block_size)
        now = self.loop.time()
        self.budget.request(now)
        job = RoutedRequest(self, request, conn, chat, model, adapter, seeds, now)
        if job.held is not None:
            # Counted as admitted under its name until answered, in the same step as the fence
            # let it through: an unload waits for it before it is broadcast (fleet/fence.py).
            self.fence.hold(job.held)
        return job, key

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
        session = job.session
        if session is not None:  # the pinned replica alone, while the session stays
            routable = self.sessions.narrow(session, routable)
        decision = self.policy.choose(key, routable)
        # The stream that follows may last minutes: it must not hold the prompt's ids, packed
        # bytes and chain (issue 16); `decision` keeps the ints it needs.
        del key
        replica = decision.replica
        if session is not None:
            self.sessions.pin(session, replica.name)
        # Counted only for one token-id prompt (its wire key): its token count is exact.
        job.prompt = decision.prompt if wire is not None else 0
        if self.debug:  # one line per decision, only when asked (--log-level debug)
            log.debug("%s -> replica %d (%s)", model or "base model", replica.rid, decision.kind)
        replica.breaker.begin()
        tried.append(replica)
        job.replica = replica
        job.tokens = decision.tokens
        if job.diverted:  # the last attempt's head was held back: this one's goes through
            if job.diverted != 404 and counted(
                failing=self._failing(None), onto_failing=replica.breaker.failures > 0
            ):
                self.budget.spend(self.loop.time())
            job.diverted = 0
        return replica

    def cut(self, job: RoutedRequest, replica: Replica, failure: UpstreamError, got: int) -> None:
        """A cut stream (module docstring): counted and logged; the retry rule then closes."""
        replica.cut_streams += 1
        path = "/v1/chat/completions" if job.chat else "/v1/completions"
        log.warning(
            "cut stream: %s broke off its answer to %s after %s bytes (%s); the client's "
            "connection is closed, so it sees a truncated answer, never retried: part of the "
            "answer had reached it",
            replica.describe(),
            path,
            f"{got:,}",
            failure,
        )

    def settle(self, job: RoutedRequest, replica: Replica, failure: UpstreamError | None) -> bool:
        """The outcome of one attempt, by the retry rule (proxy/retry.py): True when the
        request is answered, False for another attempt; raises the router's own answer."""
        if failure is not None:
            if failure.news:
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
        rule = verdict(outcome, attempts=len(tried), limit=self.config.retries)
        if rule is Verdict.ANSWER:
            return False
        self.budget.made(outcome)
        return True

    def diverts(self, job: RoutedRequest, status: int) -> bool:
        """The retry rule (proxy/retry.py) for a replica's 404 or 5xx head: hold it back and
        try another replica? Asked before any byte of the answer reached the client; held back
        only if it will be retried, so with no replica left the client gets this answer rather
        than the router's 503."""
        if status == 404:
            return job.adapter  # the router answers a lost adapter itself, retried or not
        tried = job.tried
        rule = verdict(
            Outcome.STATUS_5XX,
            status=status,
            attempts=len(tried),
            limit=self.config.retries,
            paused=self.fleet.pause.paused,
            others=bool(self.fleet.routable(job.model, tried)),
            failing=self._failing(tried[-1]),
            room=self.budget.room(self.loop.time()),
        )
        if rule is Verdict.DENIED:
            self.budget.denied += 1
        return rule is Verdict.FREE or rule is Verdict.COUNTED

    def _failing(self, just_failed: Replica | None) -> bool:
        """Whether most of the live fleet is failing (proxy/retry.py), `just_failed` counted
        as failing: its failure is not reported yet."""
        live = self.fleet.live()
        return most_failing(
            sum(1 for r in live if r.breaker.failures or r is just_failed), len(live)
        )

    def account(self, job: RoutedRequest, answer: Exchange, ended: bool = True) -> None:
        """A counted request's answer passed on (`ended`), or left by its client: its cached
        tokens, predicted against reported (proxy/usage.py), and whether it shows a whole block
        computed."""
        replica = job.replica
        if job.conn.status != 200 or replica is None:
            return
        reported = (
            job.reported
            if answer.ended
            else reported_cached_tokens(answer.tail, answer.prior, answer.earlier)
        )
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
