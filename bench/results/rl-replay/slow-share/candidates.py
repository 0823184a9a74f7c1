"""The slow member's share of new work, varied for bench/rl_replay.py (not kept):

- `w:power=P`: the weight the pace rule sets, w sixteenths, becomes 16 (w / 16) ** P (at least
  WEIGHT_MIN): at half speed 8 becomes 6 (P = 1.5) or 4 (P = 2), so fewer families and a lower
  scaled cap, or 11 (P = 0.5), 13 (P = 0.25) or 16 (P = 0: no weight), so more
  (bench/results/rl-replay/slow-share-more);
- `w:shun=1`: once the pace rule has judged a member slow it takes nothing new (no room under
  any cap): a bound on what holding it to fewer requests can buy, not a rule.
"""

from __future__ import annotations

from typing import Any

import lora_router.routing.policy as P


class Candidate(P.PrefixAffinity):
    def __init__(self, power: float = 1.0, shun: int = 0, **options: Any) -> None:
        super().__init__(**options)
        self._power, self._shun = power, bool(shun)

    def set_weight(self, name: str, weight: int) -> None:
        if weight < P.WEIGHT_FULL:
            scaled = round(P.WEIGHT_FULL * (weight / P.WEIGHT_FULL) ** self._power)
            weight = max(P.WEIGHT_MIN, scaled)
        super().set_weight(name, weight)

    def _room(self, replica: Any, cap: int) -> bool:
        if self._shun and replica.name in self._slow:
            return False
        return super()._room(replica, cap)


def make_policy(**options: Any) -> Candidate:
    return Candidate(**options)
