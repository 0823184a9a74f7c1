"""The fence and the breaker on their own: states, waits and transitions, no sockets."""

from __future__ import annotations

import asyncio

import pytest
from helpers import until

from lora_router.fleet.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from lora_router.fleet.fence import AdapterEntry, AdapterFence, AdapterState, FenceRefusal
from lora_router.proxy.answers import fence_error


async def test_the_base_model_named_or_omitted_passes_at_once() -> None:
    fence = AdapterFence(1.0)
    fence.base_models.add("base")
    assert fence.admits(None) and fence.admits("base")
    assert not fence.admits("nope")
    assert fence.waits == 0


async def test_unknown_name_is_vllms_404() -> None:
    fence = AdapterFence(1.0)
    with pytest.raises(FenceRefusal) as err:
        await fence.wait("nope")
    assert fence_error(err.value).status == 404
    assert err.value.message == "The model `nope` does not exist."
    assert fence_error(err.value).param == "model"


async def test_a_loading_name_waits_then_passes_when_live() -> None:
    fence = AdapterFence(5.0)
    entry = fence.begin_load("v1", "/a/v1", inplace=False)
    waiter = asyncio.create_task(fence.wait("v1"))
    await until(lambda: fence.waiting == 1)
    assert not waiter.done()
    fence.finish_load(entry, ok=True)
    await asyncio.wait_for(waiter, 1.0)
    assert fence.state("v1") is AdapterState.LIVE
    assert fence.waits == 1 and fence.waiting == 0


async def test_a_failed_load_answers_its_waiters_404_with_the_reason() -> None:
    fence = AdapterFence(5.0)
    entry = fence.begin_load("v1", "/a/v1", inplace=False)
    waiter = asyncio.create_task(fence.wait("v1"))
    await asyncio.sleep(0)
    fence.finish_load(entry, ok=False, failure="Replica 2 said no")
    with pytest.raises(FenceRefusal) as err:
        await waiter
    assert fence_error(err.value).status == 404
    assert "Replica 2 said no" in err.value.message
    assert fence.state("v1") is None


async def test_waiting_past_the_fence_timeout_is_a_clear_503() -> None:
    fence = AdapterFence(0.05)
    fence.begin_load("v1", "/a/v1", inplace=False)
    with pytest.raises(FenceRefusal) as err:
        await fence.wait("v1")
    assert fence_error(err.value).status == 503
    assert "still being loaded" in err.value.message
    assert fence.wait_timeouts == 1


async def test_an_unload_answers_the_requests_waiting_for_the_name_404() -> None:
    fence = AdapterFence(5.0)
    fence.begin_load("v1", "/a/v1", inplace=False)
    waiter = asyncio.create_task(fence.wait("v1"))
    await asyncio.sleep(0)
    fence.begin_unload("v1")
    with pytest.raises(FenceRefusal) as err:
        await asyncio.wait_for(waiter, 1.0)
    assert fence_error(err.value).status == 404
    assert not fence.admits("v1")


async def test_a_load_finishing_after_an_unload_arrived_does_not_bring_the_name_back() -> None:
    fence = AdapterFence(5.0)
    entry = fence.begin_load("v1", "/a/v1", inplace=False)
    unloading = fence.begin_unload("v1")
    fence.finish_load(entry, ok=True)
    assert fence.state("v1") is AdapterState.UNLOADING
    fence.finish_unload(unloading)
    assert fence.state("v1") is None


async def test_a_load_after_an_unload_is_not_erased_by_the_unload_finishing() -> None:
    fence = AdapterFence(5.0)
    fence.mark_live("v1", "/a/v1")
    unloading = fence.begin_unload("v1")
    loading = fence.begin_load("v1", "/a/v1", inplace=False)
    fence.finish_unload(unloading)
    assert fence.state("v1") is AdapterState.LOADING
    fence.finish_load(loading, ok=True)
    assert fence.state("v1") is AdapterState.LIVE


def the_same_load_twice() -> tuple[AdapterFence, AdapterEntry, AdapterEntry]:
    """A fence and what two identical loads of v1 began with."""
    fence = AdapterFence(5.0)
    first = fence.begin_load("v1", "/a/v1", inplace=False)
    second = fence.begin_load("v1", "/a/v1", inplace=False)
    return fence, first, second


async def test_the_same_load_twice_shares_one_entry() -> None:
    _, first, second = the_same_load_twice()
    assert first is second


async def test_one_success_of_the_same_load_twice_suffices() -> None:
    fence, first, second = the_same_load_twice()
    fence.finish_load(first, ok=False, failure="x")
    assert fence.state("v1") is AdapterState.LOADING  # the second attempt is still to come
    fence.finish_load(second, ok=True)
    assert fence.state("v1") is AdapterState.LIVE


async def test_a_live_name_cannot_be_repointed() -> None:
    fence = AdapterFence(5.0)
    fence.mark_live("v1", "/a/v1")
    with pytest.raises(FenceRefusal) as err:
        fence.begin_load("v1", "/b/v1", inplace=False)
    assert fence_error(err.value).status == 400 and "/a/v1" in err.value.message
    with pytest.raises(FenceRefusal) as err:
        fence.begin_load("v1", "/a/v1", inplace=True)
    assert fence_error(err.value).status == 400 and "in place" in err.value.message
    assert fence.state("v1") is AdapterState.LIVE


async def test_a_load_of_a_live_name_takes_it_out_of_service_until_the_load_settles() -> None:
    """A reload: a new loading entry that remembers the files the fleet serves; completions
    wait from its arrival and pass once it is live again."""
    fence = AdapterFence(5.0)
    first = fence.begin_load("v1", "/a/v1", inplace=False)
    first.files = "sha256:old"
    fence.finish_load(first, ok=True)
    reload = fence.begin_load("v1", "/a/v1", inplace=False)
    assert reload is not first and reload.replacing and reload.held == "sha256:old"
    assert not fence.admits("v1") and fence.state("v1") is AdapterState.LOADING
    assert not fence.current(first) and fence.current(reload)
    waiter = asyncio.create_task(fence.wait("v1"))
    await until(lambda: fence.waiting == 1)
    assert not waiter.done()
    reload.files = "sha256:new"
    fence.finish_load(reload, ok=True)
    await asyncio.wait_for(waiter, 1.0)
    assert fence.live()["v1"].files == "sha256:new"


async def test_a_failed_reload_leaves_the_name_unknown_not_live_on_its_old_files() -> None:
    fence = AdapterFence(5.0)
    fence.mark_live("v1", "/a/v1")
    reload = fence.begin_load("v1", "/a/v1", inplace=False)
    assert reload.replacing and reload.held is None  # found at start: files unknown
    fence.finish_load(reload, ok=False, failure="Replica 1 said no")
    assert fence.state("v1") is None
    with pytest.raises(FenceRefusal) as err:
        await fence.wait("v1")
    assert fence_error(err.value).status == 404


async def test_live_lists_names_in_load_order() -> None:
    fence = AdapterFence(5.0)
    for name in ("v1", "v2", "v3"):
        fence.mark_live(name, f"/a/{name}")
    fence.finish_unload(fence.begin_unload("v1"))
    fence.finish_load(fence.begin_load("v1", "/a/v1", inplace=False), ok=True)
    assert list(fence.live()) == ["v2", "v3", "v1"]


def test_breaker_opens_after_consecutive_failures_only() -> None:
    breaker = CircuitBreaker(threshold=3, cooldown=10.0)
    breaker.failure(0.0)
    breaker.failure(0.0)
    breaker.success()
    breaker.failure(0.0)
    breaker.failure(0.0)
    assert breaker.state == CLOSED and breaker.allows(0.0)
    breaker.failure(1.0)
    assert breaker.state == OPEN and not breaker.allows(5.0)
    assert breaker.opens == 1


def test_breaker_lets_one_trial_through_after_the_cooldown() -> None:
    breaker = CircuitBreaker(threshold=1, cooldown=10.0)
    breaker.failure(0.0)
    assert not breaker.allows(9.9)
    assert breaker.allows(10.0) and breaker.state == HALF_OPEN
    breaker.begin()
    assert not breaker.allows(10.1)  # the trial is in flight
    breaker.failure(11.0)
    assert breaker.state == OPEN and not breaker.allows(20.0)
    assert breaker.allows(21.0)
    breaker.begin()
    breaker.success()
    assert breaker.state == CLOSED and breaker.allows(21.0)
