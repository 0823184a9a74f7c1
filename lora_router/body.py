"""What the router reads of a completion body: the model, the prompt to key on, and `stream`.

The body is parsed once with orjson and forwarded byte for byte; nothing here re-encodes it.
Validation covers only what the router itself relies on, and answers like vLLM would (400,
`type: "Bad Request"`): a body that is not a JSON object, a `model` that is not a string, a
prompt of the wrong shape, token ids that are not non-negative 32-bit integers, or more tokens
than `max_prompt_tokens`. Everything else is the replica's to judge.

Token ids are packed into an `array('I')` here: that one C-level pass both validates them and
gives the routing keys their bytes.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import orjson

from lora_router.http.errors import bad_request


@dataclass(slots=True)
class Completion:
    """The routing-relevant fields of a /v1/completions or /v1/chat/completions body."""

    model: str | None
    tokens: array[int] | None  # the (first) token-id prompt
    text: bytes | None  # a text prompt, or chat messages in a prefix-stable encoding
    stream: bool


def read_completion(body: bytes, *, chat: bool, max_prompt_tokens: int) -> Completion:
    if not body:
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc.msg}.") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    model = data.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_request("`model` must be a string.", param="model")
    stream = data.get("stream", False)
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("`stream` must be a boolean.", param="stream")
    if chat:
        tokens, text = None, _messages_text(data.get("messages"))
    elif data.get("prompt") is None and "prompt_embeds" in data:
        tokens, text = None, None  # embeddings instead of a prompt: the replica judges them
    else:
        tokens, text = _prompt(data.get("prompt"), max_prompt_tokens)
    return Completion(model=model, tokens=tokens, text=text, stream=bool(stream))


def _prompt(prompt: object, max_tokens: int) -> tuple[array[int] | None, bytes | None]:
    """A prompt is token ids, a batch of them, a string or a batch of strings.

    A batch is one upstream request (its answer is one body), so it is routed as a whole,
    keyed by its first prompt; every prompt of it is still validated.
    """
    if isinstance(prompt, str):
        return None, prompt.encode()
    if not isinstance(prompt, list) or not prompt:
        raise bad_request(
            "`prompt` must be a string, a list of token ids, or a non-empty list of either.",
            param="prompt",
        )
    first = prompt[0]
    if isinstance(first, str):
        if not all(isinstance(p, str) for p in prompt):
            raise bad_request("A batch of text prompts must contain only strings.", "prompt")
        return None, first.encode()
    if isinstance(first, list):
        packed = [_tokens(p, max_tokens) for p in prompt]
        return packed[0], None
    return _tokens(prompt, max_tokens), None


def _tokens(ids: object, max_tokens: int) -> array[int]:
    if not isinstance(ids, list) or not ids:
        raise bad_request("A token-id prompt must be a non-empty list of integers.", "prompt")
    if len(ids) > max_tokens:
        raise bad_request(f"The prompt has {len(ids)} tokens; the limit is {max_tokens}.", "prompt")
    try:
        return array("I", ids)
    except (TypeError, OverflowError):
        raise bad_request(
            "Token ids must be integers between 0 and 4294967295.", param="prompt"
        ) from None


def _messages_text(messages: object) -> bytes:
    """Chat messages, each serialised on its own and concatenated: a later turn's encoding
    starts with an earlier turn's, so conversations keep their affinity."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list of objects.", param="messages")
    if not all(isinstance(m, dict) for m in messages):
        raise bad_request("Every message must be a JSON object.", param="messages")
    return b"".join(orjson.dumps(m, option=orjson.OPT_SORT_KEYS) for m in messages)
