"""What the router reads of a completion body (pure)."""

from __future__ import annotations

import pytest
from xxhash import xxh3_64_intdigest

from lora_router.body import CompletionReader, read_completion
from lora_router.http.errors import HTTPError


def read(body: bytes, chat: bool = False):
    return read_completion(body, chat=chat, max_prompt_tokens=100)


def test_token_prompt() -> None:
    c = read(b'{"model": "trl-policy-v7", "prompt": [151644, 8948, 198], "stream": true}')
    assert c.model == "trl-policy-v7" and list(c.token_ids() or []) == [151644, 8948, 198]
    assert c.stream and c.text is None


def test_a_sibling_prompt_is_kept_as_its_wire_text_and_not_parsed_again() -> None:
    reader = CompletionReader(100)
    first = reader.read(b'{"prompt": [7, 8,  9], "seed": 1}', chat=False)
    assert first.raw_tokens == b"[7, 8,  9]" and list(first.tokens or []) == [7, 8, 9]
    sibling = reader.read(b'{"prompt": [7, 8,  9], "seed": 2}', chat=False)
    assert sibling.raw_tokens == b"[7, 8,  9]" and sibling.tokens is None  # not parsed
    assert list(sibling.token_ids() or []) == [7, 8, 9]


@pytest.mark.parametrize(
    "prompt",
    [b"[-1, 2]", b"[1.5]", b"[1e3]", b'[1, "2"]', b"[1, [2]]", b"[]", b"[ ]", b"{}", b"null"],
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


def test_batch_is_keyed_by_its_first_prompt_and_validated_whole() -> None:
    assert list(read(b'{"prompt": [[1, 2], [3]]}').token_ids() or []) == [1, 2]
    with pytest.raises(HTTPError):
        read(b'{"prompt": [[1, 2], [-3]]}')


def test_text_and_chat_prompts() -> None:
    assert read(b'{"prompt": "hi"}').text == b"hi"
    assert read(b'{"prompt": ["a", "b"]}').text == b"a"
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


def test_the_reader_hands_an_identical_body_its_earlier_reading() -> None:
    reader = CompletionReader(100)
    body = b'{"model": "trl-policy-v3", "prompt": [1, 2, 3], "seed": 7}'
    first = reader.read(body, chat=False)
    again = reader.read(bytes(bytearray(body)), chat=False)  # equal bytes, another object
    assert again is first and reader.hits == 1
    other = reader.read(body.replace(b"3]", b"4]"), chat=False)
    assert other is not first and other.raw_tokens == b"[1, 2, 4]" and reader.hits == 1


def test_the_reader_compares_bytes_not_only_hashes() -> None:
    reader = CompletionReader(100)
    a = b'{"model": "a", "prompt": [1]}'
    b = b'{"model": "b", "prompt": [2]}'
    reader.read(a, chat=False)
    # Make b's slot hold a's reading, as a hash collision would.
    bodies = reader._bodies
    (entry,) = bodies._items.values()
    bodies._items.clear()
    bodies._items[xxh3_64_intdigest(b, bodies._seed)] = entry
    got = reader.read(b, chat=False)
    assert got.model == "b" and reader.hits == 0


def test_the_reader_never_remembers_a_bad_body_and_stays_bounded() -> None:
    reader = CompletionReader(100, entries=4, max_bytes=4096)
    bad = b'{"prompt": [-1]}'
    for _ in range(2):
        with pytest.raises(HTTPError):
            reader.read(bad, chat=False)
    bodies = reader._bodies
    assert not bodies._items and not reader._prompts._items
    for i in range(10):
        reader.read(b'{"prompt": [%d]}' % i, chat=False)
    assert len(bodies._items) == 4 and len(reader._prompts._items) == 4
    big = b'{"prompt": [1], "x": "' + b"y" * 900 + b'"}'
    for i in range(8):
        reader.read(big.replace(b"[1]", b"[%d]" % i), chat=False)
    assert bodies._bytes <= 4096 and bodies._bytes == sum(len(b) for b, _ in bodies._items.values())
    # Chat and completions never share a reading of the same bytes.
    chat = b'{"messages": [{"role": "user", "content": "hi"}], "prompt": [5]}'
    assert reader.read(chat, chat=True).text is not None
    assert reader.read(chat, chat=False).raw_tokens == b"[5]"
