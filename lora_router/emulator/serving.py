"""Serving one generation request: checks in vLLM's order, then a whole answer or an SSE stream.

Order matters because routers key behaviour on it: body validation (400), unknown model (404),
context length (400) and injected 5xx all answer *before* a stream starts; the pause check comes
after the stream's headers, so a paused 0.33 replica answers a stream with a 200, one error
frame and `[DONE]`, and a paused 0.27 replica answers with headers and then nothing until
/resume. Every sample runs as its own engine sequence (vLLM's parallel sampling); their tokens
arrive on one queue that this module alone drains and writes, so the HTTP side has a single
writer. When the client goes away the handler is cancelled (aiohttp's handler cancellation), the
sequences leave the engine and `state.counters.cancelled` counts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from http import HTTPStatus
from typing import Any

import orjson
from aiohttp import web

from lora_router.emulator import completions, tokens
from lora_router.emulator.adapters import Adapter
from lora_router.emulator.completions import ChoiceState, GenerationParams, Renderer
from lora_router.emulator.config import EmulatorConfig
from lora_router.emulator.control import Replica, is_dead
from lora_router.emulator.engine import (
    Engine,
    EngineDead,
    GenerationPaused,
    SampleJob,
    UnknownModel,
)
from lora_router.emulator.prefix_cache import block_hashes
from lora_router.emulator.replies import (
    DEAD_MESSAGE,
    PAUSED_MESSAGE,
    SSE,
    SSE_DONE,
    SSE_KEEPALIVE,
    Reply,
    engine_dead,
    error_reply,
    is_json_media_type,
    json_decode_error,
    json_reply,
    model_not_found,
    sse_error_frame,
    sse_frame,
    unsupported_media_type,
)


class UntypedResponse(web.Response):
    """A response sent with no Content-Type header, like Starlette's bare `Response`.

    aiohttp fills in `application/octet-stream` for any non-empty body; the app's
    `on_response_prepare` hook removes it again for this class only.
    """


def to_response(reply: Reply) -> web.Response:
    """A `Reply` as an aiohttp response."""
    if reply.content_type is None:
        return UntypedResponse(status=reply.status, body=reply.body, headers=reply.headers)
    headers = {"Content-Type": reply.content_type, **reply.headers}
    return web.Response(status=reply.status, body=reply.body, headers=headers)


def _error_type(status: int) -> str:
    known = {500: "InternalServerError", 503: "ServiceUnavailableError", 400: "BadRequestError"}
    if status in known:
        return known[status]
    try:
        return HTTPStatus(status).phrase.replace(" ", "") + "Error"
    except ValueError:
        return "Error"


class _ConnectionCut(Exception):
    """The crash fault cut the connection, or the client is gone: stop writing."""


async def serve_generation(
    replica: Replica, request: web.Request, body: bytes, chat: bool
) -> web.StreamResponse:
    if not is_json_media_type(request.headers.get("Content-Type")):
        return to_response(unsupported_media_type())
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        return to_response(json_decode_error(exc))
    params = completions.parse(data, chat)
    if isinstance(params, Reply):
        return to_response(params)
    engine = replica.state
    config = replica.config
    faults = replica.faults
    if is_dead(replica):
        return to_response(engine_dead())
    try:
        adapter = engine.resolve_model(params.model)
    except UnknownModel:
        return to_response(
            model_not_found(params.model, config.since("0.32"), engine.served_names())
        )
    too_long = completions.context_error(params, config.max_model_len, config.since("0.32"))
    if too_long is not None:
        return to_response(too_long)
    if faults.completion_fails():
        status = faults.error_status
        return to_response(
            error_reply(
                "Injected fault: the replica failed this request.", _error_type(status), status
            )
        )
    request_id = request.headers.get("X-Request-Id") or uuid.uuid4().hex
    model_name = adapter.name if adapter else (params.model or config.model)
    renderer = Renderer(params, request_id, model_name)
    jobs, choices = _plan(engine, params, adapter, request_id)
    if faults.crash_after_frames is not None and not params.stream:
        _cut(request)
        # aiohttp finds the transport closed when it writes this and drops it quietly.
        return web.Response(status=500)
    try:
        await faults.wait_stall()
        if params.stream:
            return await _stream(replica, request, params, renderer, jobs, choices)
        return await _whole(engine, params, renderer, jobs, choices)
    except asyncio.CancelledError:
        # aiohttp cancels the handler when the client disconnects: stalled, queued while
        # paused or generating, the request is gone and its sequences leave the engine.
        engine.note_cancelled()
        raise


def external_request_id(request_id: str, chat: bool, prompt_index: int) -> str:
    """The id vLLM 0.32's engine knows a prompt of a request by, and `/abort_requests` names:
    `chatcmpl-<X-Request-Id>` (one prompt), `cmpl-<X-Request-Id>-<i>` for a completion's i-th
    prompt; the `n` samples of a prompt share it."""
    return f"chatcmpl-{request_id}" if chat else f"cmpl-{request_id}-{prompt_index}"


def _plan(
    engine: Engine, params: GenerationParams, adapter: Adapter | None, request_id: str
) -> tuple[list[SampleJob], list[ChoiceState]]:
    config = engine.config
    # Tokens depend on the adapter *name* (and prompt, seed, index), so every replica that
    # serves the same name generates the same samples.
    adapter_key = adapter.name if adapter else config.model
    extra = engine.extra_keys(adapter)
    jobs: list[SampleJob] = []
    choices: list[ChoiceState] = []
    seed = params.seed if params.seed is not None else engine.draw_seed()
    for p_index, prompt in enumerate(params.prompts):
        external_id = external_request_id(request_id, params.chat, p_index)
        hashes = block_hashes(prompt, config.block_size, extra)
        max_tokens = completions.effective_max_tokens(params, prompt, config.max_model_len)
        for s_index in range(params.n):
            sample = tokens.generate(
                adapter_key,
                prompt,
                seed=seed,
                index=s_index,
                max_tokens=max_tokens,
                top_logprobs=params.logprobs or 0,
                greedy=params.greedy,
                ignore_eos=params.ignore_eos,
                mean_output_tokens=config.mean_output_tokens,
            )
            jobs.append(engine.new_job(external_id, adapter, prompt, hashes, sample))
            choices.append(ChoiceState(index=p_index * params.n + s_index, prompt=prompt))
    return jobs, choices


# Events on the queue between the engine sequences and the single writer.
_Event = tuple[str, int, Any]


def _start(
    engine: Engine, jobs: list[SampleJob]
) -> tuple[asyncio.Queue[_Event], list[asyncio.Task[None]]]:
    queue: asyncio.Queue[_Event] = asyncio.Queue()

    async def drive(number: int, job: SampleJob) -> None:
        async def emit(chunk: list[tokens.SampledToken]) -> None:
            queue.put_nowait(("tokens", number, chunk))

        try:
            reason = await engine.run(job, emit)
            queue.put_nowait(("end", number, reason))
        except EngineDead as exc:
            queue.put_nowait(("dead", number, str(exc)))

    tasks = [asyncio.create_task(drive(i, job)) for i, job in enumerate(jobs)]
    return queue, tasks


async def _stop(tasks: list[asyncio.Task[None]]) -> None:
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


def _usage(
    jobs: list[SampleJob], params: GenerationParams, config: EmulatorConfig
) -> dict[str, Any]:
    prompt_tokens = sum(len(p) for p in params.prompts)
    completion_tokens = sum(job.emitted for job in jobs)
    # The first sample of each prompt reports the prompt's cached tokens, as vLLM does; only
    # with `details` (--enable-prompt-tokens-details), as vLLM does.
    details = config.prompt_tokens_details
    cached = sum(job.cached_tokens for job in jobs[:: params.n]) if details else None
    return completions.usage(prompt_tokens, completion_tokens, cached, omit=config.since("0.34"))


async def _whole(
    engine: Engine,
    params: GenerationParams,
    renderer: Renderer,
    jobs: list[SampleJob],
    choices: list[ChoiceState],
) -> web.StreamResponse:
    try:
        await engine.enter()
    except GenerationPaused:
        return to_response(error_reply(PAUSED_MESSAGE, "ServiceUnavailableError", 503))
    except EngineDead:
        return to_response(engine_dead())
    queue, tasks = _start(engine, jobs)
    try:
        pending = len(jobs)
        while pending:
            kind, number, value = await queue.get()
            choice = choices[number]
            if kind == "tokens":
                choice.token_ids += [t.token_id for t in value]
                choice.logprob_tokens += value
            elif kind == "end":
                choice.finish_reason = value
                pending -= 1
            else:
                return to_response(engine_dead())
    finally:
        await _stop(tasks)
    return to_response(json_reply(renderer.whole(choices, _usage(jobs, params, engine.config))))


class _SseWriter:
    """Writes frames, counts them for the crash fault, and sends keep-alive comments."""

    __slots__ = ("_crash_after", "_frames", "_request", "_response")

    def __init__(self, request: web.Request, response: web.StreamResponse, crash_after: int | None):
        self._request = request
        self._response = response
        self._crash_after = crash_after
        self._frames = 0

    async def frame(self, payload: bytes) -> None:
        if self._crash_after is not None and self._frames >= self._crash_after:
            _cut(self._request)
            raise _ConnectionCut
        await self._response.write(payload)
        self._frames += 1

    async def comment(self) -> None:
        await self._response.write(SSE_KEEPALIVE)


def _cut(request: web.Request) -> None:
    transport = request.transport
    if transport is not None:
        # close(), not abort(): frames already written still reach the client, then EOF
        # arrives in the middle of the chunked body, as when a replica process dies.
        transport.close()


async def _stream(
    replica: Replica,
    request: web.Request,
    params: GenerationParams,
    renderer: Renderer,
    jobs: list[SampleJob],
    choices: list[ChoiceState],
) -> web.StreamResponse:
    engine = replica.state
    response = web.StreamResponse(status=200, headers={"Content-Type": SSE})
    response.enable_chunked_encoding()
    await response.prepare(request)
    writer = _SseWriter(request, response, replica.faults.crash_after_frames)
    keepalive = replica.config.keepalive_interval
    tasks: list[asyncio.Task[None]] = []
    try:
        entered = asyncio.ensure_future(engine.enter())
        try:
            while True:
                done, _ = await asyncio.wait({entered}, timeout=keepalive)
                if done:
                    break
                await writer.comment()
            entered.result()
        finally:
            if not entered.done():
                entered.cancel()
        if params.chat:
            for choice in choices:
                await writer.frame(sse_frame(renderer.role_chunk(choice.index)))
        queue, tasks = _start(engine, jobs)
        started = [False] * len(choices)
        pending = len(jobs)
        while pending:
            try:
                async with asyncio.timeout(keepalive):
                    kind, number, value = await queue.get()
            except TimeoutError:
                await writer.comment()
                continue
            choice, job = choices[number], jobs[number]
            if kind == "tokens":
                for offset, sampled in enumerate(value):
                    position = job.emitted - len(value) + offset + 1
                    last = position == len(job.sample.tokens)
                    finish = job.sample.finish_reason if last else None
                    chunk = renderer.token_chunk(choice, [sampled], finish, not started[number])
                    started[number] = True
                    if params.continuous_usage:
                        chunk["usage"] = _usage(jobs, params, engine.config)
                    await writer.frame(sse_frame(chunk))
            elif kind == "end":
                pending -= 1
                if value == "abort":
                    chunk = renderer.token_chunk(choice, [], "abort", not started[number])
                    started[number] = True
                    await writer.frame(sse_frame(chunk))
            else:
                await writer.frame(sse_error_frame(DEAD_MESSAGE, "InternalServerError", 500))
                break
        if params.include_usage:
            await writer.frame(sse_frame(renderer.usage_chunk(_usage(jobs, params, engine.config))))
        await writer.frame(SSE_DONE)
    except GenerationPaused:
        await writer.frame(sse_error_frame(PAUSED_MESSAGE, "ServiceUnavailableError", 503))
        await writer.frame(SSE_DONE)
    except EngineDead:
        await writer.frame(sse_error_frame(DEAD_MESSAGE, "InternalServerError", 500))
        await writer.frame(SSE_DONE)
    except _ConnectionCut:
        return response  # aiohttp's write_eof meets the closed transport and gives up
    except ConnectionError:
        engine.note_cancelled()  # the client went away mid-stream
        return response
    finally:
        await _stop(tasks)
    await response.write_eof()
    return response
