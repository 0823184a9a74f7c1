"""No routed body earns the router's own 500: hypothesis writes arbitrary JSON (deep nesting,
huge and negative numbers, floats, strings, nulls, invalid UTF-8, wrong types in every field the
router reads) to both routed paths of a live router, on one kept-alive connection, and checks
that each answer is either the router's 4xx in vLLM's error shape (the replica saw nothing) or
the replica's own answer to exactly the bytes sent."""

from __future__ import annotations

import aiohttp
import orjson
from http_harness import FakeReplica, RawClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

ROUTED = ("/v1/completions", "/v1/chat/completions")
# Fields the router reads (body.py), and a few it forwards untouched.
FIELDS = ("model", "stream", "prompt", "prompt_embeds", "messages", "max_tokens", "seed")


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


# JSON fragments a JSON library would not write: what a hostile client sends.
RAW = st.sampled_from(
    [
        nested(300),
        nested(1100),
        nested(200_000),
        b'{"a":' * 300 + b"1" + b"}" * 300,
        b"1" + b"0" * 100_000,
        b"-" + b"9" * 400,
        b"18446744073709551616",
        b"4294967296",
        b"1e400",
        b"-0.0",
        b'"\xff\xfe"',
        b'"\xed\xa0\x80"',  # a surrogate, UTF-8 encoded
        b'"\xc0\xaf"',  # overlong
        b'"\\ud800"',  # a lone surrogate escape
        b"[1, 2, 3]",
        b"[151644, 8948, 198]",
    ]
)


def encode(value: object) -> bytes:
    """JSON text of a value, integers of any size included (orjson stops at 64 bits)."""
    if isinstance(value, bytes):
        return value  # a raw fragment
    if value is None or isinstance(value, bool):
        return orjson.dumps(value)
    if isinstance(value, int):
        return str(value).encode()
    if isinstance(value, float):
        return repr(value).encode()
    if isinstance(value, str):
        return orjson.dumps(value)
    if isinstance(value, list):
        return b"[" + b",".join(encode(v) for v in value) + b"]"
    assert isinstance(value, dict)
    return b"{" + b",".join(orjson.dumps(k) + b":" + encode(v) for k, v in value.items()) + b"}"


scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=0, max_value=2**32),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.sampled_from(["base", "trl-policy-v1", "user", "content"]),
    RAW,
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=12,
)
plausible = st.fixed_dictionaries(
    {},
    optional={
        "model": st.sampled_from(["base", "trl-policy-v1"]) | values,
        "stream": st.booleans() | values,
        "prompt": st.lists(st.integers(0, 2**32), min_size=1, max_size=8) | values,
        "messages": st.lists(
            st.fixed_dictionaries({"role": st.just("user"), "content": st.text(max_size=8)}),
            min_size=1,
            max_size=3,
        )
        | values,
        "prompt_embeds": values,
        "max_tokens": values,
        "seed": values,
    },
)


@st.composite
def bodies(draw: st.DrawFn) -> bytes:
    shape = draw(st.sampled_from(["object", "object", "object", "value", "mangled"]))
    if shape == "value":
        return encode(draw(values))
    body = encode(draw(plausible))
    if shape == "mangled" and len(body) > 2:
        at = draw(st.integers(1, len(body) - 1))
        body = body[:at] + draw(st.sampled_from([b"\xff", b"\x00", b",", b"]", b'"'])) + body[at:]
    return body


def request(path: str, body: bytes) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nhost: r\r\ncontent-type: application/json\r\n"
    return head.encode() + b"content-length: %d\r\n\r\n" % len(body) + body


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(body=bodies(), chat=st.booleans())
async def test_any_routed_body_gets_a_4xx_from_the_router_or_goes_out_byte_for_byte(
    router, clients, replica: FakeReplica, body: bytes, chat: bool
):
    # Fixtures are shared by every example: one router, one client connection for them all.
    client: RawClient | None = getattr(replica, "body_fuzz", None)
    if client is None:
        # The default policy (prefix): it keys prompts, the path a bad prompt could break.
        rt = await router([replica], policy="prefix")
        client = replica.body_fuzz = await clients(rt.url)
    before = len(replica.requests)
    path = ROUTED[chat]
    await client.send(request(path, body))
    answer = await client.response()
    # The connection stays usable: kept alive here, and the next example reuses it.
    assert answer.header(b"connection") != b"close"
    if answer.header(b"x-lora-router-replica") is None:
        assert 400 <= answer.status < 500, (answer.status, answer.body[:300])
        error = answer.json()["error"]
        assert error["code"] == answer.status and isinstance(error["message"], str)
        assert len(replica.requests) == before
    else:
        assert answer.status == 200
        assert len(replica.requests) == before + 1
        sent = replica.requests[-1]
        assert sent.body == body and sent.target == path.encode()


async def the_reproductions_then_a_good_request(router, replica: FakeReplica):
    """The fuzzers' reproductions, then one good completion, on one client session: the
    (status, body) answers to the reproductions, the good one's status and its body, and one
    entry per connection the client opened."""
    rt = await router([replica], policy="prefix")
    opened = []  # connections the client opened: one for every request below
    refused = []

    async def on_open(*_: object) -> None:
        opened.append(1)

    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(on_open)
    headers = {"content-type": "application/json", "user-agent": "fuzz"}
    async with aiohttp.ClientSession(trace_configs=[trace]) as http:
        for path, body in (
            ("/v1/completions", b'{"prompt": ' + nested(200_000) + b"}"),
            ("/v1/chat/completions", b'{"messages": ' + nested(200_000) + b"}"),
            ("/v1/completions", b'{"prompt": [1, ' + b"7" * 100_000 + b"]}"),
        ):
            async with http.post(rt.url + path, data=body, headers=headers) as resp:
                refused.append((resp.status, await resp.json()))
        body = b'{"prompt": [1, 2]}'
        async with http.post(rt.url + "/v1/completions", data=body, headers=headers) as resp:
            status = resp.status
    return refused, status, body, opened


async def test_the_reproductions_are_400s(router, replica: FakeReplica):
    refused, _, _, _ = await the_reproductions_then_a_good_request(router, replica)
    assert len(refused) == 3
    for status, doc in refused:
        assert status == 400 and doc["error"]["type"] == "Bad Request"


async def test_the_connection_serves_on_after_the_reproductions(router, replica: FakeReplica):
    _, status, body, opened = await the_reproductions_then_a_good_request(router, replica)
    assert status == 200
    assert len(opened) == 1 and [r.body for r in replica.requests] == [body]
