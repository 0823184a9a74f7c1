"""Routing policies: given a prompt's key and the replicas that may take it, pick one.

`PrefixAffinity` (`--policy prefix`, the default): consistent hashing with bounded loads plus an
affinity table of earlier prompts (`affinity`), on placement keys (`keys`: lineage, not version).
The rules, each stated in full with its measurements in docs/design/routing.md:

0. *Sibling by its wire key*: a token-id prompt whose JSON text was seen goes to that prompt's
   home if it is routable and below the load cap, and its block key is never built.
1. *Known prompt*: of the earlier prompts whose stems it starts with, longest block prefix
   first, the first whose replica is routable and has room (the load cap for a sibling, the
   *follow cap*, twice the slack, for a continuation); a family's first later turn *moves*
   instead to the next replica on the family's ring path when the home holds more work by
   `move_price` times its tokens, within `MOVE_SHARE` and `MOVE_BUDGET` (`_lighter`).
2. *Spill*: known, but none of its replicas can take it: the first routable replica with room
   in ring order from its key (with a member below full weight: the first full-weight one with
   room, if any; *Weights*). A spill never moves the home of a prompt that has one.
3. *Fresh* (a new family): *the deal*, fewest families dealt, then fewest requests and prompt
   tokens in flight, ties in ring order from its key; inside the *deal window* (`DEAL_WINDOW`
   x the mean count) a replica dealt more that holds less work (`work_held`) takes it.
4. *No key*: least in flight, round robin among ties.
The load cap is `ceil(max((1 + load_factor) * m, m + load_slack))`, m = (in flight + 1) / n,
with members below full weight counted as their weight's share of a member (*Weights*).

*Weights* (`set_weight`, measured by the caller: fleet/pace.py): a member's relative speed in
sixteenths, `WEIGHT_FULL` unless it is measurably slow. Families dealt are counted in
`DEAL_UNIT`ths, a family costing `DEAL_UNIT * WEIGHT_FULL // weight` (a half-speed member is dealt
about half the families), and a member's room in every rule is the cap scaled by its weight,
`max(1, cap * weight // WEIGHT_FULL)`, so siblings and continuations spill off a member that is
behind. The cap's mean counts a member as its weight's share of one (n = the weights summed /
WEIGHT_FULL): the others take what a slow member does not, so their mean load is above the plain
one, and a cap on the plain mean would spill their siblings. *The finish rule*: a member below full
weight that the deal (window included) picks keeps the family only if it would finish it sooner
than the first full-weight member with room in the deal's order, a member's time being `(1 + max(0,
in_flight - BATCH_FLOOR)) x WEIGHT_FULL / weight`: its own request plus those it would wait behind,
a replica decoding what it holds together up to its batch; and only if its scaled cap has room for
the whole family, as many requests as a family has brought so far (`_family_size`: the first and
its siblings per family dealt), besides the siblings still to come of the families it was dealt
(`_coming`: each such family's size less one, less each repeat since of a prompt homed there; none
once it holds nothing, since siblings are sent with their first), since a group split over a slow
member waits for its slow siblings while those spilled recompute its prompt (`_finish_rule`). Else
that member takes it, and the slow member's turn counts as dealt to it (its count keeps pace, so
one back at full weight is owed no burst of families). A fleet whose full-weight members hold at
most BATCH_FLOOR each never deals a new family to a slower one: it would finish 1 / weight times
later for nothing. *Later turns and spills*: a continuation whose replica is below full weight, and
a spill, go to the first full-weight member with room under the load cap in ring order from the
prefix's key, if any (`_faster`; a spill finding none takes the first member with room), and a
conversation's next turns follow it: a slow member multiplies every token of a long completion, a
queue only adds its wait, and a turn's history is prefilled far faster than it is decoded. With
every weight full, decisions are exactly those without weights.

Invariants: some replica always has room under either cap unscaled, so every walk ends (with
weights none may: a walk that finds no room takes the least loaded); a prompt's first
placement sticks unless its replica left the ring; a decision is always one of `routable`.

Cost per request, n replicas (it must not grow with the fleet): a sibling by its wire key O(1);
a known prompt O(blocks), then O(1) per replica tried (a move: one ring walk, O(1 + s)); a
spill O(1 + s), s the members the walk passes over; a new family O(log n) per rank passed over
(`ranks`) plus O(min(k, n / k)) for k tied members (at most O(sqrt(n)); twice with the window
open) plus O(log n) per member whose load changed since, or one ring walk with at most
`WALK_DEAL_MEMBERS` members (the same choice); O(n) only in `least_loaded`, `set_members`.
With a member below full weight: one dict lookup more per member tried and, for each cap, per
member below full weight (a continuation on a slow member: one ring walk, O(1 + s)), and a
rank's k tied members filtered by room, O(k) (`_first_routable`); when the deal picks a member
below full weight, the finish rule's full-weight member, found the same way among the
full-weight members (walking: none more), and `_family_size` and `_coming` O(1) (a repeat of a
prompt homed on a slow member: one dict lookup more); a spill, one ring walk more at most;
`set_weight` O(1).

Contract with the caller: one `choose(key, routable)` per attempt, `key` the request's
`RouteKey` or None, dropped once decided (a retry builds a new one); `routable` a non-empty,
filtered `Candidates`, its `in_flight` the sum over its replicas. `choose` never changes
`in_flight` or `in_flight_tokens`: the caller adds 1 and `Decision.tokens` for the request it
sends, takes them off on every exit and calls `load_changed` after each change; `set_members`
gets the full membership at start and before the next `choose` after any change. Not thread-safe.

Never: I/O, clocks, randomness, logging (the caller logs decisions), mutating replicas, reading
what replicas report of themselves (their telemetry)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from functools import partial
from typing import cast

from .affinity import AffinityTable, anchor_first, anchor_tokens
from .contract import Candidates, Decision, DecisionCounts, Policy, Prefer, R, Replica
from .keys import PromptKey, RouteKey
from .ranks import Ranks
from .ring import DEFAULT_VNODES, HashRing

# The rules' constants; docs/design/routing.md gives the measurements that chose each value.
DEFAULT_LOAD_FACTOR = 0.25
DEFAULT_TABLE_SIZE = 200_000
# Two groups of TRL's default 8 samples: below it a group scatters and recomputes its prompt.
DEFAULT_LOAD_SLACK = 16
# A first later turn moves past this many times its prompt tokens of work (`_lighter`); 0: never.
DEFAULT_MOVE_PRICE = 10
# One request in flight in the work a move compares, in prompt tokens: its decode and the history
# its next turn will prefill, which the router cannot see when it routes.
MOVE_REQUEST_TOKENS = 800
# At most one move into a replica per this many requests routed per replica (moved
# conversations carry their later turns: request totals stay near the mean).
MOVE_SHARE = 50
# All moves' prompt tokens at most 1 / MOVE_BUDGET of the prompt tokens routed: what moves
# recompute stays that share of the hit rate's own denominator.
MOVE_BUDGET = 300
# The deal window's bound on a member's families, in means (floored): request totals within 5 %.
DEAL_WINDOW = Fraction(21, 20)
_WINDOW_NUM, _WINDOW_DEN = DEAL_WINDOW.numerator, DEAL_WINDOW.denominator  # read per deal
# Fleets of at most this many members deal by one walk of the ring (`_deal_walk`), which
# costs less there than keeping the ranks current (docs/design/overhead.md); larger ones
# read the kept ranks. Both make the same choice.
WALK_DEAL_MEMBERS = 4
# One request in flight in the work the deal window compares, in prompt tokens: one
# completion's decode (a new family has no later turns to price).
DEAL_REQUEST_TOKENS = 40
# A member's weight at full speed (weights are sixteenths), and the families dealt are counted
# in these units: a family dealt to a member of weight w costs DEAL_UNIT * WEIGHT_FULL // w.
WEIGHT_FULL = 16
DEAL_UNIT = 16
# The lowest weight a member can have: a slower one is still dealt a quarter of a fair share.
WEIGHT_MIN = 4
# The requests the finish rule takes every replica to decode together, none of them waiting:
# two groups, as the load slack (vLLM runs up to its max_num_seqs at once, 256 by default; a
# floor below a fleet's batch only deals a slow member what the weighted deal alone would).
BATCH_FLOOR = 16


def scaled_cap(cap: int, weight: int) -> int:
    """A member's room under `cap` at `weight` sixteenths: never below 1."""
    return max(1, cap * weight // WEIGHT_FULL)


def _cap(total: int, units: int, grow: int, den: int, slack: int) -> int:
    """The most requests a full-weight replica may have in flight after taking one more
    request: `ceil(max((1 + load_factor) * m, m + slack))` with `m = (total + 1) x WEIGHT_FULL
    / units`, the mean load counting the new request of a member at full weight, `units` the
    candidates' weights summed (WEIGHT_FULL each at full weight: then m is the plain mean),
    and 1 + load_factor given as the integers grow / den.

    Integer arithmetic on the exact fraction: with floats, `1.1 * 10 / 11` rounds up to 2 and
    would let the cap drift by one.
    """
    scaled = (total + 1) * WEIGHT_FULL
    return max(-(-grow * scaled // (den * units)), -(-scaled // units) + slack)


def work_held(replica: Replica, per_request: int) -> int:
    """The work a replica holds, in prompt tokens to compute: its prompt tokens in flight and
    `per_request` for each request in flight (its decode, and what else the rule prices)."""
    return replica.in_flight_tokens + per_request * replica.in_flight


def least_loaded(routable: Sequence[R], turn: int) -> R:
    """The replica with the fewest requests in flight; `turn` rotates among ties."""
    low = min(r.in_flight for r in routable)
    ties = [r for r in routable if r.in_flight == low]
    return ties[turn % len(ties)]


class ParamError(ValueError):
    """A policy parameter out of its bounds: `param` (a `PolicyParams` field) and its `rule`."""

    def __init__(self, param: str, rule: str) -> None:
        super().__init__(f"{param} {rule}")
        self.param = param
        self.rule = rule


@dataclass(frozen=True, slots=True)
class PolicyParams:
    """The prefix policy's parameters, typed and validated here, once (config.py builds them
    from its flags; `PrefixAffinity` is built from them). `load_factor` is ε of the load cap
    (module docstring): 0 or more, 0 leaving the spread to `load_slack`; `move_price` 0 turns
    moves off."""

    load_factor: float = DEFAULT_LOAD_FACTOR
    load_slack: int = DEFAULT_LOAD_SLACK
    move_price: int = DEFAULT_MOVE_PRICE
    vnodes: int = DEFAULT_VNODES
    table_size: int = DEFAULT_TABLE_SIZE

    def __post_init__(self) -> None:
        if not (math.isfinite(self.load_factor) and self.load_factor >= 0):
            raise ParamError("load_factor", "must be 0 or more")
        for name in ("load_slack", "move_price"):
            if getattr(self, name) < 0:
                raise ParamError(name, "must be 0 or more")
        for name in ("vnodes", "table_size"):
            if getattr(self, name) <= 0:
                raise ParamError(name, "must be positive")


class PrefixAffinity:
    """Consistent hashing with bounded loads plus exact-prefix affinity (module docstring)."""

    name = "prefix"

    def __init__(
        self,
        *,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        vnodes: int = DEFAULT_VNODES,
        table_size: int = DEFAULT_TABLE_SIZE,
        load_slack: int = DEFAULT_LOAD_SLACK,
        move_price: int = DEFAULT_MOVE_PRICE,
        prefer: Prefer | None = None,
    ) -> None:
        # Validated by their one owner (raises ParamError).
        self.params = PolicyParams(load_factor, load_slack, move_price, vnodes, table_size)
        self.move_price = move_price
        # A decimal flag value such as 0.1 is meant as 1/10, not as its binary float.
        self.load_factor = Fraction(str(load_factor))
        num, self._den = self.load_factor.as_integer_ratio()
        self._grow = self._den + num  # 1 + load_factor = grow / den, read on every request
        self.load_slack = load_slack
        self.ring = HashRing((), vnodes)
        self.table = AffinityTable(table_size)
        self.counts = DecisionCounts()
        self.prefer = prefer
        self._turn = 0
        self._dealt: dict[str, int] = {}  # member -> families dealt to it, in DEAL_UNITs
        self._dealt_total = 0  # the sum of `_dealt` over the members
        # Member -> its weight (module docstring), only for members below WEIGHT_FULL: empty on
        # a fleet at one speed, and then every rule reads the cap unscaled.
        self._slow: dict[str, int] = {}
        self._moved: dict[str, int] = {}  # member -> conversations moved into it (`_lighter`)
        self._moved_tokens = 0  # prompt tokens priced for the moves made (`_lighter`)
        self._sibling_spills = 0  # repeats of a known prompt that spilled (`_family_size`)
        # Member below full weight -> siblings still to come of the families the finish rule
        # dealt it (module docstring): only members with some.
        self._coming: dict[str, int] = {}
        self._routed_tokens = 0  # prompt tokens of every request with a key routed (`choose`)
        self._ranks = Ranks()
        # Members whose load changed since the ranks were last read, by name: re-filed when
        # the ranks are next read (`_deal`), so a request that is not dealt files nothing.
        self._unfiled: dict[str, Replica] = {}
        # A fleet of at most WALK_DEAL_MEMBERS deals by a ring walk: no ranks kept.
        self._walk_deal = True
        self._members = 0

    def set_members(self, members: Sequence[Replica]) -> None:
        """O(n log n) for the ranks, plus the ring's `with_members`: O(n * vnodes) and the
        new members' points; membership changes are rare."""
        names = [r.name for r in members]
        self.ring = self.ring.with_members(names)
        floor = min(self._dealt.values(), default=0)
        self._dealt = {name: self._dealt.get(name, floor) for name in names}
        self._dealt_total = sum(self._dealt.values())
        self._moved = {name: self._moved.get(name, 0) for name in names}
        self._slow = {name: w for name, w in self._slow.items() if name in self._dealt}
        self._coming = {name: c for name, c in self._coming.items() if name in self._slow}
        self._ranks = Ranks()
        self._unfiled.clear()
        self._members = len(self._dealt)  # before a deal outside the ring adds to `_dealt`
        self._walk_deal = self._members <= WALK_DEAL_MEMBERS
        if self._walk_deal:
            return  # the ranks are rebuilt here, from the loads then, if the fleet grows
        for r in members:
            self._ranks.file(r.name, (self._dealt[r.name], r.in_flight, r.in_flight_tokens))

    def set_weight(self, name: str, weight: int) -> None:
        """A member's weight, WEIGHT_MIN to WEIGHT_FULL sixteenths (module docstring): O(1).
        Families already dealt keep their cost; the next ones cost by the new weight."""
        if not WEIGHT_MIN <= weight <= WEIGHT_FULL:
            raise ValueError(f"weight {weight} outside {WEIGHT_MIN} to {WEIGHT_FULL}")
        if weight == WEIGHT_FULL:
            self._slow.pop(name, None)
            self._coming.pop(name, None)
        else:
            self._slow[name] = weight

    def weight(self, name: str) -> int:
        """A member's weight in sixteenths (`set_weight`): O(1)."""
        return self._slow.get(name, WEIGHT_FULL)

    def _room(self, replica: Replica, cap: int) -> bool:
        """Whether `replica` may take one more request under `cap`, scaled by its weight."""
        weight = self._slow.get(replica.name)
        limit = cap if weight is None else scaled_cap(cap, weight)
        return replica.in_flight < limit

    def load_changed(self, replica: Replica) -> None:
        """Note a member's new load: O(1). It is filed under it when the ranks are next read
        (`_file_loads`), once however often it changed in between; a walk deal reads loads
        where they are."""
        if not self._walk_deal:
            self._unfiled[replica.name] = replica

    def _file_loads(self) -> None:
        """Re-file every member whose load changed (`load_changed`): O(log n) each."""
        ranks = self._ranks
        for name, replica in self._unfiled.items():
            rank = ranks.rank.get(name)
            if rank is not None:
                ranks.file(name, (rank[0], replica.in_flight, replica.in_flight_tokens))
        self._unfiled.clear()

    def cap(self, routable: Candidates[R]) -> int:
        """The in-flight count a full-weight replica may reach by taking the next request:
        O(1) from the candidates' maintained total, plus `_units` with members below full
        weight."""
        units = self._units(routable) if self._slow else WEIGHT_FULL * len(routable)
        return _cap(routable.in_flight, units, self._grow, self._den, self.load_slack)

    def _units(self, routable: Candidates[R]) -> int:
        """The candidates' weights summed, in sixteenths (`_cap`): one lookup per member below
        full weight."""
        units = WEIGHT_FULL * len(routable)
        for name, weight in self._slow.items():
            if routable.get(name) is not None:
                units -= WEIGHT_FULL - weight
        return units

    def choose(self, key: RouteKey | None, routable: Candidates[R]) -> Decision[R]:
        """A sibling by its wire key alone when its home has room: O(1). Else the whole
        policy on the block key (module docstring): O(blocks) for the chain and the table,
        plus a spill's walk (`_next_with_room`) or a deal (`_deal`), independent of the fleet
        size but for their stated bounds; the wire key is remembered for the next sibling."""
        if key is None:
            return self._nokey(routable)
        wire = key.wire
        if wire is not None:
            known = self.table.sibling(wire)
            if known is not None:
                home = routable.get(known[0])
                # The cap is at least load_slack + 1 (the mean counting this request is at
                # least 1), so a home at or below the slack has room without computing it.
                # A slow member's room is the scaled cap, which may be below the slack.
                if home is not None and (
                    self._room(home, self.cap(routable))
                    if self._slow
                    else home.in_flight <= self.load_slack or home.in_flight < self.cap(routable)
                ):
                    self.counts.sibling += 1
                    if self._coming:
                        self._arrived(home.name)
                    tokens = anchor_tokens(known)
                    self._routed_tokens += tokens
                    return Decision(home, "sibling", 0, tokens)
            # Unknown, not routable or full: the whole policy decides (a full home spills).
        prompt = key.key
        if prompt is None:
            return self._nokey(routable)
        self._routed_tokens += prompt.tokens
        decision = self._choose(prompt, routable, wire)
        # A new family's wire key was filed with its anchor (a `kv` one's: filed again, no-op).
        if wire is not None and decision.kind != "fresh":
            # Filed with the prompt's anchor, whose replica is its home (a spill does not move
            # it), and forgotten with it.
            self.table.link(prompt, wire)
        return decision

    def _nokey(self, routable: Candidates[R]) -> Decision[R]:
        """O(n): least loaded among all of them (only requests without a key: embeddings)."""
        self.counts.nokey += 1
        self._turn += 1
        return Decision(least_loaded(routable, self._turn), "nokey")

    def follow_cap(self, routable: Candidates[R]) -> int:
        """The in-flight count a continuation's replica may reach: the load cap with twice
        the slack (module docstring), as `cap` costs."""
        units = self._units(routable) if self._slow else WEIGHT_FULL * len(routable)
        return _cap(routable.in_flight, units, self._grow, self._den, 2 * self.load_slack)

    def _choose(self, key: PromptKey, routable: Candidates[R], wire: int | None) -> Decision[R]:
        cap = self.cap(routable)
        follow = -1  # `follow_cap`, computed when a continuation first needs it
        known = False
        home: str | None = None  # this exact prompt's recorded replica
        for anchor, exact in self.table.find(key):
            known = True
            name = anchor[0]
            if exact:
                home = name
            replica = routable.get(name)
            if replica is None:
                continue
            if exact:
                if self._room(replica, cap):
                    self.counts.sibling += 1
                    if self._coming:
                        self._arrived(name)
                    return Decision(replica, "sibling", 0, key.tokens)
            else:
                if follow < 0:
                    follow = self.follow_cap(routable)
                if not self._room(replica, follow):
                    continue
                if self._slow and name in self._slow:
                    faster = self._faster(anchor[3], routable, cap)
                    if faster is not None:
                        self._remember(key, home, faster.name)
                        self.counts.spill += 1
                        return Decision(faster, "spill", key.tokens, key.tokens)
                if self.move_price and anchor_first(anchor):
                    lighter = self._lighter(anchor[3], replica, routable, cap, key.tokens)
                    if lighter is not None:
                        self._remember(key, home, lighter.name)
                        self.counts.spill += 1
                        return Decision(lighter, "spill", key.tokens, key.tokens)
                self._remember(key, home, name)
                self.counts.continuation += 1
                rest = max(0, key.tokens - anchor_tokens(anchor))
                return Decision(replica, "continuation", rest, key.tokens)

        if known:
            faster = self._faster(key.full, routable, cap) if self._slow else None
            replica = faster or self._next_with_room(key.full, routable, cap)
            self.counts.spill += 1
            if home is not None:
                self._sibling_spills += 1
                if self._coming:
                    self._arrived(home)
            self._remember(key, home, replica.name)
            return Decision(replica, "spill", key.tokens, key.tokens)
        decision = self._fresh(key, routable, cap)
        # Nothing known (no home): a new anchor, its wire key filed with it as `link` would.
        name = decision.replica.name
        if not self.table.record(key, name, first=True, wire=wire) and wire is not None:
            self.table.link(key, wire)
        return decision

    def _fresh(self, key: PromptKey, routable: Candidates[R], cap: int) -> Decision[R]:
        """A new family's replica (rule 3, the deal), among those `prefer` names, if any."""
        found = None if self.prefer is None else self.prefer.among(key, routable, cap, self)
        if found is not None:
            self.counts.kv += 1
            return Decision(self._deal(key.full, found[0], cap), "kv", found[1], key.tokens)
        self.counts.fresh += 1
        return Decision(self._deal(key.full, routable, cap), "fresh", key.tokens, key.tokens)

    def _lighter(
        self, family: int, home: R, routable: Candidates[R], cap: int, tokens: int
    ) -> R | None:
        """Where a family's first later turn (a continuation of the prompt `family` hashes)
        moves instead of its home, if anywhere (the move rule, module docstring): the first
        routable replica other than the home in ring order from the family's key, below the
        load cap, if the home's `work_held` exceeds its by more than the turn's price and both
        bounds (MOVE_SHARE, MOVE_BUDGET) allow one more move. Every first later turn of one
        family tries the same replica, so the family's shared prompt is recomputed there once.

        O(1) unless the home is heavy enough for any replica to pay; then one ring walk,
        O(1 + s) steps, s the members passed over (the home, those without room)."""
        price = self.move_price * tokens + MOVE_REQUEST_TOKENS
        held = work_held(home, MOVE_REQUEST_TOKENS)
        if held <= price:
            return None
        target = None
        for name in self.ring.walk(family):
            replica = routable.get(name)
            if replica is not None and replica is not home and self._room(replica, cap):
                target = replica
                break
        if target is None:
            return None
        if held - work_held(target, MOVE_REQUEST_TOKENS) <= price:
            return None
        counts = self.counts
        routed = counts.sibling + counts.continuation + counts.spill + counts.fresh
        moved = self._moved
        if (moved.get(target.name, 0) + 1) * MOVE_SHARE * len(routable) > routed:
            return None
        if (self._moved_tokens + tokens) * MOVE_BUDGET > self._routed_tokens:
            return None
        self._moved_tokens += tokens
        moved[target.name] = moved.get(target.name, 0) + 1
        return target

    def _faster(self, position: int, routable: Candidates[R], cap: int) -> R | None:
        """Where a continuation whose replica is below full weight, or a spill, goes (later
        turns and spills, module docstring): the first full-weight routable member with room
        under the load cap in ring order from `position`; None: none has room. One ring walk,
        O(1 + s) steps, s the members passed over (slow ones, those without room)."""
        for name in self.ring.walk(position):
            replica = routable.get(name)
            if replica is not None and name not in self._slow and self._room(replica, cap):
                return replica
        return None

    def _remember(self, key: PromptKey, home: str | None, replica: str) -> None:
        """Record where a prompt went, unless it already has a home (the first placement
        sticks) that is still in the fleet; a home that left for good is replaced, since the
        prompt's KV now grows where it went. (A fresh prompt is recorded by `_choose`.)"""
        if home is None:
            self.table.record(key, replica)
        elif home not in self.ring:
            self.table.record(key, replica, replace=True)

    def _next_with_room(self, position: int, routable: Candidates[R], cap: int) -> R:
        """The first routable replica with room in ring order from `position`: the walk
        passes over only the members that cannot take it (each once), so it is bounded by
        them, not by the fleet: O(1 + s) steps, s the members without room or not routable
        that come first."""
        for name in self.ring.walk(position):
            replica = routable.get(name)
            if replica is not None and self._room(replica, cap):
                return replica
        return self._unknown_to_the_ring(routable)

    def _deal(self, position: int, routable: Candidates[R], cap: int) -> R:
        """A fresh prompt's replica: the deal, then the deal window (module docstring).

        Read from the kept ranks (`ranks.Ranks.first`), one count of families dealt at a time
        from the lowest: a rank is passed over only if its members have no room or none is
        routable, O(log n) each; among the k members of the winning rank `HashRing.first_of`
        finds the first in ring order in O(min(k, n / k)), at most O(sqrt(n)). The window reads
        the counts above the chosen one's the same way, up to its limit. On an idle fleet
        (every member tied) that is about one ring point: plain consistent hashing."""
        if self._walk_deal:
            return self._deal_walk(position, routable, cap)
        if self._unfiled:
            self._file_loads()
        ranks = self._ranks
        # Every member is a candidate when there are as many candidates as members (the fleet
        # routes only to members); a candidate outside the ring is caught by `get` below.
        everyone = len(routable) == len(ranks.rank)
        pick = partial(self._first_routable, position, routable, everyone, cap, False)
        # A snapshot: `Ranks.first` forgets a count whose heap it finds empty.
        counts = iter(list(ranks.counts))
        best: R | None = None
        for dealt in counts:
            best = ranks.first(dealt, cap, pick)
            if best is not None:
                break
        if best is None:
            best = self._unknown_to_the_ring(routable)
        else:
            limit = self._deal_limit()
            for dealt in counts:  # the counts above the chosen one's
                if dealt >= limit:
                    break
                other = ranks.first(dealt, cap, pick)
                if other is not None:
                    if work_held(other, DEAL_REQUEST_TOKENS) < work_held(best, DEAL_REQUEST_TOKENS):
                        best = other
                    break
            weight = self._slow.get(best.name)
            if weight is not None:  # the finish rule, against the first full-weight member
                pick = partial(self._first_routable, position, routable, False, cap, True)
                full = None
                for dealt in list(ranks.counts):
                    full = ranks.first(dealt, cap, pick)
                    if full is not None:
                        break
                best = self._finish_rule(best, weight, full, cap)
        self._charge(best)
        return best

    def _charge(self, replica: Replica) -> None:
        """Count one more family dealt to `replica` at its cost; a member's (one the ring
        knows) in the total too, and filed under its new rank if ranks are kept."""
        name = replica.name
        cost = self._cost(name)
        dealt = self._dealt[name] = self._dealt.get(name, 0) + cost
        if name in self.ring:
            self._dealt_total += cost
            if not self._walk_deal:
                self._ranks.file(name, (dealt, replica.in_flight, replica.in_flight_tokens))

    def _deal_walk(self, position: int, routable: Candidates[R], cap: int) -> R:
        """`_deal` in a fleet of at most WALK_DEAL_MEMBERS members, by one ring walk from
        `position` and the loads read where they are: the members with room ordered by
        (families dealt, in flight, prompt tokens in flight, ring order), the first dealt
        unless the deal window prefers the first of the next count. The ranks' choice exactly
        (`first` reads a count's ranks in that order, `pick` ties in ring order), in O(n log n)."""
        dealt = self._dealt
        ready: list[tuple[int, int, int, int, R]] = []
        for order, name in enumerate(self.ring.walk(position)):
            replica = routable.get(name)
            if replica is not None and self._room(replica, cap):
                rank = (dealt[name], replica.in_flight, replica.in_flight_tokens, order, replica)
                ready.append(rank)  # `order` is unique: replicas are never compared
        if not ready:
            best = self._unknown_to_the_ring(routable)
            self._charge(best)
            return best
        ready.sort()
        first = ready[0]
        best = first[4]
        limit = self._deal_limit()
        for other in ready:
            if other[0] > first[0]:  # the first of the next count with a member ready
                if other[0] < limit and work_held(other[4], DEAL_REQUEST_TOKENS) < work_held(
                    best, DEAL_REQUEST_TOKENS
                ):
                    best = other[4]
                break
        weight = self._slow.get(best.name)
        if weight is not None:  # the finish rule, against the first full-weight member
            full = next((other[4] for other in ready if other[4].name not in self._slow), None)
            best = self._finish_rule(best, weight, full, cap)
        self._charge(best)
        return best

    def _finish_rule(self, best: R, weight: int, full: R | None, cap: int) -> R:
        """The finish rule (module docstring): `best`, the deal's member at `weight` below
        full, keeps the family if it would finish it sooner than `full`, the first full-weight
        member with room in the deal's order (None: none has room), and has room for all of
        it under its scaled cap besides the siblings still to come there; then the family's
        siblings are awaited there too. Else `full` takes it, and `best`'s passed turn is
        counted as dealt to it. Times compared in integers; O(1)."""
        size = self._family_size()
        coming = self._coming.get(best.name, 0) if best.in_flight else 0
        if full is None or (
            (1 + max(0, best.in_flight - BATCH_FLOOR)) * WEIGHT_FULL
            < (1 + max(0, full.in_flight - BATCH_FLOOR)) * weight
            and best.in_flight + coming + size <= scaled_cap(cap, weight)
        ):
            if coming + size > 1:
                self._coming[best.name] = coming + size - 1
            else:
                self._coming.pop(best.name, None)
            return best
        self._charge(best)
        return full

    def _arrived(self, name: str) -> None:
        """A repeat of a prompt homed on `name` was routed: one sibling fewer to come there
        (`_coming`), O(1)."""
        coming = self._coming.get(name)
        if coming is not None:
            if coming > 1:
                self._coming[name] = coming - 1
            else:
                del self._coming[name]

    def _family_size(self) -> int:
        """The requests a new family brings, as routed so far: the families dealt and every
        repeat of a known prompt (a sibling, at home or spilled), per family dealt, rounded
        up; 1 before any family. O(1)."""
        counts = self.counts
        families = counts.fresh + counts.kv
        if not families:
            return 1
        return -(-(families + counts.sibling + self._sibling_spills) // families)

    def _cost(self, name: str) -> int:
        """What one more family dealt to a member adds to its count (module docstring)."""
        weight = self._slow.get(name)
        return DEAL_UNIT if weight is None else DEAL_UNIT * WEIGHT_FULL // weight

    def _deal_limit(self) -> int:
        """The most families a member may hold once the next one is dealt (the deal window),
        in DEAL_UNITs: whole families, as the rule counts them."""
        families = self._dealt_total // DEAL_UNIT + 1
        return DEAL_UNIT * (_WINDOW_NUM * families // (_WINDOW_DEN * self._members))

    def families(self, name: str) -> int:
        """The new families dealt to a member (the deal's first criterion), in whole families
        as their weights counted them: O(1)."""
        return self._dealt.get(name, 0) // DEAL_UNIT

    def window(self) -> int:
        """A member holding fewer families than this is inside the deal window: its limit, and
        never less than one more than the fewest any member holds (the deal's first choice).
        O(1) with ranks (the lowest count kept may be one no member holds any more: a stricter
        bound), else at most WALK_DEAL_MEMBERS counts read."""
        if not self._members:
            return 1 << 62
        fewest = min(self._dealt.values()) if self._walk_deal else (self._ranks.counts or [0])[0]
        return max(self._deal_limit(), fewest + DEAL_UNIT) // DEAL_UNIT

    def _first_routable(
        self,
        position: int,
        routable: Candidates[R],
        everyone: bool,
        cap: int,
        full: bool,
        group: set[str],
    ) -> R | None:
        """The first routable member of `group` in ring order from `position`, of those at full
        weight only if `full`. With `everyone` the group is tried whole (its members are the
        candidates), and filtered only if the one found is not a candidate (one the ring does
        not know took a member's place). With members below full weight, those without room
        under their scaled cap are filtered first (`Ranks.first` knows only the unscaled cap)."""
        slow = self._slow
        if slow:
            group = {
                n
                for n in group
                if not (full and n in slow)
                and (r := routable.get(n)) is not None
                and self._room(r, cap)
            }
            if not group:
                return None
            everyone = False
        if everyone:
            name = self.ring.first_of(position, group)
            found = None if name is None else routable.get(name)
            if found is not None:
                return found
        ties = {n for n in group if routable.get(n) is not None}
        name = self.ring.first_of(position, ties) if ties else None
        return None if name is None else routable.get(name)

    def _unknown_to_the_ring(self, routable: Candidates[R]) -> R:
        # Routable replicas the ring does not know yet: the least loaded one always has room.
        self._turn += 1
        return least_loaded(routable, self._turn)


def round_robin(routable: Sequence[R], turn: int) -> R:
    """Each routable replica in turn."""
    return routable[turn % len(routable)]


class KeyBlind:
    """A policy that ignores keys (`round-robin`, `least-loaded`): it is given `pick`, which
    chooses among the routable replicas with a turn that counts the requests chosen
    (`round_robin`, `least_loaded`); it keeps no state of the fleet."""

    def __init__(self, name: str, pick: Callable[[Sequence[Replica], int], Replica]) -> None:
        self.name = name
        self.pick = pick
        self.counts = DecisionCounts()
        self._turn = -1

    def set_members(self, members: Sequence[Replica]) -> None:
        pass  # the routable list is all it looks at

    def load_changed(self, replica: Replica) -> None:
        pass

    def set_weight(self, name: str, weight: int) -> None:
        pass  # keys and speeds alike ignored

    def choose(self, key: RouteKey | None, routable: Candidates[R]) -> Decision[R]:
        self._turn += 1
        self.counts.balanced += 1
        return Decision(cast(R, self.pick(routable, self._turn)), "balanced")


# `kv` (kv_policy.py) is built with its KV index by the runtime, not by `make_policy`.
POLICIES = ("prefix", "round-robin", "least-loaded", "kv")


def make_policy(name: str, params: PolicyParams) -> Policy:
    """The policy called `name` (`--policy`), one of `POLICIES`; `params` for the prefix
    policy."""
    if name == "prefix":
        return PrefixAffinity(**asdict(params))
    if name == "round-robin":
        return KeyBlind(name, round_robin)
    if name == "least-loaded":
        return KeyBlind(name, least_loaded)
    if name == "kv":
        raise ValueError("the kv policy needs its KV index: give a kv_policy.KvLookup")
    raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
