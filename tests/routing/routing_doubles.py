"""Test doubles of what the fleet hands a policy: replicas whose request counts announce every
change, as `Fleet.started` and `Fleet.finished` do, and candidate sets whose in-flight total
follows them, as the fleet's kept sets do (fleet/fleet.py). Tests set `in_flight` directly."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, overload

from lora_router.routing.policy import Candidates, Policy


class Rep:
    """A replica as a policy reads it; every change of its counts is told to its watchers."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._in_flight = 0
        self._tokens = 0
        self.watchers: list[Callable[[Rep, int], None]] = []  # (replica, in-flight delta)

    @property
    def in_flight(self) -> int:
        return self._in_flight

    @in_flight.setter
    def in_flight(self, value: int) -> None:
        delta, self._in_flight = value - self._in_flight, value
        for watcher in self.watchers:
            watcher(self, delta)

    @property
    def in_flight_tokens(self) -> int:
        return self._tokens

    @in_flight_tokens.setter
    def in_flight_tokens(self, value: int) -> None:
        self._tokens = value
        for watcher in self.watchers:
            watcher(self, 0)

    def __repr__(self) -> str:
        return f"Rep({self.name}, in_flight={self._in_flight}, tokens={self._tokens})"


class Pool(Candidates[Rep]):
    """Candidates over `Rep`s, their total kept as the replicas' counts change; a slice is a
    Pool too."""

    def __init__(self, reps: Iterable[Rep] = ()) -> None:
        super().__init__(reps)
        for rep in self:
            rep.watchers.append(self._moved)

    def _moved(self, rep: Rep, delta: int) -> None:
        self.in_flight += delta

    @overload
    def __getitem__(self, i: int) -> Rep: ...

    @overload
    def __getitem__(self, i: slice) -> Pool: ...

    def __getitem__(self, i: Any) -> Any:
        got = list.__getitem__(self, i)
        return Pool(got) if isinstance(i, slice) else got


def fleet(n: int) -> Pool:
    return Pool(Rep(f"http://replica-{i}.internal:8000") for i in range(n))


def watch(policy: Policy, reps: Iterable[Rep]) -> None:
    """Make `reps` the policy's members and tell it of their load changes from now on."""
    members = list(reps)
    policy.set_members(members)
    for rep in members:
        rep.watchers.append(lambda r, _: policy.load_changed(r))
