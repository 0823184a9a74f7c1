"""/v1/completions and /v1/chat/completions: prompts, sampling options and response shapes."""

from __future__ import annotations

import json
import math
from collections.abc import Callable

import aiohttp
from helpers import call, completed, load

from lora_router.emulator import Emulator, tokens

from .conftest import StartEmulator, frames_of

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


async def test_token_id_prompt_is_answered_with_a_logprob_per_token_id(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    body = await completed(
        client,
        emu.url,
        prompt=[151644, 8948, 198] * 10,
        max_tokens=12,
        return_token_ids=True,
        logprobs=0,
        seed=1234567,
    )
    choice = body["choices"][0]  # type: ignore[index]
    assert len(choice["token_ids"]) == len(choice["logprobs"]["token_logprobs"])
    assert all(lp <= 0 for lp in choice["logprobs"]["token_logprobs"])
    assert choice["prompt_token_ids"] == [151644, 8948, 198] * 10
    assert body["object"] == "text_completion"


async def test_text_prompt_is_tokenized_as_utf8_bytes(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    body = await completed(client, emu.url, prompt="héllo", max_tokens=1)
    assert body["usage"]["prompt_tokens"] == len("héllo".encode())  # type: ignore[index]


async def test_batched_prompts_get_one_choice_each_indexed_in_order(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    body = await completed(client, emu.url, prompt=[[1, 2, 3], [4, 5, 6, 7]], n=2, max_tokens=3)
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]  # type: ignore[union-attr]
    assert body["usage"]["prompt_tokens"] == 3 + 4  # type: ignore[index]


async def test_list_of_strings_is_a_batch(emu: Emulator, client: aiohttp.ClientSession) -> None:
    body = await completed(client, emu.url, prompt=["a", "bc"], max_tokens=2)
    assert len(body["choices"]) == 2  # type: ignore[arg-type]


async def test_samples_of_one_request_differ(emu: Emulator, client: aiohttp.ClientSession) -> None:
    body = await completed(client, emu.url, n=4, max_tokens=6, seed=5, return_token_ids=True)
    samples = [tuple(c["token_ids"]) for c in body["choices"]]  # type: ignore[union-attr]
    assert len(set(samples)) == 4


async def test_unseeded_sibling_requests_differ(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    a = await completed(client, emu.url, max_tokens=6, return_token_ids=True)
    b = await completed(client, emu.url, max_tokens=6, return_token_ids=True)
    assert a["choices"][0]["token_ids"] != b["choices"][0]["token_ids"]  # type: ignore[index]


async def test_a_seeded_request_is_reproducible_across_replicas(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    first, second = await start(), await start()
    a = await completed(client, first.url, seed=7, max_tokens=10, return_token_ids=True, logprobs=2)
    b = await completed(
        client, second.url, seed=7, max_tokens=10, return_token_ids=True, logprobs=2
    )
    assert a["choices"] == b["choices"]


async def test_the_seed_changes_the_tokens(emu: Emulator, client: aiohttp.ClientSession) -> None:
    a = await completed(client, emu.url, seed=1, max_tokens=6, return_token_ids=True)
    b = await completed(client, emu.url, seed=2, max_tokens=6, return_token_ids=True)
    assert a["choices"][0]["token_ids"] != b["choices"][0]["token_ids"]  # type: ignore[index]


async def test_the_adapter_changes_the_tokens(
    emu: Emulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    assert (await load(client, emu.url, "v1", adapter("v1")))[0] == 200
    base = await completed(client, emu.url, seed=1, max_tokens=6, return_token_ids=True)
    tuned = await completed(
        client, emu.url, model="v1", seed=1, max_tokens=6, return_token_ids=True
    )
    assert base["choices"][0]["token_ids"] != tuned["choices"][0]["token_ids"]  # type: ignore[index]


async def test_greedy_samples_are_identical(emu: Emulator, client: aiohttp.ClientSession) -> None:
    body = await completed(client, emu.url, n=3, temperature=0, max_tokens=5, return_token_ids=True)
    samples = {tuple(c["token_ids"]) for c in body["choices"]}  # type: ignore[union-attr]
    assert len(samples) == 1


async def test_max_tokens_reached_finishes_with_length(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    body = await completed(client, emu.url, max_tokens=1, ignore_eos=True, return_token_ids=True)
    choice = body["choices"][0]  # type: ignore[index]
    assert choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 1
    assert body["usage"]["completion_tokens"] == 1  # type: ignore[index]


async def test_eos_finishes_with_stop_outside_the_text(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    body = await completed(
        client, emu.url, max_tokens=3000, seed=3, return_token_ids=True, logprobs=0
    )
    choice = body["choices"][0]  # type: ignore[index]
    assert choice["finish_reason"] == "stop"
    assert choice["stop_reason"] is None
    assert choice["token_ids"][-1] == tokens.ENDOFTEXT
    assert choice["logprobs"]["tokens"][-1] == "<|endoftext|>"
    assert "<|endoftext|>" not in choice["text"]


async def test_logprobs_have_the_completions_api_shape(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    body = await completed(client, emu.url, max_tokens=5, logprobs=2, ignore_eos=True)
    choice = body["choices"][0]  # type: ignore[index]
    logprobs = choice["logprobs"]
    assert set(logprobs) == {"text_offset", "token_logprobs", "tokens", "top_logprobs"}
    assert "".join(logprobs["tokens"]) == choice["text"]
    offsets = [0]
    for token in logprobs["tokens"][:-1]:
        offsets.append(offsets[-1] + len(token))
    assert logprobs["text_offset"] == offsets
    for token, logprob, top in zip(
        logprobs["tokens"], logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True
    ):
        assert len(top) == 3  # the sampled token plus 2 alternatives
        assert top[token] == logprob
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-9


async def test_logprobs_zero_lists_only_the_sampled_token(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    body = await completed(client, emu.url, max_tokens=3, logprobs=0, ignore_eos=True)
    tops = body["choices"][0]["logprobs"]["top_logprobs"]  # type: ignore[index]
    assert all(len(top) == 1 for top in tops)


async def test_without_logprobs_the_field_is_null(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    body = await completed(client, emu.url, max_tokens=3)
    choice = body["choices"][0]  # type: ignore[index]
    assert choice["logprobs"] is None
    assert "token_ids" not in choice


async def test_a_repeated_prompt_reports_cached_tokens(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks of 16
    first = await completed(client, emu.url, prompt=prompt, max_tokens=2)
    second = await completed(client, emu.url, prompt=prompt, max_tokens=2)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}  # type: ignore[index]
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 48}  # type: ignore[index]


async def test_a_prompt_under_another_adapter_shares_no_cached_blocks(
    emu: Emulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    assert (await load(client, emu.url, "trl-policy-v3", adapter("v3")))[0] == 200
    assert (await load(client, emu.url, "trl-policy-v4", adapter("v4")))[0] == 200
    await completed(client, emu.url, model="trl-policy-v3", max_tokens=2)
    other = await completed(client, emu.url, model="trl-policy-v4", max_tokens=2)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # type: ignore[index]


async def test_the_response_echoes_the_adapter_name(
    emu: Emulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> None:
    assert (await load(client, emu.url, "trl-policy-v7", adapter("v7")))[0] == 200
    body = await completed(client, emu.url, model="trl-policy-v7")
    assert body["model"] == "trl-policy-v7"


async def test_without_model_the_base_model_answers(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    body = await completed(client, emu.url)
    assert body["model"] == "Qwen/Qwen2.5-Math-1.5B"


async def test_x_request_id_becomes_the_response_id(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    async with client.post(
        emu.url + COMPLETIONS,
        json={"prompt": [1, 2], "max_tokens": 1},
        headers={"X-Request-Id": "rollout-42"},
    ) as r:
        assert (await r.json())["id"] == "cmpl-rollout-42"


async def test_unknown_model_is_404_on_027(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(vllm_version="0.27")
    async with client.post(
        emu.url + COMPLETIONS, json={"model": "trl-policy-v9", "prompt": [1]}
    ) as r:
        assert r.status == 404
        body = await r.json()
    assert body == {
        "error": {
            "message": "The model `trl-policy-v9` does not exist.",
            "type": "NotFoundError",
            "param": "model",
            "code": 404,
        }
    }


async def test_unknown_model_on_032_appends_the_valid_aliases(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    async with client.post(emu.url + COMPLETIONS, json={"model": "nope", "prompt": [1]}) as r:
        assert r.status == 404
        message = (await r.json())["error"]["message"]
    assert message.startswith("The model `nope` does not exist. Valid aliases: ")


async def test_unknown_model_is_404_before_a_stream_starts(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    async with client.post(
        emu.url + COMPLETIONS, json={"model": "nope", "prompt": [1], "stream": True}
    ) as r:
        assert r.status == 404
        assert r.headers["Content-Type"] == "application/json"


async def test_prompt_plus_max_tokens_beyond_the_context_is_400_on_0_27(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(max_model_len=64, vllm_version="0.27")
    async with client.post(
        emu.url + COMPLETIONS, json={"prompt": list(range(40)), "max_tokens": 30}
    ) as r:
        assert r.status == 400
        body = await r.json()
    assert body["error"]["type"] == "BadRequestError"
    assert "maximum context length is 64 tokens" in body["error"]["message"]


async def test_prompt_plus_max_tokens_beyond_the_context_is_clamped_on_0_33(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(max_model_len=64)
    body = {"prompt": list(range(40)), "max_tokens": 30, "ignore_eos": True}
    async with client.post(emu.url + COMPLETIONS, json=body) as r:
        assert r.status == 200
        answer = await r.json()
    assert answer["usage"]["completion_tokens"] == 64 - 40


async def test_max_tokens_beyond_the_context_alone_is_400_naming_max_tokens(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    body = {"prompt": [1, 2], "max_tokens": 99999}
    async with client.post(emu.url + COMPLETIONS, json=body) as r:
        assert r.status == 400
        error = (await r.json())["error"]
    assert error["param"] == "max_tokens"
    assert error["message"].startswith("max_tokens=99999 cannot be greater than max_model_len=")


async def test_missing_prompt_is_400_bad_request(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    async with client.post(emu.url + COMPLETIONS, json={"max_tokens": 3}) as r:
        assert r.status == 400
        assert (await r.json())["error"]["type"] == "Bad Request"


async def test_stream_frames_are_exactly_data_compact_json_then_done(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    async with client.post(
        emu.url + COMPLETIONS,
        json={
            "prompt": [1, 2, 3],
            "max_tokens": 4,
            "ignore_eos": True,
            "stream": True,
            "return_token_ids": True,
        },
    ) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "text/event-stream; charset=utf-8"
        assert r.headers["Transfer-Encoding"] == "chunked"
        raw = await r.read()
    frames = frames_of(raw)
    assert frames[-1] == b"[DONE]"
    assert len(frames) == 5  # one per token, then [DONE]
    assert all(b": " not in f and b", " not in f for f in frames[:-1])  # compact JSON
    assert b'"finish_reason":"length"' in frames[-2]


async def test_stream_token_ids_concatenate_to_the_whole_answer(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    request = {"prompt": [5, 6, 7], "max_tokens": 6, "seed": 9, "return_token_ids": True}
    whole = await completed(client, emu.url, **request)
    async with client.post(emu.url + COMPLETIONS, json={**request, "stream": True}) as r:
        frames = frames_of(await r.read())
    streamed = [t for f in frames[:-1] for t in json.loads(f)["choices"][0]["token_ids"]]
    assert streamed == whole["choices"][0]["token_ids"]  # type: ignore[index]


async def test_stream_include_usage_sends_a_final_usage_chunk(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    async with client.post(
        emu.url + COMPLETIONS,
        json={
            "prompt": [1, 2],
            "max_tokens": 3,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    ) as r:
        frames = frames_of(await r.read())
    usage_chunk = json.loads(frames[-2])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert usage_chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_stream_options_without_stream_is_400(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    async with client.post(
        emu.url + COMPLETIONS, json={"prompt": [1], "stream_options": {"include_usage": True}}
    ) as r:
        assert r.status == 400


async def test_032_sends_keep_alive_comments_while_a_stream_is_idle_when_asked(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(sse_keepalive_s=0.02)
    await call(client, "POST", emu.url + "/pause?mode=keep")
    async with client.post(
        emu.url + COMPLETIONS, json={"prompt": [1], "max_tokens": 2, "stream": True}
    ) as r:
        first = await r.content.readuntil(b"\n\n")
        assert first == b": keep-alive\n\n"
        await call(client, "POST", emu.url + "/resume")
        rest = await r.read()
    body = rest.replace(b": keep-alive\n\n", b"")
    assert frames_of(body)[-1] == b"[DONE]"


async def test_027_never_sends_keep_alive_comments(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(vllm_version="0.27", sse_keepalive_s=0.01, decode_s_per_token=0.01)
    async with client.post(
        emu.url + COMPLETIONS,
        json={"prompt": [1], "max_tokens": 4, "ignore_eos": True, "stream": True},
    ) as r:
        raw = await r.read()
    assert b"keep-alive" not in raw
    frames_of(raw)


async def test_chat_completion_answers_an_assistant_message(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    async with client.post(
        emu.url + CHAT,
        json={
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "2+2?"},
            ],
            "max_tokens": 5,
            "ignore_eos": True,
        },
        headers={"X-Request-Id": "c1"},
    ) as r:
        assert r.status == 200
        body = await r.json()
    assert body["id"] == "chatcmpl-c1"
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant"
    assert message["content"]
    expected_prompt = len(
        tokens.apply_chat_template(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
        )
    )
    assert body["usage"]["prompt_tokens"] == expected_prompt


async def test_chat_stream_opens_with_the_assistant_role(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    async with client.post(
        emu.url + CHAT,
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "stream": True,
            "ignore_eos": True,
        },
    ) as r:
        frames = frames_of(await r.read())
    first = json.loads(frames[0])
    assert first["object"] == "chat.completion.chunk"
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert json.loads(frames[-2])["choices"][0]["finish_reason"] == "length"


async def test_chat_logprobs_have_the_chat_api_shape(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    async with client.post(
        emu.url + CHAT,
        json={
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 2,
            "ignore_eos": True,
        },
    ) as r:
        body = await r.json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert set(content[0]) == {"token", "logprob", "bytes", "top_logprobs"}
    assert len(content[0]["top_logprobs"]) == 2


async def test_api_key_guards_v1_routes(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(api_key="sekrit")
    async with client.post(emu.url + COMPLETIONS, json={"prompt": [1]}) as r:
        assert r.status == 401
        assert await r.json() == {"error": "Unauthorized"}
    async with client.post(
        emu.url + COMPLETIONS,
        json={"prompt": [1], "max_tokens": 1},
        headers={"Authorization": "Bearer sekrit"},
    ) as r:
        assert r.status == 200


async def test_api_key_does_not_guard_dev_mode_routes(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(api_key="sekrit")
    for method, path in (
        ("GET", "/health"),
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("GET", "/server_info"),
    ):
        async with client.request(method, emu.url + path) as r:
            assert r.status == 200, path


async def test_every_request_is_recorded_as_received(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    await call(client, "POST", emu.url + "/pause?mode=keep", headers={"X-Trace": "1"})
    seen = emu.requests[-1]
    assert (seen.method, seen.path, seen.body) == ("POST", "/pause?mode=keep", b"")
    assert seen.headers["x-trace"] == "1"
