"""Bringing a replica to the fleet's state: discovery at start, and the replay before it serves.

- `discover` reads every configured replica once at start: its `/v1/models` (base model,
  adapters already registered) and `/server_info` (LoRA limits, KV block size). It warns when
  the replicas disagree on base model, `max_lora_rank`, `max_loras` or block size; clears
  names matching `--unload-stale` (a reused replica still holding `trl-policy-v1` from an
  earlier run would make TRL's first load fail with "already loaded"); and makes live the
  adapters found on *every* answering replica at the same path (static `--lora-modules`).
  A replica that does not answer is ejected; health.py brings it in later with a replay.
- `readmit` makes a replica mirror the fleet — every live adapter loaded (with the same
  mount-lag retries as a broadcast, and the trainer's own load request), every other name
  unloaded, the fleet's pause state applied — and only then admits it. The long part runs
  outside the broadcast lock, so a trainer's load never waits behind a replay; a final pass
  under the lock catches up with whatever changed meanwhile and admits the replica between two
  broadcasts, so it can neither miss one nor see half of one.

This module must never admit a replica whose replay did not complete, nor unload a name the
fleet serves from a replica that is serving.
"""

from __future__ import annotations

import asyncio
import fnmatch
import logging
from collections.abc import Sequence
from typing import Any

import orjson

from lora_router.fleet.control import ControlPlane
from lora_router.fleet.replica import Replica

log = logging.getLogger(__name__)


class ReplayError(Exception):
    """A replica could not be brought to the fleet's state; it stays out of service."""


class UnlistedError(ReplayError):
    """The replica answers that an adapter is already loaded, yet its `/v1/models` does not list
    it: its listing contradicts its loads (a load balancer over several servers?)."""

    def __init__(self, name: str) -> None:
        super().__init__(
            f"it answers that adapter '{name}' is already loaded, but its /v1/models does not "
            "list it"
        )
        self.name = name


# -- start ----------------------------------------------------------------------------------


async def discover(control: ControlPlane) -> int | None:
    """Read every replica at start; returns the replicas' KV block size if they agree."""
    fleet = control.fleet
    results = await asyncio.gather(*(_probe(control, r) for r in fleet.replicas))
    up: list[Replica] = []
    for replica, error in zip(fleet.replicas, results, strict=True):
        if error:
            fleet.eject(replica, error)
        else:
            up.append(replica)
    _warn_disagreements(control, up)
    if control.config.unload_stale:
        await _unload_stale(control, up, control.config.unload_stale)
    _adopt_static(control, up)
    sizes = {control.replica_info[r.rid].get("block_size") for r in up} - {None}
    return next(iter(sizes)) if len(sizes) == 1 else None


async def _probe(control: ControlPlane, replica: Replica) -> str:
    """Read one replica's models and server info; returns why it failed, or ''."""
    held = await control.holdings(replica)
    if held is None:
        return "did not answer /v1/models at start"
    replica.adapters = held.adapters
    control.fleet.base_models.update(held.bases)
    info: dict[str, Any] = {"base_model": held.base}
    answer = await control.call(
        replica,
        "GET",
        "/server_info",
        query="config_format=json",
        timeout=max(control.config.health_timeout, 1.0),
    )
    doc = answer.parsed() if answer.status == 200 else None
    config = doc.get("vllm_config") if isinstance(doc, dict) else None
    if isinstance(config, dict):
        lora = config.get("lora_config")
        info["lora"] = isinstance(lora, dict)
        if isinstance(lora, dict):
            info["max_lora_rank"] = lora.get("max_lora_rank")
            info["max_loras"] = lora.get("max_loras")
        cache = config.get("cache_config")
        if isinstance(cache, dict) and isinstance(cache.get("block_size"), int):
            info["block_size"] = cache["block_size"]
    control.replica_info[replica.rid] = info
    return ""


def _warn_disagreements(control: ControlPlane, replicas: Sequence[Replica]) -> None:
    infos = [(r, control.replica_info[r.rid]) for r in replicas]
    for r, info in infos:
        if info.get("lora") is False:
            log.warning("%s runs without LoRA (lora_config is null)", r.describe())
    for key in ("base_model", "max_lora_rank", "max_loras", "block_size"):
        values = {r.rid: info.get(key) for r, info in infos if info.get(key) is not None}
        if len(set(values.values())) > 1:
            shown = ", ".join(f"replica {rid}: {v}" for rid, v in values.items())
            log.warning("the replicas disagree on %s (%s)", key, shown)


async def _unload_stale(control: ControlPlane, replicas: Sequence[Replica], pattern: str) -> None:
    jobs = [(r, n) for r in replicas for n in r.adapters if fnmatch.fnmatchcase(n, pattern)]
    for replica, name in jobs:
        answers = await control.unload_from(name, [replica])
        if answers[0].status in (200, 404):
            log.info("--unload-stale: unloaded %r from %s", name, replica.describe())


def _adopt_static(control: ControlPlane, replicas: Sequence[Replica]) -> None:
    if not replicas:
        return
    everywhere = set.intersection(*(set(r.adapters) for r in replicas))
    seen = set().union(*(set(r.adapters) for r in replicas))
    for name in sorted(seen):
        roots = {r.adapters.get(name) for r in replicas}
        if name in everywhere and len(roots) == 1:
            path = next(iter(roots)) or ""
            body = orjson.dumps({"lora_name": name, "lora_path": path})
            control.fence.mark_live(name, path, body)
            log.info("adapter %r (%s) is on every replica: serving it", name, path)
        else:
            where = ", ".join(str(r.rid) for r in replicas if name in r.adapters)
            log.warning(
                "adapter %r is not on every replica at the same path (held by %s): not "
                "served until it is loaded through the router",
                name,
                where,
            )


# -- re-admission ---------------------------------------------------------------------------


async def readmit(control: ControlPlane, replica: Replica) -> None:
    """Bring a replica to the fleet's state, then admit it; raises ReplayError.

    While it replays, load broadcasts include it (best effort, see ControlPlane): a version
    that goes live meanwhile is then already loaded when the final pass runs under the
    broadcast lock, so that pass — and the trainer's next call queued behind it — does not
    wait for a whole adapter load."""
    replica.replaying = True
    try:
        await _converge(control, replica, final=False)
        async with control.lock:
            await _converge(control, replica, final=True)
            await _replay_pause(control, replica)
            if replica not in control.fleet.replicas or replica.draining:
                raise ReplayError("it was removed from the fleet")
            if not replica.healthy:
                raise ReplayError(f"it was ejected during its replay: {replica.last_error}")
            replica.admitted = True
            replica.breaker.reset()
    finally:
        replica.replaying = False


async def _converge(control: ControlPlane, replica: Replica, *, final: bool) -> None:
    held = await control.holdings(replica)
    if held is None:
        raise ReplayError("its /v1/models did not answer")
    fleet, fence = control.fleet, control.fence
    if held.base is not None:
        if fleet.base_models and held.base not in fleet.base_models:
            log.warning("%s serves base model %r, unlike the fleet", replica.describe(), held.base)
        fleet.base_models.update(held.bases)
    replica.adapters = dict(held.adapters)
    live = fence.live()
    # Names it holds that the fleet does not serve (or at another path) go: a replica mirrors
    # the fleet. Outside the lock, names with a broadcast under way are left to the final pass.
    extra = [
        n
        for n, root in held.adapters.items()
        if (n not in live or live[n].path != root) and (final or fence.state(n) is None)
    ]
    unloads = await asyncio.gather(*(control.unload_from(n, [replica]) for n in extra))
    for answers in unloads:
        if answers[0].status not in (200, 404):
            raise ReplayError(f"unloading a stale adapter failed: {answers[0].message()}")
    missing = [(n, e) for n, e in live.items() if replica.adapters.get(n) != e.path]
    if not missing:
        return
    deadline = asyncio.get_running_loop().time() + control.config.load_deadline
    outcomes = await asyncio.gather(
        *(control.load_on(replica, n, e.path, e.body, deadline) for n, e in missing)
    )
    for (name, entry), o in zip(missing, outcomes, strict=True):
        if o.kind in ("loaded", "present"):
            replica.adapters[name] = entry.path
        elif o.kind == "conflict" and not o.detail:
            raise UnlistedError(name)
        else:
            raise ReplayError(f"replaying adapter '{name}' failed ({o.kind}): {o.detail}")


async def _replay_pause(control: ControlPlane, replica: Replica) -> None:
    if not control.pause_known:
        return
    if control.paused is not None:
        answer = await control.call(replica, "POST", "/pause", query=control.paused)
    else:
        answer = await control.call(replica, "POST", "/resume")
    if answer.status != 200:
        raise ReplayError(f"replaying the pause state failed: {answer.message()}")
