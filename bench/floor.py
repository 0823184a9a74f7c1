"""The floor: the least a Python proxy on lora-router's runtime does per request.

A bench contender (bench/overhead.py), not product code. It runs on the same runtime as
lora-router (uvloop, httptools) and does only what any keep-alive HTTP/1.1 proxy must:
- parse the client's request with httptools to find where it ends;
- write it upstream on a pooled keep-alive connection to the next replica in round robin, with a
  head of its own (method, target, Host, Content-Type, Content-Length) and the body;
- relay the response to the client as raw bytes, as they arrive, parsed only to find its end,
  and put the connection back in the pool.
No routing, JSON, validation, limits, timeouts, metrics, retries or error answers, and no
pipelining (a client sends its next request after the answer, as wrk's closed loop does). What
it costs per request is what this runtime costs before any of lora-router's own work, so the
gap between the two is the part lora-router can cut in Python, and the gap between the floor
and nginx is the runtime's.

    python bench/floor.py --port 19400 --replicas http://127.0.0.1:8001,http://127.0.0.1:8002
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
from collections.abc import Iterator
from urllib.parse import urlsplit

import httptools
import uvloop


class Upstream(asyncio.Protocol):
    """One keep-alive connection to a replica, answering into one client at a time."""

    def __init__(self, replica: Replica) -> None:
        self.replica = replica
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.client: Client | None = None
        self.complete = False
        self.reusable = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.replica.idle:
            self.replica.idle.remove(self)
        if self.client is not None and self.client.transport is not None:
            self.client.transport.close()  # cut mid-answer: the client sees the close

    def data_received(self, data: bytes) -> None:
        client = self.client
        assert client is not None and client.transport is not None
        self.parser.feed_data(data)  # on_message_complete sets `complete`
        client.transport.write(data)  # relayed as it came
        if self.complete:
            self.complete = False
            self.client = None
            if self.reusable:
                self.replica.idle.append(self)
            else:
                self.transport.close()  # type: ignore[union-attr]
            client.answered()

    def on_message_complete(self) -> None:
        self.complete = True
        # Read now: once this callback returns, llhttp resets its state for the next message.
        self.reusable = self.parser.should_keep_alive()


class Replica:
    """A replica's address and its idle connections (most recently used last)."""

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.host_header = f"{self.host}:{self.port}".encode()
        self.idle: list[Upstream] = []


class Client(asyncio.Protocol):
    """One client connection: each complete request goes to the next replica."""

    def __init__(self, replicas: Iterator[Replica]) -> None:
        self.replicas = replicas
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.keep_alive = True
        self.up: Upstream | None = None  # answering the request in flight

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        if self.up is not None and self.up.transport is not None:
            self.up.transport.close()  # nobody reads its answer: the connection cannot be reused

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            assert self.transport is not None
            self.transport.close()

    def on_message_begin(self) -> None:
        self.url = b""
        self.body = []

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()  # read now, as above
        body = b"".join(self.body)
        self.body = []
        replica = next(self.replicas)
        data = b"%s %s HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n" % (
            self.parser.get_method(),
            self.url,
            replica.host_header,
        )
        data += b"content-length: %d\r\n\r\n%s" % (len(body), body)
        if replica.idle:
            self.send(replica.idle.pop(), data)
        else:  # the pool grows to the clients' concurrency, then every request finds one idle
            asyncio.get_running_loop().create_task(self.connect(replica, data))

    async def connect(self, replica: Replica, data: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            _, up = await loop.create_connection(
                lambda: Upstream(replica), replica.host, replica.port
            )
        except OSError:
            if self.transport is not None:
                self.transport.close()
            return
        self.send(up, data)

    def send(self, up: Upstream, data: bytes) -> None:
        assert up.transport is not None
        up.client = self
        self.up = up
        up.transport.write(data)

    def answered(self) -> None:
        self.up = None
        if not self.keep_alive and self.transport is not None:
            self.transport.close()


async def serve(port: int, urls: list[str]) -> None:
    replicas = itertools.cycle([Replica(u) for u in urls])
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: Client(replicas), "127.0.0.1", port, backlog=2048)
    async with server:
        await server.serve_forever()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--replicas", required=True, help="comma-separated replica URLs")
    args = p.parse_args()
    uvloop.run(serve(args.port, args.replicas.split(",")))


if __name__ == "__main__":
    main()
