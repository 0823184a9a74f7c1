"""A replica SIGKILLed and restarted empty is replayed before it serves: no client sees a 404,
and the replica itself is never asked for an adapter it does not hold yet (its own access log:
the router's retry of a 404 on another replica would hide an early admission from clients)."""

from __future__ import annotations

import time
from collections.abc import Callable

import replica_log
from rollouts import Rollouts

from lora_router.testbed.trl_client import LORA_NAME
from lora_router.testbed.vllm_harness import REPLICA_START_S, Replica, Router, wait_for

V1 = f"{LORA_NAME}-v1"


def test_restarted_replica_gets_its_adapters_back_before_it_serves(
    fleet: list[Replica], routers: Callable[..., Router], publish: Callable[..., str], base: str
) -> None:
    """TRL-shaped rollouts for trl-policy-v1 keep flowing while replica 1 is SIGKILLed and
    started again on its port with no adapter. Every rollout answered is a 200 (none 404,
    none refused; only answers the kill itself cut short fail, as transport errors TRL
    retries), replica 1 holds v1 again, it serves rollouts after its return, and it answered
    none of them 404 (none reached it before its replay loaded v1)."""
    router = routers("--health-failures", "1", "--health-successes", "1")
    path = publish(V1, 0)
    assert router.post("/v1/load_lora_adapter", {"lora_name": V1, "lora_path": path}).status == 200
    victim = fleet[1]
    with Rollouts(router.url, V1, seed=5) as rollouts:
        statuses = rollouts.statuses
        wait_for("rollouts on both replicas", lambda: {h for _, h in statuses} >= {"0", "1"}, 120)
        killed = time.monotonic()
        victim.kill()
        wait_for(
            "the router ejects the killed replica",
            lambda: not router.replicas()[1]["healthy"],
            30,
            [router.log],
        )
        ejected = time.monotonic()
        served_while_down = len(statuses)
        since_restart = victim.log_size()
        victim.start()
        victim.wait_healthy(REPLICA_START_S)
        wait_for(
            "the restarted replica is replayed and admitted",
            lambda: router.replicas()[1]["admitted"] and router.replicas()[1]["healthy"],
            120,
            [router.log, victim.log],
        )
        assert victim.adapters() == {V1: path}
        wait_for(
            "rollouts reach the restarted replica",
            lambda: rollouts.served_by("1", since=served_while_down),
            120,
            [router.log, victim.log],
        )
    cut = rollouts.cut
    assert statuses and {s for s, _ in statuses} == {200}, sorted({s for s, _ in statuses})
    assert all(h == "1" and killed <= t <= ejected for h, t in cut), (cut, killed, ejected)
    answered = replica_log.accesses(replica_log.text_since(victim.log, since_restart))
    completions = [a.status for a in answered if a.path == "/v1/completions"]
    assert completions and set(completions) == {200}, sorted(set(completions))
