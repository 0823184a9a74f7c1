"""What each replica's KV cache really holds, learnt from its KV events, in the router's own keys.

vLLM names a block by a hash the router cannot reproduce (its hash function and per-process
seed are its own); an event tells which tokens the block holds and which block comes before it.
So each stored block gets the router's key for it: `xxh3(its tokens, key of its parent)`, the
parent's key found by the parent's vLLM hash, a first block's parent key the root seed of its
adapter name. That is `keys.PromptKey.chain` computed from `root(lora_name)` (`keys` defines all
hashing; nothing is hashed here but through `keys.prompt_key`), so a routed prompt looks up its
own `chain[i]` directly, with no second hashing of it.

Key space: placement keys are seeded by an adapter's *lineage* (`keys.Lineages`), but vLLM
caches each adapter *name* apart (trl-policy-v3 and -v4 share no block). So keys are filed per
adapter name (`lora_name`, None for the base model): `root(name)` is the lineage's token seed
the request under that name is keyed by, and a lookup names the adapter. A base-model request
keyed by a named base model (not None) has another seed and finds nothing here.

Rules:
- `stored` maps only blocks whose parent this replica is known to hold (or that have none): an
  orphan is counted and skipped. So what is filed is always a subset of what the replica holds,
  as long as no removal was missed: a missed event (a gap) is answered by `reset`, which drops
  the replica's blocks. A removal or a clear of blocks never filed is a no-op.
- A stored block whose `block_size` is not the router's marks the replica `MISMATCH`: its keys
  could never match a prompt's, so it is dropped and left to the prediction.
- Only replicas in `LIVE` state are looked up (`longest`); the caller (fleet/kv_events.py)
  decides the state from the event stream. A replica not live keeps what it holds only while
  `STALE` (the stream stopped; it resumes in sequence or is reset).
- At most `max_replica_bytes` a replica, `max_bytes` in all, a block counted `block_cost` (its
  memory's bound; kv_wire.py caps hash and name): over either, the replica over its own, or the
  one holding most, is reset (`GAP`). A name beyond MAX_NAMES is refused (counted `nameless`).
- A block filed `inherited` (what the replicas held before this router started, read from
  their replay buffers) says so to `inherited` until it is removed: the policy tells a
  family placed before it from a prefix families placed since share (kv_policy.py).

Cost: `stored` O(blocks) (one xxh3 and two dict writes each); `removed` O(blocks); `reset`
O(blocks held). `longest` for a prompt of b full blocks: at most b dict lookups and b set
intersections of at most n holders (in C), stopping at the first block no live replica holds.
Memory: `max_bytes` plus a dict per name (docs/design/kv-events.md#memory measures each).

Never: I/O, clocks, logging; never a key for a block whose parent's key is unknown.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field

from .keys import prompt_key

OFF, LIVE, STALE, GAP, RESTARTED, MISMATCH = "off", "live", "stale", "gap", "restarted", "mismatch"
STATES = (OFF, LIVE, STALE, GAP, RESTARTED, MISMATCH)
# What filing one block costs at most, beyond its hash's and adapter name's own bytes: two
# dict entries, its (name, key) tuple, its key and its holder's count (measured: at most 430);
# an inherited block adds its entry in `_inherited` (measured: at most 330).
BLOCK_BYTES = 512
INHERITED_BYTES = 384
# vLLM's block hashes are 64-bit ints or 32-byte digests (docs/design/kv-events.md): twice that.
MAX_HASH_BYTES = 64
MAX_NAME_BYTES = 256  # an adapter name (`lora_name`), in UTF-8 bytes
MAX_NAMES = 1024  # adapter names filed at once, over the whole fleet (TRL uses a handful)
# A replica: about 500,000 blocks of 512 bytes, several times the pool of an 80 GB GPU.
DEFAULT_MAX_REPLICA_BYTES = 256 << 20
DEFAULT_MAX_BYTES = 2 << 30  # the fleet: about four million blocks

BlockHash = Hashable  # vLLM's ExternalBlockHash: an int (its default) or bytes


def block_cost(block_hash: BlockHash, lora: str | None, inherited: bool) -> int:
    """What filing one block costs at most, in bytes (`BLOCK_BYTES`); O(1)."""
    cost = BLOCK_BYTES + INHERITED_BYTES if inherited else BLOCK_BYTES
    if isinstance(block_hash, bytes):
        cost += len(block_hash)
    return cost if lora is None else cost + 4 * len(lora)  # a str's widest: 4 bytes a character


@dataclass(slots=True)
class ReplicaBlocks:
    """One replica's filed blocks and what its event stream did (read by /router/status)."""

    state: str = OFF
    # vLLM hash -> (adapter name, router key) of every block filed.
    blocks: dict[BlockHash, tuple[str | None, int]] = field(default_factory=dict)
    stored: int = 0  # blocks filed, ever
    removed: int = 0  # blocks unfiled by BlockRemoved
    orphans: int = 0  # stored blocks skipped: their parent was not filed
    nameless: int = 0  # stored blocks skipped: a new adapter name beyond MAX_NAMES
    resets: int = 0  # times everything was dropped (a gap, a restart, a clear)
    bytes: int = 0  # the `block_cost` of every block filed
    reason: str | None = None  # why the state is not live, if it is not
    last_fault: str | None = None  # the last reason it was not live, kept once it is again


class KvIndex:
    """Per replica and adapter name, the router keys of the blocks it holds (module docstring)."""

    __slots__ = (
        "_holders",
        "_inherited",
        "_live",
        "block_size",
        "bytes",
        "max_bytes",
        "max_replica_bytes",
        "replicas",
        "root",
    )

    def __init__(
        self,
        root: Callable[[str | None], int],
        block_size: int,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_replica_bytes: int = DEFAULT_MAX_REPLICA_BYTES,
    ) -> None:
        self.root = root  # adapter name (None: base) -> the seed its prompts' chains start from
        self.block_size = block_size  # the router's; set again once the replicas said theirs
        self.max_bytes = max_bytes
        self.max_replica_bytes = max_replica_bytes
        self.bytes = 0  # the `block_cost` of every block filed, over all replicas
        self.replicas: dict[str, ReplicaBlocks] = {}
        # adapter name -> router key -> replica -> how many of its filed blocks have that key.
        self._holders: dict[str | None, dict[int, dict[str, int]]] = {}
        # (adapter name, router key) -> the replicas whose block of that key is inherited.
        self._inherited: dict[tuple[str | None, int], set[str]] = {}
        self._live: set[str] = set()

    def replica(self, name: str) -> ReplicaBlocks:
        known = self.replicas.get(name)
        if known is None:
            known = self.replicas[name] = ReplicaBlocks()
        return known

    def set_state(self, name: str, state: str, reason: str | None = None) -> None:
        """The replica's stream state; only LIVE replicas are looked up."""
        rep = self.replica(name)
        rep.state = state
        rep.reason = None if state == LIVE else reason
        if state != LIVE and reason is not None:
            rep.last_fault = reason
        if state == LIVE:
            self._live.add(name)
        else:
            self._live.discard(name)

    def forget(self, name: str) -> None:
        """The replica left the fleet."""
        self.reset(name, OFF, "left the fleet")
        del self.replicas[name]

    def stored(
        self,
        name: str,
        hashes: Sequence[BlockHash],
        parent: BlockHash | None,
        tokens: Sequence[int],
        block_size: int,
        lora: str | None,
        inherited: bool = False,
    ) -> int:
        """A `BlockStored`: file its blocks; returns how many were filed. `inherited`: it was
        published before this router started (module docstring)."""
        if block_size != self.block_size:
            self.reset(
                name, MISMATCH, f"block size {block_size}, the router keys {self.block_size}"
            )
            return 0
        rep = self.replica(name)
        if parent is None:
            seed = self.root(lora)
        else:
            known = rep.blocks.get(parent)
            if known is None or known[0] != lora:
                rep.orphans += len(hashes)
                return 0
            seed = known[1]
        if len(tokens) != len(hashes) * block_size:
            rep.orphans += len(hashes)  # not whole blocks: nothing it says can be keyed
            return 0
        if not hashes:
            return 0
        holders = self._holders.get(lora)
        if holders is None:
            if len(self._holders) >= MAX_NAMES:
                rep.nameless += len(hashes)
                return 0
            holders = self._holders[lora] = {}
        chain = prompt_key(None, tokens, block_size, seed=seed).chain
        blocks = rep.blocks
        filed = cost = 0
        for block_hash, key in zip(hashes, chain, strict=True):
            old = blocks.get(block_hash)
            if old is not None:
                if old == (lora, key):
                    continue
                cost -= self._unfile(name, block_hash, old)
                holders = self._holders.setdefault(lora, holders)  # if that emptied it
            blocks[block_hash] = (lora, key)
            heirs = self._inherited.setdefault((lora, key), set()) if inherited else None
            # Charged as the replica joins the block's heirs, refunded as it leaves (`_unfile`).
            cost += block_cost(block_hash, lora, heirs is not None and name not in heirs)
            if heirs is not None:
                heirs.add(name)
            by_replica = holders.get(key)
            if by_replica is None:
                holders[key] = {name: 1}
            else:
                by_replica[name] = by_replica.get(name, 0) + 1
            filed += 1
        rep.stored += filed
        rep.bytes += cost
        self.bytes += cost
        if rep.bytes > self.max_replica_bytes:
            self.reset(name, GAP, f"its blocks passed {self.max_replica_bytes} bytes")
        elif self.bytes > self.max_bytes:  # the largest holds at least this store's excess
            largest = max(self.replicas, key=lambda n: self.replicas[n].bytes)
            self.reset(largest, GAP, f"the KV index was full ({self.max_bytes} bytes)")
        return filed

    def removed(self, name: str, hashes: Iterable[BlockHash]) -> None:
        """A `BlockRemoved`: unfile those blocks (unknown ones are ignored)."""
        rep = self.replicas.get(name)
        if rep is None:
            return
        pop = rep.blocks.pop
        freed = 0
        for block_hash in hashes:
            old = pop(block_hash, None)
            if old is not None:
                freed += self._unfile(name, block_hash, old)
                rep.removed += 1
        rep.bytes -= freed
        self.bytes -= freed

    def reset(self, name: str, state: str, reason: str | None = None) -> None:
        """Drop every block of the replica (`AllBlocksCleared`, a gap, a restart) and set its
        state."""
        rep = self.replica(name)
        freed = sum(self._unfile(name, h, entry) for h, entry in rep.blocks.items())
        rep.bytes -= freed
        self.bytes -= freed
        if rep.blocks:
            rep.resets += 1
        rep.blocks = {}
        self.set_state(name, state, reason)

    def _unfile(self, name: str, block_hash: BlockHash, entry: tuple[str | None, int]) -> int:
        """Take one block out of every map but the replica's `blocks` (the caller's); returns
        its `block_cost`, which the caller takes off."""
        lora, key = entry
        heirs = self._inherited.get(entry)
        inherited = False
        if heirs is not None and name in heirs:
            inherited = True
            heirs.discard(name)
            if not heirs:
                del self._inherited[entry]
        holders = self._holders[lora]
        by_replica = holders[key]
        left = by_replica[name] - 1
        if left:
            by_replica[name] = left
        else:
            del by_replica[name]
            if not by_replica:
                del holders[key]
                if not holders:
                    del self._holders[lora]
        return block_cost(block_hash, lora, inherited)

    def longest(self, lora: str | None, chain: Sequence[int]) -> tuple[int, frozenset[str]]:
        """The most leading blocks of `chain` (a prompt's `PromptKey.chain` under `root(lora)`)
        that some live replica holds under adapter `lora`, and the live replicas holding them
        all: (0, empty) when none holds its first block. O(len(chain)) at most (module
        docstring)."""
        holders = self._holders.get(lora)
        live = self._live
        if not holders or not live:
            return 0, frozenset()
        level = 0
        found: set[str] | None = None
        get = holders.get
        for key in chain:
            by_replica = get(key)
            if by_replica is None:
                break
            both = by_replica.keys() & (live if found is None else found)
            if not both:
                break
            found = both
            level += 1
        return level, frozenset(found or ())

    def inherited(self, lora: str | None, key: int, name: str) -> bool:
        """Whether the replica's block of router key `key` under `lora` was filed as held
        before this router started. O(1)."""
        heirs = self._inherited.get((lora, key))
        return heirs is not None and name in heirs

    def held(self, name: str) -> int:
        """Blocks filed for the replica."""
        rep = self.replicas.get(name)
        return len(rep.blocks) if rep is not None else 0

    def held_bytes(self, name: str) -> int:
        """The `block_cost` of the blocks filed for the replica."""
        rep = self.replicas.get(name)
        return rep.bytes if rep is not None else 0
