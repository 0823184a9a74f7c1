"""The allow-list means what it says (issue 44): the scheme is part of it, an IP-like pattern
admits IP literals only, and odd hosts or port 0 are refused with 400, never a 500 or a member.

The https replica stands behind a loopback listener that peeks at each connection's first byte:
a TLS handshake is passed on to the replica, anything else is kept as clear text, so a token
sent in the clear would be seen. No test name reaches a DNS resolver: the replica client's
resolver is replaced by one that records the names it is asked and answers none.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import orjson
import pytest
from aiohttp.resolver import ThreadedResolver
from helpers import router_config, until
from http_harness import TOKEN, FakeReplica, request


class TlsOnly:
    """A listener in front of a TLS replica: TLS goes through, clear text is recorded."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.clear = b""
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self) -> TlsOnly:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    @property
    def port(self) -> int:
        assert self._server is not None
        return int(self._server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        first = await reader.read(65536)
        if not first.startswith(b"\x16"):  # not a TLS handshake record
            self.clear += first
            writer.close()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        up_writer.write(first)
        pipes = (_pipe(reader, up_writer), _pipe(up_reader, writer))
        await asyncio.gather(*pipes, return_exceptions=True)

    def stop(self) -> None:
        if self._server is not None:
            self._server.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    finally:
        writer.close()


@pytest.fixture
async def tls_front(tls_replica: tuple[FakeReplica, str]) -> AsyncIterator[tuple[TlsOnly, str]]:
    """A TLS replica behind `TlsOnly`; yields the listener and the CA file that trusts it."""
    replica, ca_file = tls_replica
    front = await TlsOnly(replica.port).start()
    yield front, ca_file
    front.stop()


@pytest.fixture
def lookups(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every name the replica client asks to resolve; none is answered."""
    asked: list[str] = []

    async def resolve(self: ThreadedResolver, host: str, port: int = 0, family: int = 0):
        asked.append(host)
        raise OSError(f"{host}: not resolved in tests")

    monkeypatch.setattr(ThreadedResolver, "resolve", resolve)
    return asked


async def add(router_url: str, url: str):
    return await request(router_url, "POST", "/router/replicas", orjson.dumps({"url": url}))


async def test_an_https_replica_is_never_added_again_as_http(router, tls_front, tmp_path):
    front, ca_file = tls_front
    rt = await router([f"https://127.0.0.1:{front.port}"], ca_file=ca_file)
    assert (await request(rt.url, path="/health")).status == 200  # TLS through the front
    r = await add(rt.url, f"http://127.0.0.1:{front.port}")
    assert r.status == 400, r.raw
    error = r.json()["error"]
    assert error["param"] == "url" and "https" in error["message"]
    assert front.clear == b"" and TOKEN.encode() not in front.clear
    # With an allow-list wider than the replicas, the downgrade is refused all the same.
    wide = await router(
        [f"https://127.0.0.1:{front.port}"], ca_file=ca_file, replica_hosts=("127.0.0.0/8",)
    )
    assert (await add(wide.url, f"http://127.0.0.1:{front.port}")).status == 400
    assert front.clear == b""
    # Nor from a replica file.
    members = tmp_path / "replicas"
    members.write_text(f"http://127.0.0.1:{front.port}\n")
    found = await router(
        [f"https://127.0.0.1:{front.port}"],
        ca_file=ca_file,
        replica_hosts=("127.0.0.0/8",),
        replicas_files=(str(members),),
    )
    assert found.discovery is not None
    state = found.discovery.states[0]
    await until(lambda: state.skipped_count == 1)
    assert "never reached as http" in state.skipped[0]
    assert len(found.fleet.replicas) == 1 and front.clear == b""


async def test_a_scheme_in_the_allow_list_admits_that_scheme_only(router, replica_factory, replica):
    with pytest.raises(ValueError, match="outside --replica-hosts"):  # --replicas must fit it
        router_config([replica.url], replica_hosts=(f"https://127.0.0.1:{replica.port}",))
    rt = await router([replica], replica_hosts=("http://127.0.0.0/8",))
    other = await replica_factory()
    assert (await add(rt.url, f"https://127.0.0.1:{other.port}")).status == 403
    assert other.control_conns == [] and other.conns == []
    assert (await add(rt.url, other.url)).status in (200, 202)


async def test_an_ip_pattern_admits_ip_literals_only(router, replica, lookups):
    rt = await router([replica], replica_hosts=("127.0.0.*",))
    for host in ("127.0.0.attacker.example", "127.0.0.1.attacker.example"):
        r = await add(rt.url, f"http://{host}:{replica.port}")
        assert r.status == 403, (host, r.raw)
    assert lookups == []
    cidr = await router([replica], replica_hosts=("127.0.0.0/8",))
    assert (await add(cidr.url, f"http://127.0.0.attacker.example:{replica.port}")).status == 403
    assert lookups == []
    assert len(rt.fleet.replicas) == len(cidr.fleet.replicas) == 1


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1\\@evil:{port}",
        "http://a\\b:{port}",
        "http://127.0.0.1:0",
        "http://a b:{port}",
        "http://a%00b:{port}",
        "http://-a:{port}",
        "http://a..b:{port}",
        "http://127.1:{port}",  # read as 127.0.0.1 by the resolver, not by ipaddress
        "http://0x7f.1:{port}",
    ],
)
async def test_an_odd_host_or_port_0_is_refused_400_and_never_joins(router, replica, lookups, url):
    rt = await router([replica], replica_hosts=("*",))
    r = await add(rt.url, url.format(port=replica.port))
    assert r.status == 400, r.raw
    assert r.json()["error"]["param"] == "url"
    assert len(rt.fleet.replicas) == 1 and lookups == []


async def test_port_0_and_odd_hosts_from_a_replica_file_are_skipped(
    router, replica, lookups, tmp_path
):
    members = tmp_path / "replicas"
    members.write_text("http://127.0.0.1:0\nhttp://a\\b:80\n")
    rt = await router([replica], replicas_files=(str(members),), replica_hosts=("127.0.0.0/8", "*"))
    assert rt.discovery is not None
    state = rt.discovery.states[0]
    await until(lambda: len(state.skipped) == 2)
    assert len(rt.fleet.replicas) == 1 and lookups == []
