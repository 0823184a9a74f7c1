"""`/v1/completions` and `/v1/chat/completions`: reading requests and shaping answers.

Parsing turns a JSON body into `GenerationParams` or an error `Reply` with vLLM's status and
type; rendering builds the response objects field for field as vLLM's pydantic models dump
them (`choices[i].token_ids` with `return_token_ids`, the completions `logprobs` object with
`text_offset`/`token_logprobs`/`tokens`/`top_logprobs`, chat `logprobs.content`, `usage` with
`prompt_tokens_details.cached_tokens`). Choice `index` is `prompt_index * n + sample_index`.
vLLM fills `prompt_tokens_details` only with `--enable-prompt-tokens-details`; the emulator
runs as if given it unless told otherwise (`EmulatorConfig.prompt_tokens_details`), so routing
quality can be measured from every answer.

Pure: no I/O, no engine; `app.py` runs the generation and calls these.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from lora_router.emulator import tokens
from lora_router.emulator.replies import Reply, bad_request, missing_field, wrong_type

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass(slots=True)
class GenerationParams:
    """What a generation request asks for, validated."""

    chat: bool
    model: str | None
    prompts: list[list[int]]
    n: int = 1
    max_tokens: int | None = None
    seed: int | None = None
    greedy: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top alternatives per token; None: no logprobs
    return_token_ids: bool = False
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False


def parse(body: Any, chat: bool) -> GenerationParams | Reply:
    """Validate a request body; an error `Reply` says why it is refused."""
    if not isinstance(body, dict):
        return wrong_type("body", "request", "dictionary", body)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        return wrong_type("body", "model", "string", model)
    prompts_or_error = chat_prompt(body) if chat else _completion_prompts(body)
    if isinstance(prompts_or_error, Reply):
        return prompts_or_error
    params = GenerationParams(chat=chat, model=model, prompts=prompts_or_error)
    error = _sampling(body, params) or _output_options(body, params)
    return error if error is not None else params


def _completion_prompts(body: dict[str, Any]) -> list[list[int]] | Reply:
    if "prompt" not in body:
        return missing_field("body", "prompt", body)
    prompt = body["prompt"]
    if isinstance(prompt, str):
        prompts = [tokens.tokenize(prompt)]
    elif isinstance(prompt, list) and prompt:
        if all(is_token_id(t) for t in prompt):
            prompts = [list(prompt)]
        elif all(isinstance(p, str) for p in prompt):
            prompts = [tokens.tokenize(p) for p in prompt]
        elif all(isinstance(p, list) and all(is_token_id(t) for t in p) for p in prompt):
            prompts = [list(p) for p in prompt]
        else:
            return wrong_type("body", "prompt", "list of token ids or strings", prompt)
    elif isinstance(prompt, list):
        return bad_request("Prompt cannot be empty.", "prompt")
    else:
        return wrong_type("body", "prompt", "string", prompt)
    for ids in prompts:
        if not ids:
            return bad_request("Prompt cannot be empty.", "prompt")
        for token_id in ids:
            if not 0 <= token_id < tokens.VOCAB_SIZE:
                return bad_request(f"Token id {token_id} is out of vocabulary", "prompt")
    return prompts


def is_token_id(value: Any) -> bool:
    """An int that is not a bool (JSON `true` is not a token)."""
    return isinstance(value, int) and not isinstance(value, bool)


def chat_prompt(body: dict[str, Any]) -> list[list[int]] | Reply:
    """The token ids of a chat body's `messages`, or the 400 a bad list gets."""
    if "messages" not in body:
        return missing_field("body", "messages", body)
    messages = body["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return wrong_type("body", "messages", "list", messages)
    try:
        return [tokens.apply_chat_template(messages)]
    except ValueError as exc:
        return bad_request(str(exc), "messages")


def _sampling(body: dict[str, Any], params: GenerationParams) -> Reply | None:
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not is_token_id(n) or n < 1:
        return bad_request(f"n must be at least 1, got {n}.", "n")
    params.n = n
    limit_key = (
        "max_completion_tokens" if params.chat and "max_completion_tokens" in body else "max_tokens"
    )
    max_tokens = body.get(limit_key)
    if max_tokens is not None:
        if not is_token_id(max_tokens):
            return wrong_type("body", limit_key, "integer", max_tokens)
        if max_tokens < 1:
            return bad_request(f"max_tokens must be at least 1, got {max_tokens}.", limit_key)
    params.max_tokens = max_tokens
    seed = body.get("seed")
    if seed is not None and not is_token_id(seed):
        return wrong_type("body", "seed", "integer", seed)
    params.seed = seed
    temperature = body.get("temperature", 1.0)
    if temperature is None:
        temperature = 1.0
    if not isinstance(temperature, int | float) or isinstance(temperature, bool):
        return wrong_type("body", "temperature", "number", temperature)
    if temperature < 0:
        return bad_request(f"temperature must be non-negative, got {temperature}.", "temperature")
    params.greedy = temperature == 0
    params.ignore_eos = bool(body.get("ignore_eos", False))
    return None


def _output_options(body: dict[str, Any], params: GenerationParams) -> Reply | None:
    if params.chat:
        top = body.get("top_logprobs")
        if body.get("logprobs"):
            params.logprobs = top if is_token_id(top) else 0
        elif top:
            return bad_request(
                "when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs"
            )
    else:
        logprobs = body.get("logprobs")
        if logprobs is not None:
            if not is_token_id(logprobs):
                return wrong_type("body", "logprobs", "integer", logprobs)
            params.logprobs = logprobs
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
        return bad_request(
            f"Requested sample logprobs of {params.logprobs}, which is greater than max "
            f"allowed: {MAX_LOGPROBS}",
            "logprobs",
        )
    params.return_token_ids = bool(body.get("return_token_ids", False))
    params.stream = bool(body.get("stream", False))
    options = body.get("stream_options")
    if options is not None:
        if not params.stream:
            return bad_request(
                "Stream options can only be defined when `stream=True`.", "stream_options"
            )
        if not isinstance(options, dict):
            return wrong_type("body", "stream_options", "dictionary", options)
        params.include_usage = bool(options.get("include_usage", False))
        params.continuous_usage = bool(options.get("continuous_usage_stats", False))
    return None


def context_error(params: GenerationParams, max_model_len: int, since_032: bool) -> Reply | None:
    """vLLM's length checks. 0.27: the prompt alone, then prompt plus `max_tokens`. 0.32 and
    later (`since_032`, seen on a real 0.32 server): `max_tokens` alone, then the prompt alone;
    a prompt plus `max_tokens` beyond the context is not refused, `max_tokens` is clamped."""
    if since_032:
        if params.max_tokens is not None and params.max_tokens > max_model_len:
            return bad_request(
                f"max_tokens={params.max_tokens} cannot be greater than "
                f"max_model_len={max_model_len}. Please request fewer output tokens. "
                f"(parameter=max_tokens, value={params.max_tokens})",
                "max_tokens",
            )
        for prompt in params.prompts:
            if len(prompt) > max_model_len:
                return bad_request(
                    f"This model's maximum context length is {max_model_len} tokens. However, "
                    f"your prompt contains {len(prompt)} input tokens, which exceeds this limit "
                    "even without any output tokens. Please reduce the length of the input "
                    f"prompt. (parameter=input_tokens, value={len(prompt)})",
                    "input_tokens",
                )
        return None
    for prompt in params.prompts:
        if len(prompt) >= max_model_len:
            return bad_request(
                f"This model's maximum context length is {max_model_len} tokens. However, your "
                f"request has {len(prompt)} input tokens. Please reduce the length of the input "
                "messages.",
            )
        if params.max_tokens is not None and len(prompt) + params.max_tokens > max_model_len:
            return bad_request(
                f"'max_tokens' or 'max_completion_tokens' is too large: {params.max_tokens}. "
                f"This model's maximum context length is {max_model_len} tokens and your request "
                f"has {len(prompt)} input tokens ({params.max_tokens} > {max_model_len} - "
                f"{len(prompt)}).",
            )
    return None


def effective_max_tokens(params: GenerationParams, prompt: list[int], max_model_len: int) -> int:
    room = max(1, max_model_len - len(prompt))
    if params.max_tokens is not None:
        return min(params.max_tokens, room)  # 0.32+ clamps; 0.27 refused the excess earlier
    return room


# --- rendering ---------------------------------------------------------------------------


@dataclass(slots=True)
class ChoiceState:
    """Per-choice progress while rendering (text offsets continue across stream chunks)."""

    index: int
    prompt: list[int]
    token_ids: list[int] = field(default_factory=list)
    logprob_tokens: list[tokens.SampledToken] = field(default_factory=list)
    text_len: int = 0
    finish_reason: str | None = None


class Renderer:
    """Builds the JSON objects of one response (whole or streamed) for one request."""

    __slots__ = ("created", "model", "object_chunk", "object_whole", "params", "response_id")

    def __init__(self, params: GenerationParams, request_id: str, model: str) -> None:
        self.params = params
        self.model = model
        self.created = int(time.time())
        if params.chat:
            self.response_id = f"chatcmpl-{request_id}"
            self.object_whole, self.object_chunk = "chat.completion", "chat.completion.chunk"
        else:
            self.response_id = f"cmpl-{request_id}"
            self.object_whole = self.object_chunk = "text_completion"

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model}

    # Whole responses

    def whole(self, choices: list[ChoiceState], usage: dict[str, Any]) -> dict[str, Any]:
        body = self._head(self.object_whole)
        body["choices"] = [self._whole_choice(c) for c in choices]
        body["service_tier"] = None
        body["system_fingerprint"] = None
        body["usage"] = usage
        if self.params.chat:
            body["prompt_logprobs"] = None
            if self.params.return_token_ids:
                body["prompt_token_ids"] = choices[0].prompt if choices else None
        body["kv_transfer_params"] = None
        return body

    def _whole_choice(self, choice: ChoiceState) -> dict[str, Any]:
        text = tokens.detokenize(choice.token_ids)
        out: dict[str, Any] = {"index": choice.index}
        if self.params.chat:
            out["message"] = {
                "role": "assistant",
                "content": text,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [],
                "reasoning_content": None,
            }
            out["logprobs"] = self._chat_logprobs(choice.logprob_tokens)
        else:
            out["text"] = text
            out["logprobs"] = self._completion_logprobs(choice.logprob_tokens, 0)
        out["finish_reason"] = choice.finish_reason
        out["stop_reason"] = None
        if self.params.return_token_ids:
            if not self.params.chat:
                out["prompt_token_ids"] = choice.prompt
            out["token_ids"] = choice.token_ids
        if not self.params.chat:
            out["prompt_logprobs"] = None
        return out

    # Streamed chunks

    def role_chunk(self, index: int) -> dict[str, Any]:
        """Chat streams open each choice with the assistant role and empty content."""
        chunk = self._head(self.object_chunk)
        chunk["choices"] = [
            {
                "index": index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ]
        return chunk

    def token_chunk(
        self,
        choice: ChoiceState,
        sampled: list[tokens.SampledToken],
        finish_reason: str | None,
        first: bool,
    ) -> dict[str, Any]:
        ids = [t.token_id for t in sampled]
        text = tokens.detokenize(ids)
        entry: dict[str, Any] = {"index": choice.index}
        if self.params.chat:
            entry["delta"] = {"content": text}
            entry["logprobs"] = self._chat_logprobs(sampled)
        else:
            entry["text"] = text
            entry["logprobs"] = self._completion_logprobs(sampled, choice.text_len)
        entry["finish_reason"] = finish_reason
        entry["stop_reason"] = None
        if self.params.return_token_ids:
            if first and not self.params.chat:
                entry["prompt_token_ids"] = choice.prompt
            entry["token_ids"] = ids
        choice.text_len += len(text)
        chunk = self._head(self.object_chunk)
        chunk["choices"] = [entry]
        if self.params.chat and first and self.params.return_token_ids:
            chunk["prompt_token_ids"] = choice.prompt
        return chunk

    def usage_chunk(self, usage: dict[str, Any]) -> dict[str, Any]:
        chunk = self._head(self.object_chunk)
        chunk["choices"] = []
        chunk["usage"] = usage
        return chunk

    # Logprobs

    def _completion_logprobs(
        self, sampled: list[tokens.SampledToken], initial_offset: int
    ) -> dict[str, Any] | None:
        top = self.params.logprobs
        if top is None:
            return None
        offsets: list[int] = []
        token_logprobs: list[float] = []
        token_strs: list[str] = []
        top_logprobs: list[dict[str, float]] = []
        offset = initial_offset
        for t in sampled:
            text = tokens.token_text(t.token_id)
            offsets.append(offset)
            offset += len(text)
            token_strs.append(text)
            token_logprobs.append(t.logprob)
            # The sampled token comes first, then the best `top` alternatives (vLLM keeps
            # `top + 1` entries, as the OpenAI API defines it).
            step = {text: t.logprob}
            for alt_id, alt_logprob in t.alternatives[:top]:
                step[tokens.token_text(alt_id)] = alt_logprob
            top_logprobs.append(step)
        return {
            "text_offset": offsets,
            "token_logprobs": token_logprobs,
            "tokens": token_strs,
            "top_logprobs": top_logprobs,
        }

    def _chat_logprobs(self, sampled: list[tokens.SampledToken]) -> dict[str, Any] | None:
        top = self.params.logprobs
        if top is None:
            return None
        content = []
        for t in sampled:
            text = tokens.token_text(t.token_id)
            content.append(
                {
                    "token": text,
                    "logprob": t.logprob,
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {
                            "token": tokens.token_text(alt_id),
                            "logprob": alt_logprob,
                            "bytes": list(tokens.token_text(alt_id).encode("utf-8")),
                        }
                        for alt_id, alt_logprob in t.alternatives[:top]
                    ],
                }
            )
        return {"content": content}


def usage(
    prompt_tokens: int, completion_tokens: int, cached_tokens: int | None, *, omit: bool = False
) -> dict[str, Any]:
    """vLLM's `usage`; `cached_tokens` None: without --enable-prompt-tokens-details, when
    `prompt_tokens_details` is `null`, or left out with `omit` (vLLM 0.34)."""
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
    }
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    elif not omit:
        out["prompt_tokens_details"] = None
    return out
