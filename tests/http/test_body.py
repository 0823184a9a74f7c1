"""What the router reads of a completion body (pure)."""

from __future__ import annotations

import pytest

from lora_router.body import read_completion
from lora_router.http.errors import HTTPError


def read(body: bytes, chat: bool = False):
    return read_completion(body, chat=chat, max_prompt_tokens=100)


def test_token_prompt() -> None:
    c = read(b'{"model": "trl-policy-v7", "prompt": [151644, 8948, 198], "stream": true}')
    assert c.model == "trl-policy-v7" and list(c.token_ids() or []) == [151644, 8948, 198]
    assert c.stream and c.text is None


def test_a_token_prompt_is_kept_as_its_wire_text_until_its_ids_are_needed() -> None:
    c = read(b'{"prompt": [7, 8,  9]}')
    assert c.raw_tokens == b"[7, 8,  9]" and c.tokens is None  # nothing parsed yet
    assert list(c.token_ids() or []) == [7, 8, 9]


@pytest.mark.parametrize(
    "prompt",
    [b"[-1, 2]", b"[1.5]", b"[1e3]", b'[1, "2"]', b"[1, [2]]", b"[]", b"[ ]", b"{}", b"null"],
)
def test_token_ids_are_non_negative_integers_checked_on_the_raw_text(prompt: bytes) -> None:
    with pytest.raises(HTTPError) as info:
        read(b'{"prompt": %s}' % prompt)
    assert info.value.status == 400 and info.value.param == "prompt"


def test_ids_beyond_32_bits_are_refused_when_parsed() -> None:
    c = read(b'{"prompt": [4294967296]}')
    with pytest.raises(HTTPError) as info:
        c.token_ids()
    assert info.value.status == 400 and info.value.param == "prompt"


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
