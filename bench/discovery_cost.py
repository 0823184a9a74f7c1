"""What following a large fleet costs the router: file polls, DNS answers, reconciles, joins.

    python bench/discovery_cost.py          # a few minutes; bench/results/discovery_cost.*
    python bench/discovery_cost.py --joins 100 --rounds 1

Measured in this process, with the router's own objects (lora_router/fleet/discovery.py):
- *file poll, unchanged*: one `Discovery.step()` while the `--replicas-file` of `--members`
  (1,000) URLs is unchanged (a `stat`, then the reconcile), against a fleet that already holds
  every member, so nothing joins or leaves;
- *file poll, rewritten*: the same step after the file was replaced atomically with the same
  members in a new order (stat, read, split, each entry's verdict reused from the last read,
  then the reconcile); writing the file is not counted;
- *read, every entry new*: the read of a file replaced with 1,000 URLs none of which it named
  before (each parsed and judged against `--replica-hosts`), without the reconcile (which
  would start 1,000 joins: those are measured below);
- *reconcile*: `Discovery._reconcile` alone, the part of every tick that compares the wanted set
  with the fleet;
- *256 A records*: one read of a `--replicas-dns` source (dnspython, as in production) answered
  by a dnslib server on 127.0.0.1, then the judging of its 256 members. dnspython asks over
  UDP without EDNS; the 4 KB answer does not fit 512 bytes, so the server truncates it (TC), as
  real servers do, and the resolver asks again over TCP: both round trips are in the figure,
  and the AAAA query (empty) too.
Each is the median of `--repeats` timings.

Measured across processes, `--rounds` times each: *J members joining at once* (`--joins`, 100
and 1,000 by default). One process (`discovery_cost.py farm`) serves J emulated vLLM replicas
(`lora-router-emulator`'s code in-process, one port each, on one event loop); the real router
(`python -m lora_router.cli`) runs with one static replica, `--replicas-file`, `--replica-hosts
127.0.0.1`, an adapter loaded (so every join replays it) and the fleet resumed; the file is then
replaced with the J URLs, and `/router/replicas` is polled every 50 ms until all J serve. The
figure is file written -> first poll showing all of them serving (`inf` when they did not all
serve within 300 s). An older revision runs the same way from a `git archive` of it on
PYTHONPATH (the router process inherits it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, cast

import aiohttp
import uvloop
from lib.procs import Procs, free_port, git_revision, wait_port

from lora_router.config import Config, ReplicaAddress
from lora_router.emulator import EmulatorConfig, start_emulator, write_adapter
from lora_router.fleet.discovery import Discovery, DnsSource, make_sources
from lora_router.fleet.fleet import Fleet

RESULTS = Path(__file__).resolve().parent / "results"
JOIN_TIMEOUT_S = 300.0


def _urls(n: int, base: int = 20000) -> list[str]:
    return [f"http://127.0.0.1:{base + i}" for i in range(n)]


def _write(path: Path, urls: list[str]) -> None:
    aside = path.with_suffix(".new")
    aside.write_text("# members\n" + "".join(f"{u}\n" for u in urls))
    os.replace(aside, path)


async def _median_ms(repeats: int, once: Callable[[], Awaitable[object]]) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        await once()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


async def file_costs(members: int, repeats: int, tmp: Path) -> dict[str, float]:
    path = tmp / "replicas"
    urls = _urls(members)
    _write(path, urls)
    config = Config(replicas=(), replicas_files=(str(path),), replica_hosts=("127.0.0.1",))
    fleet = Fleet(config)
    for url in urls:
        fleet.add(ReplicaAddress.parse(url), origin=f"file:{path}")
    discovery = Discovery(config, fleet, cast(Any, None), make_sources(config))
    await discovery.step()  # the first read: every member is already in the fleet
    assert len(discovery.states[0].members) == members and not discovery._changes

    async def unchanged() -> None:
        discovery._due = [0.0]
        await discovery.step()

    unchanged_ms = await _median_ms(repeats, unchanged)
    rewritten = []
    for k in range(1, repeats + 1):
        _write(path, urls[k % members :] + urls[: k % members])
        rewritten.append(await _median_ms(1, unchanged))
        assert not discovery._changes
    source = discovery.sources[0]
    fresh = []  # a read whose every entry is new: each one parsed and judged
    for k in range(repeats):
        _write(path, _urls(members, base=30000 + k * members))
        fresh.append(await _median_ms(1, lambda: discovery._read(0, source)))
    _write(path, urls)
    await discovery._read(0, source)
    assert len(discovery.states[0].members) == members
    now = time.monotonic()

    async def reconcile() -> None:
        discovery._reconcile(now)

    reconcile_ms = await _median_ms(repeats, reconcile)
    fleet.close()
    return {
        "file_unchanged_ms": unchanged_ms,
        "file_rewritten_ms": statistics.median(rewritten),
        "file_all_new_ms": statistics.median(fresh),
        "reconcile_ms": reconcile_ms,
    }


async def dns_cost(records: int, repeats: int) -> dict[str, float]:
    from dnslib import QTYPE, RR, A, DNSRecord
    from dnslib.server import BaseResolver, DNSLogger, DNSServer

    addresses = [f"127.0.{i // 250}.{i % 250 + 1}" for i in range(records)]

    class Fleet256(BaseResolver):  # type: ignore[misc]
        def resolve(self, request: DNSRecord, handler: object) -> DNSRecord:
            reply = request.reply()
            if QTYPE[request.q.qtype] == "A" and getattr(handler, "protocol", "") == "udp":
                # 4 KB does not fit a 512-byte UDP answer (no EDNS): truncated, question kept,
                # as real servers do (dnslib's own truncation drops the question, which
                # dnspython then ignores as an answer to another query).
                reply.header.tc = 1
            elif QTYPE[request.q.qtype] == "A":
                for a in addresses:
                    reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(a), ttl=1))
            return reply

    port = free_port()
    servers = [
        DNSServer(
            Fleet256(),
            port=port,
            address="127.0.0.1",
            tcp=tcp,
            logger=DNSLogger("-request,-reply,-truncated", prefix=False),
        )
        for tcp in (False, True)
    ]
    for server in servers:
        server.start_thread()
    try:
        config = Config(
            replicas=(),
            replicas_dns=("vllm.fleet.test:8000",),
            dns_server=f"127.0.0.1:{port}",
            replica_hosts=("127.0.0.0/8",),
        )
        fleet = Fleet(config)
        discovery = Discovery(config, fleet, cast(Any, None), make_sources(config))
        source = discovery.sources[0]
        assert isinstance(source, DnsSource)
        assert len(await source.read()) == records

        async def read() -> None:
            await discovery._read(0, source)
            assert discovery.states[0].error == "", discovery.states[0].error

        return {"dns_a_records_ms": await _median_ms(repeats, read)}
    finally:
        for server in servers:
            server.stop()


# --- joins: a farm of emulated replicas and the real router --------------------------------


def serve_farm(argv: list[str]) -> int:
    """`discovery_cost.py farm N URLS_FILE`: N emulated replicas in this process; their URLs
    are written to URLS_FILE once all listen."""
    n, out = int(argv[0]), Path(argv[1])

    async def run() -> None:
        emus = [await start_emulator(EmulatorConfig(max_loras=4)) for _ in range(n)]
        aside = out.with_suffix(".new")
        aside.write_text("".join(f"{e.url}\n" for e in emus))
        os.replace(aside, out)
        await asyncio.Event().wait()

    uvloop.run(run())
    return 0


async def _wait_file(path: Path, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{path} never appeared")
        await asyncio.sleep(0.05)
    return path.read_text().split()


async def joins_at_once(joins: int, procs: Procs, round_: int) -> dict[str, float]:
    tmp = procs.tmp / f"joins-{joins}-{round_}"
    tmp.mkdir()
    urls_file, members = tmp / "farm-urls", tmp / "replicas"
    static = procs.start([sys.executable, __file__, "farm", "1", str(tmp / "static-url")])
    farm = procs.start([sys.executable, __file__, "farm", str(joins), str(urls_file)])
    static_url = (await _wait_file(tmp / "static-url", 60))[0]
    urls = await _wait_file(urls_file, 120)
    members.write_text("# none yet\n")
    port = free_port()
    router = procs.start(
        [
            sys.executable, "-m", "lora_router.cli", "--replicas", static_url, "--no-token",
            "--port", str(port), "--replicas-file", str(members), "--replica-hosts",
            "127.0.0.1", "--health-interval", "5", "--status-interval", "0",
            "--log-level", "warning",
        ]
    )  # fmt: skip
    wait_port(port)
    url = f"http://127.0.0.1:{port}"
    adapter = write_adapter(tmp / "trl-policy-v1", rank=1)
    async with aiohttp.ClientSession() as http:
        body = {"lora_name": "trl-policy-v1", "lora_path": str(adapter)}
        for path, doc in (("/v1/load_lora_adapter", body), ("/resume", None)):
            async with http.post(url + path, json=doc) as resp:
                assert resp.status == 200, (path, resp.status, await resp.text())
        written = time.monotonic()
        _write(members, urls)
        serving = 0
        while time.monotonic() - written < JOIN_TIMEOUT_S:
            async with http.get(url + "/router/replicas") as resp:
                doc = await resp.json()
            replicas = doc["replicas"]
            serving = sum(1 for r in replicas if r["admitted"] and "trl-policy-v1" in r["adapters"])
            if serving == joins + 1:
                break
            await asyncio.sleep(0.05)
        took = time.monotonic() - written
    for proc in (router, farm, static):
        procs.stop(proc)
    if serving != joins + 1:  # reported as such: an older revision may not make it in time
        print(f"{joins} joins: only {serving - 1} serving after {took:.0f} s", flush=True)
        return {"seconds": float("inf")}
    return {"seconds": took}


def report(results: dict[str, Any], command: str) -> str:
    f = results["figures"]
    lines = [
        "# Discovery: the cost of following a large fleet",
        "",
        f"Command: `{command}`",
        "",
        f"Revision: `{results['revision']}`; {results['cpus']} CPUs (shared); script: "
        "bench/discovery_cost.py (its docstring says what each figure is).",
        "",
        "| What | Figure |",
        "|---|---|",
        f"| poll of an unchanged {results['members']}-member file (step) | "
        f"{f['file_unchanged_ms']:.2f} ms |",
        f"| poll of a rewritten {results['members']}-member file (step) | "
        f"{f['file_rewritten_ms']:.1f} ms |",
        f"| read of a rewritten {results['members']}-member file, every entry new | "
        f"{f['file_all_new_ms']:.1f} ms |",
        f"| reconcile, {results['members']} members | {f['reconcile_ms']:.2f} ms |",
        f"| read of {results['records']} A records (loopback DNS server) | "
        f"{f['dns_a_records_ms']:.1f} ms |",
    ]
    for joins, times in results["joins"].items():
        lines.append(
            f"| {joins} members joining at once, until all serve (median of {len(times)}) | "
            f"{statistics.median(times):.1f} s |"
        )
    lines += [
        "",
        f"In-process figures are medians of {results['repeats']} timings; join rounds: "
        + "; ".join(
            f"{j}: {', '.join(f'{t:.1f}' for t in ts)} s" for j, ts in results["joins"].items()
        )
        + ".",
        "",
    ]
    return "\n".join(lines)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    procs = Procs()
    try:
        figures = await file_costs(args.members, args.repeats, procs.tmp)
        figures.update(await dns_cost(args.records, args.repeats))
        joins: dict[str, list[float]] = {}
        for j in args.joins:
            joins[str(j)] = [
                (await joins_at_once(j, procs, r))["seconds"] for r in range(args.rounds)
            ]
            print(f"{j} joins: {joins[str(j)]}", flush=True)
    finally:
        procs.close()
    return {
        "revision": git_revision(),
        "cpus": os.cpu_count(),
        "members": args.members,
        "records": args.records,
        "repeats": args.repeats,
        "figures": figures,
        "joins": joins,
    }


def run(argv: list[str]) -> int:
    if argv[:1] == ["farm"]:
        return serve_farm(argv[1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=1000)
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--joins", type=int, nargs="*", default=[100, 1000])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "discovery_cost")
    args = parser.parse_args(argv)
    results = uvloop.run(main(args))
    command = "python bench/discovery_cost.py " + " ".join(argv)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(report(results, command.strip()))
    print(report(results, command.strip()))
    return 0


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:]))
