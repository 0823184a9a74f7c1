"""Dev-mode routes (/pause, /resume, /is_paused, /reset_prefix_cache, /server_info ...),
health, version, tokenize and metrics, with the differences between vLLM lines while paused."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import pytest
from helpers import call, completed, load, until

from lora_router.emulator import Emulator

from .conftest import StartEmulator, frames_of

COMPLETIONS = "/v1/completions"
SLOW = {"decode_s_per_token": 0.01}  # 100 tokens take a second: long enough to act mid-way


async def test_pause_answers_paused(emu: Emulator, client: aiohttp.ClientSession) -> None:
    assert (await call(client, "POST", emu.url + "/pause?mode=keep"))[:2] == (
        200,
        b'{"status":"paused"}',
    )
    assert emu.state.paused


async def test_is_paused_says_so_after_a_pause(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    await call(client, "POST", emu.url + "/pause?mode=keep")
    assert (await call(client, "GET", emu.url + "/is_paused"))[:2] == (200, b'{"is_paused":true}')


async def test_resume_without_a_pause_answers_resumed(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    assert (await call(client, "POST", emu.url + "/resume"))[:2] == (200, b'{"status":"resumed"}')


async def test_resume_after_a_pause_answers_resumed_with_is_paused_false(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    await call(client, "POST", emu.url + "/pause")
    assert (await call(client, "POST", emu.url + "/resume"))[:2] == (200, b'{"status":"resumed"}')
    assert (await call(client, "GET", emu.url + "/is_paused"))[:2] == (200, b'{"is_paused":false}')


async def test_pause_with_an_unknown_mode_is_400(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    status, body, _ = await call(client, "POST", emu.url + "/pause?mode=sometimes")
    assert status == 400
    assert json.loads(body)["error"]["type"] == "Bad Request"


@pytest.mark.parametrize(
    ("version", "mode"),
    [("0.27", "abort"), ("0.32", "abort"), ("0.32", "wait"), ("0.32", "keep")],
)
async def test_027_and_032_queue_a_request_sent_while_paused_until_resume(
    start: StartEmulator, client: aiohttp.ClientSession, version: str, mode: str
) -> None:
    # 0.32's EngineCore.pause_scheduler: "All pause modes queue new adds".
    emu = await start(vllm_version=version)
    await call(client, "POST", emu.url + f"/pause?mode={mode}")
    pending = asyncio.create_task(completed(client, emu.url))
    await until(lambda: emu.state.num_waiting == 1)
    assert not pending.done()
    await call(client, "POST", emu.url + "/resume")
    body = await pending
    assert body["choices"][0]["finish_reason"] in ("stop", "length")  # type: ignore[index]


async def test_033_rejects_a_request_while_paused_in_abort_mode(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(vllm_version="0.33")
    await call(client, "POST", emu.url + "/pause?mode=abort")
    status, body, _ = await call(client, "POST", emu.url + COMPLETIONS, json={"prompt": [1]})
    assert status == 503
    assert json.loads(body) == {
        "error": {
            "message": "Generation is paused. Please retry after it resumes.",
            "type": "ServiceUnavailableError",
            "param": None,
            "code": 503,
        }
    }


async def test_033_rejects_a_request_while_paused_in_wait_mode(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(vllm_version="0.33")
    await call(client, "POST", emu.url + "/pause?mode=wait")
    status, _, _ = await call(client, "POST", emu.url + COMPLETIONS, json={"prompt": [1]})
    assert status == 503


async def test_033_queues_a_request_while_paused_in_keep_mode(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(vllm_version="0.33")
    await call(client, "POST", emu.url + "/pause?mode=keep")
    pending = asyncio.create_task(completed(client, emu.url))
    await until(lambda: emu.state.num_waiting == 1)
    await call(client, "POST", emu.url + "/resume")
    await pending


async def test_033_paused_stream_is_a_200_with_one_error_frame_then_done(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(vllm_version="0.33")
    await call(client, "POST", emu.url + "/pause?mode=abort")
    async with client.post(emu.url + COMPLETIONS, json={"prompt": [1], "stream": True}) as r:
        assert r.status == 200
        raw = await r.read()
    assert raw == (
        b'data: {"error": {"message": "Generation is paused. Please retry after it resumes.", '
        b'"type": "ServiceUnavailableError", "param": null, "code": 503}}\n\n'
        b"data: [DONE]\n\n"
    )


async def test_027_paused_stream_sends_headers_at_once_then_waits_for_resume(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(vllm_version="0.27")
    await call(client, "POST", emu.url + "/pause?mode=abort")
    async with client.post(
        emu.url + COMPLETIONS,
        json={"prompt": [1], "max_tokens": 2, "stream": True, "ignore_eos": True},
    ) as r:
        assert r.status == 200  # the headers arrived while paused
        await until(lambda: emu.state.num_waiting == 1)
        assert not r.content.is_eof()
        await call(client, "POST", emu.url + "/resume")
        frames = frames_of(await r.read())
    assert frames[-1] == b"[DONE]"
    assert len(frames) == 3


async def test_pause_abort_finishes_in_flight_requests_with_abort(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(**SLOW)
    pending = asyncio.create_task(completed(client, emu.url, max_tokens=100, ignore_eos=True))
    await until(lambda: emu.state.num_running == 1)
    await call(client, "POST", emu.url + "/pause?mode=abort")
    body = await pending
    assert body["choices"][0]["finish_reason"] == "abort"  # type: ignore[index]
    assert body["usage"]["completion_tokens"] < 100  # type: ignore[index]


async def test_pause_abort_ends_an_in_flight_stream_with_an_abort_chunk(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(**SLOW)
    async with client.post(
        emu.url + COMPLETIONS,
        json={"prompt": [1], "max_tokens": 100, "stream": True, "ignore_eos": True},
    ) as r:
        await r.content.readuntil(b"\n\n")  # the first token is out
        await call(client, "POST", emu.url + "/pause?mode=abort")
        frames = frames_of(await r.read())
    assert frames[-1] == b"[DONE]"
    assert json.loads(frames[-2])["choices"][0]["finish_reason"] == "abort"


async def test_pause_wait_returns_after_in_flight_requests_finish(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(decode_s_per_token=0.005)
    pending = asyncio.create_task(completed(client, emu.url, max_tokens=20, ignore_eos=True))
    await until(lambda: emu.state.num_running == 1)
    status, _, _ = await call(client, "POST", emu.url + "/pause?mode=wait")
    assert status == 200
    assert pending.done()
    assert (await pending)["choices"][0]["finish_reason"] == "length"  # type: ignore[index]


async def test_pause_keep_freezes_in_flight_requests_until_resume(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(decode_s_per_token=0.002)
    pending = asyncio.create_task(completed(client, emu.url, max_tokens=50, ignore_eos=True))
    await until(lambda: emu.state.num_running == 1)
    await call(client, "POST", emu.url + "/pause?mode=keep")
    await until(lambda: len(emu.state._frozen) == 1)
    generated = emu.state.counters.generated_tokens
    assert not pending.done()
    await call(client, "POST", emu.url + "/resume")
    body = await pending
    assert generated < 50
    assert body["choices"][0]["finish_reason"] == "length"  # type: ignore[index]


async def test_pause_clears_the_prefix_cache_by_default(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    await completed(client, emu.url)
    assert len(emu.state.cache) > 0
    await call(client, "POST", emu.url + "/pause?mode=abort")
    assert len(emu.state.cache) == 0


async def test_pause_with_clear_cache_false_keeps_the_prefix_cache(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    await completed(client, emu.url)
    await call(client, "POST", emu.url + "/pause?mode=abort&clear_cache=false")
    assert len(emu.state.cache) > 0


async def test_reset_prefix_cache_empties_the_cache(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    await completed(client, emu.url)
    assert (await call(client, "POST", emu.url + "/reset_prefix_cache"))[:2] == (
        200,
        b'{"success":true}',
    )
    again = await completed(client, emu.url)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # type: ignore[index]


async def test_reset_prefix_cache_fails_while_requests_run(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(**SLOW)
    pending = asyncio.create_task(completed(client, emu.url, max_tokens=20, ignore_eos=True))
    await until(lambda: emu.state.num_running == 1)
    assert (await call(client, "POST", emu.url + "/reset_prefix_cache"))[:2] == (
        200,
        b'{"success":false}',
    )
    await pending


async def test_server_info_json_reports_the_configured_engine_settings(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(max_lora_rank=1, max_loras=6, max_cpu_loras=8, block_size=32)
    status, body, _ = await call(client, "GET", emu.url + "/server_info?config_format=json")
    assert status == 200
    info = json.loads(body)
    assert set(info) == {"vllm_config", "vllm_env", "system_env"}
    config = info["vllm_config"]
    assert config["lora_config"]["max_lora_rank"] == 1
    assert config["lora_config"]["max_loras"] == 6
    assert config["lora_config"]["max_cpu_loras"] == 8
    assert config["cache_config"]["block_size"] == 32
    assert config["parallel_config"]["data_parallel_size"] == 1


async def test_server_info_without_lora_reports_null_lora_config(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(enable_lora=False)
    _, body, _ = await call(client, "GET", emu.url + "/server_info?config_format=json")
    assert json.loads(body)["vllm_config"]["lora_config"] is None


async def test_server_info_text_form_has_no_lora_config(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    _, body, _ = await call(client, "GET", emu.url + "/server_info")
    config = json.loads(body)["vllm_config"]
    assert isinstance(config, str)
    assert "lora" not in config


async def test_dev_mode_routes_are_404_without_dev_mode(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    emu = await start(dev_mode=False)
    assert (await call(client, "POST", emu.url + "/pause"))[:2] == (404, b'{"detail":"Not Found"}')


async def test_wrong_method_is_405(emu: Emulator, client: aiohttp.ClientSession) -> None:
    assert (await call(client, "GET", emu.url + "/pause"))[:2] == (
        405,
        b'{"detail":"Method Not Allowed"}',
    )


async def test_health_answers_200_empty(emu: Emulator, client: aiohttp.ClientSession) -> None:
    assert (await call(client, "GET", emu.url + "/health"))[:2] == (200, b"")


async def test_ping_answers_200_empty_to_either_method(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    assert (await call(client, "GET", emu.url + "/ping"))[:2] == (200, b"")
    assert (await call(client, "POST", emu.url + "/ping"))[:2] == (200, b"")


async def test_health_stays_200_while_paused(emu: Emulator, client: aiohttp.ClientSession) -> None:
    await call(client, "POST", emu.url + "/pause?mode=keep")
    assert (await call(client, "GET", emu.url + "/health"))[:2] == (200, b"")


async def test_version_reports_the_emulated_release(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    for version, release in (("0.27", b"0.27.1"), ("0.32", b"0.32.0"), ("0.33", b"0.33.0")):
        emu = await start(vllm_version=version)
        assert (await call(client, "GET", emu.url + "/version"))[:2] == (
            200,
            b'{"version":"%s"}' % release,
        )


async def tokenize_2_plus_2(emu: Emulator, client: aiohttp.ClientSession) -> dict[str, Any]:
    """The emulator's `/tokenize` answer for the text "2+2"."""
    _, body, _ = await call(client, "POST", emu.url + "/tokenize", json={"prompt": "2+2"})
    tokenized: dict[str, Any] = json.loads(body)
    return tokenized


async def test_tokenize_answers_the_tokens_their_count_the_max_model_len(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    tokenized = await tokenize_2_plus_2(emu, client)
    assert tokenized["tokens"] == [50, 43, 50]
    assert tokenized["count"] == 3
    assert tokenized["max_model_len"] == 4096


async def test_detokenize_gives_back_the_text_tokenize_took(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    tokenized = await tokenize_2_plus_2(emu, client)
    _, body, _ = await call(
        client, "POST", emu.url + "/detokenize", json={"tokens": tokenized["tokens"]}
    )
    assert json.loads(body) == {"prompt": "2+2"}


async def test_metrics_count_the_prefix_cache_in_tokens(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    await completed(client, emu.url, prompt=list(range(40)))
    await completed(client, emu.url, prompt=list(range(40)))
    status, body, _ = await call(client, "GET", emu.url + "/metrics")
    assert status == 200
    text = body.decode()
    assert (
        'vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen2.5-Math-1.5B"} 80.0'
        in text
    )
    assert (
        'vllm:prefix_cache_hits_total{engine="0",model_name="Qwen/Qwen2.5-Math-1.5B"} 32.0' in text
    )


@pytest.fixture
async def metrics_with_v1_running_v2_waiting(
    start: StartEmulator, client: aiohttp.ClientSession, adapter: Callable[..., str]
) -> AsyncIterator[str]:
    """`/metrics` of one sequence at a time while trl-policy-v1 runs and trl-policy-v2 waits;
    both requests then finish."""
    emu = await start(max_num_seqs=1, **SLOW)
    assert (await load(client, emu.url, "trl-policy-v1", adapter("v1")))[0] == 200
    assert (await load(client, emu.url, "trl-policy-v2", adapter("v2")))[0] == 200
    first = asyncio.create_task(
        completed(client, emu.url, model="trl-policy-v1", max_tokens=20, ignore_eos=True)
    )
    await until(lambda: emu.state.num_running == 1)
    second = asyncio.create_task(completed(client, emu.url, model="trl-policy-v2", max_tokens=1))
    await until(lambda: emu.state.num_waiting == 1)
    _, body, _ = await call(client, "GET", emu.url + "/metrics")
    yield body.decode()
    await asyncio.gather(first, second)


async def test_metrics_report_the_queue(metrics_with_v1_running_v2_waiting: str) -> None:
    text = metrics_with_v1_running_v2_waiting
    assert 'vllm:num_requests_running{engine="0",model_name="Qwen/Qwen2.5-Math-1.5B"} 1.0' in text
    assert 'vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen2.5-Math-1.5B"} 1.0' in text


async def test_metrics_label_the_adapters_running_apart_from_those_waiting(
    metrics_with_v1_running_v2_waiting: str,
) -> None:
    assert (
        'vllm:lora_requests_info{max_lora="6",running_lora_adapters="trl-policy-v1",'
        'waiting_lora_adapters="trl-policy-v2"}'
    ) in metrics_with_v1_running_v2_waiting


def kv_usage(metrics: bytes) -> float:
    """The value of `vllm:kv_cache_usage_perc` in a `/metrics` answer."""
    prefix = 'vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen2.5-Math-1.5B"} '
    (line,) = [line for line in metrics.decode().splitlines() if line.startswith(prefix)]
    return float(line.removeprefix(prefix))


async def test_kv_cache_usage_of_an_idle_replica_is_zero_however_full_its_prefix_cache(
    emu: Emulator, client: aiohttp.ClientSession
) -> None:
    # A real vLLM 0.32 replica reports 0 when idle: cached blocks no request holds are free.
    await completed(client, emu.url, prompt=list(range(40)))
    await completed(client, emu.url, prompt=list(range(40, 80)))
    assert len(emu.state.cache) >= 4
    status, body, _ = await call(client, "GET", emu.url + "/metrics")
    assert status == 200
    assert kv_usage(body) == 0.0


async def test_kv_cache_usage_counts_the_blocks_running_samples_hold_shared_blocks_once(
    start: StartEmulator, client: aiohttp.ClientSession
) -> None:
    # No sample emits a token while the test looks: each holds exactly its prompt's blocks.
    emu = await start(cache_blocks=64, decode_s_per_token=60.0)
    prompts = [list(range(40)), list(range(40)), list(range(100, 120))]
    tasks = [
        asyncio.create_task(completed(client, emu.url, prompt=p, max_tokens=4)) for p in prompts
    ]
    try:
        await until(lambda: emu.state.num_running == 3)
        _, body, _ = await call(client, "GET", emu.url + "/metrics")
        # 40 tokens: 2 full blocks the two siblings share, and a partial block each;
        # 20 tokens: 1 full block and a partial one.
        assert kv_usage(body) == (2 + 1 + 1 + 2) / 64
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/tokenize", {"messages": [1]}),
        ("/tokenize", {"messages": [{"role": "user", "content": 5}]}),
        ("/detokenize", {"tokens": [-1]}),
        ("/detokenize", {"tokens": [True]}),
    ],
)
async def test_the_tokenizer_routes_answer_bad_input_400(
    emu: Emulator, client: aiohttp.ClientSession, path: str, body: dict[str, object]
) -> None:
    status, raw, _ = await call(client, "POST", emu.url + path, json=body)
    assert status == 400, raw
    assert json.loads(raw)["error"]["code"] == 400
