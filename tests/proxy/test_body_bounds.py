"""What reading a completion body costs the router (proxy/body.py, *Bounded decoding*), over
real sockets to a router process whose peak memory is read from /proc/PID/status (VmHWM):
bodies of millions of tiny JSON values, under --max-body-bytes, cost a bounded few times their
size. Before, a chat of 2,000,000 `{}` messages (6 MB) took 8.4 GB and a batch of 15,000,000
one-token prompts (60 MB) 3 GB. The model is unknown to the router: each body is read whole,
judged, then refused at the fence (404) without reaching the replica.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import orjson
import pytest
from helpers import router_process
from http_harness import TOKEN, FakeReplica

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs /proc")

BOUND_MIB = 32  # the growth allowed beside a few copies of the body (today: under 16 MiB)
COPIES = 4  # the body held while read, and its prompt copied out of it (today: about 2)


def peak_mib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmHWM:\s+(\d+) kB", status)
    assert match, status
    return int(match.group(1)) / 1024


async def answer(port: int, path: bytes, body: bytes) -> tuple[bytes, bytes]:
    """POST `body` on a connection of its own: the answer's status line and body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    head = b"POST %s HTTP/1.1\r\nhost: r\r\nconnection: close\r\ncontent-length: %d\r\n\r\n"
    try:
        writer.write(head % (path, len(body)) + body)
        async with asyncio.timeout(30):
            data = await reader.read()
    finally:
        writer.close()
    status, _, rest = data.partition(b"\r\n")
    return status, rest.partition(b"\r\n\r\n")[2]


async def peak_growth(replica: FakeReplica, path: bytes, body: bytes) -> tuple[float, bytes, bytes]:
    """The router's peak memory grown (MiB) while it answers `body`, the answer's status line
    and body."""
    argv = ("--replicas", replica.url, "--token-env", "HF_TOKEN")
    async with router_process(*argv, env={"HF_TOKEN": TOKEN}) as router:
        pid = router.proc.pid
        before = peak_mib(pid)
        status, data = await answer(router.port, path, body)
        return peak_mib(pid) - before, status, data


def bound(body: bytes) -> float:
    return BOUND_MIB + COPIES * len(body) / 2**20


@pytest.mark.parametrize("messages", [120_000, 400_000], ids=["decoded", "past-the-bound"])
async def test_a_chat_of_many_empty_messages_costs_a_bounded_few_times_its_size(
    replica: FakeReplica, messages: int
) -> None:
    # 120,000 messages are decoded and keyed (each serialised: before, 4 KiB resident apiece);
    # 400,000 are past MAX_DECODED_VALUES, left to the replica unread.
    body = b'{"model":"nope","messages":[' + b",".join([b"{}"] * messages) + b"]}"
    grown, status, data = await peak_growth(replica, b"/v1/chat/completions", body)
    assert status == b"HTTP/1.1 404 Not Found", data
    assert grown < bound(body), f"{grown:.0f} MiB for a body of {len(body) >> 10} KiB"
    assert not replica.requests


async def test_a_batch_of_many_one_token_prompts_is_refused_at_a_bounded_cost(
    replica: FakeReplica,
) -> None:
    body = b'{"model":"nope","prompt":[' + b",".join([b"[1]"] * 1_500_000) + b"]}"
    grown, status, data = await peak_growth(replica, b"/v1/completions", body)
    assert grown < bound(body), f"{grown:.0f} MiB for a body of {len(body) >> 20} MiB"
    assert status == b"HTTP/1.1 400 Bad Request", data
    error = orjson.loads(data)["error"]
    assert error["param"] == "prompt" and error["type"] == "Bad Request"
    assert error["message"] == (
        "The batch's prompts have 1500000 tokens in all; the limit is 1000000."
    )


async def test_a_batch_of_many_text_prompts_is_read_at_a_bounded_cost(
    replica: FakeReplica,
) -> None:
    body = b'{"model":"nope","prompt":[' + b",".join([b'"ab"'] * 2_000_000) + b"]}"
    grown, status, data = await peak_growth(replica, b"/v1/completions", body)
    assert status == b"HTTP/1.1 404 Not Found", data  # read, and keyed by its first prompt
    assert grown < bound(body), f"{grown:.0f} MiB for a body of {len(body) >> 20} MiB"
