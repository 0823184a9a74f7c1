"""Discovery: replicas that come and go, named by a file, DNS A/AAAA records or SRV records.

The fleet's wanted members are the `--replicas` plus every source's last good answer (the
union), one member per replica name: entries that are spellings of one URL (config.py's
`ReplicaAddress`) are one member; two host names that resolve to one address are two, warned
of when the second joins (fleet/aliases.py). `Discovery` compares that with the fleet every
tick and changes the fleet only through the health monitor, as an operator's
`POST`/`DELETE /router/replicas` does:

- **join**: a wanted URL the fleet lacks is added as a joining replica (`HealthMonitor.add`): its
  live adapters and the pause state are replayed before it takes a request, the final pass under
  the broadcast lock, so a member that joins during a load never serves a version it lacks;
  a join beyond `--max-replicas` members waits for room (counted in `waiting`, logged once);
- **leave**: a discovered member missing from every source's answer for `--discovery-grace`
  seconds drains (no new work, its requests finish) and is removed. One that comes back within
  the grace is untouched: a flapping answer causes no churn. Members from `--replicas` or added
  through `/router/replicas` are never removed here;
- **a source that fails** (file unreadable or empty, a DNS error, timeout or empty answer)
  keeps its last good set, so a failure never empties the fleet; its error is reported;
- **an entry that is not a replica** (not an http(s) URL, or outside `--replica-hosts`: every
  member gets the token, so discovery requires that allow-list) is skipped and the rest of the
  answer is used. Reports are bounded however many there are: one WARNING a read for the
  entries newly skipped (their count and `SKIPPED_SHOWN` examples), and the same in status.

A file is polled every `FILE_POLL_S` and read again when its inode, size or modification time
changes (a writer may replace it atomically). It is opened and read in a thread, never on the
event loop, without blocking on open: only a regular file of at most `MAX_FILE_BYTES` is read
(a FIFO, a device or a directory is a failed read, logged with its path). One URL a line, `#`
starts a comment. A read whose
last line has no newline and that differs from the previous read is taken as a write in
progress: it is used once a later poll finds it unchanged. An entry the source's previous read
held keeps its verdict (member or skipped). DNS names are resolved every
`--dns-interval` with dnspython, through the system's resolvers or `--dns-server`; members are
`http://ADDRESS:PORT`, for SRV records each target's addresses with the record's port.
"""

from __future__ import annotations

import asyncio
import logging
import os
import stat
import time
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import dns.asyncresolver
import dns.exception
import dns.rdatatype
import dns.resolver

from lora_router.config import Config, ReplicaAddress

if TYPE_CHECKING:
    from lora_router.fleet.fleet import Fleet
    from lora_router.fleet.health import HealthMonitor
    from lora_router.fleet.replica import Replica

log = logging.getLogger(__name__)

FILE_POLL_S = 1.0
MAX_FILE_BYTES = 4 << 20  # a replica file's size cap: some 100,000 URLs
FILE_READ_S = 10.0  # a poll waits this long for a read (a stuck network filesystem)
SKIPPED_SHOWN = 5  # examples of skipped entries kept for status and the log
STATIC_ORIGINS = ("replicas", "admin")  # members discovery never removes


class SourceError(Exception):
    """A source that could not be read: its last good set stands."""


@dataclass(slots=True)
class SourceState:
    """What one source last said, as /router/status, /metrics and top show it."""

    label: str  # file:PATH, dns:NAME:PORT, srv:NAME
    members: tuple[str, ...] = ()  # the last good answer, as replica names
    last_ok: float | None = None  # wall-clock time of the last good read
    error: str = ""  # why the last read failed; "" when it did not
    errors: int = 0  # failed reads since start
    skipped_count: int = 0  # entries of the last good read that are not replicas
    skipped: tuple[str, ...] = ()  # the first SKIPPED_SHOWN of them, with why

    def json(self) -> dict[str, object]:
        return {
            "source": self.label,
            "members": len(self.members),
            "last_ok": self.last_ok,
            "error": self.error or None,
            "errors": self.errors,
            "skipped_count": self.skipped_count,
            "skipped": list(self.skipped),
        }


class FileSource:
    """`--replicas-file PATH`: one URL a line."""

    def __init__(self, path: str) -> None:
        self.label = f"file:{path}"
        self.interval = FILE_POLL_S
        self._path = path
        self._seen: tuple[int, int, int] | None = None  # inode, size, mtime of the last read
        self._pending: str | None = None  # a read that may be a write in progress
        self._job: asyncio.Future[list[str] | None] | None = None  # the read under way

    async def read(self) -> list[str] | None:
        """The entries, or None when the file has not changed since the last read. Read in a
        thread; a read still under way after `FILE_READ_S` is a failed poll, and the next
        poll waits for that same read (never two at once)."""
        job = self._job
        if job is None:
            job = self._job = asyncio.get_running_loop().run_in_executor(None, self._load)
        try:
            async with asyncio.timeout(FILE_READ_S):
                return await asyncio.shield(job)
        except TimeoutError:
            raise SourceError(f"still reading it after {FILE_READ_S:g} s") from None
        finally:
            if job.done():
                self._job = None

    def _load(self) -> list[str] | None:
        """`read`'s work, in a thread: O_NONBLOCK, so opening a FIFO cannot block it."""
        try:
            fd = os.open(self._path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as exc:
            self._seen = None
            raise SourceError(f"cannot read it: {exc.strerror or exc}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self._seen = None
                raise SourceError(f"not a regular file ({_kind(st.st_mode)}): not read")
            seen = (st.st_ino, st.st_size, st.st_mtime_ns)
            if seen == self._seen and self._pending is None:
                return None
            data = _read_at_most(fd, MAX_FILE_BYTES + 1)
        except OSError as exc:
            self._seen = None
            raise SourceError(f"cannot read it: {exc.strerror or exc}") from None
        finally:
            os.close(fd)
        if len(data) > MAX_FILE_BYTES:
            self._seen = None
            raise SourceError(f"larger than {MAX_FILE_BYTES:,} bytes: not read")
        self._seen = seen
        text = data.decode("utf-8", "replace")
        if text and not text.endswith("\n") and text != self._pending:
            self._pending = text  # maybe half written: used when the next poll finds it same
            return None
        self._pending = None
        entries = [line.split("#", 1)[0].strip() for line in text.splitlines()]
        return [e for e in entries if e]


def _read_at_most(fd: int, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while size < limit and (chunk := os.read(fd, min(1 << 20, limit - size))):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _kind(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class DnsSource:
    """`--replicas-dns NAME:PORT` (A and AAAA records) or `--replicas-srv NAME` (SRV)."""

    def __init__(self, spec: str, srv: bool, resolver: dns.asyncresolver.Resolver, every: float):
        self.label = f"{'srv' if srv else 'dns'}:{spec}"
        self.interval = every
        self._srv = srv
        self._resolver = resolver
        if srv:
            self._name, self._port = spec, 0
        else:
            name, _, port = spec.rpartition(":")
            self._name, self._port = name, int(port)

    async def read(self) -> list[str]:
        targets = [(self._name, self._port)]
        if self._srv:
            targets = [(r.target.to_text(), r.port) for r in await self._query(self._name, "SRV")]
        return [
            f"http://{_host(r.address)}:{port}"
            for name, port in targets
            for kind in ("A", "AAAA")
            for r in await self._query(name, kind)
        ]

    async def _query(self, name: str, kind: str) -> list[Any]:
        try:
            answer = await self._resolver.resolve(name, kind, search=False)
        except (dns.resolver.NoAnswer, dns.resolver.NXDOMAIN):
            return []
        except dns.exception.Timeout:
            raise SourceError(f"{kind} query timed out") from None
        except dns.exception.DNSException as exc:
            raise SourceError(f"{kind} query failed: {exc}") from None
        return list(answer)


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def entry_verdict(entry: str, config: Config) -> ReplicaAddress | str:
    """The replica a source's entry names, or why it is skipped: not an http(s) URL, or
    outside `--replica-hosts` (every member gets the token)."""
    try:
        address = ReplicaAddress.parse(entry)
    except ValueError as exc:
        return f"{entry[:200]!r}: {exc}"
    if not config.replica_allowed(address):
        return f"{address.name[:200]}: outside --replica-hosts (the token goes to it)"
    return address


async def read_sources(config: Config) -> tuple[list[ReplicaAddress], list[str], list[str]]:
    """Every source the configuration names, read once as the router reads it at start (a
    file still being written is read again once): the replicas they name, each failed
    source's error, and the entries skipped with why. For `lora-router --check`."""
    found: dict[str, ReplicaAddress] = {}
    errors: list[str] = []
    skipped: list[str] = []
    for source in make_sources(config):
        try:
            entries = await source.read()
            if entries is None:  # a write in progress, or so it seemed: as a second poll does
                entries = await source.read()
            if not entries:
                raise SourceError("it names no replica")
        except SourceError as exc:
            errors.append(f"discovery {source.label}: {exc}")
            continue
        for entry in entries:
            verdict = entry_verdict(entry, config)
            if isinstance(verdict, str):
                skipped.append(f"discovery {source.label}: {verdict}")
            else:
                found.setdefault(verdict.name, verdict)
    return list(found.values()), errors, skipped


def make_sources(config: Config) -> list[FileSource | DnsSource]:
    """The sources the configuration names, in the order status lists them."""
    sources: list[FileSource | DnsSource] = [FileSource(p) for p in config.replicas_files]
    if config.replicas_dns or config.replicas_srv:
        resolver = dns.asyncresolver.Resolver(configure=not config.dns_server)
        if config.dns_server:
            host, _, port = config.dns_server.rpartition(":")
            resolver.nameservers = [host.strip("[]")]
            resolver.port = int(port)
        resolver.lifetime = config.health_timeout
        for spec in config.replicas_dns:
            sources.append(DnsSource(spec, False, resolver, config.dns_interval))
        for spec in config.replicas_srv:
            sources.append(DnsSource(spec, True, resolver, config.dns_interval))
    return sources


@dataclass(slots=True)
class _Member:
    address: ReplicaAddress
    origin: str  # the first source that named it


@dataclass
class Discovery:
    """Keeps the fleet equal to what the sources say, under the rules of the module."""

    config: Config
    fleet: Fleet
    health: HealthMonitor
    sources: list[FileSource | DnsSource]
    clock: Callable[[], float] = time.monotonic
    states: list[SourceState] = field(init=False)
    waiting: int = field(init=False, default=0)  # wanted members left out by --max-replicas
    _wanted: dict[int, dict[str, _Member]] = field(init=False, default_factory=dict)
    _missing: dict[str, float] = field(init=False, default_factory=dict)
    # source -> entry -> its member, or why it was skipped, as its last good read judged it
    _verdicts: dict[int, dict[str, _Member | str]] = field(init=False, default_factory=dict)
    _due: list[float] = field(init=False)
    _changes: set[asyncio.Task[object]] = field(init=False, default_factory=set)
    _busy: set[str] = field(init=False, default_factory=set)
    _task: asyncio.Task[None] | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.states = [SourceState(s.label) for s in self.sources]
        self._due = [0.0] * len(self.sources)

    def start(self) -> None:
        if self.sources:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        tasks = [t for t in (self._task, *self._changes) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _run(self) -> None:
        tick = min(s.interval for s in self.sources)
        while True:
            await self.step()
            await asyncio.sleep(tick)

    async def step(self) -> None:
        """Read the sources that are due, then bring the fleet towards what they say."""
        now = self.clock()
        for i, source in enumerate(self.sources):
            if now >= self._due[i]:
                self._due[i] = now + source.interval
                await self._read(i, source)
        self._reconcile(now)

    async def _read(self, i: int, source: FileSource | DnsSource) -> None:
        state = self.states[i]
        try:
            entries = await source.read()
            if entries is None:
                return
            if not entries:
                raise SourceError("it names no replica")
        except SourceError as exc:
            state.errors += 1
            if state.error != str(exc):
                log.warning(
                    "discovery %s: %s; keeping its last %d members",
                    state.label,
                    exc,
                    len(state.members),
                )
            state.error = str(exc)
            return
        members, skipped, fresh = self._judge(i, entries, state.label)
        if state.error:
            log.info("discovery %s: read again, %d members", state.label, len(members))
        if fresh:
            log.warning(
                "discovery %s: skipped %d new entries that are not replicas, such as: %s",
                state.label,
                len(fresh),
                "; ".join(fresh[:SKIPPED_SHOWN]),
            )
        state.error, state.last_ok = "", time.time()
        state.skipped_count, state.skipped = len(skipped), tuple(skipped[:SKIPPED_SHOWN])
        state.members = tuple(members)
        self._wanted[i] = members

    def _judge(
        self, i: int, entries: Iterable[str], origin: str
    ) -> tuple[dict[str, _Member], list[str], list[str]]:
        """The members, the skipped entries and those of them the previous read did not hold
        (each skipped one as why) of a read of source `i`. An entry its previous read held is
        judged as then (the same text, the same allow-list): a rewrite that adds one URL to
        1,000 parses one."""
        before = self._verdicts.get(i, {})
        verdicts: dict[str, _Member | str] = {}
        members: dict[str, _Member] = {}
        skipped: list[str] = []
        fresh: list[str] = []
        for entry in entries:
            verdict = verdicts.get(entry) or before.get(entry)
            if verdict is None:
                verdict = self._verdict(entry, origin)
                if isinstance(verdict, str):
                    fresh.append(verdict)
            verdicts[entry] = verdict
            if isinstance(verdict, str):
                skipped.append(verdict)
            else:
                members.setdefault(verdict.address.name, verdict)
        self._verdicts[i] = verdicts
        return members, skipped, fresh

    def _verdict(self, entry: str, origin: str) -> _Member | str:
        """The member an entry names, or why it is skipped."""
        address = entry_verdict(entry, self.config)
        if isinstance(address, str):
            return address
        if self.fleet.downgrade(address):
            return f"{address.name[:200]}: an https replica of the fleet, never reached as http"
        return _Member(address, origin)

    def _reconcile(self, now: float) -> None:
        """O(members): the wanted set, the fleet's names and the absences are each read once."""
        wanted: dict[str, _Member] = {}
        for members in self._wanted.values():
            for name, member in members.items():
                wanted.setdefault(name, member)
        present = {r.name for r in self.fleet.replicas}
        joining = sum(1 for name in self._busy if name not in present)
        room = self.config.max_replicas - len(present) - joining
        waiting = 0
        for name, member in wanted.items():
            self._missing.pop(name, None)
            if name not in present and name not in self._busy:
                if room <= 0:
                    waiting += 1
                    continue
                room -= 1
                self._change(name, self._join(member))
        if waiting != self.waiting:
            if waiting:
                log.warning(
                    "discovery: %d members wait for room: the fleet has its --max-replicas "
                    "(%d) members",
                    waiting,
                    self.config.max_replicas,
                )
            self.waiting = waiting
        self._missing = {n: t for n, t in self._missing.items() if n in present}
        for replica in list(self.fleet.replicas):
            if replica.origin in STATIC_ORIGINS or replica.name in wanted:
                continue
            since = self._missing.setdefault(replica.name, now)
            if now - since >= self.config.discovery_grace and replica.name not in self._busy:
                self._change(replica.name, self._leave(replica))

    def _change(self, name: str, work: Coroutine[Any, Any, None]) -> None:
        self._busy.add(name)
        task: asyncio.Task[object] = asyncio.get_running_loop().create_task(work)
        self._changes.add(task)
        task.add_done_callback(lambda t: self._done(t, name))

    def _done(self, task: asyncio.Task[object], name: str) -> None:
        self._changes.discard(task)
        self._busy.discard(name)
        if not task.cancelled() and task.exception() is not None:
            log.error("discovery: changing %s failed: %r", name, task.exception())

    async def _join(self, member: _Member) -> None:
        log.info("discovery %s: %s joins", member.origin, member.address.name)
        await self.health.add(member.address, origin=member.origin)

    async def _leave(self, replica: Replica) -> None:
        log.info("discovery: %s left every source; draining it", replica.describe())
        self._missing.pop(replica.name, None)
        await self.health.remove(replica)
