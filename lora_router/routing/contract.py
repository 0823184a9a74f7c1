"""The contract between a routing policy and its caller (policy.py holds the policies).

- `Replica`: what a policy reads of a replica (the caller's own objects are passed through);
- `Candidates`: the replicas a request may go to, with their total in flight kept by the caller;
- `Decision`: the replica chosen, the kind of decision (counted in `DecisionCounts`) and the
  prompt tokens it leaves to compute;
- `Policy`: what every policy answers (`choose`, `set_members`, `load_changed`,
  `set_weight`), its calling rules stated in policy.py's module docstring;
- `Prefer` and `Deal`: the strategy a `PrefixAffinity` may be given for a new family
  (kv_policy.py's `KvLookup`), and what it may read of the deal.

Types only: no rule lives here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Generic, NamedTuple, Protocol, TypeVar

from .keys import PromptKey, RouteKey


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
    # The prompt's own tokens as its key counts them (0: the policy did not look at the key), so
    # `prompt - tokens` is what the policy expects the replica to have cached.
    prompt: int = 0


@dataclass(slots=True)
class DecisionCounts:
    """How many decisions of each kind a policy made (read by metrics and the status page)."""

    sibling: int = 0  # this exact prompt's home
    continuation: int = 0  # the home of an earlier prompt this one extends
    spill: int = 0  # a home was known but full or unroutable: next on the ring with room
    fresh: int = 0  # an unknown prompt: least loaded, ties in ring order from its key
    nokey: int = 0  # no key: least loaded
    balanced: int = 0  # KeyBlind (round-robin, least-loaded): chosen without looking at keys
    kv: int = 0  # a new family sent where its longest prefix really is (kv_policy.py)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class Candidates(list[R]):
    """The replicas a request may go to, as a policy reads them: a list in fleet order that
    also finds a replica by name in O(1) (`get`) and carries `in_flight`, the requests in
    flight over all of them, which whoever counts requests keeps current (fleet/fleet.py
    keeps one per model and adds or takes one off per request: O(1) to read here)."""

    __slots__ = ("get", "in_flight", "model")

    # The name index's own `dict.get`, bound once per set: the policy and Fleet.started /
    # finished look a replica up 3 times per request, and a bound C method has no Python frame.
    get: Callable[[str], R | None]

    def __init__(self, replicas: Iterable[R] = (), model: str | None = None) -> None:
        super().__init__(replicas)
        self.get = {r.name: r for r in self}.get
        self.in_flight = sum(r.in_flight for r in self)
        self.model = model  # the adapter they were chosen for (None: the base model)


class Policy(Protocol):
    counts: DecisionCounts

    def set_members(self, members: Sequence[Replica]) -> None:
        """The full membership (the ring), with each member's load now; called at start and,
        after adds or removes, before the next `choose` (once for several)."""

    def load_changed(self, replica: Replica) -> None:
        """`replica`'s `in_flight` or `in_flight_tokens` changed (the caller calls it after
        every change it makes)."""

    def set_weight(self, name: str, weight: int) -> None:
        """Member `name`'s relative speed changed, in sixteenths (policy.py's `WEIGHT_FULL`
        at full speed; measured by fleet/pace.py); a policy may ignore it."""

    def choose(self, key: RouteKey | None, routable: Candidates[R]) -> Decision[R]:
        """Pick a replica among `routable` (never empty); must not change `in_flight`. `key`
        is the request's `RouteKey` under placement seeds (`keys.completion_key`): a policy
        reads its `wire` first and builds its block `key` only when that is not enough."""
        ...


class Deal(Protocol):
    """What a `Prefer` strategy may read of the deal (policy.py's `PrefixAffinity`)."""

    def families(self, name: str) -> int:
        """The new families dealt to a member (the deal's first criterion)."""
        ...

    def window(self) -> int:
        """A member holding fewer families than this is inside the deal window."""
        ...


class Prefer(Protocol):
    """Rule 3's first step, if a `PrefixAffinity` is given one (`--policy kv`, kv_policy.py):
    the routable replicas a new family is dealt among instead of all, and the prompt tokens
    they leave to compute; None: the deal over all of them (decision `fresh`)."""

    def among(
        self, key: PromptKey, routable: Candidates[R], cap: int, deal: Deal
    ) -> tuple[Candidates[R], int] | None: ...
