"""The set of replicas behind the router, and which of them may serve a given model.

This is the data plane's view of the fleet: membership (add, remove, with ids never reused),
the pause the fleet is under (`pause`, a `PauseIntent`), `routable`, the one function the
routed path asks "who may take a request for this model now?", and the request counts
(`started`, `finished`: the only writers of `in_flight` and `in_flight_tokens`). A replica's
service state is its `Lifecycle` (lifecycle.py), changed only by that object's methods; this
module reads it and does no I/O.

`routable` is the second half of the fence's invariant: a replica is a candidate for adapter A
only when its state is *serving* (which it reaches only through a completed replay), its
circuit breaker lets traffic through, and its acknowledged adapters include A.

Kept, not rebuilt per request (issue 16): one `Candidates` per model (None for the base
model), built on first use after a change and dropped on every change that can alter it: a
member added or removed, a lifecycle transition, a breaker closing or opening, an adapter
acknowledged or forgotten (each of those objects calls `_changed`). A breaker's open ->
half-open is driven by the clock, not by an event, so the replicas whose breaker is not closed
(`_trial`, usually none) are asked per request; one that lets its trial through is added to
that request's candidates. `started`/`finished` keep each kept set's `in_flight` total and
tell the policy (`on_load`), so no step of a routed request walks the fleet.

Membership changes reach the policy (`on_members`, its ring and ranks) at the next `routable`,
once for all the changes since the last one: a burst of joins (a discovery source naming 1,000
new members) costs one ring update, not one per member, which made such a burst quadratic.
The policy only ever chooses among a `routable` set, so it never sees a membership older than
the candidates it is given.

**Base model names** (`base_models`: a completion naming one passes the fence at once, to any
serving replica) come only from agreement (issue 44): each member's last `/v1/models` listing
(its cards without a `parent`, recorded by `listed`) counts, and a name is a base only when
every member that listed one names it, and it is neither a name the fence knows as an adapter
nor shaped like a version of one (`--lineage-pattern`, routing/keys.py: `trl-policy-v8`).
Agreement, not the union, because any one member's card would otherwise widen the fence for
the whole fleet: a member can only narrow the set (at worst a name some members list is then
answered 404 naming those that do not, `unshared_base`, and the disagreement shows in
`/router/status`, `disagreements`), never add a name the others do not serve. A removed
member's listing stops counting at once. The set is recomputed in place: the fence holds the
same object (runtime.py).
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass

from lora_router.config import Config, ReplicaAddress
from lora_router.fleet.aliases import ALIAS_FIX, aliases
from lora_router.fleet.breaker import CLOSED, CircuitBreaker
from lora_router.fleet.client import AGREE_FIX, AGREEMENT, disagreement
from lora_router.fleet.lifecycle import OUT, Lifecycle, State
from lora_router.fleet.replica import Replica
from lora_router.http.upstream import UpstreamPool
from lora_router.routing.keys import Lineages
from lora_router.routing.policy import Candidates

log = logging.getLogger(__name__)

_MAX_SETS = 64  # kept candidate sets (models in use); more and they are all dropped, rebuilt


@dataclass(frozen=True, slots=True)
class PauseIntent:
    """The pause the trainer last asked the fleet for, replayed onto replicas that come back.

    `known` stays False until the router has broadcast a /pause or a /resume, so a replica
    coming back is not resumed on a guess; `query` is the last /pause's query string (its
    mode), None after a /resume."""

    known: bool = False
    query: str | None = None

    @property
    def paused(self) -> bool:
        return self.query is not None


class Fleet:
    """The replicas, in the order they were given (ids are never reused)."""

    def __init__(self, config: Config, ssl_context: ssl.SSLContext | None = None) -> None:
        self._config = config
        self._ssl = ssl_context
        self._next_rid = 0
        self.replicas: list[Replica] = []
        # Names that are the base model, not an adapter: every lister's agreement (module
        # docstring), kept by `listed` and `remove`.
        self.base_models: set[str] = set()
        self._listed: dict[int, frozenset[str]] = {}  # rid -> its last listing's base names
        self._lineages = Lineages(config.lineage_pattern)
        self._tls: set[tuple[str, int]] = set()  # host, port of every https member ever added
        # Set by the broadcaster when a /pause or /resume is asked (before its outcome).
        self.pause = PauseIntent()
        # Called with every member at the next `routable` after adds or removes (module
        # docstring: the policy's ring).
        self.on_members: Callable[[Sequence[Replica]], None] | None = None
        self._members_stale = False
        # Called after each change of a replica's request counts (the policy's dealing ranks).
        self.on_load: Callable[[Replica], None] | None = None
        # Called with each replica removed for good (the request stats fold its rows away:
        # observe/metrics.py `RequestStats.forget`).
        self.on_removed: Callable[[Replica], None] | None = None
        self._sets: dict[str | None, Candidates[Replica]] = {}  # model -> its candidates
        self._trial: list[Replica] = []  # replicas whose breaker is not closed
        self._stale = True
        for address in config.replicas:
            self.add(address)

    def add(self, address: ReplicaAddress, origin: str = "replicas") -> Replica:
        """A replica in the fleet: serving (the `--replicas`, read before the router accepts a
        request) or, from any other `origin` (`admin`, a discovery source), out of service
        until its replay."""
        config = self._config
        if address.tls:
            self._tls.add((address.host, address.port))
            if self._ssl is None:
                self._ssl = config.tls_context()  # a first https replica added at run time
        rid = self._next_rid
        self._next_rid += 1
        pool = UpstreamPool(
            address,
            str(rid).encode(),
            self._ssl,
            connect_timeout=config.connect_timeout,
            first_byte_timeout=config.first_byte_timeout,
            stream_idle_timeout=config.idle_timeout,
            idle_timeout=config.upstream_idle_timeout,
            max_connections=config.max_upstream_connections,
            withdrawn_gap=config.stall_timeout,
        )
        life = Lifecycle(
            f"Replica {rid} ({address.name})",
            config.health_interval,
            State.SERVING if origin == "replicas" else State.JOINING,
        )
        breaker = CircuitBreaker(config.breaker_failures, config.breaker_cooldown)
        replica = Replica(rid, address, pool, breaker, life, origin)
        life.on_change = breaker.on_change = replica.on_change = self._changed
        life.on_leave = pool.withdraw  # its waiting requests go elsewhere (lifecycle.py)
        self.replicas.append(replica)
        self._members_changed()
        return replica

    def remove(self, replica: Replica) -> None:
        """Take a replica out of the fleet for good (its requests have drained)."""
        if replica in self.replicas:
            self.replicas.remove(replica)
            replica.life.remove()
            replica.pool.close()
            self._members_changed()
            if self.on_removed is not None:
                self.on_removed(replica)
        if self._listed.pop(replica.rid, None) is not None:
            self._agree()

    def listed(
        self, replica: Replica, bases: Iterable[str], adapter: Callable[[str], bool]
    ) -> None:
        """Record the base names `replica`'s `/v1/models` just listed (its cards without a
        parent) and recompute `base_models` (module docstring). `adapter(name)`: whether the
        fence knows `name` as an adapter. A listing with no base name left says nothing and
        does not count, nor does one that arrives after the replica was removed."""
        if not replica.life.member:
            return
        names = set(bases)
        shaped = {n for n in names if adapter(n) or self._lineages.versioned(n)}
        if shaped:
            log.warning(
                "%s lists %d adapter-like names as base models (such as %s): never taken as "
                "base models",
                replica.describe(),
                len(shaped),
                ", ".join(repr(n[:80]) for n in sorted(shaped)[:3]),
            )
        kept = frozenset(names - shaped)
        if kept:
            self._listed[replica.rid] = kept
        else:
            self._listed.pop(replica.rid, None)
        self._agree()

    def _agree(self) -> None:
        agreed = frozenset.intersection(*self._listed.values()) if self._listed else frozenset()
        if agreed != self.base_models:
            self.base_models.clear()
            self.base_models.update(agreed)
            self._changed()

    def disagreements(self) -> list[str]:
        """What the members disagree on of the facts every replica must share
        (`client.AGREEMENT`, from each one's `Replica.facts`), each with its fix; empty when
        they agree. A standing warning: logged when it appears (replay.py), shown in
        `/router/status` and by `lora-router top`. The base model's part also explains the 404
        a completion for it gets (`unshared_base`)."""
        seen = {f"replica {r.rid}": r.facts for r in self.replicas if r.life.member and r.facts}
        out = []
        for attr, label in AGREEMENT:
            what = disagreement(label, {who: getattr(f, attr) for who, f in seen.items()})
            if what is not None:
                out.append(f"{what}; fix: {AGREE_FIX}")
        return out

    def aliases(self, involving: Collection[Replica] = ()) -> list[str]:
        """The members that very likely are one server under two names (aliases.py's rule),
        each with its fix; with `involving`, only those that include one of them. A standing
        warning: logged when it appears (health.py's `locate`), shown in `/router/status` and by
        `lora-router top`. O(members)."""

        def who(r: Replica) -> str:
            return f"replica {r.rid} ({r.name})"

        seen = {who(r): (r.address, r.addresses) for r in self.replicas if r.life.member}
        found = aliases(seen, [who(r) for r in involving])
        return [f"{what}; fix: {ALIAS_FIX}" for what in found]

    def unshared_base(self, model: str) -> str | None:
        """Why `model` is no base model of the fleet although a member lists it as one: the
        members that do not (module docstring, *Base model names*); None when none lists it."""
        if not any(model in names for names in self._listed.values()):
            return None
        others = [
            f"replica {rid} ({', '.join(sorted(names))})"
            for rid, names in sorted(self._listed.items())
            if model not in names
        ]
        if not others:
            return None
        return (
            f"Not every replica serves it as its base model: {', '.join(others)} "
            f"{'lists' if len(others) == 1 else 'list'} another; fix: {AGREE_FIX}."
        )

    @property
    def full(self) -> bool:
        """Whether the fleet has `--max-replicas` members: no other joins until one leaves
        (the API refuses, discovery waits for room)."""
        return len(self.replicas) >= self._config.max_replicas

    def downgrade(self, address: ReplicaAddress) -> bool:
        """Whether `address` is plain http to a host and port the fleet has known as https (a
        `--replicas` entry, or any member since start): refused wherever a replica joins, so
        the token never goes in clear text to an endpoint that was reached over TLS."""
        return not address.tls and (address.host, address.port) in self._tls

    def find(self, rid: int) -> Replica | None:
        return next((r for r in self.replicas if r.rid == rid), None)

    def by_name(self, name: str) -> Replica | None:
        return next((r for r in self.replicas if r.name == name), None)

    def live(self) -> list[Replica]:
        """Replicas that take traffic and broadcasts (see `Replica.live`)."""
        return [r for r in self.replicas if r.live]

    def stranded(self) -> list[Replica]:
        """Members out of service that still run routed requests (ejected, replaying or
        draining): a resume or an abort reaches them too, best effort, where their requests
        would otherwise wait (paused) or decode on (fleet/broadcast.py, fleet/aborts.py)."""
        out = (*OUT, State.REPLAYING, State.DRAINING)
        return [r for r in self.replicas if r.in_flight and r.state in out]

    def others_serving(self, replica: Replica) -> bool:
        """Whether a replica other than `replica` serves (the lifecycle's last-replica rules)."""
        return any(r.live for r in self.replicas if r is not replica)

    def routable(self, model: str | None, exclude: Collection[Replica] = ()) -> Candidates[Replica]:
        """Replicas that may receive a request for `model` now.

        For an adapter, only replicas that acknowledged loading it; the fence has already
        made sure every live replica did before the first request was let through.

        O(1) plus O(t), t the replicas whose breaker is not closed, while nothing changed
        (module docstring); O(n) to rebuild after a change, and O(n) for a retry's `exclude`
        or a breaker's trial, which build that request's own set.
        """
        if self._members_stale:
            self._members_stale = False
            if self.on_members is not None:
                self.on_members(self.replicas)
        if self._stale:
            self._sets.clear()
            self._trial = [r for r in self.replicas if r.breaker.state != CLOSED]
            self._stale = False
        key = model if model is not None and model not in self.base_models else None
        kept = self._sets.get(key)
        if kept is None:
            if len(self._sets) >= _MAX_SETS:
                self._sets.clear()
            kept = self._sets[key] = Candidates(
                (r for r in self.replicas if r.breaker.state == CLOSED and self._serves(r, key)),
                key,
            )
        trial: list[Replica] = []
        if self._trial:
            now = asyncio.get_running_loop().time()
            trial = [r for r in self._trial if self._serves(r, key) and r.breaker.allows(now)]
        if not trial and not exclude:
            return kept
        extra = set(trial)
        chosen = (r for r in self.replicas if r in extra or kept.get(r.name) is r)
        return Candidates((r for r in chosen if r not in exclude), key)

    @staticmethod
    def _serves(replica: Replica, adapter: str | None) -> bool:
        return replica.life.state is State.SERVING and (
            adapter is None or adapter in replica.adapters
        )

    # `started` and `finished` run once per routed request each: the same four steps written
    # out in both, not a shared helper (a call each).

    def started(self, replica: Replica, tokens: int) -> None:
        """A request of `tokens` prompt tokens is being sent to `replica`: O(m), m the kept
        sets (one per model in use), plus the policy's `on_load`."""
        replica.in_flight += 1
        replica.in_flight_tokens += tokens
        name = replica.name
        for kept in self._sets.values():
            if kept.get(name) is replica:
                kept.in_flight += 1
        if self.on_load is not None:
            self.on_load(replica)

    def finished(self, replica: Replica, tokens: int) -> None:
        """The request `started` counted is over, however it ended."""
        replica.in_flight -= 1
        replica.in_flight_tokens -= tokens
        name = replica.name
        for kept in self._sets.values():
            if kept.get(name) is replica:
                kept.in_flight -= 1
        if self.on_load is not None:
            self.on_load(replica)

    def _changed(self) -> None:
        """Something `routable` reads changed: the kept sets are rebuilt on next use."""
        self._stale = True

    def _members_changed(self) -> None:
        self._stale = self._members_stale = True

    def close(self) -> None:
        for replica in self.replicas:
            replica.pool.close()
