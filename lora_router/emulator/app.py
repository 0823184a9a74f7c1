"""The emulator's aiohttp server: one dispatch function in front of every route.

It records each request as received (`Emulator.requests`, unless `record_requests` is off),
applies the `--api-key` guard to /v1/*, sends generation to `serving.py` and everything else
to the shared handlers of `control.py`, and makes aiohttp's answers look like uvicorn's where
routers could notice: no Content-Type where Starlette sends none, and `server: uvicorn`.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from aiohttp import web
from multidict import CIMultiDict

from lora_router.emulator import control
from lora_router.emulator.control import ControlReply, PlainRequest, RecordedRequest, Replica
from lora_router.emulator.replies import METHOD_NOT_ALLOWED, Reply
from lora_router.emulator.serving import UntypedResponse, serve_generation, to_response

# Path -> whether it is the chat API.
GENERATION_ROUTES = {"/v1/completions": False, "/v1/chat/completions": True}
MAX_BODY_BYTES = 256 * 1024 * 1024  # long token-id prompts are large JSON


class RecordingReplica(Replica, Protocol):
    requests: list[RecordedRequest]
    background: set[asyncio.Task[None]]


async def _look_like_uvicorn(request: web.Request, response: web.StreamResponse) -> None:
    if isinstance(response, UntypedResponse):
        response.headers.popall("Content-Type", None)
    response.headers["Server"] = "uvicorn"


def build_app(replica: RecordingReplica) -> web.Application:
    table = control.routes(replica.config)

    async def dispatch(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        if replica.config.record_requests:
            replica.requests.append(
                RecordedRequest(
                    request.method, request.raw_path, CIMultiDict(request.headers), body
                )
            )
        path = request.path
        if not path.startswith("/emulator/"):  # the admin surface answers, to lift the hang
            await replica.faults.wait_hang(path)
        denied = control.unauthorized(replica.config, path, request.headers)
        if denied is not None:
            return to_response(denied)
        chat = GENERATION_ROUTES.get(path)
        if chat is not None:
            if request.method != "POST":
                return to_response(METHOD_NOT_ALLOWED)
            return await serve_generation(replica, request, body, chat)
        found = control.lookup(table, request.method, path)
        if isinstance(found, Reply):
            return to_response(found)
        plain = PlainRequest(request.method, path, request.query, request.headers, body)
        result = await found(replica, plain)
        if isinstance(result, ControlReply):
            response = to_response(result.reply)
            await response.prepare(request)
            await response.write_eof()
            if result.after is not None:
                task = asyncio.create_task(result.after())
                replica.background.add(task)
                task.add_done_callback(replica.background.discard)
            return response
        return to_response(result)

    app = web.Application(client_max_size=MAX_BODY_BYTES)
    app.router.add_route("*", "/{tail:.*}", dispatch)
    app.on_response_prepare.append(_look_like_uvicorn)
    return app
