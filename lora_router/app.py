"""The request dispatcher: which of the three kinds of route a request takes, and the proxy loop.

- **Routed**: `POST /v1/completions` and `/v1/chat/completions`. The body is read once for
  `model` and the prompt; the request waits at the adapter fence if its adapter is being
  loaded; the routing policy picks a replica among those allowed to serve the model; the
  body goes out byte for byte and the answer streams back untouched.
- **Broadcast**: adapter loads/unloads, pause/resume, prefix-cache resets — to every replica,
  through the fleet's control plane.
- **Read-only and local**: health, server info, the model list, metrics, status.
Anything else is forwarded to one replica, like a single vLLM server would answer it.

Retries: a routed request that failed without receiving a single response byte (connection
refused or reset, replica gone) is tried on the next replica the policy picks, at most
`config.retries` times. Once a byte has arrived nothing is retried (see http/upstream.py).
"""

from __future__ import annotations

import logging
import uuid

from lora_router.body import read_completion
from lora_router.config import Config
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.replica import Replica
from lora_router.http.errors import HTTPError
from lora_router.http.headers import upstream_request_head
from lora_router.http.server import ClientConnection, Request
from lora_router.http.upstream import UpstreamError
from lora_router.routing.keys import PromptKey, prompt_key, text_key
from lora_router.routing.policy import Policy

log = logging.getLogger(__name__)

_ROUTED = {b"/v1/completions": False, b"/v1/chat/completions": True}


class RouterApp:
    """Everything a request needs, wired once at start."""

    def __init__(self, config: Config, fleet: Fleet, policy: Policy) -> None:
        self.config = config
        self.fleet = fleet
        self.policy = policy
        self.block_size = config.block_size or 16
        token = config.token.reveal()
        self._authorization = f"Bearer {token}".encode() if token else None

    async def handle(self, request: Request, conn: ClientConnection) -> None:
        chat = _ROUTED.get(request.path)
        if chat is not None and request.method == b"POST":
            await self.completion(request, conn, chat)
        else:
            await self.forward_any(request, conn)

    async def completion(self, request: Request, conn: ClientConnection, chat: bool) -> None:
        fields = read_completion(
            request.body, chat=chat, max_prompt_tokens=self.config.max_prompt_tokens
        )
        model = fields.model
        key: PromptKey | None
        if fields.tokens is not None:
            key = prompt_key(model, fields.tokens, self.block_size)
        elif fields.text is not None:
            key = text_key(model, fields.text)
        else:
            key = None
        tried: list[Replica] = []
        while True:
            routable = self.fleet.routable(model, tried)
            if not routable:
                raise HTTPError(503, _no_replica(model, tried))
            replica = self.policy.choose(key, routable).replica
            try:
                await self._forward(request, conn, replica)
                return
            except UpstreamError as exc:
                tried.append(replica)
                if not exc.retryable or len(tried) > self.config.retries:
                    raise _upstream_http_error(replica, exc) from None

    async def forward_any(self, request: Request, conn: ClientConnection) -> None:
        """A path the router has no rule for: one replica answers, as a single server would."""
        routable = self.fleet.routable(None)
        if not routable:
            raise HTTPError(503, "No replica is available.")
        replica = min(routable, key=lambda r: r.in_flight)
        try:
            await self._forward(request, conn, replica)
        except UpstreamError as exc:
            raise _upstream_http_error(replica, exc) from None

    async def _forward(self, request: Request, conn: ClientConnection, replica: Replica) -> None:
        address = replica.address
        request_id = request.header(b"x-request-id") or uuid.uuid4().hex.encode()
        head = upstream_request_head(
            request.method,
            address.path_prefix.encode() + request.target,
            request.headers,
            host=address.host_header.encode(),
            authorization=self._authorization,
            client_ip=request.client_ip,
            request_id=request_id,
            body_length=len(request.body),
        )
        replica.in_flight += 1
        try:
            keep_alive = await replica.pool.forward(
                head + request.body,
                conn,
                head_only=request.method == b"HEAD",
                http11=request.http11,
            )
        finally:
            replica.in_flight -= 1
        conn.keep_alive = conn.keep_alive and keep_alive


def _no_replica(model: str | None, tried: list[Replica]) -> str:
    if tried:
        names = ", ".join(str(r.rid) for r in tried)
        return f"No replica could take the request (tried replicas {names})."
    return f"No replica is available for model `{model}`." if model else "No replica is available."


def _upstream_http_error(replica: Replica, exc: UpstreamError) -> HTTPError:
    status = 504 if exc.kind == "timeout" else 502
    return HTTPError(status, f"Replica {replica.rid} ({replica.name}): {exc}.")
