"""A running router: the listening socket, the fleet, the policy and the app, started and
stopped together. Tests and the demo start routers in-process through this class."""

from __future__ import annotations

import asyncio
import logging

from lora_router.app import RouterApp
from lora_router.config import Config
from lora_router.fleet.fleet import Fleet
from lora_router.http.server import ConnectionCount, serve
from lora_router.routing.policy import make_policy

log = logging.getLogger("lora_router")


class RouterRuntime:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.server: asyncio.Server | None = None
        self.connections: ConnectionCount | None = None
        self.fleet: Fleet | None = None
        self.app: RouterApp | None = None

    @property
    def port(self) -> int:
        assert self.server is not None
        return int(self.server.sockets[0].getsockname()[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        config = self.config
        self.fleet = Fleet(config, config.ssl_context())
        policy = make_policy(
            config.policy,
            load_factor=config.load_factor,
            vnodes=config.vnodes,
            table_size=config.affinity_table_size,
        )
        policy.set_members([r.name for r in self.fleet.replicas])
        self.app = RouterApp(config, self.fleet, policy)
        self.server, self.connections = await serve(
            self.app.handle,
            config,
            config.host,
            config.port,
            max_connections=config.max_connections,
        )
        log.info(
            "lora-router listening on %s:%d, %d replicas (%s), policy %s",
            config.host,
            self.port,
            len(config.replicas),
            ", ".join(r.name for r in config.replicas),
            config.policy,
        )

    async def stop(self, grace: float = 0.0) -> None:
        """Stop accepting, give in-flight requests `grace` seconds, then close everything."""
        if self.server is not None:
            self.server.close()
        if self.connections is not None:
            await self.connections.drain(grace)
        if self.fleet is not None:
            self.fleet.close()
