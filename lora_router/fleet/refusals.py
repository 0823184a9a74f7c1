"""The fleet's refusals, as values: why a control operation failed, never how HTTP says it.

The fence's pattern (fleet/fence.py's `FenceRefusal`): a refusal's class says which answer it
is, `message` is what the client reads, and proxy/answers.py renders it as vLLM's answer
(status, error type, headers). Nothing here knows a status code, except a replica's own,
passed on as data (`ReplicaRefused`). Messages name a replica by index and URL, never a
credential; the broadcaster (broadcast.py) and the request path (proxy/routed.py) raise these.
"""

from __future__ import annotations

from collections.abc import Sequence

from lora_router.config import Config
from lora_router.fleet.client import Answer
from lora_router.fleet.failure import Cause
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.replica import Replica


class FleetRefusal(Exception):
    """A control operation the fleet refused or could not complete."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class Unavailable(FleetRefusal):
    """No replica could do it now (none in service, none reached, one not healthy);
    `retry_after`: seconds until a health check may bring one back, when known."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class TimedOut(FleetRefusal):
    """A replica did not finish in time (a load past --load-deadline)."""


class Misbehaved(FleetRefusal):
    """A replica failed a step the router needs of it (a reload's prefix-cache reset)."""


class Conflict(FleetRefusal):
    """The request conflicts with what a replica already holds (the client's to fix)."""


class Invalid(FleetRefusal):
    """The request cannot be what the client means (a load's path the router can judge as
    wrong, fleet/adapter_files.py); the client's to fix, nothing was sent to a replica."""


class ReplicaRefused(FleetRefusal):
    """A replica's own refusal, passed on: its status and error type."""

    def __init__(self, message: str, status: int, type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.type = type


def replica_failure(answer: Answer[Replica], what: str, path: str = "") -> FleetRefusal:
    """A replica's refusal, passed on with its status and type and the replica named; a route
    the replica lacks (on `path`) names the flag that adds it (failure.py)."""
    who = answer.replica.describe()
    if answer.status == 0:
        return Unavailable(f"{what}: {who} is unreachable: {answer.error}")
    failure = answer.failure(path) if path and answer.status == 404 else None
    if failure is not None and failure.cause in (Cause.DEV_MODE, Cause.RUNTIME_LOADING):
        return ReplicaRefused(f"{what}: {who}: {failure}", 404, answer.error_type())
    return ReplicaRefused(
        f"{what}: {who} answered: {answer.message()}", answer.status, answer.error_type()
    )


def no_replica_in_service(fleet: Fleet, config: Config) -> Unavailable:
    """No replica serves: names why the first one is out (with its fix), and a retry after one
    health interval, the soonest a health check can bring one back."""
    out = [r for r in fleet.replicas if r.life.member]
    if out:
        why = f" ({named(out)} out of service{reason(out[0])})"
    elif config.discovering:
        why = (
            " (the fleet has no member: discovery has named none yet; /router/status's "
            "`discovery` shows what each source last read)"
        )
    else:
        why = " (the fleet has no member: add one with POST /router/replicas)"
    return Unavailable(f"No replica is in service{why}.", config.health_interval)


def named(replicas: Sequence[Replica]) -> str:
    return ", ".join(r.describe() for r in replicas)


def reason(replica: Replica) -> str:
    return f": {replica.life.last_error}" if replica.life.last_error else ""
