"""The cache accounting's two readings as pure functions (proxy/usage.py): what the policy
predicts vLLM will report, and what an answer's last reads say it reported."""

from __future__ import annotations

import itertools

import orjson
from hypothesis import example, given
from hypothesis import strategies as st

from lora_router.proxy.usage import (
    TAIL_BYTES,
    predicted_cached_tokens,
    reported_cached_tokens,
)


def test_a_prediction_counts_whole_blocks_and_never_the_last_token() -> None:
    assert predicted_cached_tokens(64, 0, 16) == 48  # a sibling of 64: the last block recomputed
    assert predicted_cached_tokens(65, 0, 16) == 64
    assert predicted_cached_tokens(76, 12, 16) == 64  # a continuation of a 64-token prompt
    assert predicted_cached_tokens(76, 76, 16) == 0  # a new family
    assert predicted_cached_tokens(10, 0, 16) == 0  # under one block


def _answer(cached: int | None, text: str = "a reply") -> bytes:
    details = None if cached is None else {"cached_tokens": cached, "created_cache_tokens": None}
    return orjson.dumps(
        {
            "id": "cmpl-1",
            "choices": [{"index": 0, "text": text}],
            "usage": {"prompt_tokens": 70, "prompt_tokens_details": details},
            "kv_transfer_params": None,
        }
    )


@given(
    cached=st.integers(0, 10**9),
    text=st.text(max_size=300),
    cuts=st.lists(st.integers(0, 10_000), max_size=6),
)
# The key cut across three reads, the middle one a byte: found once by CI's profile.
@example(cached=0, text="", cuts=[103, 104])
def test_the_report_is_read_wherever_the_reads_cut_the_body(
    cached: int, text: str, cuts: list[int]
) -> None:
    """A body cut into reads anywhere: found from its last three reads when the key lies in
    them and near the end, as the usage object of vLLM's answers does."""
    body = _answer(cached, text)
    at = sorted({min(c, len(body)) for c in cuts} | {0, len(body)})
    reads = [body[a:b] for a, b in itertools.pairwise(at) if b > a]
    last = [*reads[::-1], b"", b""][:3]
    key = body.rfind(b'"cached_tokens":')
    if key >= len(body) - sum(map(len, last)):
        assert key >= len(body) - 256  # where vLLM puts it: near the end
        assert reported_cached_tokens(*last) == cached


def test_a_stream_reports_in_its_usage_frame_before_done() -> None:
    usage = b'data: {"choices":[],"usage":{"prompt_tokens_details":{"cached_tokens":48}}}\n\n'
    frames = b"2f\r\n" + usage + b"\r\n"
    done = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"
    assert reported_cached_tokens(done, frames) == 48
    assert reported_cached_tokens(frames + done, b"") == 48
    # vLLM's three last writes, a read each (seen on a real replica): the frame two reads back.
    done, end = b"e\r\ndata: [DONE]\n\n\r\n", b"0\r\n\r\n"
    assert reported_cached_tokens(end, done, frames) == 48
    assert reported_cached_tokens(end, done, b"", frames) is None  # nothing before b""


def test_only_the_end_of_each_read_is_searched() -> None:
    far = _answer(16) + b" " * TAIL_BYTES
    assert reported_cached_tokens(far, b"") is None
    assert reported_cached_tokens(b"0\r\n\r\n", far) is None
    assert reported_cached_tokens(b"0\r\n\r\n", _answer(16)) == 16


def test_a_number_cut_by_the_reads_is_read_whole() -> None:
    body = _answer(123456)
    cut = body.index(b"123456") + 3
    assert reported_cached_tokens(body[cut:], body[:cut]) == 123456


def test_no_report_reads_as_none() -> None:
    assert reported_cached_tokens(_answer(None), b"") is None
    assert (
        reported_cached_tokens(b'{"usage":{"prompt_tokens_details":{"cached_tokens":null}}}', b"")
        is None
    )
    assert reported_cached_tokens(b"", b"") is None
    assert reported_cached_tokens(b'"cached_tokens":', b"") is None


def test_the_key_inside_generated_text_is_not_a_report() -> None:
    body = _answer(None, text='{"cached_tokens":999}')
    assert b'\\"cached_tokens\\":999' in body
    assert reported_cached_tokens(body, b"") is None
    assert reported_cached_tokens(_answer(16, text='"cached_tokens":999'), b"") == 16
