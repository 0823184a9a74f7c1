"""Every rendering of a domain outcome as the answer a client gets, in vLLM's shape.

The fleet and the fence return outcome values and keep no HTTP (fleet/fence.py's
`FenceRefusal`s); the request path (routed.py) and the handlers (dispatch.py) raise what is
rendered here, so the wording and status a client reads are written once, in this module:
the fence's refusals, the routes the router will not pass on, and the warning for a token
sent in the clear. Messages name a replica by index and URL, never a credential.
"""

from __future__ import annotations

from lora_router.fleet.fence import FenceRefusal, LoadRefused, StillLoading, UnknownAdapter
from lora_router.http.errors import HTTPError, bad_request
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
