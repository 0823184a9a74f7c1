"""A running router: the listening socket, the fleet, its fence, the replica client, the
broadcaster, replays, health checks and replica telemetry, the policy and the app, started and
stopped together. Tests and the demo start routers in-process through this class.

Start order matters: the listening socket is bound first, before any replica is contacted, so
a port in use fails at once with nothing to clean up; the replicas' hosts are resolved next
(members listed under two names are warned of, fleet/aliases.py), then the replicas are read
(adapters already on them, their KV block size, `--unload-stale`), and only then does the
socket accept, so the first request already sees the fleet as it is; with `--policy kv` the
KV-event subscriptions start then too (fleet/kv_events.py), so that a router that just started
learns what the replicas' replay buffers still hold before it routes; the health watchers and
the telemetry loop start last.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import asdict

from lora_router.config import Config
from lora_router.fleet.broadcast import Broadcaster
from lora_router.fleet.client import ReplicaClient
from lora_router.fleet.discovery import Discovery, make_sources
from lora_router.fleet.fence import AdapterFence
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.health import HealthMonitor
from lora_router.fleet.kv_events import KvEvents
from lora_router.fleet.pace import PaceRule
from lora_router.fleet.replay import Replay
from lora_router.fleet.replica_loads import ReplicaLoads
from lora_router.fleet.telemetry import Telemetry
from lora_router.http.request import ConnectionCount
from lora_router.http.server import ClientConnection
from lora_router.observe.families import metric_families
from lora_router.observe.metrics import MetricsCollector, RequestStats, make_registry
from lora_router.observe.status import summary_line
from lora_router.proxy.answers import cleartext_warning
from lora_router.proxy.dispatch import RouterApp
from lora_router.proxy.forward import Forwarder
from lora_router.proxy.retry import RetryBudget
from lora_router.proxy.routed import CompletionRoute
from lora_router.routing.keys import DEFAULT_BLOCK_SIZE, Lineages
from lora_router.routing.kv_index import KvIndex
from lora_router.routing.kv_policy import KvLookup
from lora_router.routing.policy import Policy, PrefixAffinity, make_policy

log = logging.getLogger("lora_router")


class ListenError(Exception):
    """The listening socket could not be bound; the message is the line the user sees."""


class RouterRuntime:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.server: asyncio.Server | None = None
        self.connections: ConnectionCount | None = None
        self.fleet: Fleet | None = None
        self.fence: AdapterFence | None = None
        self.client: ReplicaClient | None = None
        self.broadcaster: Broadcaster | None = None
        self.health: HealthMonitor | None = None
        self.telemetry: Telemetry | None = None
        self.discovery: Discovery | None = None
        self.kv_events: KvEvents | None = None  # with --policy kv
        self.app: RouterApp | None = None
        self.route: CompletionRoute | None = None  # the routed completion, in app's table
        self._summary: asyncio.Task[None] | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        config = self.config
        for address in config.replicas:
            if config.cleartext_token(address):
                log.warning("%s", cleartext_warning(address.name))
        self.fleet = fleet = Fleet(config, config.ssl_context())
        params = config.policy_params()
        index: KvIndex | None = None
        policy: Policy
        if config.policy == "kv":
            lineages = Lineages(config.lineage_pattern)  # the roots of the routed prompts' keys
            index = KvIndex(lambda lora: lineages.seeds(lora, lora is not None).token, 0)
            policy = PrefixAffinity(**asdict(params), prefer=KvLookup(index))
        else:
            policy = make_policy(config.policy, params)
        policy.set_members(fleet.replicas)
        fleet.on_members = policy.set_members
        fleet.on_load = policy.load_changed
        self.fence = fence = AdapterFence(config.fence_timeout)
        fence.base_models = fleet.base_models  # one set, filled by discovery and replays
        self.client = client = ReplicaClient(config)
        loads = ReplicaLoads(config, client)
        self.broadcaster = broadcaster = Broadcaster(config, loads, fleet, fence)
        replay = Replay(config, client, fleet, fence, broadcaster.lock, loads)
        self.health = health = HealthMonitor(config, client, fleet, fence, replay)
        stats = RequestStats()
        fleet.on_removed = lambda replica: stats.forget(replica.label)
        collector = MetricsCollector(stats)
        registry = make_registry(collector)
        budget = RetryBudget(config.retry_budget)
        forwarder = Forwarder(config, fleet)
        self.route = route = CompletionRoute(
            config, fleet, policy, fence, health, stats, budget, forwarder, DEFAULT_BLOCK_SIZE
        )
        self.app = app = RouterApp(
            config,
            fleet,
            policy,
            fence,
            broadcaster,
            health,
            stats,
            registry,
            budget,
            forwarder,
            route,
        )
        # The replicas' decode steps, their weights told to the policy (fleet/pace.py).
        pace = PaceRule(lambda: fleet.replicas, policy.set_weight) if config.pace else None
        self.telemetry = telemetry = Telemetry(config, client, fleet, broadcaster.syncs, pace)
        app.state.telemetry = telemetry
        self.discovery = discovery = Discovery(config, fleet, health, make_sources(config))
        app.state.discovery = discovery
        collector.add_source(lambda: metric_families(app.state))
        try:
            self.connections = count = ConnectionCount(
                config.max_connections, config.max_buffered_bytes
            )
            # Bound now, accepting only once the fleet is known (`start_serving` below).
            self.server = await asyncio.get_running_loop().create_server(
                lambda: ClientConnection(app.handle, config, count, app.body_cap),
                config.host,
                config.port,
                backlog=2048,
                start_serving=False,
            )
        except OSError as exc:
            fleet.close()
            raise ListenError(
                f"cannot listen on {config.host}:{config.port}: {exc.strerror or exc}"
            ) from None
        try:
            await client.open()
            await health.locate(fleet.replicas)  # warns of members under two names
            block_size = await replay.discover() or DEFAULT_BLOCK_SIZE
        except BaseException:
            await self.stop()
            raise
        route.block_size = block_size
        if index is not None:
            index.block_size = block_size
            self.kv_events = kv = KvEvents(config, client, fleet, index)
            health.on_restart = kv.restarted
            app.state.kv_events = kv
            try:
                await kv.start()
            except BaseException:
                await self.stop()
                raise
        replay.on_block_size = self._key_by  # the size no replica said at start (replay.py)
        await telemetry.scrape_round()  # before serving: the first reports (telemetry.py)
        await self.server.start_serving()
        health.start()
        telemetry.start()
        discovery.start()
        if config.status_interval > 0:
            self._summary = asyncio.get_running_loop().create_task(self._log_summaries())
        log.info(
            "lora-router listening on %s:%d, %d replicas (%s), %d in service, policy %s",
            config.host,
            self.port,
            len(fleet.replicas),
            ", ".join(r.name for r in fleet.replicas),
            len(fleet.live()),
            config.policy,
        )
        if not fleet.replicas:
            # Discovery alone, and nothing found yet (a file not written yet, a name not yet
            # in DNS): the router starts, as a scheduler may write the file after it, and says
            # so once, loudly (docs/operating.md, discovery).
            log.warning(
                "no replica yet: the router serves nothing, and /health answers 503, until %s "
                "names one",
                " or ".join(s.label for s in discovery.sources),
            )

    def _key_by(self, block_size: int) -> None:
        """Key prompts, and file KV events, by `block_size` tokens a block from now on: what
        was keyed by the size guessed before no longer matches (a new family)."""
        assert self.route is not None
        self.route.block_size = block_size
        if self.kv_events is not None:
            self.kv_events.key_by(block_size)

    def in_flight(self) -> tuple[int, int]:
        """Routed requests running on replicas, and broadcasts received and not yet ended:
        what a stop waits for."""
        routed = sum(r.in_flight for r in self.fleet.replicas) if self.fleet else 0
        return routed, self.broadcaster.pending if self.broadcaster else 0

    async def _log_summaries(self) -> None:
        """One line every `status_interval` seconds with what an operator checks first."""
        assert self.app is not None
        while True:
            await asyncio.sleep(self.config.status_interval)
            log.info("%s", summary_line(self.app.state))

    async def stop(self, grace: float = 0.0) -> None:
        """Stop accepting, give in-flight requests `grace` seconds, then close everything."""
        if self._summary is not None:
            self._summary.cancel()
        if self.server is not None:
            self.server.close()
        if self.discovery is not None:
            await self.discovery.stop()
        if self.health is not None:
            await self.health.stop()
        if self.kv_events is not None:
            await self.kv_events.stop()
        if self.telemetry is not None:
            await self.telemetry.stop()
        if self.connections is not None:
            await self.connections.drain(grace)
        if self.broadcaster is not None:
            await self.broadcaster.close()
        if self.client is not None:
            await self.client.close()
        if self.fleet is not None:
            self.fleet.close()
