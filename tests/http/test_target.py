"""The path rule, without sockets: a path is judged as vLLM's server (uvicorn's `unquote`, then
Starlette's exact match) will read it, or refused; never read as something else."""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lora_router.http.errors import HTTPError
from lora_router.http.target import canonical
from lora_router.routes import ROUTES, TABLE, Kind, forward_path_error, lookup


@pytest.mark.parametrize(
    ("path", "judged"),
    [
        (b"/pause", b"/pause"),
        (b"/p%61use", b"/pause"),
        (b"/%70%61%75%73%65", b"/pause"),
        (b"/update%5Fweights", b"/update_weights"),
        (b"/update%5fweights", b"/update_weights"),
        (b"/v1/load%5Flora%5Fadapter", b"/v1/load_lora_adapter"),
        (b"/pa%2575se", b"/pa%75se"),  # decoded once, as uvicorn does
        (b"/pause;x", b"/pause;x"),  # `;` is an ordinary character
        (b"/PAUSE", b"/PAUSE"),  # case is kept: no route matches it
        (b"/caf%C3%A9", "/café".encode()),
        (b"/", b"/"),
    ],
)
def test_a_path_is_judged_as_vllm_reads_it(path: bytes, judged: bytes) -> None:
    assert canonical(path) == judged


@pytest.mark.parametrize(
    "path",
    [
        b"/v1%2Fload_lora_adapter",  # an escaped separator
        b"/v1%2fload_lora_adapter",
        b"/v1%5Cload_lora_adapter",
        b"/v1\\load_lora_adapter",  # a raw backslash
        b"/pause%00",  # escaped controls
        b"/pause%0a",
        b"/pause%7F",
        b"/pause%",  # invalid escapes
        b"/pause%zz",
        b"/pause%4",
        b"/pause%ff",  # not UTF-8 once decoded
        b"//update_weights",  # empty segments
        b"/pause/",
        b"/v1//completions",
        b"/./update_weights",  # dot segments, escaped or not
        b"/x/../update_weights",
        b"/%2e/pause",
        b"/%2E%2E/pause",
        b"/pause/.",
    ],
)
def test_a_path_that_could_mean_two_things_is_refused_400(path: bytes) -> None:
    with pytest.raises(HTTPError) as err:
        canonical(path)
    assert err.value.status == 400 and "path" in err.value.message


_PIECES = st.sampled_from(
    [
        *"abcdefghijklmnopqrstuvwxyz_./;%\\ABCZ09-~",
        "%2F",
        "%2f",
        "%5C",
        "%00",
        "%25",
        "%2e",
        "%61",
        "%41",
        "%5F",
        "%C3%A9",
        "%ff",
        "%zz",
        "//",
        "/./",
        "/../",
    ]
)


@given(st.lists(_PIECES, max_size=12))
def test_a_judged_path_is_exactly_what_uvicorn_decodes_and_has_no_dot_or_empty_segment(
    pieces: list[str],
) -> None:
    raw = ("/" + "".join(pieces)).encode()
    try:
        judged = canonical(raw)
    except HTTPError as exc:
        assert exc.status == 400
        return
    assert judged == unquote(raw.decode("ascii")).encode()  # what vLLM routes on
    assert judged == b"/" or not {b"", b".", b".."} & set(judged.split(b"/")[1:])
    assert b"\\" not in judged and not any(c < 0x20 or c == 0x7F for c in judged)


def test_every_route_of_the_table_is_canonical_so_an_exact_hit_needs_no_decoding() -> None:
    for route in ROUTES:
        assert canonical(route.path) == route.path
        assert lookup(route.path) is route
    assert len(TABLE) == len(ROUTES)  # one entry per path


def test_the_replica_route_takes_one_id_segment() -> None:
    assert lookup(b"/router/replicas/3") is not None
    assert lookup(b"/router/replicas/3/x") is None
    assert lookup(b"/router/replicas") is TABLE[b"/router/replicas"]


@pytest.mark.parametrize(
    "path",
    [
        "/v1/completions",  # routed
        "/pause",  # broadcast
        "/sleep",  # refused
        "/update_weights",
        "/health",  # answered by the router
        "/router/anything",
        "v1/foo",  # not a path
        "http://evil.example/x",
        "/x?y=1",
        "/x%2Fy",
        "/a//b",
        "/a/./b",
        "/a/",
    ],
)
def test_a_forward_path_may_not_name_a_guarded_route_or_a_spelling(path: str) -> None:
    error = forward_path_error(path)
    assert error is not None and error.startswith("--forward-path")


@pytest.mark.parametrize("path", ["/v1/embeddings", "/version", "/my/own;v=1", "/"])
def test_a_forward_path_may_open_a_closed_or_unknown_route(path: str) -> None:
    assert forward_path_error(path) is None
    assert path != "/v1/embeddings" or TABLE[b"/v1/embeddings"].kind is Kind.CLOSED
