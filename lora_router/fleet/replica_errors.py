"""The router's own error answers about its replicas, in vLLM's shape (http/errors.py).

A replica's refusal passed on (its status and type, the replica named); no replica in service
(503 with `Retry-After`, naming why the replicas are out: their `last_error`, whose cause and
fix fleet/failure.py names); no replica that could take a routed request; an adapter a replica
lost; an exchange that failed. The broadcaster (broadcast.py) and the request path (proxy/routed.py)
answer with these. Messages name a replica by index and URL, never a credential.
"""

from __future__ import annotations

from collections.abc import Sequence

from lora_router.config import Config
from lora_router.fleet.client import Answer
from lora_router.fleet.fence import AdapterState
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.replica import Replica
from lora_router.http.errors import HTTPError, model_not_found, unavailable
from lora_router.http.upstream import UpstreamError


def replica_failure(answer: Answer[Replica], what: str) -> HTTPError:
    """A replica's refusal, passed on with its status and type and the replica named."""
    who = answer.replica.describe()
    if answer.status == 0:
        return HTTPError(503, f"{what}: {who} is unreachable: {answer.error}")
    status = answer.status if answer.status >= 400 else 502
    return HTTPError(
        status, f"{what}: {who} answered: {answer.message()}", type=answer.error_type()
    )


def no_replica_in_service(fleet: Fleet, config: Config) -> HTTPError:
    """The 503 when no replica serves, naming why the first one is out (with its fix), and
    `Retry-After` one health interval: the soonest a health check can bring one back."""
    out = [r for r in fleet.replicas if r.life.member]
    why = f" ({named(out)} out of service{reason(out[0])})" if out else ""
    return unavailable(f"No replica is in service{why}.", config.health_interval)


def no_replica_for(
    fleet: Fleet, model: str | None, tried: Sequence[Replica], config: Config
) -> HTTPError:
    """The 503 (with `Retry-After`) when no replica can take a request for `model` after
    `tried` failed: none in service, or none left to try."""
    if not tried and not fleet.live():
        return no_replica_in_service(fleet, config)
    if tried:
        names = ", ".join(str(r.rid) for r in tried)
        message = f"No replica could take the request (tried replicas {names})."
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
    status = 504 if exc.kind == "timeout" else 502
    return HTTPError(status, f"{replica.describe()}: {exc}.")


def named(replicas: Sequence[Replica]) -> str:
    return ", ".join(r.describe() for r in replicas)


def reason(replica: Replica) -> str:
    return f": {replica.life.last_error}" if replica.life.last_error else ""
