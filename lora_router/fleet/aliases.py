"""Aliases: members that are very likely one server listed under two names.

Two URLs with one name are one replica (config.py's `ReplicaAddress` normalises them; the
`--replicas` may not list one twice, discovery and `POST /router/replicas` keep one). Two
host names, or an IP address and a host name, that resolve to one address are not refused: a
proxy at that address may route by host name to different servers. Such members are
*aliases* when they share an *endpoint*: the same scheme, port and path prefix, and an
address both hosts resolved to. One server listed twice takes twice its share of requests
and every broadcast twice: its second load of an adapter is answered "already loaded", so
the router takes the copy for someone else's, unloads it, resets the server's prefix cache
(preempting its running requests) and loads it again, at every weight sync.

`aliases` is the rule. It is reported, never acted on: a warning logged when members whose
hosts were just resolved make one (health.py's `locate`: every member at start, and each
member that joins through discovery or `POST /router/replicas`), `aliases` in
`/router/status` (`Fleet.aliases`), a `lora-router top` verdict, and a `lora-router --check`
note, each with `ALIAS_FIX`.

A member's host is resolved once, when it joins, within `--health-timeout` (`resolve`); a host
that does not resolve in time has no address and is nobody's alias. A shared address is the whole
evidence: nothing the router reads of a replica proves two URLs reach one process (vLLM's
`/metrics` `process_start_time_seconds` counts in 10 ms ticks, which two servers started
together may share). This module never changes a replica's service state and never refuses one.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Collection, Mapping

from lora_router.config import ReplicaAddress

# The fix of any alias.
ALIAS_FIX = (
    "list each server once, under one URL (unless a proxy at that address routes by host name "
    "to different servers)"
)


def aliases(
    members: Mapping[str, tuple[ReplicaAddress, Collection[str]]], involving: Collection[str] = ()
) -> list[str]:
    """Each group of members that share an endpoint (module docstring), in words: `members`
    maps each member (as the message names it) to its address and the addresses its host
    resolved to. With `involving`, only the groups that include one of those members. Empty
    when no two members share an endpoint. O(the addresses of all members)."""
    by_endpoint: dict[tuple[str, str, int, str], list[str]] = {}
    for who, (address, found) in members.items():
        for ip in sorted(found):
            key = (address.scheme, ip, address.port, address.path_prefix)
            by_endpoint.setdefault(key, []).append(who)
    out: dict[tuple[str, ...], str] = {}
    for (_, ip, port, _), group in by_endpoint.items():
        if len(group) < 2 or (involving and not any(who in involving for who in group)):
            continue
        shown = f"[{ip}]" if ":" in ip else ip
        out.setdefault(
            tuple(group),
            f"{', '.join(group[:-1])} and {group[-1]} reach the same address, {shown}:{port}: "
            "very likely one server listed twice, which takes twice its share of requests "
            "and every adapter load twice (the second is answered 'already loaded', then "
            "redone after a prefix cache reset)",
        )
    return list(out.values())


async def resolve(address: ReplicaAddress, timeout: float) -> frozenset[str]:
    """The addresses `address`'s host resolves to (an IP address: itself), empty when it does
    not resolve within `timeout` seconds."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(timeout):
            found = await loop.getaddrinfo(address.host, address.port, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError):  # socket.gaierror is an OSError
        return frozenset()
    return frozenset(str(sockaddr[0]) for *_, sockaddr in found)
