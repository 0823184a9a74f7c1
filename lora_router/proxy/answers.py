"""Every rendering of a domain outcome as the answer a client gets, in vLLM's shape.

The fleet and the fence return outcome values and keep no HTTP (fleet/fence.py's
`FenceRefusal`s, fleet/refusals.py's `FleetRefusal`s); the request path (routed.py) and the
handlers (dispatch.py) raise what is rendered here, so the status, error type and headers a
client reads are decided once, in this module: for the fence's and the fleet's refusals (their
`message` is the text), and, wording included, for no replica to take a routed request, a lost
adapter, a failed exchange, the routes the router will not pass on, and the warning for a
token sent in the clear. Messages name a replica by index and URL, never a
credential.
"""

from __future__ import annotations

from collections.abc import Sequence

from lora_router.config import Config
from lora_router.fleet.fence import (
    AdapterState,
    FenceRefusal,
    LoadRefused,
    StillLoading,
    UnknownAdapter,
)
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.refusals import (
    Conflict,
    FleetRefusal,
    Invalid,
    Misbehaved,
    ReplicaRefused,
    TimedOut,
    Unavailable,
    named,
    no_replica_in_service,
)
from lora_router.fleet.replica import Replica
from lora_router.http.errors import HTTPError, bad_request, model_not_found, unavailable
from lora_router.http.exchange import UpstreamError
from lora_router.routes import REFUSED_STATUS, Kind, Route


def cleartext_warning(name: str) -> str:
    """The start-up and run-time warning for a token sent in the clear (never the token)."""
    return (
        f"the replicas' token goes to {name} over plain http:// beyond this machine, readable "
        "on the way: give the replica an https:// URL, or reach it through a tunnel"
    )


def refusal(route: Route) -> HTTPError:
    """Why the router will not pass on a REFUSED or CLOSED route, and what to do instead."""
    path = route.label
    if route.kind is Kind.REFUSED:
        return HTTPError(REFUSED_STATUS, f"lora-router does not forward {path}: {route.why}")
    return HTTPError(
        REFUSED_STATUS,
        f"lora-router does not forward {path}: it routes only /v1/completions and "
        "/v1/chat/completions (by prefix affinity, behind the adapter fence), and this call "
        f"would reach one replica with neither. Start the router with --forward-path {path} "
        "to forward it to one replica as it is.",
    )


def fence_error(refusal: FenceRefusal) -> HTTPError:
    """The fence's refusal as vLLM would answer it (fleet/fence.py keeps no HTTP)."""
    if isinstance(refusal, UnknownAdapter):
        return HTTPError(404, refusal.message, param="model")
    if isinstance(refusal, StillLoading):
        return HTTPError(503, refusal.message)
    if isinstance(refusal, LoadRefused) and refusal.in_place:
        return bad_request(refusal.message, param="load_inplace")
    return HTTPError(400, refusal.message, type="InvalidUserInput")


def fleet_error(refusal: FleetRefusal) -> HTTPError:
    """The fleet's refusal as vLLM would answer it (fleet/refusals.py keeps no HTTP)."""
    message = refusal.message
    if isinstance(refusal, Unavailable):
        if refusal.retry_after is not None:
            return unavailable(message, refusal.retry_after)
        return HTTPError(503, message)
    if isinstance(refusal, TimedOut):
        return HTTPError(504, message)
    if isinstance(refusal, Misbehaved):
        return HTTPError(502, message)
    if isinstance(refusal, Conflict | Invalid):
        return HTTPError(400, message, type="InvalidUserInput")
    assert isinstance(refusal, ReplicaRefused)
    # A replica's status passed on; one that is no error (a redirect) is a bad gateway.
    return HTTPError(refusal.status if refusal.status >= 400 else 502, message, type=refusal.type)


def no_replica_for(
    fleet: Fleet, model: str | None, tried: Sequence[Replica], config: Config
) -> HTTPError:
    """The 503 (with `Retry-After`) when no replica can take a request for `model` after
    `tried` failed: none in service, or none left to try."""
    if not tried and not fleet.live():
        return fleet_error(no_replica_in_service(fleet, config))
    if tried:
        names = ", ".join(r.describe() for r in tried)
        message = f"No replica could take the request (tried {names})."
    else:
        message = f"No replica is available for model `{model}`." if model else ""
    return unavailable(message or "No replica is available.", config.health_interval)


def lost_adapter(model: str, tried: Sequence[Replica], state: AdapterState | None) -> HTTPError:
    if state is not AdapterState.LIVE:
        # Unloaded while this request was on its way: what vLLM answers for a gone name.
        return model_not_found(model)
    return HTTPError(
        502, f"The adapter `{model}` was missing on {named(tried)}; they are being replayed."
    )


def exchange_failed(replica: Replica, exc: UpstreamError) -> HTTPError:
    """A failed exchange: 504 for a timeout, 503 when it waited for a connection too long (the
    router's own cap: busy, not broken), else 502."""
    status = 504 if exc.kind == "timeout" else 503 if exc.kind == "busy" else 502
    return HTTPError(status, f"{replica.describe()}: {exc}.")
