"""What the router reads of a body: a completion's model, prompt to key on and `stream`, an
adapter load's or unload's fields (`load_fields`, `unload_name`) and an abort's request ids
(`abort_ids`).

The body is decoded once with msgspec and forwarded byte for byte; nothing here re-encodes it.
Validation covers only what the router itself relies on, and answers like vLLM would (400,
`type: "Bad Request"`): a body that is not a JSON object, a `model` that is not a string, a
prompt of the wrong shape, token ids that are not non-negative 32-bit integers, more tokens
than `max_prompt_tokens` (a batch's prompts counted together), or JSON nested deeper than the
decoders go. Everything else is the replica's to judge. `max_prompt_tokens` bounds the routing
work of every prompt shape: token ids beyond it are refused, in one prompt or in a whole batch;
text and chat prompts, which the router cannot count in tokens
(it counts `TEXT_BYTES_PER_TOKEN` bytes a token, routing/keys.py), are keyed and counted on
their first `max_prompt_tokens` * that many bytes and forwarded whole, for the replica to
judge their length. All of it is judged here, in `read_completion`, before the request is
routed: nothing the router does with a `Completion` afterwards can fail on its content, so no
body can earn the router's own 500.

Why msgspec and a raw prompt: turning a 512-token prompt into Python ints costs more than all
the rest of a request's routing. msgspec checks the body's JSON (all of it but a token-id list
cut out, below, which its own parse checks) and hands the prompt over as its raw text. A flat
list of token ids is validated on that text in C (only digits, commas and spaces between one
pair of brackets: non-negative integers) and counted by its commas. Its range (every id below
2**32) can only be checked by parsing it, which is also what keying it needs; so the first body
carrying a given prompt text parses it into an `array('I')` at once, and `CompletionReader`
remembers the last few prompt texts it parsed, exactly, so the G - 1 siblings of a GRPO prompt
(same prompt, their own seeds) skip the parse: they are routed by a hash of the raw text (see
routed.py) and never need their ids. A batch is read on its text too, in one C pass: a list
of flat lists of ids (`_token_batch`: counted by its commas, every id range-checked in one
parse, which the limit on its tokens bounds), or a list of strings (`_TEXT_BATCH`); either is
keyed by its first prompt, the only one the router decodes. A text prompt is one string,
decoded; chat messages are decoded whole, within the bound below, and each serialised.

Bounded decoding: JSON decoded into Python objects costs up to some 60 bytes a value, 20 times
the text of `[{},{},...]`. So nothing is decoded whole that may hold more than
`MAX_DECODED_VALUES` values (262,144: some 16 MiB), counted on its text by the bytes `{[,:`
that precede them (`_decodable`). Chat messages past it are neither keyed nor checked: the
request is routed by load alone, like `prompt_embeds`, and the replica judges it (ordinary text
holds one of those bytes every few dozen: a conversation past the bound is millions of tokens
long). A prompt that no reader above accepts is wrong; it is decoded only to name what is
wrong, and past the bound gets the 400 that names every shape. A control call's body is decoded
whole: its route caps it at `CONTROL_BODY_BYTES` (1 MiB, routes.py), a 413 as it arrives
(http/server.py), so no body over it reaches here.

The cut (`_read_cut`): the decoder skips a token-id list number by number, most of the time a
TRL body takes to read (docs/design/overhead.md#one-path-41). So a body whose `"prompt":` is
followed by an array is first read with that array cut out, up to its first `]`: the decoder
checks the rest with `[]` in its place, and the array is judged on its own text as above
(remembered, or range-checked by its parse, which also checks its JSON). The cut holds only
when the rest's prompt is that `[]` and the rest holds no other `[]`, so that no other key
(nested, written twice, spelled with escapes) is the body's prompt. Whatever it cannot prove,
and every refusal, goes to the whole body's read: the one rule of what is accepted, and of
every error's wording.

No memory of whole bodies: TRL 1.16 gives each of the G samples its own `seed`, so no two
bodies are identical, and a cache of recent bodies never hit while costing every request a
hash of its body (bench/results/body_reuse.md).
"""

from __future__ import annotations

import os
import re
from array import array
from collections import OrderedDict
from typing import Any, cast

import msgspec
import orjson
from xxhash import xxh3_64_intdigest

from lora_router.http.errors import HTTPError, bad_request
from lora_router.routing.keys import TEXT_BYTES_PER_TOKEN


class _Body(msgspec.Struct):
    """The fields the router reads; an absent Raw field is empty."""

    model: str | None = None
    stream: bool | None = False
    prompt: msgspec.Raw = msgspec.Raw()
    prompt_embeds: msgspec.Raw = msgspec.Raw()
    messages: msgspec.Raw = msgspec.Raw()


_decode = msgspec.json.Decoder(_Body).decode
# A byte that every JSON value but a non-negative integer holds: a string's quote, an object's
# or array's opening, a sign, a fraction, an exponent, the e of `true` and `false`, the n of
# `null`. A JSON array (its syntax is already checked) without them between its brackets holds
# only digits, commas and whitespace: a flat list of non-negative integers. One `in` (memchr)
# each, where deleting every digit (`bytes.translate`) looks each byte up.
_NOT_IN_IDS = b'"{[-.eEn'  # iterated as ints: `int in bytes` is memchr with no TypeError
_WHERE = re.compile(r"at `\$\.(\w+)")
# The cut (`_read_cut`): a `"prompt":` key, then an array, whose place the hole takes.
_PROMPT_KEY = b'"prompt":'
_ARRAY_AT = re.compile(rb"[ \t\r\n]*\[")
_HOLE = b"[]"
_HOLE_RAW = msgspec.Raw(_HOLE)
# A batch read on its text (`_token_batch`, `_TEXT_BATCH`), the syntax already checked: a list
# of lists each holding digits, commas and whitespace, an id first; a list of strings.
_TOKEN_BATCH = re.compile(rb"\[\s*+\[\s*+\d[\d\s,]*+\](?:\s*+,\s*+\[\s*+\d[\d\s,]*+\])*+\s*+\]")
_STRING = rb'"[^"\\]*+(?:\\.[^"\\]*+)*+"'
_TEXT_BATCH = re.compile(
    rb"\[\s*+(" + _STRING + rb")(?:\s*+,\s*+" + _STRING + rb")*+\s*+\]", re.DOTALL
)
_MAX_ID = 2**32 - 1
# The JSON values (keys included) a prompt or messages may decode into (module docstring):
# about 60 bytes each at most, so some 16 MiB.
MAX_DECODED_VALUES = 1 << 18


class Completion(msgspec.Struct):
    """The routing-relevant fields of a /v1/completions or /v1/chat/completions body.

    A msgspec Struct rather than a dataclass: built in C, with no Python `__init__` frame, once
    per request."""

    model: str | None
    raw_tokens: bytes | None  # a flat token-id prompt, as the client wrote it (validated)
    tokens: array[int] | None  # the first prompt of a batch of token-id prompts
    text: bytes | None  # a text prompt, or chat messages in a prefix-stable encoding
    stream: bool

    def token_ids(self) -> array[int] | None:
        """The (first) token-id prompt as packed ids; a raw prompt is parsed on first use (its
        text was validated by `read_completion`, so this cannot fail)."""
        if self.tokens is None and self.raw_tokens is not None:
            self.tokens = array("I", orjson.loads(self.raw_tokens))
        return self.tokens


class _RecentPrompts:
    """The last few token-id prompt texts whose ids were range-checked, found by a seeded hash
    and compared exactly (a collision costs a parse, never a wrong answer), bounded by count
    and by bytes."""

    __slots__ = ("_bytes", "_items", "_seed", "entries", "max_bytes")

    def __init__(self, entries: int, max_bytes: int) -> None:
        self.entries = entries
        self.max_bytes = max_bytes
        self._seed = int.from_bytes(os.urandom(8), "little")  # unpredictable buckets
        self._items: OrderedDict[int, bytes] = OrderedDict()
        self._bytes = 0

    def seen(self, raw: bytes) -> int | None:
        """None if `raw` was checked recently, else its key for `add`."""
        key = xxh3_64_intdigest(raw, self._seed)
        if self._items.get(key) == raw:
            self._items.move_to_end(key)
            return None
        return key

    def add(self, key: int, raw: bytes) -> None:
        if len(raw) > self.max_bytes // 4:
            return
        items = self._items
        old = items.get(key)
        if old is not None:
            self._bytes -= len(old)
            items.move_to_end(key)  # a new key is stored last already
        items[key] = raw
        self._bytes += len(raw)
        while len(items) > self.entries or self._bytes > self.max_bytes:
            _, gone = items.popitem(last=False)
            self._bytes -= len(gone)


class CompletionReader:
    """`read_completion` with a memory of the token-id prompts it range-checked last (see the
    module docstring). Only prompts read without error are kept, so a bad one is judged afresh
    every time."""

    __slots__ = ("_prompts", "max_prompt_tokens")

    def __init__(self, max_prompt_tokens: int, entries: int = 256, max_bytes: int = 16 << 20):
        self.max_prompt_tokens = max_prompt_tokens
        self._prompts = _RecentPrompts(entries, max_bytes)

    def read(self, body: bytes, *, chat: bool) -> Completion:
        """`read_completion` with this reader's limit and memory."""
        return read_completion(
            body, chat=chat, max_prompt_tokens=self.max_prompt_tokens, checked=self._prompts
        )


def read_completion(
    body: bytes, *, chat: bool, max_prompt_tokens: int, checked: _RecentPrompts | None = None
) -> Completion:
    """Read and validate a completion body (raises vLLM's 400). `checked`: token-id prompt
    texts that passed every check here already, under this same `max_prompt_tokens` (a
    `CompletionReader`'s), whose text needs no second look."""
    if not body:
        raise bad_request("The request body is empty; expected a JSON object.")
    if not chat:
        cut = _read_cut(body, max_prompt_tokens, checked)
        if cut is not None:
            return cut
    try:
        data = _decode(body)
    except RecursionError:
        raise _too_deep() from None
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
    limit = max_prompt_tokens * TEXT_BYTES_PER_TOKEN  # a text's keyed prefix (above)
    if chat:
        messages = _messages_text(bytes(data.messages), limit)
        return Completion(model, None, None, messages, stream)
    raw = bytes(data.prompt)
    if (not raw or raw == b"null") and data.prompt_embeds:
        return Completion(model, None, None, None, stream)  # embeddings: the replica judges them
    if raw[:1] == b'"':
        return Completion(model, None, None, _text(raw, limit), stream)
    if raw[:1] == b"[":
        flat = _token_prompt(model, raw, stream, max_prompt_tokens, checked)
        if flat is not None:
            return flat
        tokens = _token_batch(raw, max_prompt_tokens)
        if tokens is not None:
            return Completion(model, None, tokens, None, stream)
        texts = _TEXT_BATCH.fullmatch(raw)
        if texts is not None:  # keyed by its first prompt, the others left to the replica
            return Completion(model, None, None, _text(texts.group(1), limit), stream)
    raise _prompt_error(_loads(raw) if raw and _decodable(raw) else None)


def _read_cut(
    body: bytes, max_prompt_tokens: int, checked: _RecentPrompts | None
) -> Completion | None:
    """A body whose prompt is a flat token-id list, read with the list cut out (module
    docstring): the decoder checks the rest of the body with `[]` in the list's place, the
    list is judged on its own text (`_token_prompt`), and the cut holds only where the rest's
    prompt is that `[]`, the rest's only one (so no other key, nested or spelled otherwise,
    is the body's prompt). A valid rest with a valid JSON value put back in the hole is a
    valid body, with the same fields. None, for any doubt or any refusal: the whole body is
    then read by `read_completion`, whose answer is the rule."""
    at = body.find(_PROMPT_KEY)
    if at < 0:
        return None
    found = _ARRAY_AT.match(body, at + len(_PROMPT_KEY))
    if found is None:
        return None
    start = found.end() - 1
    end = body.find(b"]", start) + 1  # a flat list's first `]` is its end
    if not end:
        return None
    rest = body[:start] + _HOLE + body[end:]
    try:
        data = _decode(rest)
    except (msgspec.DecodeError, RecursionError):
        return None
    if data.prompt != _HOLE_RAW or rest.count(_HOLE) != 1:
        return None
    try:
        return _token_prompt(
            data.model, body[start:end], bool(data.stream), max_prompt_tokens, checked
        )
    except HTTPError:
        return None


def _token_prompt(
    model: str | None,
    raw: bytes,
    stream: bool,
    max_prompt_tokens: int,
    checked: _RecentPrompts | None,
) -> Completion | None:
    """The completion of a flat token-id prompt `raw` (a JSON array's text), its ids
    range-checked unless `checked` holds its text, or None if `raw` is not a flat list of
    non-negative integers (by its text); raises vLLM's 400 for an empty list, too many
    tokens or an id past 32 bits."""
    key: int | None = 0
    if checked is not None:
        key = checked.seen(raw)
        if key is None:  # passed every check below already (a GRPO sibling): no second look
            return Completion(model, raw, None, None, stream)
    ids = raw[1:-1]
    if any(c in ids for c in _NOT_IN_IDS):
        return None
    if not ids.strip():
        raise bad_request("A token-id prompt must be a non-empty list of integers.", "prompt")
    # A token per comma but the first, counted only if there can be too many (each token
    # but the last takes a digit and a comma at least).
    if (len(ids) + 1) // 2 > max_prompt_tokens:
        count = ids.count(b",") + 1
        if count > max_prompt_tokens:
            raise bad_request(
                f"The prompt has {count} tokens; the limit is {max_prompt_tokens}.", "prompt"
            )
    tokens = _range_checked(raw)
    if checked is not None and key is not None:
        checked.add(key, raw)
    return Completion(model, raw, tokens, None, stream)


def _decodable(raw: bytes) -> bool:
    """Whether decoding `raw` whole makes at most `MAX_DECODED_VALUES` JSON values (module
    docstring): a value (or key) begins the text or follows a `{`, `[`, `,` or `:`, so those
    bytes, counted in C (inside strings too: an upper bound), bound them; a text that short
    holds no more."""
    if len(raw) < MAX_DECODED_VALUES:
        return True
    return 1 + sum(raw.count(c) for c in b"{[,:") <= MAX_DECODED_VALUES


def _loads(raw: bytes) -> object:
    """A raw field decoded (msgspec checked its JSON syntax, not its strings' UTF-8); callers
    decode a string, or a text `_decodable` passed."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        if exc.msg.startswith("depth limit"):
            raise _too_deep() from None
        raise bad_request(f"The request body is not valid JSON: {exc.msg}.") from None


def _text(raw: bytes, limit: int) -> bytes:
    """A JSON string's (`raw` opens with its quote) first `limit` bytes of UTF-8."""
    return cast(str, _loads(raw)).encode()[:limit]


def _token_batch(raw: bytes, max_prompt_tokens: int) -> array[int] | None:
    """The first prompt of a batch of token-id prompts `raw` (a JSON array's text), or None if
    `raw` is not a list of non-empty flat lists of non-negative integers (by its text, as
    `_token_prompt` judges one); raises vLLM's 400 for more than `max_prompt_tokens` tokens in
    the whole batch or an id past 32 bits.

    Every id is range-checked in one parse, bounded by the limit on the batch's tokens: a
    batch costs what one prompt of as many tokens costs, however many prompts it holds."""
    if _TOKEN_BATCH.fullmatch(raw) is None:
        return None
    # A token per comma, plus one: each list's last id has none, the lists' commas make up
    # for all but the first (every list holds an id: checked above).
    count = raw.count(b",") + 1
    if count > max_prompt_tokens:
        raise bad_request(
            f"The batch's prompts have {count} tokens in all; the limit is {max_prompt_tokens}.",
            "prompt",
        )
    ids = _range_checked(b"[" + raw.translate(None, b"[]") + b"]")
    first = raw[: raw.index(b"]")]
    return ids[: first.count(b",") + 1]


def _prompt_error(prompt: object) -> HTTPError:
    """Why `prompt` (decoded; None when absent or not `_decodable`) is none of the shapes
    `read_completion` reads: a string, a list of token ids, or a non-empty list of either
    (a text batch of strings only). The 400 names what is wrong as closely as its shape
    tells."""
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):
            return bad_request("A batch of text prompts must contain only strings.", "prompt")
        for ids in prompt if isinstance(first, list) else (prompt,):
            if not isinstance(ids, list) or not ids:
                return bad_request(
                    "A token-id prompt must be a non-empty list of integers.", "prompt"
                )
            if not all(type(i) is int and 0 <= i <= _MAX_ID for i in ids):
                return _bad_token_ids()
    return bad_request(
        "`prompt` must be a string, a list of token ids, or a non-empty list of either.",
        param="prompt",
    )


def _range_checked(raw: bytes) -> array[int]:
    """A flat list of non-negative integers (checked on its text) as 32-bit ids."""
    tokens = array("I")
    try:
        tokens.fromlist(orjson.loads(raw))  # faster than array("I", list): no generic iteration
    # Beyond 64 bits orjson reads a float (TypeError here), beyond a double's range it gives
    # up ("number is infinity"); between 32 and 64 bits the array overflows.
    except (orjson.JSONDecodeError, TypeError, OverflowError):
        raise _bad_token_ids() from None
    return tokens


def _too_deep() -> HTTPError:
    return bad_request("The request body is nested too deeply to be read.")


def _bad_token_ids() -> HTTPError:
    return bad_request("Token ids must be integers between 0 and 4294967295.", param="prompt")


def _messages_text(raw: bytes, limit: int) -> bytes | None:
    """Chat messages `raw` (their JSON text), each serialised on its own and concatenated: a
    later turn's encoding starts with an earlier turn's, so conversations keep their affinity.
    Only the first `limit` bytes are kept (the messages after them are not serialised), grown
    in one buffer: a bytes object kept per message held some 4 KiB resident each.
    None, unkeyed and left to the replica, for messages not `_decodable` (module docstring)."""
    if raw and not _decodable(raw):
        return None
    messages = _loads(raw) if raw else None
    if not isinstance(messages, list) or not messages:
        raise bad_request("`messages` must be a non-empty list of objects.", param="messages")
    if not all(isinstance(m, dict) for m in messages):
        raise bad_request("Every message must be a JSON object.", param="messages")
    text = bytearray()
    try:
        for m in messages:
            if len(text) >= limit:
                break
            text += orjson.dumps(m, option=orjson.OPT_SORT_KEYS)
    except orjson.JSONEncodeError:  # nested deeper than the encoder goes (255 levels)
        raise _too_deep() from None
    del text[limit:]
    return bytes(text)


# -- adapter loads and unloads (their bodies go to the replicas as they are) ------------


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        doc = orjson.loads(body) if body else None
    except orjson.JSONDecodeError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc.msg}.") from None
    if not isinstance(doc, dict):
        raise bad_request("The request body must be a JSON object.")
    return doc


def load_fields(body: bytes) -> tuple[str, str, bool]:
    """A load's `lora_name`, `lora_path` and `load_inplace`, validated as vLLM does."""
    doc = _json_object(body)
    name, path = doc.get("lora_name"), doc.get("lora_path")
    if not isinstance(name, str) or not isinstance(path, str) or not name or not path:
        raise HTTPError(
            400, "Both 'lora_name' and 'lora_path' must be provided.", type="InvalidUserInput"
        )
    inplace = doc.get("load_inplace", False)
    if not isinstance(inplace, bool):
        raise bad_request("`load_inplace` must be a boolean.", param="load_inplace")
    return name, path, inplace


def unload_name(body: bytes) -> str:
    """An unload's `lora_name`, validated as vLLM does."""
    name = _json_object(body).get("lora_name")
    if not isinstance(name, str) or not name:
        raise HTTPError(
            400, "'lora_name' needs to be provided to unload an adapter.", type="InvalidUserInput"
        )
    return name


# -- aborts (their bodies go to every replica as they are: fleet/aborts.py) ----------------

ABORT_PATH = "/abort_requests"  # the RLHF dev route; the other is the scale-out route


def abort_ids(path: str, body: bytes) -> list[str] | None:
    """The request ids an abort on `path` names (None: every request in flight), checked as
    vLLM 0.32 checks them, with its messages: a body that is not JSON or not a JSON object is
    a 400; on `/inference/v1/abort_requests` a missing `request_ids` is a 400, and an empty
    list aborts nothing; on `/abort_requests` an empty or missing one aborts everything.

    Stricter than vLLM on purpose: `request_ids` must be null, a string or a list of strings
    (vLLM would abort everything for a falsy `0`, `false` or `{}` on `/abort_requests`, and
    answer 500 for a number), and the scale-out route's body must be an object (vLLM answers
    500). A typo must not abort a fleet's work."""
    dev = path == ABORT_PATH
    try:
        doc = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise bad_request("Invalid JSON format" if dev else f"JSON decode error: {exc}") from None
    if not isinstance(doc, dict):
        raise bad_request("Request body must be a JSON object")
    ids = doc.get("request_ids")
    if ids is None and not dev:
        raise bad_request("Missing 'request_ids' in request body")
    if not (
        ids is None
        or isinstance(ids, str)
        or (isinstance(ids, list) and all(isinstance(i, str) for i in ids))
    ):
        raise bad_request(
            "'request_ids' must be a list of request ids (strings), or null.", "request_ids"
        )
    if dev and not ids:
        return None
    return [ids] if isinstance(ids, str) else ids
