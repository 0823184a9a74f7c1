"""Every route of a replica except generation: adapters, dev mode, info, metrics, admin.

The handlers take a `PlainRequest` and return a `Reply`, so the aiohttp server (`app.py`) and
the fast protocol (`fast.py`) answer these routes with the same bytes. Which routes exist
depends on the configuration as it does in vLLM: without `VLLM_ALLOW_RUNTIME_LORA_UPDATING`
the adapter routes are FastAPI 404s (which TRL misreads), without `VLLM_SERVER_DEV_MODE` so are
/pause, /resume, /is_paused, /reset_prefix_cache, /server_info, /sleep ...

`/emulator/*` is the emulator's own admin surface (faults, state, restart) for tests that run
the emulator out of process. It is not behind `--api-key`, like vLLM's dev-mode routes.
"""

from __future__ import annotations

import asyncio
import platform
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import orjson

from lora_router.emulator import completions, metrics, tokens
from lora_router.emulator.adapter_files import AdapterInvalid, AdapterNotFound, read_adapter
from lora_router.emulator.config import EmulatorConfig
from lora_router.emulator.engine import PAUSE_MODES, Engine
from lora_router.emulator.faults import Faults
from lora_router.emulator.replies import (
    METHOD_NOT_ALLOWED,
    ROUTE_NOT_FOUND,
    UNAUTHORIZED,
    Reply,
    bad_request,
    empty,
    error_reply,
    flat_error,
    is_json_media_type,
    json_decode_error,
    json_reply,
    missing,
    missing_field,
    not_of_type,
    unsupported_media_type,
    untyped_text,
    validation_error,
    wrong_type,
)


class Replica(Protocol):
    """What the handlers need from a running emulator."""

    config: EmulatorConfig
    faults: Faults

    @property
    def state(self) -> Engine: ...

    async def restart(self) -> None: ...

    def kv_event_sources(self) -> dict[str, Any]: ...


@dataclass(slots=True)
class PlainRequest:
    """A request as both servers hand it over: header names lower-cased."""

    method: str
    path: str  # without the query string
    query: Mapping[str, str]
    headers: Mapping[str, str]
    body: bytes


@dataclass(slots=True)
class RecordedRequest:
    """A request exactly as the replica received it, kept in `Emulator.requests` for tests."""

    method: str
    path: str  # with the query string, as sent
    headers: Mapping[str, str]
    body: bytes


@dataclass(slots=True)
class ControlReply:
    """A reply plus an optional action to run once it has been sent (e.g. a restart)."""

    reply: Reply
    after: Callable[[], Coroutine[Any, Any, None]] | None = field(default=None)


Handler = Callable[[Replica, PlainRequest], Awaitable[Reply | ControlReply]]


def unauthorized(config: EmulatorConfig, path: str, headers: Mapping[str, str]) -> Reply | None:
    """vLLM's `--api-key` guard: only /v1/* and /inference/* need `Authorization: Bearer
    <key>`."""
    if config.api_key is None or not path.startswith(("/v1", "/inference")):
        return None
    if headers.get("authorization") == f"Bearer {config.api_key}":
        return None
    return UNAUTHORIZED


def is_dead(replica: Replica) -> bool:
    return replica.faults.dead or replica.state.crashed is not None


def _json_body(req: PlainRequest) -> Any | Reply:
    """The JSON body of a POST that vLLM guards with `validate_json_request`."""
    if not is_json_media_type(req.headers.get("content-type")):
        return unsupported_media_type()
    try:
        return orjson.loads(req.body) if req.body else None
    except orjson.JSONDecodeError as exc:
        return json_decode_error(exc)


# --- health and info ---------------------------------------------------------------------


async def health(replica: Replica, req: PlainRequest) -> Reply:
    # Still 200 while paused: a paused engine is alive.
    return empty(503 if is_dead(replica) else 200)


async def version(replica: Replica, req: PlainRequest) -> Reply:
    return json_reply({"version": replica.config.release})


async def models(replica: Replica, req: PlainRequest) -> Reply:
    config = replica.config
    now = int(time.time())
    cards = [_model_card(config.model, config.model, None, config.max_model_len, now)]
    adapters = () if replica.faults.listing_hides_adapters() else replica.state.registry.all()
    for adapter in adapters:
        cards.append(_model_card(adapter.name, adapter.path, config.model, None, now))
    return json_reply({"object": "list", "data": cards})


def _model_card(
    name: str, root: str, parent: str | None, max_model_len: int | None, now: int
) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": now,
        "owned_by": "vllm",
        "root": root,
        "parent": parent,
        "max_model_len": max_model_len,
        "permission": [
            {
                "id": f"modelperm-{uuid.uuid4().hex}",
                "object": "model_permission",
                "created": now,
                "allow_create_engine": False,
                "allow_sampling": True,
                "allow_logprobs": True,
                "allow_search_indices": False,
                "allow_view": True,
                "allow_fine_tuning": False,
                "organization": "*",
                "group": None,
                "is_blocking": False,
            }
        ],
    }


async def server_info(replica: Replica, req: PlainRequest) -> Reply:
    config = replica.config
    lora = (
        {
            "max_lora_rank": config.max_lora_rank,
            "max_loras": config.max_loras,
            "max_cpu_loras": config.cpu_loras,
            "lora_dtype": "auto",
            "fully_sharded_loras": False,
            "default_mm_loras": None,
        }
        if config.enable_lora
        else None
    )
    vllm_config = {
        "model_config": {
            "model": config.model,
            "served_model_name": config.model,
            "max_model_len": config.max_model_len,
            "dtype": "torch.bfloat16",
        },
        "cache_config": {
            "block_size": config.block_size,
            "enable_prefix_caching": True,
            "num_gpu_blocks": config.cache_blocks,
        },
        "parallel_config": {
            "data_parallel_size": 1,
            "tensor_parallel_size": 1,
            "pipeline_parallel_size": 1,
        },
        "scheduler_config": {"max_num_seqs": config.max_num_seqs},
        "lora_config": lora,
    }
    env = {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": config.runtime_lora_updating,
        "VLLM_SERVER_DEV_MODE": config.dev_mode,
    }
    system = {"python_version": platform.python_version(), "emulated": True}
    if req.query.get("config_format") != "json":
        # The default text form is vLLM's `str(vllm_config)`, which omits the LoRA config.
        text = (
            f"model={config.model!r}, max_seq_len={config.max_model_len}, "
            f"block_size={config.block_size}, enable_prefix_caching=True, "
            "tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1"
        )
        return json_reply({"vllm_config": text, "vllm_env": env, "system_env": system})
    return json_reply({"vllm_config": vllm_config, "vllm_env": env, "system_env": system})


async def prometheus(replica: Replica, req: PlainRequest) -> Reply:
    return Reply(status=200, body=metrics.render(replica.state), content_type=metrics.CONTENT_TYPE)


async def load(replica: Replica, req: PlainRequest) -> Reply:
    engine = replica.state
    return json_reply({"server_load": engine.num_running + engine.num_waiting})


async def tokenize(replica: Replica, req: PlainRequest) -> Reply:
    body = _json_body(req)
    if isinstance(body, Reply):
        return body
    if not isinstance(body, dict):
        return wrong_type("body", "request", "dictionary", body)
    if "messages" in body:
        chat = completions.chat_prompt(body)
        if isinstance(chat, Reply):
            return chat
        ids = chat[0]
    elif isinstance(body.get("prompt"), str):
        ids = tokens.tokenize(body["prompt"])
    elif "prompt" in body:
        return wrong_type("body", "prompt", "string", body["prompt"])
    else:
        return missing_field("body", "prompt", body)
    strs = [tokens.token_text(t) for t in ids] if body.get("return_token_strs") else None
    return json_reply(
        {
            "count": len(ids),
            "max_model_len": replica.config.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }
    )


async def detokenize(replica: Replica, req: PlainRequest) -> Reply:
    body = _json_body(req)
    if isinstance(body, Reply):
        return body
    if not isinstance(body, dict) or "tokens" not in body:
        return missing_field("body", "tokens", body)
    ids = body["tokens"]
    if not isinstance(ids, list) or not all(completions.is_token_id(t) for t in ids):
        return wrong_type("body", "tokens", "list", ids)
    if any(not 0 <= t < tokens.VOCAB_SIZE for t in ids):
        return bad_request("Token id out of vocabulary.", "tokens")
    return json_reply({"prompt": tokens.detokenize(ids)})


# --- adapters ----------------------------------------------------------------------------


async def load_lora_adapter(replica: Replica, req: PlainRequest) -> Reply:
    body = _json_body(req)
    if isinstance(body, Reply):
        return body
    if not isinstance(body, dict):
        return wrong_type("body", "request", "dictionary", body)
    # Pydantic reports every bad field at once, in field order.
    errors = [
        missing("body", key, body)
        if key not in body
        else not_of_type("body", key, "string", body[key])
        for key in ("lora_name", "lora_path")
        if not isinstance(body.get(key), str)
    ]
    if errors:
        return validation_error(errors)
    name, path = body["lora_name"], body["lora_path"]
    inplace = body.get("load_inplace", False)
    if not isinstance(inplace, bool):
        return wrong_type("body", "load_inplace", "boolean", inplace)
    if not name or not path:
        return error_reply(
            "Both 'lora_name' and 'lora_path' must be provided.", "InvalidUserInput", 400
        )
    engine = replica.state
    lock = engine.load_locks.setdefault(name, asyncio.Lock())
    # Loads of different names run concurrently; one name is loaded once at a time.
    async with lock:
        if name in engine.registry and not inplace:
            if replica.faults.hide_adapters:
                # Behind a balancer a load can reach a server that lacks the name: accepted.
                return untyped_text(f"Success: LoRA adapter '{name}' added successfully.")
            return error_reply(
                f"The lora adapter '{name}' has already been loaded. If you want to load the "
                "adapter in place, set 'load_inplace' to True.",
                "InvalidUserInput",
                400,
            )
        faults = replica.faults
        if faults.load_delay_s > 0:
            await asyncio.sleep(faults.load_delay_s)
        if faults.mount_lagging(path):
            return _adapter_not_found(name, path)
        if faults.load_fails():
            return _add_lora_failed("injected load failure")
        try:
            spec = read_adapter(path)
        except AdapterNotFound:
            return _adapter_not_found(name, path)
        except AdapterInvalid as exc:
            return _add_lora_failed(str(exc))
        max_rank = replica.config.max_lora_rank
        if spec.rank > max_rank:
            return _add_lora_failed(
                f"LoRA rank {spec.rank} is greater than max_lora_rank {max_rank}."
            )
        engine.register(name, path, spec, inplace)
    return untyped_text(f"Success: LoRA adapter '{name}' added successfully.")


def _adapter_not_found(name: str, path: str) -> Reply:
    return error_reply(
        f"Loading lora {name} failed: No adapter found for {path}", "NotFoundError", 404
    )


def _add_lora_failed(reason: str) -> Reply:
    return error_reply(f"Call to add_lora method failed: {reason}", "InternalServerError", 500)


async def unload_lora_adapter(replica: Replica, req: PlainRequest) -> Reply:
    body = _json_body(req)
    if isinstance(body, Reply):
        return body
    if not isinstance(body, dict):
        return wrong_type("body", "request", "dictionary", body)
    if "lora_name" not in body:
        return missing_field("body", "lora_name", body)
    name = body["lora_name"]
    if not isinstance(name, str):
        return wrong_type("body", "lora_name", "string", name)
    if not name and not body.get("lora_int_id"):
        return error_reply(
            "either 'lora_name' or 'lora_int_id' needs to be provided.", "InvalidUserInput", 400
        )
    if replica.state.unregister(name) is None:
        return error_reply(f"The lora adapter '{name}' cannot be found.", "NotFoundError", 404)
    return untyped_text(f"Success: LoRA adapter '{name}' removed successfully.")


# --- dev mode ----------------------------------------------------------------------------

_TRUE = {"true", "1", "yes", "on", "t", "y"}
_FALSE = {"false", "0", "no", "off", "f", "n"}


def _query_bool(req: PlainRequest, key: str, default: bool) -> bool | Reply:
    raw = req.query.get(key)
    if raw is None:
        return default
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    return validation_error(
        [
            {
                "type": "bool_parsing",
                "loc": ("query", key),
                "msg": "Input should be a valid boolean, unable to interpret input",
                "input": raw,
            }
        ]
    )


async def pause(replica: Replica, req: PlainRequest) -> Reply:
    mode = req.query.get("mode", "abort")
    if mode not in PAUSE_MODES:
        return validation_error(
            [
                {
                    "type": "literal_error",
                    "loc": ("query", "mode"),
                    "msg": "Input should be 'abort', 'wait' or 'keep'",
                    "input": mode,
                    "ctx": {"expected": "'abort', 'wait' or 'keep'"},
                }
            ]
        )
    clear_cache = _query_bool(req, "clear_cache", True)
    if isinstance(clear_cache, Reply):
        return clear_cache
    wait = _query_bool(req, "wait_for_inflight_requests", False)
    if isinstance(wait, Reply):
        return wait
    if wait and "mode" not in req.query:
        mode = "wait"  # the deprecated spelling of mode=wait
    await replica.state.pause(mode, clear_cache)  # `mode` was checked above
    return json_reply({"status": "paused"})


async def resume(replica: Replica, req: PlainRequest) -> Reply:
    replica.state.resume()
    return json_reply({"status": "resumed"})


async def abort_requests(replica: Replica, req: PlainRequest) -> Reply:
    """vLLM 0.32's RLHF dev route: `request_ids` (external ids, serving.py) aborts those, an
    empty or missing one every request in flight; 200 `{"status": "aborted", "aborted": N}`,
    N the ids given, or the requests aborted. No content-type check (it reads the body as
    JSON itself); a body that is not JSON or not an object is a 400, an id list vLLM cannot
    iterate a 500 in the dev routes' flat shape."""
    try:
        doc = orjson.loads(req.body)
    except orjson.JSONDecodeError:
        return error_reply("Invalid JSON format", "Bad Request", 400)
    if not isinstance(doc, dict):
        return error_reply("Request body must be a JSON object", "Bad Request", 400)
    ids = doc.get("request_ids")
    if not ids:
        return json_reply({"status": "aborted", "aborted": replica.state.abort(None)})
    if isinstance(ids, str):
        ids = [ids]
    if not isinstance(ids, list | dict):
        return flat_error(
            f"Failed to abort requests: '{type(ids).__name__}' object is not iterable", 500
        )
    named = [i for i in ids if isinstance(i, str)]
    replica.state.abort(named)
    return json_reply({"status": "aborted", "aborted": len(ids)})


async def scale_out_abort_requests(replica: Replica, req: PlainRequest) -> Reply:
    """vLLM 0.32's `/inference/v1/abort_requests` with `--enable-scale-out` (behind
    `--api-key`): `request_ids` required (400 without), aborts those, 200 with an empty body.
    Without the flag vLLM registers it as a 403 (`scale_out_disabled`)."""
    try:
        doc = orjson.loads(req.body)
    except orjson.JSONDecodeError as exc:
        return error_reply(f"JSON decode error: {exc}", "Bad Request", 400)
    if not isinstance(doc, dict):
        message = f"'{type(doc).__name__}' object has no attribute 'get'"
        return error_reply(message, "InternalServerError", 500)
    ids = doc.get("request_ids")
    if ids is None:
        return error_reply("Missing 'request_ids' in request body", "Bad Request", 400)
    ids = [ids] if isinstance(ids, str) else ids
    if isinstance(ids, list):
        replica.state.abort([i for i in ids if isinstance(i, str)])
    return empty(200)


async def scale_out_disabled(replica: Replica, req: PlainRequest) -> Reply:
    message = (
        "Scale-out endpoints are disabled. Restart vllm serve with --enable-scale-out to "
        "enable them."
    )
    return error_reply(message, "PermissionDeniedError", 403)


async def get_world_size(replica: Replica, req: PlainRequest) -> Reply:
    # TP * PP (* DP): one process each here. TRL's weight-transfer client reads it.
    return json_reply({"world_size": 1})


async def is_paused(replica: Replica, req: PlainRequest) -> Reply:
    return json_reply({"is_paused": replica.state.paused})


async def reset_prefix_cache(replica: Replica, req: PlainRequest) -> Reply:
    return json_reply({"success": replica.state.reset_prefix_cache()})


async def is_sleeping(replica: Replica, req: PlainRequest) -> Reply:
    return json_reply({"is_sleeping": replica.state.sleeping})


async def sleep(replica: Replica, req: PlainRequest) -> Reply:
    replica.state.sleeping = True
    return empty(200)


async def wake_up(replica: Replica, req: PlainRequest) -> Reply:
    replica.state.sleeping = False
    return empty(200)


# --- emulator admin ----------------------------------------------------------------------


async def get_faults(replica: Replica, req: PlainRequest) -> Reply:
    return json_reply(replica.faults.snapshot())


async def set_faults(replica: Replica, req: PlainRequest) -> Reply:
    try:
        changes = orjson.loads(req.body) if req.body else {}
    except orjson.JSONDecodeError as exc:
        return flat_error(f"body must be a JSON object of fault switches: {exc}", 400)
    if not isinstance(changes, dict):
        return flat_error("body must be a JSON object of fault switches", 400)
    try:
        replica.faults.update(changes)
    except (ValueError, TypeError) as exc:
        return flat_error(str(exc), 400)
    return json_reply(replica.faults.snapshot())


async def get_state(replica: Replica, req: PlainRequest) -> Reply:
    engine = replica.state
    counters = engine.counters
    return json_reply(
        {
            "adapters": engine.adapters,
            "paused": engine.paused,
            "pause_mode": engine.pause_mode,
            "dead": is_dead(replica),
            "crashed": engine.crashed,
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            "cache_blocks": len(engine.cache),
            "cache_queries": engine.cache.queries,
            "cache_hits": engine.cache.hits,
            "adapter_disk_reads": engine.slots.disk_reads,
            "adapter_evictions": engine.slots.evictions,
            "finished": counters.finished,
            "aborted": counters.aborted,
            "cancelled": counters.cancelled,
            "rejected_paused": counters.rejected_paused,
        }
    )


async def kv_event_sources(replica: Replica, req: PlainRequest) -> Reply:
    return json_reply(replica.kv_event_sources())


async def restart(replica: Replica, req: PlainRequest) -> ControlReply:
    # The answer goes out first; then the replica restarts and forgets its adapters.
    return ControlReply(json_reply({"status": "restarting"}), after=replica.restart)


def routes(config: EmulatorConfig) -> dict[str, dict[str, Handler]]:
    """Path -> method -> handler, for the routes this configuration serves."""
    table: dict[str, dict[str, Handler]] = {
        "/health": {"GET": health},
        "/ping": {"GET": health, "POST": health},
        "/version": {"GET": version},
        "/v1/models": {"GET": models},
        "/metrics": {"GET": prometheus},
        "/load": {"GET": load},
        "/tokenize": {"POST": tokenize},
        "/detokenize": {"POST": detokenize},
        "/emulator/faults": {"GET": get_faults, "POST": set_faults},
        "/emulator/state": {"GET": get_state},
        "/emulator/restart": {"POST": restart},
    }
    if config.since("0.32"):
        table["/kv_event_sources"] = {"GET": kv_event_sources}
        scale_out = scale_out_abort_requests if config.enable_scale_out else scale_out_disabled
        table["/inference/v1/abort_requests"] = {"POST": scale_out}
    if config.enable_lora and config.runtime_lora_updating:
        table["/v1/load_lora_adapter"] = {"POST": load_lora_adapter}
        table["/v1/unload_lora_adapter"] = {"POST": unload_lora_adapter}
    if config.dev_mode:
        table["/pause"] = {"POST": pause}
        table["/resume"] = {"POST": resume}
        table["/is_paused"] = {"GET": is_paused}
        table["/get_world_size"] = {"GET": get_world_size}
        table["/reset_prefix_cache"] = {"POST": reset_prefix_cache}
        table["/server_info"] = {"GET": server_info}
        table["/is_sleeping"] = {"GET": is_sleeping}
        table["/sleep"] = {"POST": sleep}
        table["/wake_up"] = {"POST": wake_up}
        if config.since("0.32"):
            table["/abort_requests"] = {"POST": abort_requests}
    return table


def lookup(table: Mapping[str, Mapping[str, Handler]], method: str, path: str) -> Handler | Reply:
    """The handler for a request, or FastAPI's 404/405 answer."""
    methods = table.get(path)
    if methods is None:
        return ROUTE_NOT_FOUND
    handler = methods.get(method)
    if handler is None:
        return METHOD_NOT_ALLOWED
    return handler
