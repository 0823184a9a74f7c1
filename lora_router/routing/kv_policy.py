"""`--policy kv`: prefix affinity, with a new family sent where its prefix really is.

`PrefixAffinity` (policy.py) given a `KvLookup` as its `prefer` strategy, which changes one
rule, rule 3 (a fresh prompt, one the affinity table knows no family of): before the deal,
`KvLookup` asks the KV index (kv_index.py, filled from the replicas' own KV events by
fleet/kv_events.py) which live replicas hold the longest prefix of the prompt's block chain
under the request's adapter name (`Candidates.model`).
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

from .contract import Candidates, Deal, R
from .keys import PromptKey
from .kv_index import KvIndex

_TOKEN_BYTES = 4


class KvLookup:
    """Where a new family's prefix really is, by the KV index (module docstring): the
    `contract.Prefer` strategy of `--policy kv`."""

    __slots__ = ("index",)

    def __init__(self, index: KvIndex) -> None:
        self.index = index

    def among(
        self, key: PromptKey, routable: Candidates[R], cap: int, deal: Deal
    ) -> tuple[Candidates[R], int] | None:
        """The routable holders of the prompt's longest prefix that have room, and its tokens
        left to compute; None when the index finds none (module docstring)."""
        index = self.index
        lora = routable.model
        if key.block_bytes != index.block_size * _TOKEN_BYTES or key.seed != index.root(lora):
            return None
        level, holders = index.longest(lora, key.chain)
        if not level:
            return None
        # The holders in name order (a set's order is not stable across processes), routable,
        # below the cap, and inside the deal window.
        window = deal.window()
        last = key.chain[level - 1]
        found = (routable.get(name) for name in sorted(holders))
        room = Candidates(
            (
                r
                for r in found
                if r is not None
                and r.in_flight < cap
                and (deal.families(r.name) < window or index.inherited(lora, last, r.name))
            ),
            lora,
        )
        if not room:
            return None
        return room, max(0, key.tokens - level * index.block_size)
