"""Routing policies: given a prompt's key and the replicas that may take it, pick one.

`PrefixAffinity` (`--policy prefix`, the default) is consistent hashing with bounded loads
plus an affinity table of earlier prompts (`affinity`). Keys are placement keys (`keys`: seeded
by the adapter's lineage, not its version), so a turn sent under `trl-policy-v8` finds the turns
its conversation sent under `-v7`:

0. *Sibling by its wire key.* A token-id prompt whose JSON text was seen before (`RouteKey.wire`,
   filed with that exact prompt's anchor in the table, `AffinityTable.link`, which holds its
   home and token count) goes to that home if it is routable and has room, and its block key is
   never built: the G - 1 later samples of a GRPO prompt cost one hash. Otherwise the block key
   is built and the steps below run.
1. *Known prompt.* The table finds the earlier prompts whose stems this one starts with, longest
   shared block prefix first (itself, if it was seen: a *sibling*; a shorter one: a
   *continuation*, e.g. the previous turn of a conversation, appended to or re-rendered). The
   first of their replicas that is routable and has room takes it (room: below the load cap
   for a sibling, below the follow cap for a continuation, see below): the longest prefix's
   replica if it can, else the next longest (its KV is still there, which beats any other
   replica), unless it is a family's first later turn that moves (below). A new prompt is then
   remembered on that replica.
2. *Spill.* If prefixes were known but none of their replicas can take it, walk the ring from
   the prompt's key to the first routable replica with room. Siblings walk the same path, so
   they keep meeting on one replica while their home is full. A spill never moves the home of
   a prompt that has one (the first placement sticks, unless its replica left the ring); a new
   prompt is remembered where it went, because its KV now grows there.
3. *Fresh prompt* (a new family: nothing known shares its stem). Among the routable replicas
   with room, the one that was dealt the fewest families so far, then the one holding the
   least work now (fewest requests in flight, then fewest prompt tokens in flight that it must
   compute, `in_flight_tokens`, which the caller maintains next to `in_flight` from
   `Decision.tokens`: 0 for a sibling, a continuation's tokens beyond the earlier prompt it
   extends, all of them otherwise), ties to the first in ring order from the prompt's key.
   Only new families count: a later turn, under whatever version of its lineage, is a
   continuation (1), so the count is the number of conversations a replica holds, which is
   what the oracle of bench/routing.py deals evenly.
   *The deal window.* The replica so chosen gives the family up to the first replica by the
   same rank among those dealt more families, if that one holds less work,

       in_flight_tokens + DEAL_REQUEST_TOKENS * in_flight   (`work_held`),

   and its count stays at most `DEAL_WINDOW` (1.05) x the mean once the family is dealt
   (floored), so request totals stay within 5 % of the mean. The count alone cannot see the
   work a family brings (on single-turn prompts of 40-400 tokens, the prefill differs by up to
   10 x between families); below 20 families per replica the window is the count itself,
   so it only opens on fleets that have dealt many families (in bench/routing.py, the
   single-turn and system-prompt traces; never the multi-turn ones). Measured in the noise-free
   replay over 10 trace seeds (bench/results/routing-deal-work/): the median makespan on
   single-turn -0.5, -0.9 and -2.2 % at 2, 3 and 8 replicas, on the system-prompt traces 0.0
   to -2.0 % (the worst seed's makespan down to 1.019 of the oracle's from 1.056), request
   totals at 1.04, placements on the multi-turn traces unchanged. Placing new families by the
   work held alone let request totals drift to 1.08-1.10 max/mean on multi-turn,
   re-rendered and long-tailed traces (bench/results/routing-work-held/); a window ranked by
   requests in flight alone gained less (bench/results/routing-deal-window/).
   A replica that joins starts at the fewest count. On an idle fleet every replica ties and
   placement is plain consistent hashing, so two routers that saw the same requests agree. The
   ranks are kept, not computed per request (`_Ranks`: grouped by equal rank, the distinct
   ranks of each count in a heap, re-filed on `load_changed`), and ties are settled by
   `HashRing.first_of`.
4. *No key.* Least in flight, round robin among ties.

What the replicas report of themselves (fleet/telemetry.py's `Replica.report`: running,
waiting, KV use, up to one health interval old) is not read here. Dealing fresh families on
the reported waiting queue was measured on the long-tail, multi-turn-sync and single-turn
traces at 2, 3 and 8 replicas, 3 rounds (bench/results/routing-reported/, with the exact
rules): as a rank component between families dealt and in flight, and additionally as a spill
signal (a replica whose reported queue is at or above the bounded-loads bound of the mean
reported queue is not dealt a family while another is below it). Neither improved in-flight
balance; on long-tail at 8 replicas both lengthened the modeled makespan by 3-4 % in every
round and cost load-cap spills; only single-turn's makespan at 2 and 3 replicas gained (2-5 %,
spill rule), and wall times moved by less than the machine's noise. With one router in front,
a replica's queue is the router's own in-flight count there minus what it runs, which the
router knows exactly and now; the report is that number up to 2 s old, and it counts requests,
not the tokens left to generate. The reports serve people instead: `/router/status`, the
router's `/metrics`, `lora-router top` and the Grafana dashboard.

A replica has room while its in-flight count is below the load cap

    cap = ceil(max((1 + load_factor) * m, m + load_slack)),  m = (total + 1) / n

with `total` the requests in flight over the `n` routable replicas. With `load_slack = 0` this
is consistent hashing with bounded loads (Mirrokni, Thorup and Zadimoghaddam; HAProxy's
`hash-balance-factor`). Some replica always has room, so every walk ends. The slack is for few
requests in flight: a GRPO trainer sends a group of G identical prompts at once, and when the
mean is a handful, `(1 + e) * m` is below one group, so the textbook bound scatters the group
over replicas that each recompute its prompt. An allowance of `load_slack` requests above the
mean lets a group meet on its home; once the mean exceeds `load_slack / load_factor` (64 by
default) the multiplicative bound is the larger and applies unchanged.

A continuation (step 1, a known prompt that extends an earlier one) may take its replica up to
the *follow cap*, the same bound with twice the slack (`follow_cap`); siblings, spill targets
and fresh families keep the load cap. A trainer sends a conversation's next turn only once its
previous turn has answered, and that turn left the replica the continuation now joins, so
following a conversation does not add to a replica's load: what the load cap spilled instead
was the drain at the end of a burst, when the mean falls with the requests in flight and a
replica still works through the long conversations it holds (bench/routing.py, long-tail at 3
replicas: the conversation's home at 31 in flight, the other two at 8 and 3, the cap 31). Such a
spilled turn recomputes its whole history elsewhere (up to two long-tailed completions), so a
few spills cost 0.2-0.8 % of the hit rate. The allowance stays bounded: once the mean exceeds
`2 * load_slack / load_factor` (128 by default) the multiplicative bound applies to
continuations unchanged, so prompts extending one shared prompt (an open-loop client) cannot
pile up on one replica. Measured (bench/results/routing-follow/): with the follow cap no trace
spilled, every later turn followed its conversation and every cell reached the oracle's hit
rate (the load cap alone: 0.993-0.994 on long-tail at 3 and 8 replicas); the price is the
drain a spill used to even out: the modelled makespan on long-tail moved by -0.2 % to +2.8 %
(medians over rounds and over trace seeds), +3.6 % on the worst of 10 seeds.

*Moving a family's first later turn.* Dealing by count keeps every replica's share of
conversations even, but on long-tailed completions their work is not: on bench/routing.py's
long-tail trace the busiest replica's modelled work was 6-9 % above the mean at 3 replicas,
which no fresh placement can see coming (a family's completion lengths are drawn when it runs).
So a continuation whose longest match is a new family's first prompt (`AffinityTable.record`'s
`first`: the first later turn of one of its conversations) leaves its home for the first
replica other than the home on the ring path of the *family's* key, when that one is below the
load cap and the home holds more work by more than the turn's price (`_lighter`):

    W(home) - W(other) > move_price * t + D,   W(r) = in_flight_tokens(r) + D * in_flight(r)

with t the turn's prompt tokens (its whole history, which the home may hold and the other
recomputes: priced conservatively, since an appended turn's completion is cached at home),
D = `MOVE_REQUEST_TOKENS` and `move_price` 10 (`--move-price`, 0 turns it off). It counts as a
spill, and the conversation goes on there (its new prompt is recorded where it went). Two
bounds keep the targets: at most one conversation moves into a replica per `MOVE_SHARE` (50)
requests routed per replica, so request totals stay near the mean (each move carries the
conversation's later turns), and all moves together are priced at most 1 / `MOVE_BUDGET` (1/300)
of the prompt tokens routed, so what they cost the hit rate is a bounded share of the
prompts routed whatever the fleet size (at 2 replicas the share alone let 11 moves cost 0.8 %).
Only first later turns move: every first later turn of a family tries the same replica, so
the family's shared prompt is recomputed there once, not per conversation moved, while a deeper
turn's history is its own (moving turns 1 and 2 alike cost 1.1-1.6 % of the hit rate at 3
replicas in the replay). Measured in the noise-free replay over 10 trace seeds, against the
same policy with `move_price=0` (bench/results/routing-seeds/replay/): on long-tail the median
makespan moves by -0.2 % at 2 and 3 replicas and 0.0 % at 8, the worst seed's by -1.7 % at 3 and
-1.0 % at 8, the worst in-flight balance from 1.079 to 1.052 and from 1.081 to 1.057, for a hit
rate >= 0.9975 of the oracle's and max/mean requests <= 1.035; on the other traces a handful of
moves. (Under the earlier budget of 3 tokens per request routed the median gains were 1.9-2.9 %,
bench/results/routing-makespan/, at the cost of the hit-rate target on one wall-clock run,
bench/results/routing-seeds/.) The earlier continuation spill priced by request counts
(bench/results/routing-spill/) gained 0.2 % at 3 replicas: counts barely differ between
replicas whose work does.

Prompts that share only a template never match each other in the table (neither starts with
the other's stem, see `keys`), so
they are placed by their own keys and spread like unrelated prompts. The reference proxy's rule
("a block with two or more successors is common") is deliberately not used: the samples of a
multi-turn rollout branch after every turn, and that rule then takes their own conversation
for a shared template.

`RoundRobin` and `LeastLoaded` ignore keys; they are there for comparison.

Cost per request, with n replicas (issue 16: it must not grow with the fleet): a sibling by
its wire key and the load cap, O(1) (the candidates carry their in-flight total); a known
prompt, O(blocks) for the chain and the table, then O(1) per earlier prompt's replica tried (a
first later turn whose home is heavy enough: one more ring walk, O(1 + s)); a spill,
O(1 + s), s the replicas the ring walk passes over because they cannot take it; a new
family, O(log n) per rank passed over (ranks without room or without a candidate) plus
O(min(k, n / k)) for k tied replicas, at most O(sqrt(n)), twice when the deal window is open,
plus one step per count of families dealt passed over (the window keeps the counts within
5 % of the mean); `load_changed`, O(log n). Only what
by definition compares every replica is O(n): a request without a key (least loaded), the
`LeastLoaded` comparison policy, `set_members`.

Contract with the caller (the HTTP layer): one `choose(key, routable)` per attempt, `key` the
request's `RouteKey` (`keys.completion_key`) or None, which the caller drops once it has the
decision (a retry builds a new one); `routable` is a `Candidates` (fleet/fleet.py keeps one
per model), already filtered (healthy, adapter loaded, breaker closed, not excluded by a
retry), never empty, its `in_flight` the sum over its replicas; `choose` reads `in_flight` and
`in_flight_tokens` but never changes them — the caller adds 1 and `Decision.tokens` for the
request it sends and takes them off on every exit path, and calls `load_changed` after each
change. `set_members` gets the full membership (the ring) with their loads, at start and on
every add or remove. Policies are not thread-safe; the router calls them from its event loop.

Never: I/O, clocks, randomness, logging (the caller logs decisions at debug level), mutating
replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from fractions import Fraction
from functools import partial
from typing import Generic, NamedTuple, Protocol, TypeVar

from .affinity import AffinityTable, anchor_first, anchor_tokens
from .keys import PromptKey, RouteKey
from .ranks import Ranks
from .ring import DEFAULT_VNODES, HashRing

DEFAULT_LOAD_FACTOR = 0.25
DEFAULT_TABLE_SIZE = 200_000
# Two groups of TRL's default 8 samples: with few requests in flight the multiplicative bound
# alone is below one group, and a group scattered over replicas recomputes its prompt on each.
# bench/routing.py measured 16 at the oracle's hit rate with max/mean 1.00 on every trace; 32
# measured the same (a one-round run), so the smaller allowance stays.
DEFAULT_LOAD_SLACK = 16
# A first later turn leaves a heavier home when the work difference exceeds this many times its
# prompt tokens (`PrefixAffinity._lighter`); 0 never moves one. Measured in the noise-free
# replay (bench/results/routing-makespan/): 10 kept the hit rate >= 0.995 of the oracle's.
DEFAULT_MOVE_PRICE = 10
# What one request in flight weighs in the work compared, in prompt tokens: its decode and the
# history its next turn will prefill, which the router cannot see when it routes.
MOVE_REQUEST_TOKENS = 800
# Moves into one replica, at most one per this many requests routed per replica: moved
# conversations carry their later turns with them, so request totals stay near the mean.
MOVE_SHARE = 50
# Prompt tokens priced for all moves made (`tokens` of each), at most 1 / MOVE_BUDGET of the
# prompt tokens routed: what the moves recompute stays that share of the tokens the replicas
# are asked for, the hit rate's own denominator, whatever the prompts' lengths. (A budget of 3
# tokens per request routed, measured on long-tailed prompts, let 4 moves on 330-token
# multi-turn prompts cost 0.6 % of the hit rate, against the 0.5 % bench/routing.py allows.)
MOVE_BUDGET = 300
# A new family may go to a member dealt more families than the fewest, if it holds less work,
# while that member's count stays at most this many times the mean (floored): request totals
# stay within 5 % of the mean, the target bench/routing.py holds every router to.
DEAL_WINDOW = Fraction(21, 20)
# What one request in flight weighs in the work the deal window compares, in prompt tokens: one
# completion's decode, in the time of prompt tokens (bench/routing.py's replicas: 80 tokens on
# average at half a prompt token's cost each). A new family has no later turns to price.
DEAL_REQUEST_TOKENS = 40


class Replica(Protocol):
    """What a policy reads of a replica; the caller's own objects are passed through."""

    @property
    def name(self) -> str: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def in_flight_tokens(self) -> int:
        """Prompt tokens the requests in flight must compute (`Decision.tokens` of each)."""
        ...


R = TypeVar("R", bound=Replica)


class Decision(NamedTuple, Generic[R]):
    replica: R
    kind: str  # one of the fields of DecisionCounts
    # The prompt tokens the replica must compute as far as the table knows (a sibling: 0; a
    # continuation: those beyond the earlier prompt it extends; else all), which the caller
    # counts in `in_flight_tokens`.
    tokens: int = 0


@dataclass(slots=True)
class DecisionCounts:
    """How many decisions of each kind a policy made (read by metrics and the status page)."""

    sibling: int = 0  # this exact prompt's home
    continuation: int = 0  # the home of an earlier prompt this one extends
    spill: int = 0  # a home was known but full or unroutable: next on the ring with room
    fresh: int = 0  # an unknown prompt: least loaded, ties in ring order from its key
    nokey: int = 0  # no key: least loaded
    balanced: int = 0  # RoundRobin / LeastLoaded: chosen without looking at keys

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Candidates(list[R]):
    """The replicas a request may go to, as a policy reads them: a list in fleet order that
    also finds a replica by name in O(1) (`get`) and carries `in_flight`, the requests in
    flight over all of them, which whoever counts requests keeps current (fleet/fleet.py
    keeps one per model and adds or takes one off per request: O(1) to read here)."""

    __slots__ = ("get", "in_flight")

    # The name index's own `dict.get`, bound once per set: the policy and Fleet.started /
    # finished look a replica up 3 times per request, and a bound C method has no Python frame.
    get: Callable[[str], R | None]

    def __init__(self, replicas: Iterable[R] = ()) -> None:
        super().__init__(replicas)
        self.get = {r.name: r for r in self}.get
        self.in_flight = sum(r.in_flight for r in self)


class Policy(Protocol):
    counts: DecisionCounts

    def set_members(self, members: Sequence[Replica]) -> None:
        """The full membership (the ring), with each member's load now; called at start and
        on every add or remove."""

    def load_changed(self, replica: Replica) -> None:
        """`replica`'s `in_flight` or `in_flight_tokens` changed (the caller calls it after
        every change it makes)."""

    def choose(self, key: RouteKey | None, routable: Candidates[R]) -> Decision[R]:
        """Pick a replica among `routable` (never empty); must not change `in_flight`. `key`
        is the request's `RouteKey` under placement seeds (`keys.completion_key`): a policy
        reads its `wire` first and builds its block `key` only when that is not enough."""
        ...


def _cap(total: int, n: int, grow: int, den: int, slack: int) -> int:
    """The most requests a replica may have in flight after taking one more request:
    `ceil(max((1 + load_factor) * m, m + slack))` with `m = (total + 1) / n`, the mean load
    counting the new request, and 1 + load_factor given as the integers grow / den.

    Integer arithmetic on the exact fraction: with floats, `1.1 * 10 / 11` rounds up to 2 and
    would let the cap drift by one.
    """
    return max(-(-grow * (total + 1) // (den * n)), -(-(total + 1) // n) + slack)


def work_held(replica: Replica, per_request: int) -> int:
    """The work a replica holds, in prompt tokens to compute: its prompt tokens in flight and
    `per_request` for each request in flight (its decode, and what else the rule prices)."""
    return replica.in_flight_tokens + per_request * replica.in_flight


def least_loaded(routable: Sequence[R], turn: int) -> R:
    """The replica with the fewest requests in flight; `turn` rotates among ties."""
    low = min(r.in_flight for r in routable)
    ties = [r for r in routable if r.in_flight == low]
    return ties[turn % len(ties)]


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
    ) -> None:
        if load_factor < 0:
            raise ValueError("load_factor must be >= 0")
        if load_slack < 0:
            raise ValueError("load_slack must be >= 0")
        if move_price < 0:
            raise ValueError("move_price must be >= 0")
        self.move_price = move_price
        # A decimal flag value such as 0.1 is meant as 1/10, not as its binary float.
        self.load_factor = Fraction(str(load_factor))
        num, self._den = self.load_factor.as_integer_ratio()
        self._grow = self._den + num  # 1 + load_factor = grow / den, read on every request
        self.load_slack = load_slack
        self.ring = HashRing((), vnodes)
        self.table = AffinityTable(table_size)
        self.counts = DecisionCounts()
        self._turn = 0
        self._dealt: dict[str, int] = {}  # member -> families dealt to it
        self._dealt_total = 0  # the sum of `_dealt` over the members
        self._moved: dict[str, int] = {}  # member -> conversations moved into it (`_lighter`)
        self._moved_tokens = 0  # prompt tokens priced for the moves made (`_lighter`)
        self._routed_tokens = 0  # prompt tokens of every request with a key routed (`choose`)
        self._ranks = Ranks()

    def set_members(self, members: Sequence[Replica]) -> None:
        """O(n * vnodes log) for the ring; membership changes are rare."""
        names = [r.name for r in members]
        self.ring = HashRing(names, self.ring.vnodes)
        floor = min(self._dealt.values(), default=0)
        self._dealt = {name: self._dealt.get(name, floor) for name in names}
        self._dealt_total = sum(self._dealt.values())
        self._moved = {name: self._moved.get(name, 0) for name in names}
        self._ranks = Ranks()
        for r in members:
            self._ranks.file(r.name, (self._dealt[r.name], r.in_flight, r.in_flight_tokens))

    def load_changed(self, replica: Replica) -> None:
        """Re-file a member under its new load: O(log n) (`Ranks.file`)."""
        name = replica.name
        rank = self._ranks.rank.get(name)
        if rank is not None:
            self._ranks.file(name, (rank[0], replica.in_flight, replica.in_flight_tokens))

    def cap(self, routable: Candidates[R]) -> int:
        """The in-flight count a replica may reach by taking the next request: O(1), from
        the candidates' maintained total."""
        return _cap(routable.in_flight, len(routable), self._grow, self._den, self.load_slack)

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
                if home is not None and (
                    home.in_flight <= self.load_slack or home.in_flight < self.cap(routable)
                ):
                    self.counts.sibling += 1
                    self._routed_tokens += anchor_tokens(known)
                    return Decision(home, "sibling")
            # Unknown, not routable or full: the whole policy decides (a full home spills).
        prompt = key.key
        if prompt is None:
            return self._nokey(routable)
        self._routed_tokens += prompt.tokens
        decision = self._choose(prompt, routable)
        if wire is not None:
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
        the slack (module docstring), O(1)."""
        return _cap(routable.in_flight, len(routable), self._grow, self._den, 2 * self.load_slack)

    def _choose(self, key: PromptKey, routable: Candidates[R]) -> Decision[R]:
        cap = self.cap(routable)
        follow = self.follow_cap(routable)
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
                if replica.in_flight < cap:
                    self.counts.sibling += 1
                    return Decision(replica, "sibling")
            elif replica.in_flight < follow:
                if self.move_price and anchor_first(anchor):
                    lighter = self._lighter(anchor[3], replica, routable, cap, key.tokens)
                    if lighter is not None:
                        self._remember(key, home, lighter.name)
                        self.counts.spill += 1
                        return Decision(lighter, "spill", key.tokens)
                self._remember(key, home, name)
                self.counts.continuation += 1
                return Decision(replica, "continuation", max(0, key.tokens - anchor_tokens(anchor)))

        if known:
            replica = self._next_with_room(key.full, routable, cap)
            self.counts.spill += 1
            kind = "spill"
        else:
            replica = self._deal(key.full, routable, cap)
            self.counts.fresh += 1
            kind = "fresh"
        self._remember(key, home, replica.name, first=kind == "fresh")
        return Decision(replica, kind, key.tokens)

    def _lighter(
        self, family: int, home: R, routable: Candidates[R], cap: int, tokens: int
    ) -> R | None:
        """Where a family's first later turn (a continuation of the prompt `family` hashes)
        goes instead of its home, if anywhere: the first routable replica other than the home
        in ring order from the family's key that is below the load cap, taken only if

            W(home) - W(it) > move_price * tokens + MOVE_REQUEST_TOKENS,
            W(r) = r.in_flight_tokens + MOVE_REQUEST_TOKENS * r.in_flight

        (the work held, in prompt tokens to compute; `tokens` prices the prompt's history,
        all of which the home may hold and the other replica recomputes), and only while the
        conversations moved into it stay at most one per MOVE_SHARE requests routed per
        replica (request totals stay near the mean) and all moves' `tokens` at most
        1 / MOVE_BUDGET of the prompt tokens routed (what they recompute stays that share of
        the prompts routed). Every later turn of one family tries the
        same replica first, so its shared first prompt is recomputed once, not per turn moved;
        later turns of a moved conversation follow it there (a first later turn is a new
        prompt, recorded where it went). Only first later turns move: a deeper turn's history
        is its own, and recomputing it costs the hit rate (module docstring).

        O(1) unless the home is heavy enough for any replica to pay; then one ring walk,
        O(1 + s) steps, s the members passed over (the home, those without room)."""
        price = self.move_price * tokens + MOVE_REQUEST_TOKENS
        held = work_held(home, MOVE_REQUEST_TOKENS)
        if held <= price:
            return None
        target = None
        for name in self.ring.walk(family):
            replica = routable.get(name)
            if replica is not None and replica is not home and replica.in_flight < cap:
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

    def _remember(
        self, key: PromptKey, home: str | None, replica: str, *, first: bool = False
    ) -> None:
        """Record where a prompt went, unless it already has a home (the first placement
        sticks) that is still in the fleet; a home that left for good is replaced, since the
        prompt's KV now grows where it went. `first`: a new family's first prompt."""
        if home is None:
            self.table.record(key, replica, first=first)
        elif home not in self.ring:
            self.table.record(key, replica, replace=True)

    def _next_with_room(self, position: int, routable: Candidates[R], cap: int) -> R:
        """The first routable replica with room in ring order from `position`: the walk
        passes over only the members that cannot take it (each once), so it is bounded by
        them, not by the fleet: O(1 + s) steps, s the members without room or not routable
        that come first."""
        for name in self.ring.walk(position):
            replica = routable.get(name)
            if replica is not None and replica.in_flight < cap:
                return replica
        return self._unknown_to_the_ring(routable)

    def _deal(self, position: int, routable: Candidates[R], cap: int) -> R:
        """A fresh prompt's replica: among the routable members with room, the fewest families
        dealt, then the fewest in flight, then the fewest prompt tokens in flight, ties to the
        first in ring order from `position`; but a member dealt more families goes instead if
        it holds less work (`work_held`) and its count stays inside the deal window
        (`DEAL_WINDOW`): the first such member by the same rank.

        Read from the maintained ranks (`ranks.Ranks`), one count of families dealt at a time from
        the lowest: a rank is passed over only if its members have no room (they share one
        in-flight count, and a count's later ranks have no room either) or none of them is
        routable, O(log n) each; among the k members of the winning rank, `HashRing.first_of`
        finds the first in ring order in O(min(k, n / k)), at most O(sqrt(n)). The window adds
        the same read of the counts inside it, which it keeps within 5 % of the mean. On an
        idle fleet (every member tied) that is about one ring point: plain consistent hashing."""
        ranks = self._ranks
        # Every member is a candidate when there are as many candidates as members (the fleet
        # routes only to members); a candidate outside the ring is caught by `get` below.
        everyone = len(routable) == len(ranks.rank)
        pick = partial(self._first_routable, position, routable, everyone)
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
            # The most families a member may hold once this one is dealt.
            limit = DEAL_WINDOW.numerator * (self._dealt_total + 1)
            limit //= DEAL_WINDOW.denominator * len(ranks.rank)
            for dealt in counts:  # the counts above the chosen one's
                if dealt >= limit:
                    break
                other = ranks.first(dealt, cap, pick)
                if other is not None:
                    if work_held(other, DEAL_REQUEST_TOKENS) < work_held(best, DEAL_REQUEST_TOKENS):
                        best = other
                    break
        dealt = self._dealt[best.name] = self._dealt.get(best.name, 0) + 1
        if best.name in ranks.rank:
            self._dealt_total += 1
            ranks.file(best.name, (dealt, best.in_flight, best.in_flight_tokens))
        return best

    def _first_routable(
        self, position: int, routable: Candidates[R], everyone: bool, group: set[str]
    ) -> R | None:
        """The first routable member of `group` in ring order from `position`. With `everyone`
        the group is tried whole (its members are the candidates), and filtered only if the
        one found is not a candidate (one the ring does not know took a member's place)."""
        if everyone:
            name = self.ring.first_of(position, group)
            found = None if name is None else routable.get(name)
            if found is not None:
                return found
        ties = {n for n in group if routable.get(n) is not None}
        name = self.ring.first_of(position, ties) if ties else None
        return None if name is None else routable.get(name)

    def _unknown_to_the_ring(self, routable: Candidates[R]) -> R:
        # Routable replicas the ring does not know (membership not set yet): still bounded,
        # since the least loaded replica always has room.
        self._turn += 1
        return least_loaded(routable, self._turn)


class _KeyBlind:
    """A policy that ignores keys: `_pick` chooses among the routable replicas."""

    name = ""

    def __init__(self) -> None:
        self.counts = DecisionCounts()
        self._turn = -1

    def set_members(self, members: Sequence[Replica]) -> None:
        pass  # the routable list is all it looks at

    def load_changed(self, replica: Replica) -> None:
        pass

    def choose(self, key: RouteKey | None, routable: Candidates[R]) -> Decision[R]:
        self._turn += 1
        self.counts.balanced += 1
        return Decision(self._pick(routable, self._turn), "balanced")

    @staticmethod
    def _pick(routable: Sequence[R], turn: int) -> R:
        raise NotImplementedError


class RoundRobin(_KeyBlind):
    """Each routable replica in turn, keys ignored."""

    name = "round-robin"

    @staticmethod
    def _pick(routable: Sequence[R], turn: int) -> R:
        return routable[turn % len(routable)]


class LeastLoaded(_KeyBlind):
    """Fewest requests in flight, round robin among ties, keys ignored."""

    name = "least-loaded"

    @staticmethod
    def _pick(routable: Sequence[R], turn: int) -> R:
        return least_loaded(routable, turn)


POLICIES = ("prefix", "round-robin", "least-loaded")


def make_policy(
    name: str,
    *,
    load_factor: float = DEFAULT_LOAD_FACTOR,
    vnodes: int = DEFAULT_VNODES,
    table_size: int = DEFAULT_TABLE_SIZE,
    load_slack: int = DEFAULT_LOAD_SLACK,
    move_price: int = DEFAULT_MOVE_PRICE,
) -> Policy:
    """The policy called `name` (`--policy`), one of `POLICIES`."""
    if name == "prefix":
        return PrefixAffinity(
            load_factor=load_factor,
            vnodes=vnodes,
            table_size=table_size,
            load_slack=load_slack,
            move_price=move_price,
        )
    if name == "round-robin":
        return RoundRobin()
    if name == "least-loaded":
        return LeastLoaded()
    raise ValueError(f"unknown policy {name!r}; expected one of {', '.join(POLICIES)}")
