"""Inbound authentication: the key clients must present when the router has one (`--api-key-env`).

A client sends `Authorization: Bearer <key>`; the key is compared in constant time
(`hmac.compare_digest`), so response timing tells nothing about how much of a guess was right.
Without a configured key every request passes (the router then listens on loopback only, or
the operator said `--insecure-listen`).

Open without a key: `GET`/`HEAD`/`POST` of `/health` and `/ping`, so the readiness polling of a
trainer or an orchestrator works without credentials. They reveal only whether the fleet can
serve.
Everything else — completions, adapter loads, pause/resume, metrics, server info — needs it.

The client's `Authorization` header, whether it carried the right key or not, is never
forwarded to a replica (see headers.py): the replicas get the router's own token.

What this module must never do: put the key, or what the client sent, in an error or a log.
"""

from __future__ import annotations

import hmac

from lora_router.config import Config
from lora_router.http.errors import HTTPError
from lora_router.http.request import Request

OPEN_PATHS = frozenset({b"/health", b"/ping"})
_OPEN_METHODS = frozenset({b"GET", b"HEAD", b"POST"})  # POST /ping: SageMaker-style


def authenticate(request: Request, config: Config) -> None:
    """Return if `request` may proceed; raise a 401 in vLLM's error shape if not."""
    key = config.api_key
    if not key:
        return
    if request.path in OPEN_PATHS and request.method in _OPEN_METHODS:
        return
    sent = request.header(b"authorization")
    if sent is not None:
        scheme, _, credential = sent.strip().partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(
            credential.strip(), key.reveal().encode()
        ):
            return
    raise HTTPError(401, "Missing or invalid API key: send `Authorization: Bearer <key>`.")
