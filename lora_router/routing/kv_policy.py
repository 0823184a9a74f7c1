"""`--policy kv`: prefix affinity, with a new family sent where its prefix really is.

`KvAffinity` is `PrefixAffinity` (policy.py) with one rule changed, rule 3 (a fresh prompt,
one the affinity table knows no family of): before the deal, it asks the KV index (kv_index.py,
filled from the replicas' own KV events by fleet/kv_events.py) which live replicas hold the
longest prefix of the prompt's block chain under the request's adapter name (`Candidates.model`).
- Some routable replica among those holding it has room under the load cap and either is
  inside the deal window (it holds fewer families than the window allows, or no more than the
  fewest) or holds the prefix's last block from before this router started (`inherited`: the
  family was placed by an earlier router): the prompt goes to one of them, chosen by the deal
  among them alone (counted as dealt, ties broken as the deal breaks them); decision `kv`,
  its tokens to compute less the blocks found. It is recorded as a new family's first prompt.
  The window keeps a prefix families placed by this router share (a system prompt, held first
  by one replica) from pulling every new family (docs/design/kv-events.md measures both).
- No live replica holds its first block, or no holder qualifies: the deal over every
  routable replica, exactly as `prefix` (decision `fresh`).
Every other rule is `PrefixAffinity`'s, unchanged: siblings, continuations and moves follow
lineage placement; spills; no key. A replica whose events are not live (stale, a gap, a
restart, another block size, no source) is never a holder: it gets today's prediction.

Only token-id prompts are looked up: a text or chat key, or a base-model prompt keyed by a
named base model, is seeded apart from the index's roots (`KvIndex.root`) and goes to the deal.

Cost added per request: none for a sibling or a known prompt; for a fresh prompt, `longest`
(O(blocks) dict lookups, bounded by the prompt's blocks, kv_index.py) on the chain the
affinity lookup already computed, plus the deal among at most n holders (policy.py's bound).
Measured in bench/results/kv-index-cost.json (bench/kv_index_cost.py).

Never: I/O, clocks, randomness, logging; never a replica outside `routable`, never over the cap.
"""

from __future__ import annotations

from .keys import PromptKey
from .kv_index import KvIndex
from .policy import (
    DEFAULT_LOAD_FACTOR,
    DEFAULT_LOAD_SLACK,
    DEFAULT_MOVE_PRICE,
    DEFAULT_TABLE_SIZE,
    Candidates,
    Decision,
    PrefixAffinity,
    R,
)
from .ring import DEFAULT_VNODES

_TOKEN_BYTES = 4


class KvAffinity(PrefixAffinity):
    """`PrefixAffinity` whose fresh prompts go where the KV index finds them (module docstring)."""

    name = "kv"

    def __init__(
        self,
        index: KvIndex,
        *,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        vnodes: int = DEFAULT_VNODES,
        table_size: int = DEFAULT_TABLE_SIZE,
        load_slack: int = DEFAULT_LOAD_SLACK,
        move_price: int = DEFAULT_MOVE_PRICE,
    ) -> None:
        super().__init__(
            load_factor=load_factor,
            vnodes=vnodes,
            table_size=table_size,
            load_slack=load_slack,
            move_price=move_price,
        )
        self.index = index

    def _fresh(self, key: PromptKey, routable: Candidates[R], cap: int) -> Decision[R]:
        index = self.index
        lora = routable.model
        if key.block_bytes == index.block_size * _TOKEN_BYTES and key.seed == index.root(lora):
            level, holders = index.longest(lora, key.chain)
            if level:
                # The holders in name order (a set's order is not stable across processes),
                # routable, below the cap, and inside the deal window.
                window = self._window()
                dealt = self._dealt.get
                last = key.chain[level - 1]
                found = (routable.get(name) for name in sorted(holders))
                room = Candidates(
                    (
                        r
                        for r in found
                        if r is not None
                        and r.in_flight < cap
                        and (dealt(r.name, 0) < window or index.inherited(lora, last, r.name))
                    ),
                    lora,
                )
                if room:
                    self.counts.kv += 1
                    cached = level * index.block_size
                    return Decision(
                        self._deal(key.full, room, cap), "kv", max(0, key.tokens - cached)
                    )
        return super()._fresh(key, routable, cap)

    def _window(self) -> int:
        """A holder may take a new family while it holds fewer than this many: the deal
        window's limit, and never less than one more than the fewest any member holds (the
        deal's own first choice). O(1): the lowest count kept may be one no member holds any
        more, which only makes the bound stricter."""
        if not self._ranks.rank:
            return 1 << 62
        counts = self._ranks.counts
        return max(self._deal_limit(), (counts[0] if counts else 0) + 1)
