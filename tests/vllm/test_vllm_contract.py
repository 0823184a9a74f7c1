"""The emulator against real vLLM: the same requests, the same answers where the router reads.

Each probe goes to a real vLLM 0.32 replica and to `lora-router-emulator` configured like it
(same model name, `--api-key`, block size 128, rank 1, 3 slots). What is compared is what a
client or the router can depend on: status, Content-Type, the error's `type`, `param` and
message (volatile parts masked), response keys, SSE framing, `/v1/models` cards and the
`/server_info` fields the router reads. Generated text and ids differ by design (the emulator
has no model). The response keys the emulator does not reproduce are listed, each with why,
in `KEY_DIFFERENCES`; a key that appears or goes on either side fails the test.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lora_router.testbed.tiny_model import adapter_dir
from lora_router.testbed.vllm_harness import BIN, TOKEN, Answer, Replica, free_port, http, wait_for

FRAME = re.compile(rb"data: (\{[^\n]*\}|\[DONE\])\n\n")


@dataclass(slots=True)
class Server:
    url: str

    def call(self, method: str, path: str, body: Any = None, **kw: Any) -> Answer:
        kw.setdefault("token", TOKEN)
        return http(method, self.url + path, body, **kw)


@pytest.fixture(scope="module")
def emulator(base: str, logs: Path) -> Iterator[Server]:
    port = free_port()
    log = logs / "emulator.log"
    command = [
        str(BIN / "lora-router-emulator"),
        "--port",
        str(port),
        "--api-key",
        TOKEN,
        "--model",
        base,
        "--max-model-len",
        "4096",
        "--block-size",
        "128",
        "--max-lora-rank",
        "1",
        "--max-loras",
        "3",
    ]
    with log.open("ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    server = Server(f"http://127.0.0.1:{port}")
    try:
        wait_for(
            "emulator /health",
            lambda: server.call("GET", "/health").status == 200,
            30,
            [log],
            lambda: None if process.poll() is None else "emulator exited",
        )
        yield server
    finally:
        process.terminate()
        process.wait(timeout=10)


@pytest.fixture
def both(fleet: list[Replica], emulator: Server) -> Iterator[list[Server]]:
    """[real vLLM, emulator]; adapters loaded by a probe are unloaded afterwards."""
    servers = [Server(fleet[0].url), emulator]
    yield servers
    for server in servers:
        cards = server.call("GET", "/v1/models").json()["data"]
        for card in cards[1:]:
            server.call("POST", "/v1/unload_lora_adapter", {"lora_name": card["id"]})
        server.call("POST", "/resume")


def masked(text: str) -> str:
    """A message with what legitimately varies masked: ids, numbers in parser messages."""
    text = re.sub(r"'ctx': \{'error': [^}]*\}", "'ctx': {'error': ...}", text)
    return text


def error_shape(answer: Answer) -> dict[str, Any]:
    body = answer.json()
    error = body.get("error")
    if not isinstance(error, dict):
        return {"status": answer.status, "body": body}
    return {
        "status": answer.status,
        "content-type": answer.headers.get("content-type"),
        "keys": sorted(error),
        "type": error["type"],
        "param": error["param"],
        "code": error["code"],
        "message": masked(error["message"]),
    }


# Response keys ("path:type") real vLLM 0.32 sends and the emulator does not, and the reverse.
# None of them is read by TRL, the router or the openai SDK. Both report
# `prompt_tokens_details.cached_tokens` (the tier's replicas run with
# --enable-prompt-tokens-details; the emulator always does: the demo and the benches read their
# hit rates from it); a real server adds two fields beside it (chat counts the tokens it
# cached; completions leave that null).
_USAGE_REAL = {
    "usage.completion_tokens_details:None",
    "usage.prompt_tokens_details.multimodal_tokens:None",
}
_USAGE_EMULATED: set[str] = set()
_NEW_FIELDS = {"ec_transfer_params:None", "metrics:None", "choices[].routed_experts:None"}
KEY_DIFFERENCES = {
    "completion": (
        _NEW_FIELDS
        | _USAGE_REAL
        | {"system_fingerprint:str", "usage.prompt_tokens_details.created_cache_tokens:None"},
        _USAGE_EMULATED | {"system_fingerprint:None"},
    ),
    # Every chunk of a 0.32 stream carries token_ids/prompt_token_ids, null unless asked for.
    "stream chunk": ({"choices[].prompt_token_ids:None", "choices[].token_ids:None"}, set()),
    "chat": (
        _NEW_FIELDS
        | _USAGE_REAL
        | {
            "system_fingerprint:str",
            "usage.prompt_tokens_details.created_cache_tokens:int",
            "choices[].message.reasoning:None",  # 0.33's name per the contract: reasoning_content
            "choices[].token_ids:None",
            "prompt_text:None",
            "prompt_token_ids:None",
        },
        _USAGE_EMULATED
        | {
            "system_fingerprint:None",
            "choices[].message.reasoning_content:None",
            "choices[].message.tool_calls[]",  # 0.32 leaves the key out when there are none
        },
    ),
}


def flat(value: Any, path: str = "") -> set[str]:
    """Every leaf of a JSON value as "dotted.path:type"; lists by their first element, the
    token-keyed `top_logprobs` maps as `*`."""
    if isinstance(value, dict):
        out: set[str] = set()
        for key, item in value.items():
            name = "*" if path.endswith("top_logprobs[]") else key
            out |= flat(item, f"{path}.{name}" if path else name)
        return out
    if isinstance(value, list):
        return flat(value[0], path + "[]") if value else {path + "[]"}
    return {f"{path}:{type(value).__name__ if value is not None else None}"}


def same_keys(kind: str, probe: Callable[[Server], Any], servers: list[Server]) -> None:
    """The key paths of both answers agree up to the documented differences of `kind`."""
    real, emulated = (flat(probe(s)) for s in servers)
    only_real, only_emulated = KEY_DIFFERENCES[kind]
    assert (real - emulated, emulated - real) == (only_real, only_emulated)


def keys(value: Any) -> Any:
    """The key structure of a JSON value: dicts by their keys (recursively), lists by their
    first element."""
    if isinstance(value, dict):
        return {k: keys(v) for k, v in sorted(value.items())}
    if isinstance(value, list):
        return [keys(value[0])] if value else []
    return type(value).__name__ if value is not None else None


def same(probe: Callable[[Server], Any], servers: list[Server]) -> None:
    real, emulated = (probe(s) for s in servers)
    assert emulated == real, f"emulator: {emulated!r}\nreal vLLM: {real!r}"


def test_health_is_an_empty_200(both: list[Server]) -> None:
    same(lambda s: (lambda a: (a.status, a.body))(s.call("GET", "/health", token=None)), both)


def test_requests_without_the_token_are_refused_alike(both: list[Server]) -> None:
    def probe(s: Server) -> Any:
        a = s.call("GET", "/v1/models", token=None)
        return a.status, a.headers.get("content-type"), a.body

    same(probe, both)


def test_models_lists_the_base_then_adapters_in_the_same_card_shape(
    both: list[Server], model: Path, base: str
) -> None:
    path = str(adapter_dir(model, 0))

    def probe(s: Server) -> Any:
        loaded = s.call("POST", "/v1/load_lora_adapter", {"lora_name": "a0", "lora_path": path})
        assert loaded.status == 200, loaded.text
        cards = s.call("GET", "/v1/models").json()["data"]
        fields = ("id", "object", "owned_by", "root", "parent", "max_model_len")
        return [{f: c[f] for f in fields} for c in cards], keys(cards)

    same(probe, both)


def test_server_info_has_every_field_its_readers_use(both: list[Server]) -> None:
    def probe(s: Server) -> Any:
        info = s.call("GET", "/server_info?config_format=json", token=None).json()
        config = info["vllm_config"]
        lora = config["lora_config"]
        return (
            sorted(info),
            {k: lora[k] for k in ("max_lora_rank", "max_loras", "max_cpu_loras")},
            config["cache_config"]["block_size"],
            config["parallel_config"]["data_parallel_size"],
            config["model_config"]["max_model_len"],
            config["model_config"]["dtype"].startswith("torch."),
        )

    same(probe, both)


def test_get_world_size_answers_one(both: list[Server]) -> None:
    same(lambda s: (lambda a: (a.status, a.json()))(s.call("GET", "/get_world_size")), both)


def test_the_pause_cycle_answers_alike(both: list[Server]) -> None:
    def probe(s: Server) -> Any:
        return [
            (a.status, a.json())
            for a in (
                s.call("POST", "/pause?mode=keep", token=None),
                s.call("GET", "/is_paused", token=None),
                s.call("POST", "/resume", token=None),
                s.call("GET", "/is_paused", token=None),
            )
        ]

    same(probe, both)


def test_the_load_unload_cycle_answers_alike_in_every_outcome(
    both: list[Server], model: Path
) -> None:
    path = str(adapter_dir(model, 1))

    def probe(s: Server) -> Any:
        body = {"lora_name": "a1", "lora_path": path, "load_inplace": False}
        ok = s.call("POST", "/v1/load_lora_adapter", body)
        again = s.call("POST", "/v1/load_lora_adapter", body)
        gone = s.call("POST", "/v1/unload_lora_adapter", {"lora_name": "a1"})
        unknown = s.call("POST", "/v1/unload_lora_adapter", {"lora_name": "a1"})
        return [
            (ok.status, ok.headers.get("content-type"), ok.text),
            error_shape(again),
            (gone.status, gone.headers.get("content-type"), gone.text),
            error_shape(unknown),
        ]

    same(probe, both)


@pytest.mark.parametrize(
    "path",
    ["/tmp/lora-router-no-such-adapter", "/srv/missing/trl-policy-v9", "/nonexistent/adapter"],
)
def test_load_of_a_missing_path_is_a_404_not_found(both: list[Server], path: str) -> None:
    def probe(s: Server) -> Any:
        return error_shape(
            s.call("POST", "/v1/load_lora_adapter", {"lora_name": "m", "lora_path": path})
        )

    same(probe, both)


@pytest.mark.parametrize(
    ("body", "content_type"),
    [
        (b"{}", "application/json"),
        (b'{"lora_name": "q"}', "application/json"),
        (b'{"lora_name": 5, "lora_path": "x"}', "application/json"),
        (b"{}", "text/plain"),
        (b"{x", "application/json"),
    ],
    ids=["empty", "no-path", "name-not-a-string", "not-json-media-type", "bad-json"],
)
def test_malformed_loads_are_400_bad_request_alike(
    both: list[Server], body: bytes, content_type: str
) -> None:
    def probe(s: Server) -> Any:
        answer = s.call(
            "POST", "/v1/load_lora_adapter", raw=body, headers={"Content-Type": content_type}
        )
        return error_shape(answer)

    same(probe, both)


def test_bad_pause_mode_is_400_bad_request_alike(both: list[Server]) -> None:
    same(lambda s: error_shape(s.call("POST", "/pause?mode=bogus", token=None)), both)


def test_completion_for_an_unknown_model_is_404_param_model(both: list[Server]) -> None:
    body = {"model": "trl-policy-v404", "prompt": [1, 2, 3], "max_tokens": 2}
    same(lambda s: error_shape(s.call("POST", "/v1/completions", body)), both)


def test_completion_asking_past_the_context_is_400(both: list[Server]) -> None:
    body = {"prompt": [5, 6], "max_tokens": 99999}
    same(lambda s: error_shape(s.call("POST", "/v1/completions", body)), both)


def test_an_unknown_route_is_fastapis_answer(both: list[Server]) -> None:
    def probe(s: Server) -> Any:
        a = s.call("GET", "/no/such/route")
        return a.status, a.body

    same(probe, both)


def test_a_wrong_method_is_fastapis_answer(both: list[Server]) -> None:
    def probe(s: Server) -> Any:
        b = s.call("GET", "/v1/load_lora_adapter")
        return b.status, b.body

    same(probe, both)


def test_trl_rollout_answer_has_the_same_keys(both: list[Server], base: str) -> None:
    """TRL's request; TRL reads choices[0].token_ids and choices[0].logprobs.token_logprobs."""
    body = {
        "model": base,
        "prompt": [5, 6, 7, 8],
        "max_tokens": 3,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "n": 1,
        "return_token_ids": True,
        "logprobs": 0,
        "seed": 1234567,
    }

    def probe(s: Server) -> Any:
        answer = s.call("POST", "/v1/completions", body)
        assert answer.status == 200, answer.text
        assert answer.headers.get("content-type") == "application/json"
        result = answer.json()
        choice = result["choices"][0]
        assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"]) == 3
        return result

    same_keys("completion", probe, both)


def sse_frames(answer: Answer) -> list[bytes]:
    """The data frames of an SSE body, insisting every byte belongs to one."""
    frames, position = [], 0
    while position < len(answer.body):
        match = FRAME.match(answer.body, position)
        assert match is not None, answer.body[position : position + 80]
        frames.append(match.group(1))
        position = match.end()
    return frames


STREAM = {"prompt": "hello", "max_tokens": 3, "stream": True, "seed": 5}


def test_a_stream_is_framed_alike_through_its_done(both: list[Server], base: str) -> None:
    def probe(s: Server) -> Any:
        answer = s.call("POST", "/v1/completions", {"model": base, **STREAM})
        frames = sse_frames(answer)
        chunks = [json.loads(f) for f in frames[:-1]]
        return (
            answer.status,
            answer.headers.get("content-type"),
            frames[-1],
            [c["choices"][0]["finish_reason"] for c in chunks][-1],
            all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1]),
        )

    same(probe, both)


def test_stream_chunks_have_the_same_keys(both: list[Server], base: str) -> None:
    def probe(s: Server) -> Any:
        return json.loads(
            sse_frames(s.call("POST", "/v1/completions", {"model": base, **STREAM}))[0]
        )

    same_keys("stream chunk", probe, both)


def test_chat_completion_answer_has_the_same_keys(both: list[Server], base: str) -> None:
    body = {"model": base, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}

    def probe(s: Server) -> Any:
        answer = s.call("POST", "/v1/chat/completions", body)
        assert answer.status == 200, answer.text
        return answer.json()

    same_keys("chat", probe, both)
