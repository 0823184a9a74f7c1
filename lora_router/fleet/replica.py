"""One replica as the router sees it: where it is, how busy, whether it may serve, what it holds.

State here is written by the control plane (adapters, the files it loaded, load times), by
the request path (`in_flight` and `in_flight_tokens`, the requests and their prompt tokens,
added around every forwarded request in a try/finally so the counts are exact on every path:
success, error, client disconnect, cancellation) and by the telemetry loop (`report`: what the
replica's own `/metrics` said at the last scrape, its queue included, or None when unknown;
fleet/telemetry.py). Its `pace` is written by fleet/pace.py's rule from its reports' decode step.
It is read by the routing policy, which must never write it.

Its service state (joining, replaying, serving, ejected, backing-off, draining, gone) is
`life`, a `Lifecycle` (lifecycle.py): only that object changes it, on the events health checks,
replays and broadcasts report. Only a serving replica receives traffic or broadcasts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from lora_router.config import ReplicaAddress
from lora_router.fleet.breaker import CircuitBreaker
from lora_router.fleet.client import Facts
from lora_router.fleet.failure import Failure
from lora_router.fleet.lifecycle import Lifecycle, State
from lora_router.fleet.pace import Pace
from lora_router.fleet.report import Report
from lora_router.http.upstream import UpstreamPool


class Replica:
    """A vLLM server behind the router. `rid` is stable for the replica's lifetime in the fleet."""

    __slots__ = (
        "_adapters",
        "address",
        "addresses",
        "breaker",
        "computed_at",
        "cut_streams",
        "facts",
        "host_header",
        "in_flight",
        "in_flight_tokens",
        "info_unread",
        "label",
        "life",
        "load_seconds",
        "loaded",
        "name",
        "on_change",
        "origin",
        "pace",
        "pool",
        "report",
        "report_error",
        "rid",
        "target_prefix",
        "unready",
    )

    def __init__(
        self,
        rid: int,
        address: ReplicaAddress,
        pool: UpstreamPool,
        breaker: CircuitBreaker,
        life: Lifecycle,
        origin: str = "replicas",
    ) -> None:
        self.rid = rid
        self.origin = origin  # how it joined: replicas, admin, or a discovery source's label
        self.address = address
        self.name = address.name  # ring identity: the same URLs give the same placements
        # What its host resolved to when it joined (fleet/aliases.py); empty: not resolved.
        self.addresses: frozenset[str] = frozenset()
        self.label = str(rid).encode()  # what clients see in x-lora-router-replica
        # The request line's path prefix and the Host header, as they go on the wire.
        self.target_prefix = address.path_prefix.encode()
        self.host_header = address.host_header.encode()
        self.pool = pool
        self.breaker = breaker
        self.in_flight = 0
        self.in_flight_tokens = 0  # prompt tokens its requests in flight must compute (placement)
        # Answers it broke off after their head had reached the client (proxy/routed.py).
        self.cut_streams = 0
        # Loop time the latest request arrived whose answer reported a full block computed:
        # its KV events must have said so since (fleet/kv_events.py's silence check).
        self.computed_at = 0.0
        self.life = life  # its service state; only `life`'s own methods change it
        # Called when its acknowledged adapters change (the fleet's kept candidate sets).
        self.on_change: Callable[[], None] | None = None
        self._adapters = _Adapters(self._announce)  # adapter name -> lora_path, as acknowledged
        self.load_seconds = 0.0  # how long its last adapter load took (broadcast order)
        # Why it cannot take part in a weight sync, as last seen (fleet/readiness.py): a
        # standing warning, shown in /router/status; empty when it can.
        self.unready: tuple[Failure, ...] = ()
        # What it last said of itself (`/server_info` and `/v1/models`): the fleet checks that
        # every member agrees on `client.AGREEMENT`'s facts (`Fleet.disagreements`).
        self.facts: Facts | None = None
        # Its `/server_info` could not be read (not for dev mode): read again at its next
        # passing health check (fleet/replay.py's `reread`).
        self.info_unread = False
        # Adapter name -> digest of the files this router process loaded onto it under that
        # name (fleet/adapter_files.py). A copy it holds without a record here was put there by
        # someone else (an earlier router, a direct load): its weights are unknown.
        self.loaded: dict[str, str] = {}
        # Its own /metrics at the last scrape (running, waiting, KV, ...); None: unknown, with
        # the reason in report_error. Never a reason to eject it, but for the stall rule
        # (health.py: it computed nothing for `--stall-timeout` while holding requests).
        self.report: Report | None = None
        self.report_error = "not scraped yet"
        # Its decode step and routing weight, written only by fleet/pace.py's rule.
        self.pace = Pace()

    @property
    def adapters(self) -> dict[str, str]:
        """Adapter name -> lora_path, as acknowledged; every change is announced."""
        return self._adapters

    @adapters.setter
    def adapters(self, adapters: dict[str, str]) -> None:
        self._adapters = _Adapters(self._announce, adapters)
        self._announce()

    def _announce(self) -> None:
        if self.on_change is not None:
            self.on_change()

    @property
    def state(self) -> State:
        return self.life.state

    @property
    def live(self) -> bool:
        """Takes traffic and broadcasts (serving)."""
        return self.life.state is State.SERVING

    def describe(self) -> str:
        """How errors name a replica: index and URL (the URL never carries a credential)."""
        return f"Replica {self.rid} ({self.name})"

    def __repr__(self) -> str:
        return f"Replica({self.rid}, {self.name}, in_flight={self.in_flight})"


class _Adapters(dict[str, str]):
    """A replica's acknowledged adapters: a dict that calls `changed` (its replica's
    announcement) after every change."""

    __slots__ = ("_changed",)

    def __init__(self, changed: Callable[[], None], items: dict[str, str] | None = None) -> None:
        super().__init__(items or {})
        self._changed = changed

    def __setitem__(self, name: str, path: str) -> None:
        super().__setitem__(name, path)
        self._changed()

    def __delitem__(self, name: str) -> None:
        super().__delitem__(name)
        self._changed()

    def pop(self, name: str, *default: Any) -> Any:
        out = super().pop(name, *default)
        self._changed()
        return out

    def popitem(self) -> tuple[str, str]:
        out = super().popitem()
        self._changed()
        return out

    def clear(self) -> None:
        super().clear()
        self._changed()

    def update(self, *args: Any, **kwargs: str) -> None:
        super().update(*args, **kwargs)
        self._changed()

    def setdefault(self, name: str, default: str = "") -> str:
        out = super().setdefault(name, default)
        self._changed()
        return out
