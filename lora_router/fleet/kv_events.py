"""KV events: a ZMQ subscriber per replica, feeding the KV index (routing/kv_index.py).

Where a replica publishes (`--kv-events`): `auto` asks its `GET /kv_event_sources` (vLLM 0.32:
`{"0": KVEventsConfig}`; DP rank 0 only, a wildcard host read as the replica's, another host
refused: a replica's answer never sends the router elsewhere), a template
`tcp://{host}:5557[,tcp://{host}:5558]` names the PUB (and replay ROUTER) endpoint, `off` none.
A replica without a source stays `off`: the policy gives it today's prediction. Replicas that
join later, or whose source could not be read, are tried again every `health_interval`; so is
the source of one whose publisher went away or that restarted (`auto`: a new process may
publish elsewhere, and is then followed there).

The wire, and the caps on it, are kv_wire.py's: what breaks them is counted (`malformed`,
`undecodable`, `refused`) and skipped; the subscription goes on. Only GPU blocks of KV-cache
group 0 (or unnamed) are filed.

A replica's stream state, set in the index (only `live` replicas are looked up):
- the first batch (after a replay from 0 when there is a replay endpoint: what a router that
  just started missed, filed as `inherited`) sets `live`; every later one must be the next;
- a *gap* (a batch beyond the next) is first asked of the replay socket; filled, nothing was
  lost; else the replica's blocks are dropped and it is `gap`: the index is a subset of the
  truth again, and it stays out of lookups until a batch comes in sequence;
- a *restart*: a batch numbered below the next, published after the last one (its `ts`), or the
  health monitor's restart verdict (`restarted`, fleet/health.py): blocks dropped, `restarted`
  until a batch comes in sequence; an earlier batch (a replay's overlap) is skipped;
- *stopped*: ZMQ reports the connection to the publisher gone: `stale` (blocks kept, unused).
  At the next batch the replay socket is asked for the last batch applied: the same `ts`, the
  same process (what followed is replayed); another, a restart; gone or no replay endpoint,
  unknown (blocks dropped, `gap`). An idle replica publishes nothing (vLLM sends a batch only
  when its cache changes): silence alone is not a fault;
- *silent*: a live replica answered a request whose report shows a whole block computed
  (`Replica.computed_at`, proxy/routed.py), and no batch has come since that request passed the
  fence, for `silence_s` (twice the health interval, at least SILENCE_S): `stale`, checked at
  the next batch as after a reconnect (a publisher that stopped sending, with its connection
  up). With data parallelism only rank 0 is followed: a rank 0 left idle may look silent;
- a block of another size than the router keys by: `mismatch` (logged), until the replica
  restarts or the router learns the replicas' size (fleet/replay.py, `key_by`).

Cost: per batch O(events + blocks) (kv_index.py); nothing on the request path. Never: block
the loop, write a replica's state, or file a block from a batch out of sequence.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from lora_router.config import Config, ReplicaAddress
from lora_router.fleet.client import ReplicaClient
from lora_router.fleet.fleet import Fleet
from lora_router.fleet.kv_wire import (
    END_SEQ,
    MAX_FRAME_BYTES,
    MAX_REPLAY_BYTES,
    RCV_HWM,
    Batch,
    Removed,
    Source,
    Stored,
    bounded,
    decode,
    filed,
    host_of,
    is_seq,
    parse_sources,
)
from lora_router.fleet.replica import Replica
from lora_router.routing.kv_index import (
    GAP,
    LIVE,
    MISMATCH,
    OFF,
    RESTARTED,
    STALE,
    KvIndex,
)

log = logging.getLogger(__name__)

REPLAY_TIMEOUT_S = 2.0  # for a whole replay's answer
SILENCE_S = 1.0  # the least time a computed block's batch may take to arrive
RECONNECT_S = 1.0  # a dropped connection not back by then is connected anew (`_listen`)


@dataclass(slots=True)
class Stream:
    """What one replica's subscription has seen (status, tests)."""

    source: Source | None = None
    reason: str | None = None  # why there is no source
    retry: bool = False  # ask for the source again at the next sync (it did not answer)
    batches: int = 0
    events: int = 0
    next_seq: int | None = None
    last_ts: float = 0.0
    gaps: int = 0
    restarts: int = 0
    disconnects: int = 0
    replays: int = 0
    undecodable: int = 0  # payloads that are not a batch (counted as gaps too)
    malformed: int = 0  # messages not (topic, 8-byte seq, payload), skipped
    refused: int = 0  # stored events naming a hash or a name over its cap, skipped
    replays_refused: int = 0  # replay answers over MAX_REPLAY_BYTES, not applied
    silences: int = 0
    batch_at: float = 0.0  # loop time the last batch arrived
    owed_since: float | None = None  # loop time a computed block's batch was first found missing
    verify: bool = False  # the connection came back: check the stream at its next batch
    recheck: bool = False  # ask for the source again (it went away, or restarted)
    task: asyncio.Task[None] | None = None


class KvEvents:
    """The subscriptions of every replica (module docstring)."""

    def __init__(self, config: Config, client: ReplicaClient, fleet: Fleet, index: KvIndex):
        self.config = config
        self.client = client
        self.fleet = fleet
        self.index = index
        self.streams: dict[str, Stream] = {}
        self._ctx: zmq.asyncio.Context | None = None
        self._loop_task: asyncio.Task[None] | None = None
        self.silence_s = max(2 * config.health_interval, SILENCE_S)
        self.silence_checks = 0  # times `check_silence` ran

    @property
    def mode(self) -> str:
        return self.config.kv_events

    async def start(self) -> None:
        """Subscribe to every replica that has a source; then keep trying the others."""
        self._ctx = zmq.asyncio.Context()
        await self.sync()
        self._loop_task = asyncio.get_running_loop().create_task(self._resync())

    async def _resync(self) -> None:
        while True:
            await asyncio.sleep(self.config.health_interval)
            await self.sync()
            self.check_silence()

    def check_silence(self) -> None:
        """A live stream owing the batch of a block its replica computed, for `silence_s`, is
        `stale` (module docstring)."""
        now = asyncio.get_running_loop().time()
        self.silence_checks += 1
        for replica in self.fleet.replicas:
            stream = self.streams.get(replica.name)
            if stream is None or self.index.replica(replica.name).state != LIVE:
                continue
            if stream.batch_at >= replica.computed_at:
                stream.owed_since = None
            elif stream.owed_since is None:
                stream.owed_since = now
            elif now - stream.owed_since >= self.silence_s:
                stream.owed_since = None
                stream.silences += 1
                stream.verify = True  # what it published meanwhile is unknown
                reason = (
                    f"its publisher is silent: no batch for {now - stream.batch_at:.1f} s, "
                    "though it computed blocks"
                )
                self.index.set_state(replica.name, STALE, reason)
                log.warning("KV events of %s: %s", replica.name, reason)

    async def sync(self) -> None:
        """Subscribe to replicas not subscribed yet; drop those that left the fleet."""
        names = {r.name for r in self.fleet.replicas}
        for name in [n for n in self.streams if n not in names]:
            await self._drop(name)
        wanted = []
        for replica in list(self.fleet.replicas):
            stream = self.streams.get(replica.name)
            if stream is None or (stream.task is None and stream.retry):
                wanted.append(self._subscribe(replica))
            elif stream.recheck and self.config.kv_events == "auto":
                wanted.append(self._recheck(replica, stream))
        await asyncio.gather(*wanted)  # each bounded by the health timeout, all at once

    async def _subscribe(self, replica: Replica) -> None:
        stream = self.streams.setdefault(replica.name, Stream())
        source, reason, stream.retry = await self._source(replica)
        stream.source, stream.reason = source, reason
        if source is None:
            self.index.set_state(replica.name, OFF, reason)
            return
        self.index.set_state(replica.name, STALE, "not connected yet")
        assert self._ctx is not None
        loop = asyncio.get_running_loop()
        stream.task = loop.create_task(self._follow(replica.name, stream, source))

    async def _recheck(self, replica: Replica, stream: Stream) -> None:
        """Its publisher went away or it restarted: where does it publish now? Asked again at
        every sync until it answers; a new place is followed from its first batch."""
        source, reason, retry = await self._source(replica)
        if retry:
            return  # not answering (yet): asked again at the next sync
        stream.recheck = False
        if source == stream.source:
            return
        log.warning(
            "KV events of %s: it publishes at %s now (was %s)",
            replica.name,
            source.endpoint if source else reason,
            stream.source.endpoint if stream.source else None,
        )
        if stream.task is not None:
            stream.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stream.task
            stream.task = None
        stream.next_seq, stream.verify = None, False
        self.index.reset(replica.name, STALE, "it publishes elsewhere now")  # the old process's
        await self._subscribe(replica)

    async def _source(self, replica: Replica) -> tuple[Source | None, str | None, bool]:
        """(source, why there is none, whether to ask again at the next sync)."""
        mode = self.config.kv_events
        if mode == "off":
            return None, "--kv-events off", False
        host = ReplicaAddress.parse(replica.name).host
        if mode != "auto":
            pub, _, replay = mode.partition(",")
            return Source(pub.format(host=host), replay.format(host=host) or None), None, False
        answer = await self.client.call(
            replica, "GET", "/kv_event_sources", timeout=max(self.config.health_timeout, 1.0)
        )
        if answer.status != 200:
            # Not answered (or not yet: a replica still starting): asked again; a 404 is a
            # vLLM without the route, asked again only if it restarts.
            return None, str(answer.failure("/kv_event_sources")), answer.status != 404
        source = parse_sources(answer.parsed(), host)
        if source is None:
            return (
                None,
                "its /kv_event_sources names no ZMQ publisher (no --kv-events-config)",
                False,
            )
        foreign = [e for e in (source.endpoint, source.replay) if e and host_of(e) != host]
        if foreign:
            # The router connects only to the fleet's own hosts: another one is named only by
            # the operator (`--kv-events tcp://HOST:PORT`), never by what a replica answers.
            return (
                None,
                f"its /kv_event_sources names another host ({foreign[0]}); "
                "name it with --kv-events to subscribe there",
                False,
            )
        return source, None, False

    def key_by(self, block_size: int) -> None:
        """The router keys by `block_size` from now on (runtime.py): a replica filed as
        `mismatch` is looked up again from its next batch in sequence."""
        self.index.block_size = block_size
        for name, rep in self.index.replicas.items():
            if rep.state == MISMATCH:
                self.index.set_state(name, STALE, "the router's block size changed")

    def restarted(self, replica: Replica) -> None:
        """The health monitor found the replica restarted: what it held is gone."""
        stream = self.streams.get(replica.name)
        if stream is None:
            return
        if stream.source is None:
            stream.retry = True  # a new process may publish now
            return
        stream.recheck = True  # perhaps elsewhere
        stream.restarts += 1
        stream.next_seq = None
        if self.index.replica(replica.name).state != OFF:
            self._fault(replica.name, RESTARTED, "the health monitor saw it restart")

    async def _follow(self, name: str, stream: Stream, source: Source) -> None:
        assert self._ctx is not None
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sub.setsockopt(zmq.RCVHWM, RCV_HWM)
        sub.setsockopt(zmq.SUBSCRIBE, source.topic.encode())
        monitor = sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sub.connect(source.endpoint)
        try:
            if source.replay is not None:  # what it held before this router started
                await self._replay(name, stream, source, 0, inherited=True)
            await self._listen(name, stream, source, sub, monitor)
        except Exception as exc:  # a bug must not end in silence: the replica is off, visibly
            log.exception("KV events of %s: the subscription failed", name)
            self.index.reset(name, OFF, f"the subscription failed: {exc!r}")
        finally:
            sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    async def _listen(
        self, name: str, stream: Stream, source: Source, sub: zmq.asyncio.Socket, monitor: Any
    ) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(sub, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        # ZMQ never reconnects a connection it dropped for a protocol error (a frame over
        # MAX_FRAME_BYTES): not connected again RECONNECT_S after a disconnect, connect anew
        # (which drops ZMQ's own retry, if it was retrying).
        reconnect_ms: int | None = None
        while True:
            ready = dict(await poller.poll(reconnect_ms))
            if not ready:
                with contextlib.suppress(zmq.ZMQError):
                    sub.disconnect(source.endpoint)
                sub.connect(source.endpoint)
                continue
            if monitor in ready:
                event = parse_monitor_message(await monitor.recv_multipart())
                reconnect_ms = None
                if event["event"] == zmq.EVENT_DISCONNECTED:
                    reconnect_ms = int(RECONNECT_S * 1000)
                    stream.disconnects += 1
                    stream.verify = True  # what it published meanwhile is unknown
                    stream.recheck = True  # a new process may publish elsewhere
                    if self.index.replica(name).state == LIVE:
                        self.index.set_state(name, STALE, "its publisher went away")
                        log.warning("KV events of %s: its publisher went away", name)
            if sub in ready:
                frames = await sub.recv_multipart()
                if len(frames) == 3 and is_seq(frames[1]):
                    await self._on_batch(name, stream, source, frames[1], frames[2])
                else:
                    stream.malformed += 1
                    if stream.malformed == 1:
                        log.warning("KV events of %s: a message not of vLLM's shape", name)

    async def _on_batch(
        self, name: str, stream: Stream, source: Source, seq_bytes: bytes, payload: bytes
    ) -> None:
        seq = int.from_bytes(seq_bytes, "big")
        stream.batch_at = asyncio.get_running_loop().time()
        try:
            batch = decode(payload)
        except msgspec.DecodeError:
            stream.undecodable += 1
            stream.gaps += 1
            stream.next_seq = seq + 1
            self._fault(name, GAP, f"batch {seq} could not be decoded")
            return
        if stream.verify:
            stream.verify = False
            await self._verify(name, stream, source)
        expected = stream.next_seq
        state = self.index.replica(name).state
        if expected is not None and seq < expected:
            if batch.ts <= stream.last_ts:
                return  # already applied (a replay's overlap)
            stream.restarts += 1
            self._fault(name, RESTARTED, f"batch {seq} after {expected - 1}: it restarted")
            state = RESTARTED
        elif expected is not None and seq > expected:
            if source.replay is not None and await self._replay(name, stream, source, expected):
                if stream.next_seq is not None and seq < stream.next_seq:
                    return  # the replay brought this batch too
                if stream.next_seq == seq:
                    self._apply(name, stream, seq, batch, self.index.replica(name).state)
                    return
            stream.gaps += 1
            self._fault(name, GAP, f"missed batches {expected} to {seq - 1}")
            state = GAP
        elif expected is None and state == STALE:
            state = LIVE  # the first batch of a subscription
        self._apply(name, stream, seq, batch, state)

    def _apply(
        self,
        name: str,
        stream: Stream,
        seq: int,
        batch: Batch,
        state: str,
        inherited: bool = False,
    ) -> None:
        """File one batch. `state`: the replica's state after it, unless the batch is the next
        in sequence, which ends a fault (a gap, a restart, a stop); a fault the index itself
        found while filing (another block size, the index full) stands."""
        in_sequence = stream.next_seq is not None and seq == stream.next_seq
        index = self.index
        rep = index.replica(name)
        before = rep.state
        for event in batch.events:
            if isinstance(event, Stored):
                if not bounded(event):
                    stream.refused += 1
                elif filed(event):
                    index.stored(
                        name,
                        event.block_hashes,
                        event.parent_block_hash,
                        event.token_ids,
                        event.block_size,
                        event.lora_name,
                        inherited,
                    )
            elif isinstance(event, Removed):
                if filed(event):
                    index.removed(name, event.block_hashes)
            else:
                index.reset(name, rep.state, rep.reason)
        stream.batches += 1
        stream.events += len(batch.events)
        stream.next_seq = seq + 1
        stream.last_ts = batch.ts
        if rep.state == MISMATCH and before != MISMATCH:
            log.warning(
                "KV events of %s: %s; routing it by prediction (fix: give the router "
                "--block-size to match the replicas' --block-size)",
                name,
                rep.reason,
            )
        if rep.state != before or rep.state == MISMATCH:
            return
        if in_sequence or state == LIVE:
            index.set_state(name, LIVE)
        elif state != before:
            index.set_state(name, state, rep.reason)

    async def _verify(self, name: str, stream: Stream, source: Source) -> None:
        """After the connection came back: the same process (its replay buffer still has the
        last batch applied, same `ts`: replay what followed), a restarted one (another batch
        under that number: start again from its buffer), or unknown (blocks dropped)."""
        last = None if stream.next_seq is None else stream.next_seq - 1
        if last is None:
            return  # nothing applied yet: any batch is a first one
        if source.replay is None:
            stream.gaps += 1
            stream.next_seq = None
            self._fault(name, GAP, "reconnected, and no replay endpoint says what it missed")
            return
        probe = await self._replayed(stream, source, last, limit=1)
        found = self._decoded(stream, probe[0][1]) if probe and probe[0][0] == last else None
        if found is not None and found.ts == stream.last_ts:
            await self._replay(name, stream, source, last + 1)
            return
        if found is not None:
            stream.restarts += 1
            stream.next_seq = None
            self._fault(name, RESTARTED, f"batch {last} was published again: it restarted")
            await self._replay(name, stream, source, 0)
            return
        stream.gaps += 1
        stream.next_seq = None
        self._fault(name, GAP, f"reconnected, and batch {last} is no longer replayable")

    async def _replay(
        self, name: str, stream: Stream, source: Source, start: int, *, inherited: bool = False
    ) -> bool:
        """Ask the replay socket for every batch from `start` and apply those in sequence;
        True when it answered (whatever it still held). `inherited`: the start-up replay."""
        stream.replays += 1
        batches = await self._replayed(stream, source, start)
        if batches is None:
            return False
        for seq, payload in batches:
            expected = stream.next_seq
            if expected is not None and seq != expected:
                continue  # before what was applied, or beyond a hole it cannot fill
            batch = self._decoded(stream, payload)
            if batch is None:
                continue  # a hole: what follows it is out of sequence
            state = self.index.replica(name).state
            self._apply(name, stream, seq, batch, LIVE if state == STALE else state, inherited)
        return True

    async def _replayed(
        self, stream: Stream, source: Source, start: int, limit: int | None = None
    ) -> list[tuple[int, bytes]] | None:
        """The payloads the replay socket holds from `start` (at most `limit` kept), in order,
        still encoded; None when it did not answer within REPLAY_TIMEOUT_S, or answered more
        than MAX_REPLAY_BYTES (counted `replays_refused`). A message not of the wire's shape is
        counted `malformed` and skipped."""
        assert self._ctx is not None and source.replay is not None
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        sock.connect(source.replay)
        out: list[tuple[int, bytes]] = []
        budget = MAX_REPLAY_BYTES
        try:
            async with asyncio.timeout(REPLAY_TIMEOUT_S):
                await sock.send_multipart((b"", start.to_bytes(8, "big")))
                while True:
                    frames = await sock.recv_multipart()
                    # 0.32: (b"", topic, seq, payload); earlier releases: (b"", seq, payload).
                    if len(frames) < 3 or not (is_seq(frames[-2]) or frames[-2] == END_SEQ):
                        stream.malformed += 1
                        continue
                    seq_bytes, payload = frames[-2], frames[-1]
                    if seq_bytes == END_SEQ:
                        return out
                    if limit is not None and len(out) >= limit:
                        continue
                    budget -= len(payload)
                    if budget < 0:
                        stream.replays_refused += 1
                        log.warning(
                            "KV events: the replay of %s holds more than %d bytes; not applied",
                            source.replay,
                            MAX_REPLAY_BYTES,
                        )
                        return None
                    out.append((int.from_bytes(seq_bytes, "big"), payload))
        except TimeoutError:
            return None
        finally:
            sock.close(linger=0)

    @staticmethod
    def _decoded(stream: Stream, payload: bytes) -> Batch | None:
        """A replayed payload decoded; None, counted `undecodable`, when it is not a batch."""
        try:
            return decode(payload)
        except msgspec.DecodeError:
            stream.undecodable += 1
            return None

    def _fault(self, name: str, state: str, reason: str) -> None:
        """Drop what the replica held: its stream can no longer say what that is."""
        self.index.reset(name, state, reason)
        log.warning("KV events of %s: %s; routing it by prediction until they resume", name, reason)

    async def _drop(self, name: str) -> None:
        stream = self.streams.pop(name)
        if stream.task is not None:
            stream.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await stream.task
        if name in self.index.replicas:
            self.index.forget(name)

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
        for name in list(self.streams):
            await self._drop(name)
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
            self._ctx = None

    def json(self) -> dict[str, object]:
        """Per replica: the stream's state, its blocks filed, what it has seen."""
        out: dict[str, object] = {}
        for name, stream in self.streams.items():
            rep = self.index.replicas.get(name)
            out[name] = {
                "state": rep.state if rep is not None else OFF,
                "reason": (rep.reason if rep is not None else None) or stream.reason,
                "last_fault": rep.last_fault if rep is not None else stream.reason,
                "endpoint": stream.source.endpoint if stream.source else None,
                "blocks": len(rep.blocks) if rep is not None else 0,
                "batches": stream.batches,
                "events": stream.events,
                "next_seq": stream.next_seq,
                "gaps": stream.gaps,
                "restarts": stream.restarts,
                "disconnects": stream.disconnects,
                "replays": stream.replays,
                "orphans": rep.orphans if rep is not None else 0,
                "undecodable": stream.undecodable,
                "malformed": stream.malformed,
                "refused": stream.refused,
                "replays_refused": stream.replays_refused,
                "nameless": rep.nameless if rep is not None else 0,
                "bytes": rep.bytes if rep is not None else 0,
                "silences": stream.silences,
            }
        return {
            "mode": self.config.kv_events,
            "silence_s": self.silence_s,
            "silence_checks": self.silence_checks,
            "bytes": self.index.bytes,
            "max_bytes": self.index.max_bytes,
            "max_replica_bytes": self.index.max_replica_bytes,
            "replicas": out,
        }
