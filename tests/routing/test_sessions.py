"""The session table's rules (routing/sessions.py), without sockets: what an id is, which
candidates a session's request is offered, idle expiry, the bound, release."""

from __future__ import annotations

import pytest
from routing_doubles import Rep

from lora_router.routing.contract import Candidates
from lora_router.routing.sessions import (
    MAX_ID_BYTES,
    SessionIdError,
    SessionTable,
    finish_id,
    header_id,
    overloaded,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(ttl: float = 10.0, max_sessions: int = 100, slack: int = 0) -> tuple[SessionTable, Clock]:
    clock = Clock()
    return SessionTable(ttl, max_sessions, slack, clock), clock


def fleet(*loads: int) -> Candidates[Rep]:
    reps = [Rep(f"r{i}") for i in range(len(loads))]
    for rep, load in zip(reps, loads, strict=True):
        rep.in_flight = load
    return Candidates(reps)


def test_a_request_without_the_header_has_no_session() -> None:
    # The values of a request's X-Session-ID headers, as the parser picks them out.
    assert header_id(()) is None
    assert header_id((b"",)) is None  # empty: none, as in vllm-router
    assert header_id((b"traj-7",)) == b"traj-7"


@pytest.mark.parametrize(
    "values",
    [
        (b"a" * (MAX_ID_BYTES + 1),),
        (b"two words",),
        ("caf\u00e9".encode(),),
        (b"a", b"b"),
        (b"", b""),
    ],
    ids=["too-long", "space", "non-ascii", "twice", "twice-empty"],
)
def test_a_bad_header_is_refused(values: tuple[bytes, ...]) -> None:
    with pytest.raises(SessionIdError):
        header_id(values)


def test_finish_names_its_session_by_query_or_body() -> None:
    assert finish_id(b"session_id=traj-7", b"") == b"traj-7"
    assert finish_id(b"session_id=a%2Fb", b"") == b"a/b"
    assert finish_id(b"", b'{"session_id": "traj-8"}') == b"traj-8"
    for query, body in ((b"", b""), (b"", b"[]"), (b"session_id=", b""), (b"x=1", b"{")):
        with pytest.raises(SessionIdError):
            finish_id(query, body)
    with pytest.raises(SessionIdError):
        finish_id(b"session_id=a&session_id=b", b"")


def test_a_first_request_is_offered_every_candidate_then_sticks() -> None:
    sessions, _ = table()
    routable = fleet(0, 0, 0)
    assert sessions.narrow(b"s", routable) is routable
    sessions.pin(b"s", "r1")
    narrowed = sessions.narrow(b"s", routable)
    assert [r.name for r in narrowed] == ["r1"] and narrowed.in_flight == 0
    assert (sessions.placed, sessions.stuck) == (1, 1)


def test_a_pin_not_routable_is_placed_again() -> None:
    sessions, _ = table()
    sessions.pin(b"s", "gone")
    routable = fleet(0, 0)
    assert sessions.narrow(b"s", routable) is routable
    assert sessions.replaced == 1


def test_far_over_the_load_is_the_others_mean_twice_plus_twice_the_slack() -> None:
    assert not overloaded(1, 1, 2, 0)
    assert overloaded(2, 2, 2, 0)  # others idle: their mean counts as 1
    assert not overloaded(33, 33, 3, 16)
    assert overloaded(34, 33 + 1, 3, 16)
    assert not overloaded(50, 50 + 2 * 10, 3, 16)  # others hold 10 each: 2 * 10 + 32 = 52
    assert overloaded(52, 52 + 2 * 10, 3, 16)
    assert not overloaded(1000, 1000, 1, 0)  # alone: nowhere else to go
    sessions, _ = table()
    sessions.pin(b"s", "r0")
    routable = fleet(2, 0)
    assert sessions.narrow(b"s", routable) is routable and sessions.replaced == 1


def test_an_idle_session_expires_after_the_ttl() -> None:
    sessions, clock = table(ttl=10.0)
    sessions.pin(b"old", "r0")
    clock.now += 6
    sessions.pin(b"new", "r1")
    clock.now += 5  # "old" idle 11 s, "new" 5 s
    assert sessions.json()["count"] == 1 and sessions.json()["expired"] == 1  # read-only
    assert len(sessions) == 2
    routable = fleet(0, 0)
    assert sessions.narrow(b"old", routable) is routable  # placed again
    assert len(sessions) == 1 and sessions.expired == 1


def test_the_bound_forgets_the_least_recently_used() -> None:
    sessions, clock = table(max_sessions=2)
    sessions.pin(b"a", "r0")
    sessions.pin(b"b", "r0")
    clock.now += 1
    sessions.pin(b"a", "r0")  # used again: "b" is now the oldest
    sessions.pin(b"c", "r1")
    assert len(sessions) == 2 and sessions.evicted == 1
    routable = fleet(0, 0)
    assert sessions.narrow(b"b", routable) is routable
    assert [r.name for r in sessions.narrow(b"a", routable)] == ["r0"]


def test_finish_releases_and_an_unknown_id_is_harmless() -> None:
    sessions, _ = table()
    sessions.pin(b"s", "r0")
    assert sessions.finish(b"s") is True
    assert sessions.finish(b"s") is False
    assert sessions.finish(b"never") is False
    assert len(sessions) == 0 and sessions.finished == 1
