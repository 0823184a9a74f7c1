"""The head rules of http/framing.py, as a pure function: each framing a request may have, and
each it may not (the real-socket cases are in test_smuggling.py)."""

from __future__ import annotations

import pytest

from lora_router.http.errors import HTTPError
from lora_router.http.framing import CONTROL, Framing, body_framing

LENGTH = (b"content-length", b"12")
CHUNKED = (b"transfer-encoding", b"chunked")
CONTINUE = (b"expect", b"100-continue")


@pytest.mark.parametrize(
    ("headers", "version", "framing"),
    [
        ([LENGTH], "1.1", Framing(False, b"12", False)),
        ([CHUNKED], "1.1", Framing(True, None, False)),
        ([LENGTH, CONTINUE], "1.1", Framing(False, b"12", True)),
        ([CHUNKED, (b"expect", b"100-Continue")], "1.1", Framing(True, None, True)),
        ([LENGTH, CONTINUE], "1.0", Framing(False, b"12", False)),  # HTTP/1.0 has no 100
        ([CONTINUE], "1.1", Framing(False, None, False)),  # no body announced: nothing owed
    ],
)
def test_a_body_is_framed_by_one_length_or_plain_chunked(
    headers: list[tuple[bytes, bytes]], version: str, framing: Framing
) -> None:
    assert body_framing(headers, version) == framing


@pytest.mark.parametrize(
    ("headers", "version", "status"),
    [
        ([LENGTH, LENGTH], "1.1", 400),
        ([LENGTH, CHUNKED], "1.1", 400),
        ([CHUNKED, LENGTH], "1.1", 400),
        ([CHUNKED, CHUNKED], "1.1", 400),
        ([(b"transfer-encoding", b"gzip, chunked")], "1.1", 400),
        ([CHUNKED], "1.0", 400),
        ([LENGTH, (b"expect", b"200-ok")], "1.1", 417),
    ],
)
def test_an_ambiguous_or_unsupported_framing_is_refused(
    headers: list[tuple[bytes, bytes]], version: str, status: int
) -> None:
    with pytest.raises(HTTPError) as refused:
        body_framing(headers, version)
    assert refused.value.status == status


@pytest.mark.parametrize("value", [b"a\x00b", b"a\nb", b"a\rb", b"\x7f", b"\x1f"])
def test_a_control_character_in_a_header_value_is_found(value: bytes) -> None:
    assert CONTROL.search(value) is not None


def test_a_tab_in_a_header_value_is_allowed() -> None:
    assert CONTROL.search(b"a\tb") is None
