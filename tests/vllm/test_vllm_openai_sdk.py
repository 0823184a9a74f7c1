"""Streaming and chat completions through the router to real vLLM, the openai SDK as client."""

from __future__ import annotations

import random
from typing import Any

import openai

from lora_router.testbed.vllm_harness import Router, wait_for


def sdk(router: Router) -> openai.OpenAI:
    # The router holds the replicas' token; a client without --api-key-env sends anything.
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def test_streamed_completion_arrives_as_chunks_ending_with_a_finish_reason(
    router: Router, base: str
) -> None:
    chunks = list(
        sdk(router).completions.create(
            model=base, prompt="The quick brown fox", max_tokens=4, stream=True, seed=1
        )
    )
    assert len(chunks) >= 2
    assert all(c.object == "text_completion" and c.model == base for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_a_streams_usage_frame_is_what_the_router_counts_as_reported(
    router: Router, base: str
) -> None:
    """The same token-id prompt streamed twice with `include_usage`, as the SDK sends it: the
    second finds all but the last block cached, vLLM's usage frame says so, and the router read
    the same figures from the stream it passed through (routing_accuracy)."""
    prompt = random.Random().choices(range(3, 480), k=300)  # no replica has seen it
    reported = []
    for seed in (1, 2):
        chunks = list(
            sdk(router).completions.create(
                model=base,
                prompt=prompt,
                max_tokens=2,
                stream=True,
                seed=seed,
                stream_options={"include_usage": True},
            )
        )
        usage = chunks[-1].usage
        assert usage is not None and usage.prompt_tokens_details is not None
        reported.append(usage.prompt_tokens_details.cached_tokens)
    assert reported[0] == 0 and reported[1] > 0, reported

    def accuracy() -> dict[str, Any]:
        return router.get("/router/status").json()["routing_accuracy"]

    # The SDK stops at `[DONE]`; the router counts an answer at its end, the chunked
    # terminator vLLM writes a moment later (or at the client's leaving, if it closes).
    wait_for("both answers counted", lambda: accuracy()["answers"] == 2, 10)
    counted = accuracy()
    assert counted["unreported"] == 0, counted
    assert counted["reported_cached_tokens"] == sum(reported)
    assert counted["predicted_cached_tokens"] == sum(reported)


def test_chat_completion_answers_with_an_assistant_message(router: Router, base: str) -> None:
    answer = sdk(router).chat.completions.create(
        model=base, messages=[{"role": "user", "content": "hello"}], max_tokens=4, seed=2
    )
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason in ("length", "stop")
    assert answer.usage is not None and answer.usage.completion_tokens <= 4


def test_streamed_chat_completion_arrives_as_deltas(router: Router, base: str) -> None:
    chunks = list(
        sdk(router).chat.completions.create(
            model=base,
            messages=[{"role": "user", "content": "What is 17 times 23?"}],
            max_tokens=4,
            stream=True,
            seed=3,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")


def test_unknown_model_is_vllms_404_through_the_sdk(router: Router) -> None:
    try:
        sdk(router).completions.create(model="trl-policy-v404", prompt=[1, 2, 3], max_tokens=2)
    except openai.NotFoundError as exc:
        assert exc.status_code == 404
        assert "trl-policy-v404" in str(exc)
    else:
        raise AssertionError("an unknown model was served")
