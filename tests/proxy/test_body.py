"""What the router reads of a completion body (pure)."""

from __future__ import annotations

import json
from functools import partial

import pytest
from hypothesis import given
from hypothesis import strategies as st
from xxhash import xxh3_64_intdigest

from lora_router.http.errors import HTTPError
from lora_router.proxy.body import MAX_DECODED_VALUES, CompletionReader, read_completion


def read(body: bytes, chat: bool = False):
    return read_completion(body, chat=chat, max_prompt_tokens=100)


def test_token_prompt() -> None:
    c = read(b'{"model": "trl-policy-v7", "prompt": [151644, 8948, 198], "stream": true}')
    assert c.model == "trl-policy-v7" and list(c.token_ids() or []) == [151644, 8948, 198]
    assert c.stream and c.text is None


def test_a_sibling_prompt_is_kept_as_its_wire_text_unparsed() -> None:
    reader = CompletionReader(100)
    first = reader.read(b'{"prompt": [7, 8,  9], "seed": 1}', chat=False)
    assert first.raw_tokens == b"[7, 8,  9]" and list(first.tokens or []) == [7, 8, 9]
    sibling = reader.read(b'{"prompt": [7, 8,  9], "seed": 2}', chat=False)
    assert sibling.raw_tokens == b"[7, 8,  9]" and sibling.tokens is None  # not parsed
    assert list(sibling.token_ids() or []) == [7, 8, 9]


@pytest.mark.parametrize(
    "prompt",
    [
        b"[-1, 2]",
        b"[1.5]",
        b"[1e3]",
        b'[1, "2"]',
        b"[1, [2]]",
        b"[]",
        b"[ ]",
        b"{}",
        b"null",
        b"[true]",
        b"[[1], [false]]",
        b"[[1], []]",
        b"[[1], [[2]]]",
        b"[[1], 2]",
        b'[[1], "a"]',
        b'["a", [1]]',
    ],
)
def test_token_ids_are_non_negative_integers_checked_on_the_raw_text(prompt: bytes) -> None:
    with pytest.raises(HTTPError) as info:
        read(b'{"prompt": %s}' % prompt)
    assert info.value.status == 400 and info.value.param == "prompt"


@pytest.mark.parametrize(
    "number", [b"4294967296", b"18446744073709551616", b"9" * 400, b"1" + b"0" * 100_000]
)
def test_ids_beyond_32_bits_are_refused_before_routing(number: bytes) -> None:
    with pytest.raises(HTTPError) as info:
        read(b'{"prompt": [1, %s]}' % number)
    assert info.value.status == 400 and info.value.param == "prompt"


@pytest.mark.parametrize("field", [b"prompt", b"messages", b"x", b"model"])
@pytest.mark.parametrize("depth", [300, 1100, 200_000])
def test_deep_nesting_anywhere_is_a_400(field: bytes, depth: int) -> None:
    nested = b"[" * depth + b"]" * depth
    with pytest.raises(HTTPError) as info:
        read(b'{"%s": %s}' % (field, nested), chat=field == b"messages")
    assert info.value.status == 400


def test_a_message_nested_past_the_encoders_depth_is_a_400() -> None:
    inner = b'{"a":' * 300 + b"1" + b"}" * 300
    with pytest.raises(HTTPError) as info:
        read(b'{"messages": [{"role": "user", "content": %s}]}' % inner, chat=True)
    assert info.value.status == 400 and "nested" in info.value.message


def test_a_batch_is_keyed_by_its_first_prompt() -> None:
    assert list(read(b'{"prompt": [[1, 2], [3]]}').token_ids() or []) == [1, 2]


def test_a_batch_is_validated_whole() -> None:
    with pytest.raises(HTTPError):
        read(b'{"prompt": [[1, 2], [-3]]}')


def ids(n: int, start: int = 0) -> bytes:
    return b"[%s]" % b", ".join(b"%d" % i for i in range(start, start + n))


def test_a_batch_is_limited_by_its_tokens_in_all() -> None:
    with pytest.raises(HTTPError) as info:
        read(b'{"prompt": [%s, %s]}' % (ids(60), ids(41)))
    assert info.value.status == 400 and info.value.param == "prompt"
    assert info.value.message == "The batch's prompts have 101 tokens in all; the limit is 100."
    batch = read(b'{"prompt": [%s, %s]}' % (ids(60, 7), ids(40)))
    assert list(batch.token_ids() or []) == list(range(7, 67))


@given(
    batch=st.lists(st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=5), min_size=1),
    spaced=st.booleans(),
)
def test_a_batch_of_token_ids_read_on_its_text_is_keyed_by_its_first_prompt(
    batch: list[list[int]], spaced: bool
) -> None:
    body = json.dumps({"prompt": batch[:20]}, separators=(" , ", ": ") if spaced else (",", ":"))
    assert list(read(body.encode()).token_ids() or []) == batch[0]


def test_a_text_prompt_is_read_as_its_first_text() -> None:
    assert read(b'{"prompt": "hi"}').text == b"hi"
    assert read(b'{"prompt": ["a", "b"]}').text == b"a"


def test_a_chat_prompt_is_read_as_text_without_token_ids() -> None:
    chat = read(b'{"messages": [{"role": "user", "content": "x"}]}', chat=True)
    assert chat.text and chat.token_ids() is None


def test_prompt_embeds_instead_of_a_prompt_is_left_to_the_replica() -> None:
    c = read(b'{"prompt_embeds": "base64..."}')
    assert c.token_ids() is None and c.text is None


def test_errors_are_vllm_400_naming_the_field() -> None:
    with pytest.raises(HTTPError) as info:
        read(b'{"model": 5, "prompt": [1]}')
    assert info.value.status == 400 and info.value.param == "model"
    assert info.value.type == "Bad Request"
    with pytest.raises(HTTPError) as info:
        read(b'{"prompt": [%s]}' % b",".join(b"1" for _ in range(101)))
    assert info.value.param == "prompt" and "101" in info.value.message


def test_the_reader_compares_prompt_bytes_not_only_hashes() -> None:
    reader = CompletionReader(100)
    reader.read(b'{"prompt": [1]}', chat=False)
    # Make [2]'s slot hold [1]'s text, as a hash collision would: [2] is still checked.
    prompts = reader._prompts
    (text,) = prompts._items.values()
    prompts._items.clear()
    prompts._items[xxh3_64_intdigest(b"[2]", prompts._seed)] = text
    got = reader.read(b'{"prompt": [2]}', chat=False)
    assert got.tokens is not None and list(got.tokens) == [2]


def small_reader() -> CompletionReader:
    """A reader that remembers at most 4 prompts, of 64 bytes in all."""
    return CompletionReader(100, entries=4, max_bytes=64)


def test_the_reader_never_remembers_a_bad_prompt() -> None:
    reader = small_reader()
    for _ in range(2):
        with pytest.raises(HTTPError):
            reader.read(b'{"prompt": [4294967296]}', chat=False)  # 2**32: out of range
    assert not reader._prompts._items


def test_the_reader_stays_bounded() -> None:
    reader = small_reader()
    prompts = reader._prompts
    for i in range(10):
        reader.read(b'{"prompt": [%d]}' % i, chat=False)
    assert len(prompts._items) == 4
    for i in range(8):
        reader.read(b'{"prompt": [%d, 1, 2, 3]}' % (1000 + i), chat=False)
    assert prompts._bytes <= 64 and prompts._bytes == sum(map(len, prompts._items.values()))


def test_a_text_prompt_is_keyed_on_its_first_4_bytes_a_token_of_the_limit() -> None:
    import orjson

    from lora_router.routing.keys import Seeds, completion_key

    shared = "é" * 300  # 600 bytes of UTF-8: past the 400 the limit of 100 tokens allows
    one, other = (read(orjson.dumps({"prompt": shared + tail})) for tail in ("a", "b" * 10**5))
    assert one.text == other.text == shared.encode()[:400]
    batch = read(orjson.dumps({"prompt": [shared + "a", "x"]}))
    assert batch.text == one.text
    seeds = Seeds(0, 0, 0)
    keys = [completion_key(c, seeds, 16).key for c in (one, other)]
    assert keys[0] == keys[1] and keys[0] is not None and keys[0].tokens == 100


def test_chat_messages_are_keyed_on_a_bounded_prefix_and_later_messages_not_encoded() -> None:
    import orjson

    first = {"role": "user", "content": "q" * 500}
    deep = b"[" * 300 + b'"x"' + b"]" * 300  # deeper than the encoder goes: never encoded
    body = b'{"messages": [%s, {"role": "assistant", "content": %s}]}' % (orjson.dumps(first), deep)
    chat = read(body, chat=True)
    assert chat.text == orjson.dumps(first, option=orjson.OPT_SORT_KEYS)[:400]
    short = read(orjson.dumps({"messages": [{"role": "user", "content": "hi"}]}), chat=True)
    assert short.text == b'{"content":"hi","role":"user"}'


def test_a_chat_past_the_decoded_values_bound_is_left_unkeyed_to_the_replica() -> None:
    # `[{},{},...]`: a `{` and a `,` a message, and the `[`; one more value than the bound.
    past = b'{"messages": [%s]}' % b",".join([b"{}"] * (MAX_DECODED_VALUES // 2))
    chat = read(past, chat=True)
    assert chat.text is None and chat.token_ids() is None
    within = b'{"messages": [%s]}' % b",".join([b"{}"] * (MAX_DECODED_VALUES // 2 - 1))
    assert read(within, chat=True).text == b"{}" * 200  # keyed on its first 400 bytes


def test_a_wrong_prompt_past_the_decoded_values_bound_gets_the_400_naming_every_shape() -> None:
    with pytest.raises(HTTPError) as info:
        read(b'{"prompt": [%s]}' % b",".join([b"[-1]"] * MAX_DECODED_VALUES))
    assert info.value.status == 400 and info.value.param == "prompt"
    assert info.value.message.startswith("`prompt` must be a string, a list of token ids")


# -- the cut: a flat token-id list is judged on its own text, not walked by the decoder -------


def whole(read) -> object:
    """What `read()` answers with the cut taken out, the body decoded whole (`outcome`)."""
    from lora_router.proxy import body as module

    saved, module._read_cut = module._read_cut, lambda *args: None
    try:
        return outcome(read)
    finally:
        module._read_cut = saved


def outcome(read):
    """A read's `Completion` fields, or its error's status, message and param."""
    try:
        c = read()
    except HTTPError as exc:
        return ("error", exc.status, exc.message, exc.param)
    tokens = None if c.tokens is None else list(c.tokens)
    return (c.model, c.raw_tokens, tokens, c.text, c.stream)


def test_a_flat_token_id_prompt_is_never_walked_by_the_decoder(monkeypatch) -> None:
    from lora_router.proxy import body as module

    prompt = b"[" + b", ".join(b"%d" % (151_000 + i) for i in range(400)) + b"]"
    seen: list[bytes] = []
    real = module._decode
    monkeypatch.setattr(module, "_decode", lambda data: seen.append(data) or real(data))
    reader = CompletionReader(1000)
    for seed in (1, 2):  # a first prompt, then its sibling
        body = b'{"model": "m", "prompt": %s, "max_tokens": 16, "seed": %d}' % (prompt, seed)
        got = reader.read(body, chat=False)
        assert got.raw_tokens == prompt and got.model == "m" and not got.stream
    assert len(seen) == 2 and all(prompt[:40] not in data for data in seen)
    ids = read_completion(body, chat=False, max_prompt_tokens=1000).token_ids()
    assert list(ids or []) == [151_000 + i for i in range(400)]


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": [1, 2, 3], "stream": true, "model": "a"}',
        b'{"prompt":[1,2]}',
        b'{"prompt" : [1, 2]}',  # the key spelled with a space: read whole
        b'{"prompt":\n\t [1, 2] }',
        b'{"a": {"prompt": [5, 6]}, "prompt": [7]}',  # a nested key first
        b'{"a": {"prompt": [5, 6]}, "prompt": []}',  # ... and the real prompt the hole's text
        b'{"a": {"prompt": [5, 6]}, "prompt": "text"}',
        b'{"a": {"prompt": [5, 6]}}',
        b'{"x\\"prompt": [5], "prompt": [9]}',  # the key inside an escaped string
        b'{"\\u0070rompt": [3], "prompt": [4]}',
        b'{"prompt": [4], "\\u0070rompt": [3]}',
        b'{"prompt": [1], "prompt": [2]}',  # a key twice: the decoder's rule, whichever
        b'{"prompt": [1], "stop": []}',
        b'{"prompt": [1, 2], "model": 5}',
        b'{"prompt": [1, 2], "stream": "yes"}',
        b'{"prompt": [1,, 2]}',
        b'{"prompt": [01, 2]}',
        b'{"prompt": [1 2]}',
        b'{"prompt": [1, 2],}',
        b'{"prompt": [1, 2]',
        b'{"prompt": [1, 2]} x',
        b'{"prompt": [1, 4294967296]}',
        b'{"prompt": [], "model": "m"}',
        b'{"prompt": [ ]}',
        b'{"prompt": [%s]}' % b",".join(b"1" for _ in range(101)),
        b'{"prompt": [[1, 2], [3]]}',
        b'{"prompt": [1, "]"]}',
        b'{"prompt": [1, [2]]}',
        b'{"prompt": [1], "prompt_embeds": "x"}',
        b'[{"prompt": [1]}]',
        b'{"prompt": [1], "x": %s}' % (b"[" * 2000 + b"]" * 2000),
    ],
)
def test_the_cut_reads_what_the_whole_body_says(body: bytes) -> None:
    assert outcome(lambda: read(body)) == whole(lambda: read(body))
    cut, decoded = CompletionReader(100), CompletionReader(100)  # with a memory of prompts
    for _ in range(2):  # a first prompt, then its sibling
        got = outcome(lambda: cut.read(body, chat=False))
        assert got == whole(lambda: decoded.read(body, chat=False))


_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-2, 2**33)
    | st.sampled_from(["", "a", "]", '"'])
    | st.lists(st.integers(0, 2**32), max_size=4),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["prompt", "model", "x"]), inner, max_size=3)
    ),
    max_leaves=8,
)


@given(
    doc=st.dictionaries(st.sampled_from(["prompt", "model", "stream", "x"]), _VALUES, max_size=4),
    spaced=st.booleans(),
    dropped=st.integers(0, 80),
)
def test_the_cut_reads_what_the_whole_body_says_of_any_body(
    doc: dict[str, object], spaced: bool, dropped: int
) -> None:
    body = json.dumps(doc, separators=(", ", ": ") if spaced else (",", ":")).encode()
    for variant in (body, body[:dropped] + body[dropped + 1 :]):  # and one byte short
        assert outcome(partial(read, variant)) == whole(partial(read, variant))
