"""Where a real vLLM replica's streamed completion ends, read by read.

    tests/vllm/install.sh && .venv-vllm/bin/python bench/probes/stream_end.py

One vLLM CPU replica (tests/vllm's tiny model and flags), 40 streamed completions of fresh
100-token token-id prompts with `stream_options.include_usage`, each read over a raw asyncio
connection (no client library between the socket and the count). For each stream: how many
reads before the last one hold the usage frame's `"cached_tokens"` and `[DONE]`. Printed: the
count of streams per (usage frame, [DONE]) position. proxy/usage.py reads the report from an
answer's last reads; this is how far back it has to look.
"""

import asyncio
import json
import random
from pathlib import Path

from lora_router.testbed.tiny_model import model_dir
from lora_router.testbed.vllm_harness import TOKEN, Replica, start_replicas

STREAMS = 40


class Reads(asyncio.Protocol):
    def __init__(self, done: asyncio.Future[None]) -> None:
        self.reads: list[bytes] = []
        self.done = done

    def data_received(self, data: bytes) -> None:
        self.reads.append(data)
        if data.endswith(b"0\r\n\r\n") and not self.done.done():
            self.done.set_result(None)


async def stream(port: int, prompt: list[int]) -> list[bytes]:
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    transport, reads = await loop.create_connection(lambda: Reads(done), "127.0.0.1", port)
    body = json.dumps(
        {
            "model": str(model_dir() / "model"),
            "prompt": prompt,
            "max_tokens": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()
    transport.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
        + f"authorization: Bearer {TOKEN}\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await asyncio.wait_for(done, 60)
    transport.close()
    return reads.reads


def from_end(reads: list[bytes], key: bytes) -> int:
    """How many reads before the last one the last read holding `key` is."""
    return next(len(reads) - 1 - i for i in range(len(reads) - 1, -1, -1) if key in reads[i])


async def main() -> None:
    replica = Replica(model=model_dir() / "model", log=Path("/tmp/stream-end-replica.log"))
    start_replicas([replica])
    try:
        shapes: dict[tuple[int, int], int] = {}
        for i in range(STREAMS):
            reads = await stream(replica.port, random.Random(i).choices(range(3, 480), k=100))
            shape = (from_end(reads, b'"cached_tokens"'), from_end(reads, b"[DONE]"))
            shapes[shape] = shapes.get(shape, 0) + 1
        print(f"(reads from the end to the usage frame, to [DONE]): streams of {STREAMS}")
        for shape, n in sorted(shapes.items()):
            print(shape, n)
    finally:
        replica.stop()


if __name__ == "__main__":
    asyncio.run(main())
