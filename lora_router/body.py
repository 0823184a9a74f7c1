"""What the router reads of a completion body: the model, the prompt to key on, and `stream`.

The body is decoded once with msgspec and forwarded byte for byte; nothing here re-encodes it.
Validation covers only what the router itself relies on, and answers like vLLM would (400,
`type: "Bad Request"`): a body that is not a JSON object, a `model` that is not a string, a
prompt of the wrong shape, token ids that are not non-negative 32-bit integers, or more tokens
than `max_prompt_tokens`. Everything else is the replica's to judge.

Why msgspec and a raw prompt: turning a 512-token prompt into Python ints costs more than all
the rest of a request's routing. msgspec checks the whole body's JSON but hands the prompt over
as its raw text. A flat list of token ids is validated on that text in C (only digits, commas
and spaces between one pair of brackets: non-negative integers) and counted by its commas; it
is turned into an `array('I')` only when the router needs its blocks (`Completion.token_ids`),
which the G - 1 siblings of a GRPO prompt never do (they are routed by a hash of the raw text,
see app.py). Everything else (batches, text, chat) is decoded whole.

No memory of whole bodies: TRL 1.16 gives each of the G samples its own `seed`, so no two
bodies are identical, and a cache of recent bodies never hit while costing every request a
hash of its body (bench/results/body_reuse.md).
"""

from __future__ import annotations

import re
from array import array
from dataclasses import dataclass

import msgspec
import orjson

from lora_router.http.errors import bad_request


class _Body(msgspec.Struct):
    """The fields the router reads; an absent Raw field is empty."""

    model: str | None = None
    stream: bool | None = False
    prompt: msgspec.Raw = msgspec.Raw()
    prompt_embeds: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()


_decode = msgspec.json.Decoder(_Body).decode
# What a flat JSON list of non-negative integers holds between its brackets (JSON syntax is
# already checked). `bytes.translate` deletes them in one C pass, ten times faster than a regex.
_TOKEN_LIST_BYTES = b"0123456789, \t\r\n"
_WHERE = re.compile(r"at `\$\.(\w+)")


@dataclass(slots=True)
class Completion:
    """The routing-relevant fields of a /v1/completions or /v1/chat/completions body."""

    model: str | None
    raw_tokens: bytes | None  # a flat token-id prompt, as the client wrote it (validated)
    tokens: array[int] | None  # the first prompt of a batch of token-id prompts
    text: bytes | None  # a text prompt, or chat messages in a prefix-stable encoding
    stream: bool

    def token_ids(self) -> array[int] | None:
        """The (first) token-id prompt as packed ids; parsed on first use."""
        if self.tokens is None and self.raw_tokens is not None:
            try:
                self.tokens = array("I", orjson.loads(self.raw_tokens))
            except OverflowError:  # validated as digits, but beyond 32 bits
                raise _bad_token_ids() from None
        return self.tokens


def read_completion(body: bytes, *, chat: bool, max_prompt_tokens: int) -> Completion:
    if not body:
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        data = _decode(body)
    except msgspec.ValidationError as exc:  # a subclass of DecodeError: first
        where = _WHERE.search(str(exc))
        if where is None:
            raise bad_request("The request body must be a JSON object.") from None
        field = where.group(1)
        kind = "a boolean" if field == "stream" else "a string"
        raise bad_request(f"`{field}` must be {kind}.", param=field) from None
    except msgspec.DecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}.") from None
    model, stream = data.model, bool(data.stream)
    if chat:
        messages = _messages_text(_loads(data.messages) if data.messages else None)
        return Completion(model, None, None, messages, stream)
    raw = bytes(data.prompt)
    if (not raw or raw == b"null") and data.prompt_embeds:
        return Completion(model, None, None, None, stream)  # embeddings: the replica judges them
    if raw[:1] == b"[" and not raw[1:-1].translate(None, _TOKEN_LIST_BYTES):
        count = raw.count(b",") + 1
        if count == 1 and raw[1:-1].strip() == b"":
            raise bad_request("A token-id prompt must be a non-empty list of integers.", "prompt")
        if count > max_prompt_tokens:
            raise bad_request(
                f"The prompt has {count} tokens; the limit is {max_prompt_tokens}.", "prompt"
            )
        return Completion(model, raw, None, None, stream)
    batch_tokens, text = _prompt(_loads(raw) if raw else None, max_prompt_tokens)
    return Completion(model, None, batch_tokens, text, stream)


def _loads(raw: bytes | msgspec.Raw) -> object:
    """A raw field decoded (msgspec checked its JSON syntax, not its strings' UTF-8)."""
    try:
        return orjson.loads(bytes(raw))
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc.msg}.") from None


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
        raise _bad_token_ids() from None


def _bad_token_ids() -> Exception:
    return bad_request("Token ids must be integers between 0 and 4294967295.", param="prompt")


def _messages_text(messages: object) -> bytes:
    """Chat messages, each serialised on its own and concatenated: a later turn's encoding
    starts with an earlier turn's, so conversations keep their affinity."""
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list of objects.", param="messages")
    if not all(isinstance(m, dict) for m in messages):
        raise bad_request("Every message must be a JSON object.", param="messages")
    return b"".join(orjson.dumps(m, option=orjson.OPT_SORT_KEYS) for m in messages)
