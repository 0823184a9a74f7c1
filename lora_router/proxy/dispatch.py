"""The dispatcher: what each route is (routes.py), the control and admin handlers.

A request's path is judged once (http/target.py) and matched against the route table
(routes.py), whose entry says what happens; a path found there as written is not decoded at
all. Whatever is forwarded carries the canonical path of the route applied, never the client's
spelling. Unknown paths answer 404, a known path with another method 405, as vLLM does.

- **Routed**: `POST /v1/completions` and `/v1/chat/completions`: the completion route
  (proxy/routed.py), an object the dispatcher is given.
- **Broadcast**: adapter loads and unloads, `/pause`, `/resume` and the cache resets — to every
  serving replica, serialized, through the broadcaster (fleet/broadcast.py).
- **Fanned out**: `/abort_requests` and `/inference/v1/abort_requests`, their body checked
  (proxy/body.py's `abort_ids`), then to every serving replica at once (fleet/aborts.py).
- **Answered by the router**: `/health` and `/ping` (every live replica must be healthy; one
  probe of the fleet at a time per route, whose answer every caller that arrived meanwhile
  shares, so unauthenticated callers cannot multiply the replicas' connections),
  `/v1/models` (one replica's list, filtered by the fence), `/metrics`, `/router/status`,
  `/finish_session` (releases an `X-Session-ID` session: routing/sessions.py), and
  the operators' membership routes under `/router/replicas` (a new replica's URL must be inside
  `--replica-hosts`: `Config.replica_allowed`).
- **Forwarded to one healthy replica**: the read-only routes (`/server_info`, `/tokenize`,
  `/version`, ...) and the operator's `--forward-path`s, like a single vLLM server answers them.
- **Refused** (501, naming why): the calls that would change one engine's state or weights
  while the others keep theirs, such as vLLM's merged-weight sync, which TRL falls back to
  without LoRA, `/sleep` or `/collective_rpc`; and the other generation APIs, which
  `--forward-path` can open.

Retries on the control plane (the whole rule; fleet/client.py and fleet/broadcast.py hold it):
- `ReplicaClient.call` resends a request once, only when it met a pooled connection the replica
  had closed while idle (every control request is safe to send twice); any other transport
  failure comes back as an answer with status 0, never retried by the client;
- a load a replica answers 404 "No adapter found" (its mount has not caught up) is resent every
  `--load-retry-interval` until `--load-deadline`, or until the client that asked disconnects;
- nothing else is retried in place: a replica unreachable during a broadcast is ejected and
  gets the fleet's state by a replay on its return, and health checks count failures against
  their thresholds (`--health-failures`, `--health-successes`) instead of retrying.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import partial

import orjson
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.registry import CollectorRegistry

from lora_router.config import Config, ReplicaAddress
from lora_router.fleet.aborts import Aborts
from lora_router.fleet.broadcast import Broadcaster, Reply
from lora_router.fleet.fence import AdapterFence, FenceRefusal
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.health import HealthMonitor
from lora_router.fleet.refusals import FleetRefusal
from lora_router.http.auth import authenticate
from lora_router.http.errors import HTTPError, bad_request, method_not_allowed, not_found
from lora_router.http.exchange import UpstreamError
from lora_router.http.request import Request
from lora_router.http.server import ClientConnection
from lora_router.http.target import canonical
from lora_router.observe.metrics import RequestStats
from lora_router.observe.status import RouterState, replica_json, status
from lora_router.proxy.answers import (
    cleartext_warning,
    exchange_failed,
    fence_error,
    fleet_error,
    no_replica_for,
    refusal,
)
from lora_router.proxy.body import abort_ids, load_fields, unload_name
from lora_router.proxy.forward import Forwarder
from lora_router.proxy.retry import RetryBudget
from lora_router.proxy.routed import ROUTED, CompletionRoute
from lora_router.routes import REPLICA, Kind, Route, body_cap, lookup, with_forward_paths
from lora_router.routing.policy import Policy
from lora_router.routing.sessions import SessionIdError, finish_id

log = logging.getLogger(__name__)

_JSON = [(b"content-type", b"application/json")]
_ADMIN = b"/router/replicas"
_ID_DIGITS = 20  # a replica id's digits at most: 2**64 has 20
_LOOPBACK = (b"127.", b"::1", b"::ffff:127.")

Handler = Callable[[Request, ClientConnection], Awaitable[None]]


class RouterApp:
    """Everything a request needs, wired once at start (runtime.py): the route table, one
    handler per path, and the count of every request answered."""

    def __init__(
        self,
        config: Config,
        fleet: Fleet,
        policy: Policy,
        fence: AdapterFence,
        broadcaster: Broadcaster,
        health: HealthMonitor,
        stats: RequestStats,
        registry: CollectorRegistry,
        budget: RetryBudget,
        forwarder: Forwarder,
        completions: CompletionRoute,
    ) -> None:
        self.config = config
        self.fleet = fleet
        self.policy = policy
        self.broadcaster = broadcaster
        self.health = health
        self.stats = stats
        self.budget = budget
        self.forwarder = forwarder
        self.completions = completions
        self.aborts = Aborts(config, fleet, broadcaster.call)
        self.state = RouterState(
            fleet, fence, broadcaster, health, policy, stats, budget, completions.sessions
        )
        self._registry = registry
        self._loop = asyncio.get_running_loop()
        self._health_probes: dict[str, asyncio.Future[Reply]] = {}  # route -> the probe
        self._keyed = bool(config.api_key)
        # The route table with the operator's --forward-paths, its metric labels, and one
        # handler per path.
        self.table = with_forward_paths(config.forward_paths)
        self.labels = {path: route.label for path, route in self.table.items()}
        self._handlers = {path: self._handler(route) for path, route in self.table.items()}
        self._handlers[REPLICA.path] = self.remove_replica

    def body_cap(self, path: bytes) -> int | None:
        """The cap on the body of a request for `path`, in this router's table (routes.py's
        `body_cap`; http/server.py applies it as the body arrives)."""
        return body_cap(path, self.table)

    def _handler(self, route: Route) -> Handler:
        """What answers `route` (routes.py says which kind it is)."""
        kind, path = route.kind, route.path
        if kind is Kind.ROUTED:
            return partial(self.completions.completion, ROUTED[path])  # positional: no kwargs dict
        if kind is Kind.FORWARD:
            return self.forward_one
        if kind is Kind.BROADCAST:
            adapters = {b"/v1/load_lora_adapter": self.load_adapter}
            adapters[b"/v1/unload_lora_adapter"] = self.unload_adapter
            return adapters.get(path, self.dev_broadcast)
        if kind is Kind.FAN_OUT:
            return self.abort
        if kind is Kind.LOCAL:
            local: dict[bytes, Handler] = {
                b"/health": partial(self.health_check, route="/health"),
                b"/ping": partial(self.health_check, route="/ping"),
                b"/v1/models": self.models,
                b"/metrics": self.metrics,
                b"/router/status": self.router_status,
                b"/finish_session": self.finish_session,
                _ADMIN: self.membership,
            }
            return local[path]  # a LOCAL route without a handler fails at start
        return partial(self._refuse, route)

    async def handle(self, request: Request, conn: ClientConnection) -> None:
        """Answer one request (in its Task, http/server.py) and count it once: route, status,
        replica, latency, first byte. A refusal of the fence or the fleet becomes vLLM's
        answer here (proxy/answers.py); a client gone counts as 499."""
        conn.replica = b"-"
        started = self._loop.time()
        try:
            try:
                route = self.table.get(request.path)  # found as written: canonical (routes.py)
                if route is None:
                    route = self._judged(request)
                if self._keyed:  # without a key every request passes (http/auth.py)
                    authenticate(request, self.config)
                if route is None:
                    raise not_found()
                if route.methods is not None and request.method not in route.methods:
                    raise method_not_allowed(route.methods)
                await self._handlers[route.path](request, conn)
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

    def _observe(self, request: Request, conn: ClientConnection, started: float, code: int) -> None:
        route = self.labels.get(request.path, "other")
        self.stats.observe(
            route, code, conn.replica, started, self._loop.time(), conn.first_byte_at
        )

    def _judged(self, request: Request) -> Route | None:
        """The path rule (http/target.py) for a path not found as written: a 400, or the
        route of its canonical form, which `request` carries from now on (so it is what a
        replica receives and what auth and the metrics read)."""
        path = canonical(request.path)
        if path != request.path:
            request.target = path + request.target[len(request.path) :]
            request.path = path
        return lookup(path, self.table)

    # -- broadcasts and read-only routes ----------------------------------------------------

    async def forward_one(self, request: Request, conn: ClientConnection) -> None:
        """A read-only route (or a --forward-path): one replica answers, as a single server
        would; never retried."""
        routable = self.fleet.routable(None)
        if not routable:
            raise no_replica_for(self.fleet, None, (), self.config)
        replica = min(routable, key=lambda r: r.in_flight)
        try:
            await self.forwarder.send(
                self.forwarder.exchange(request, replica, conn), conn, replica
            )
        except UpstreamError as exc:
            raise exchange_failed(replica, exc) from None

    async def load_adapter(self, request: Request, conn: ClientConnection) -> None:
        name, path, inplace = load_fields(request.body)
        _send(conn, await self.broadcaster.load(name, path, inplace, request.body))

    async def unload_adapter(self, request: Request, conn: ClientConnection) -> None:
        _send(conn, await self.broadcaster.unload(unload_name(request.body), request.body))

    async def dev_broadcast(self, request: Request, conn: ClientConnection) -> None:
        path = request.path.decode("latin-1")
        query = request.query.decode("latin-1")
        _send(conn, await self.broadcaster.dev_broadcast(path[1:], path, query, request.body))

    async def abort(self, request: Request, conn: ClientConnection) -> None:
        path = request.path.decode("latin-1")
        ids = abort_ids(path, request.body)
        _send(conn, await self.aborts.abort(path, request.body, ids))

    async def health_check(self, request: Request, conn: ClientConnection, route: str) -> None:
        """The probe of the fleet under way for `route`, or a new one (module docstring): a
        caller that leaves does not cancel it for the others."""
        probe = self._health_probes.get(route)
        if probe is None:
            probe = asyncio.ensure_future(self.broadcaster.health(route))
            self._health_probes[route] = probe
            probe.add_done_callback(partial(self._probed, route))
        _send(conn, await asyncio.shield(probe))

    def _probed(self, route: str, probe: asyncio.Future[Reply]) -> None:
        del self._health_probes[route]
        if not probe.cancelled():
            probe.exception()  # retrieved, even when every caller left

    async def models(self, request: Request, conn: ClientConnection) -> None:
        _send(conn, await self.broadcaster.models())

    async def metrics(self, request: Request, conn: ClientConnection) -> None:
        """Prometheus exposition of the request counters and the live fleet state."""
        body = generate_latest(self._registry)
        conn.send(200, body, [(b"content-type", CONTENT_TYPE_LATEST.encode())])

    async def router_status(self, request: Request, conn: ClientConnection) -> None:
        """What an operator reads first when training stalls (see observe/status.py)."""
        conn.send(200, orjson.dumps(status(self.state), option=orjson.OPT_INDENT_2), _JSON)

    async def finish_session(self, request: Request, conn: ClientConnection) -> None:
        """vllm-router's `POST /finish_session?session_id=ID`: the session is released (200
        whether it was kept or not: an unknown id is harmless); no id, or one the rules refuse,
        is a 400 (routing/sessions.py)."""
        try:
            session = finish_id(request.query, request.body)
        except SessionIdError as exc:
            raise bad_request(str(exc), param="session_id") from None
        released = self.completions.sessions.finish(session)
        payload = {"session_id": session.decode("ascii"), "released": released}
        conn.send(200, orjson.dumps(payload), _JSON)

    # -- membership (operators) -------------------------------------------------------------

    def _admin_allowed(self, request: Request) -> None:
        # With an API key, `authenticate` has already checked it; without one the router
        # trusts only this machine, whatever address it listens on.
        if not self.config.api_key and not request.client_ip.startswith(_LOOPBACK):
            raise HTTPError(
                403,
                "Membership changes are accepted from loopback clients only, unless the "
                "router has an API key (--api-key-env).",
            )

    async def _refuse(self, route: Route, request: Request, conn: ClientConnection) -> None:
        raise refusal(route)  # a new error each time: a raised one keeps its traceback

    async def membership(self, request: Request, conn: ClientConnection) -> None:
        if request.method == b"POST":
            await self.add_replica(request, conn)
        else:
            await self.list_replicas(request, conn)

    async def list_replicas(self, request: Request, conn: ClientConnection) -> None:
        self._admin_allowed(request)
        payload = {"replicas": [replica_json(r) for r in self.fleet.replicas]}
        conn.send(200, orjson.dumps(payload), _JSON)

    async def add_replica(self, request: Request, conn: ClientConnection) -> None:
        """`POST /router/replicas {"url": ...}`: replayed, then serving (200), or, when it does
        not answer or its replay fails, kept out of service and retried by its health check
        (202)."""
        self._admin_allowed(request)
        try:
            doc = orjson.loads(request.body)
        except orjson.JSONDecodeError:
            doc = None
        url = doc.get("url") if isinstance(doc, dict) else None
        if not isinstance(url, str):
            raise bad_request('Expected a JSON object {"url": "http(s)://host:port"}.', "url")
        try:
            address = ReplicaAddress.parse(url)
        except ValueError as exc:
            raise bad_request(str(exc), param="url") from None
        if self.fleet.downgrade(address):
            raise bad_request(
                f"{address.name}: this host and port is an https replica of the fleet; it is "
                "never reached over plain http (the token would cross in clear text).",
                param="url",
            )
        if not self.config.replica_allowed(address):
            raise HTTPError(
                403,
                f"{address.name} is outside the hosts replicas may be added from (the token "
                "goes to every replica): start the router with --replica-hosts naming it "
                "(a host glob, host:port or network).",
            )
        existing = self.fleet.by_name(address.name)
        if existing is not None:
            raise HTTPError(409, f"{existing.describe()} is already in the fleet.")
        if self.fleet.full:
            raise HTTPError(
                409,
                f"The fleet has {len(self.fleet.replicas)} members, its cap (--max-replicas): "
                "remove one first.",
            )
        if self.config.cleartext_token(address):
            log.warning("%s", cleartext_warning(address.name))
        replica = await self.health.add(address, "admin")
        status = 200 if replica.live else 202
        conn.send(status, orjson.dumps(replica_json(replica)), _JSON)

    async def remove_replica(self, request: Request, conn: ClientConnection) -> None:
        """`DELETE /router/replicas/{id}`: no new work at once, removed once drained."""
        self._admin_allowed(request)
        tail = request.path[len(_ADMIN) + 1 :]
        # An id is a count of replicas added: past `_ID_DIGITS` digits none is in the fleet
        # (and int() refuses past 4,300 digits).
        replica = self.fleet.find(int(tail)) if tail.isdigit() and len(tail) <= _ID_DIGITS else None
        if replica is None:
            raise HTTPError(404, f"No replica with id {tail.decode('latin-1')!r} in the fleet.")
        drained = await self.health.remove(replica)
        payload = {**replica_json(replica), "drained": drained}
        conn.send(200, orjson.dumps(payload), _JSON)


def _send(conn: ClientConnection, reply: Reply) -> None:
    conn.send(reply.status, reply.body, reply.headers)
