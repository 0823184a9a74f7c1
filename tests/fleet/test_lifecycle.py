"""The replica lifecycle (fleet/lifecycle.py) as a table of state x event, refusals included.

Every cell says what an event does to a replica in a given state: the state it ends in, or
REFUSED (the method returns False and nothing changes). A missing cell fails the test, so a new
state or event must be given a row before it can ship.
"""

from __future__ import annotations

import pytest

from lora_router.fleet.lifecycle import GIVEN_UP, MAX_BACKOFF_S, Lifecycle, State

J, R, S, E, B, D, G = (
    State.JOINING,
    State.REPLAYING,
    State.SERVING,
    State.EJECTED,
    State.BACKING_OFF,
    State.DRAINING,
    State.GONE,
)
REFUSED = "refused"
INTERVAL = 1.0
NOW = 100.0  # the clock at the event; a serving replica was admitted long before (no back-off)


def _events() -> dict[str, object]:
    return {
        "eject": lambda lc: lc.eject("test"),
        "restarted": lambda lc: lc.restarted(NOW, "test"),
        "listing_lacks(others)": lambda lc: lc.listing_lacks(NOW, "test", others_serving=True),
        "listing_lacks(last)": lambda lc: lc.listing_lacks(NOW, "test", others_serving=False),
        "replay_begins(others)": lambda lc: lc.replay_begins(NOW, others_serving=True),
        "replay_begins(last)": lambda lc: lc.replay_begins(NOW, others_serving=False),
        "replay_succeeded": lambda lc: lc.replay_succeeded(NOW),
        "replay_failed": lambda lc: lc.replay_failed(NOW, "test"),
        "replay_failed(unlisted)": lambda lc: lc.replay_failed(NOW, "test", unlisted=True),
        "replay_failed(hung)": lambda lc: lc.replay_failed(NOW, "test", hung=True),
        "drain": lambda lc: lc.drain(),
        "remove": lambda lc: lc.remove(),
    }


EVENTS = _events()

# state -> event -> the state after it, or REFUSED. BACKING_OFF rows are a replica whose
# back-off has not run out yet (readmit_at after NOW).
TABLE: dict[State, dict[str, State | str]] = {
    J: {
        "eject": J,
        "restarted": REFUSED,
        "listing_lacks(others)": REFUSED,
        "listing_lacks(last)": REFUSED,
        "replay_begins(others)": R,
        "replay_begins(last)": R,
        "replay_succeeded": REFUSED,
        "replay_failed": J,
        "replay_failed(unlisted)": B,
        "replay_failed(hung)": B,
        "drain": D,
        "remove": G,
    },
    R: {
        "eject": E,
        "restarted": REFUSED,
        "listing_lacks(others)": REFUSED,
        "listing_lacks(last)": REFUSED,
        "replay_begins(others)": REFUSED,
        "replay_begins(last)": REFUSED,
        "replay_succeeded": S,
        "replay_failed": E,
        "replay_failed(unlisted)": B,
        "replay_failed(hung)": B,
        "drain": D,
        "remove": G,
    },
    S: {
        "eject": E,
        "restarted": E,
        "listing_lacks(others)": E,
        "listing_lacks(last)": REFUSED,
        "replay_begins(others)": REFUSED,
        "replay_begins(last)": REFUSED,
        "replay_succeeded": REFUSED,
        "replay_failed": REFUSED,
        "replay_failed(unlisted)": REFUSED,
        "replay_failed(hung)": REFUSED,
        "drain": D,
        "remove": G,
    },
    E: {
        "eject": E,
        "restarted": REFUSED,
        "listing_lacks(others)": REFUSED,
        "listing_lacks(last)": REFUSED,
        "replay_begins(others)": R,
        "replay_begins(last)": R,
        "replay_succeeded": REFUSED,
        "replay_failed": E,
        "replay_failed(unlisted)": B,
        "replay_failed(hung)": B,
        "drain": D,
        "remove": G,
    },
    B: {
        "eject": B,
        "restarted": REFUSED,
        "listing_lacks(others)": REFUSED,
        "listing_lacks(last)": REFUSED,
        "replay_begins(others)": REFUSED,  # backing off while others serve
        "replay_begins(last)": R,  # nobody else serves: try it now
        "replay_succeeded": REFUSED,
        "replay_failed": B,
        "replay_failed(unlisted)": B,
        "replay_failed(hung)": B,
        "drain": D,
        "remove": G,
    },
    D: {
        "eject": REFUSED,
        "restarted": REFUSED,
        "listing_lacks(others)": REFUSED,
        "listing_lacks(last)": REFUSED,
        "replay_begins(others)": REFUSED,
        "replay_begins(last)": REFUSED,
        "replay_succeeded": REFUSED,
        "replay_failed": REFUSED,
        "replay_failed(unlisted)": REFUSED,
        "replay_failed(hung)": REFUSED,
        "drain": REFUSED,
        "remove": G,
    },
    G: dict.fromkeys(EVENTS, REFUSED),
}


def in_state(state: State) -> Lifecycle:
    life = Lifecycle("Replica 0 (http://a:1)", INTERVAL, state)
    if state is State.BACKING_OFF:
        life.slips, life.readmit_at = 1, NOW + 2 * INTERVAL
    return life


CELLS = [(state, event) for state in State for event in EVENTS]


def test_the_table_covers_every_state_event_pair() -> None:
    assert set(TABLE) == set(State)
    for row in TABLE.values():
        assert set(row) == set(EVENTS)


@pytest.mark.parametrize(("state", "event"), CELLS, ids=[f"{s.value}-{e}" for s, e in CELLS])
def test_each_event_moves_each_state_as_the_table_says(state: State, event: str) -> None:
    life = in_state(state)
    expected = TABLE[state][event]
    changed = EVENTS[event](life)  # type: ignore[operator]
    if expected == REFUSED:
        assert changed is False and life.state is state
    else:
        assert changed is True and life.state is expected
    # Whoever waits for its answers stops waiting exactly when the router gives up on it.
    assert life.given_up.is_set() is (life.state in GIVEN_UP)


def test_only_a_replica_in_service_counts_an_ejection() -> None:
    serving, ejected = in_state(S), in_state(E)
    serving.eject("gone")
    ejected.eject("still gone")
    assert (serving.ejections, ejected.ejections) == (1, 0)
    assert ejected.last_error == "still gone"


@pytest.mark.parametrize(("state", "event"), CELLS, ids=[f"{s.value}-{e}" for s, e in CELLS])
def test_only_leaving_service_is_told_to_on_leave_with_the_reason(state: State, event: str) -> None:
    life = in_state(state)
    left: list[str] = []
    life.on_leave = lambda why, stalled: left.append(why)
    ejections = life.ejections
    EVENTS[event](life)  # type: ignore[operator]
    assert left == (["test"] if life.ejections > ejections else [])  # it left service


def _replayed() -> Lifecycle:
    life = in_state(E)
    life.eject("down")
    life.replay_begins(NOW, others_serving=True)
    life.replay_succeeded(NOW + 1)
    return life


def test_a_successful_replay_clears_the_last_error() -> None:
    assert _replayed().last_error == ""


def test_a_successful_replay_stamps_the_admission_time() -> None:
    assert _replayed().admitted_at == NOW + 1


def test_a_restart_soon_after_admission_backs_off_for_double_the_wait_each_time() -> None:
    life = in_state(S)
    life.admitted_at = NOW - INTERVAL  # re-admitted one interval ago: the replay did not stick
    assert life.restarted(NOW, "lost v1")
    assert life.state is B and life.slips == 1 and life.readmit_at == NOW + 2 * INTERVAL
    assert not life.replay_begins(NOW + INTERVAL, others_serving=True)
    assert life.replay_begins(NOW + 2 * INTERVAL, others_serving=True)
    life.replay_succeeded(NOW + 2 * INTERVAL)
    life.restarted(NOW + 3 * INTERVAL, "lost v1")
    assert life.slips == 2 and life.readmit_at == NOW + 3 * INTERVAL + 4 * INTERVAL


def test_a_replay_that_hung_backs_off_for_double_the_wait_each_time() -> None:
    life = in_state(E)
    life.replay_begins(NOW, others_serving=True)
    assert life.replay_failed(NOW, "its /pause got no answer", hung=True)
    assert life.state is B and life.readmit_at == NOW + 2 * INTERVAL
    assert not life.replay_begins(NOW + INTERVAL, others_serving=True)
    assert life.replay_begins(NOW + 2 * INTERVAL, others_serving=True)
    life.replay_failed(NOW + 2 * INTERVAL, "its /pause got no answer", hung=True)
    assert life.slips == 2 and life.readmit_at == NOW + 2 * INTERVAL + 4 * INTERVAL


def test_a_waiter_keeps_the_event_it_got_when_the_replica_comes_back() -> None:
    life = in_state(S)
    waited = life.given_up
    life.eject("down")
    life.replay_begins(NOW, others_serving=True)
    life.replay_succeeded(NOW)
    assert waited.is_set() and not life.given_up.is_set()


def test_a_replica_that_stayed_in_service_a_while_restarts_afresh() -> None:
    life = in_state(S)
    life.slips, life.admitted_at = 3, NOW - 100 * INTERVAL
    life.restarted(NOW, "lost v1")
    assert life.state is E and life.slips == 0 and life.readmit_at == 0.0


def test_the_back_off_is_capped() -> None:
    life = in_state(S)
    life.slips = 30
    assert life.backoff() == MAX_BACKOFF_S


def three_listings_lacking_v1_on_the_last_serving_replica() -> tuple[Lifecycle, list[bool]]:
    """A serving replica, the only one, told three times that its listing lacks v1: the
    lifecycle and what each listing answered (True: ejected)."""
    life = in_state(S)
    return life, [life.listing_lacks(NOW, "lost v1", others_serving=False) for _ in range(3)]


def test_a_listing_never_ejects_the_last_serving_replica() -> None:
    life, ejected = three_listings_lacking_v1_on_the_last_serving_replica()
    for answer in ejected:
        assert not answer
    assert life.state is S and life.ejections == 0


def test_each_listing_refused_for_the_last_serving_replica_is_counted() -> None:
    life, _ = three_listings_lacking_v1_on_the_last_serving_replica()
    assert life.listing_kept == 3
