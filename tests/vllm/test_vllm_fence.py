"""The version fence under concurrent rollouts on real vLLM, read from the replicas' own logs."""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Callable

import replica_log

from lora_router.testbed.trl_client import LORA_NAME, Rollouts
from lora_router.testbed.vllm_harness import Replica, Router, wait_for

V1, V2 = f"{LORA_NAME}-v1", f"{LORA_NAME}-v2"


def load_404s(replica: Replica, offset: int) -> int:
    text = replica_log.text_since(replica.log, offset)
    return sum(
        1
        for a in replica_log.accesses(text)
        if a.path == "/v1/load_lora_adapter" and a.status == 404
    )


def test_rollouts_naming_a_version_whose_files_lag_never_reach_a_replica_early(
    fleet: list[Replica],
    routers: Callable[..., Router],
    publish: Callable[..., str],
    arrive: Callable[[str], None],
    base: str,
) -> None:
    """TRL's rollouts keep flowing under v1 while v2 is loaded, and rollouts naming v2 are sent
    right after its load was asked for (an eager client). v2's directory is renamed into place
    only once both replicas have answered its load 404 "No adapter found" twice (the router
    retrying) and the v2 rollouts wait at the fence. Every rollout answers 200, and no request
    naming v2 reaches either replica before both replicas loaded v2 (the replicas' logs)."""
    router = routers("--load-retry-interval", "0.3")
    assert router.post("/v1/load_lora_adapter", _body(V1, publish(V1, 0))).status == 200
    # Built here: the first one imports TRL, which takes a while on a busy machine.
    v1 = Rollouts(router.url, base, version=1, max_tokens=2)
    later = Rollouts(router.url, base, version=2, max_tokens=2)
    offsets = [r.log_size() for r in fleet]
    v2 = publish(V2, 1, rename=False)  # the mount lags
    loaded: list[int] = []
    loader = threading.Thread(
        target=lambda: loaded.append(router.post("/v1/load_lora_adapter", _body(V2, v2)).status)
    )
    loader.start()
    wait_for(
        "both replicas answer v2's load 404",
        lambda: all(load_404s(r, o) >= 1 for r, o in zip(fleet, offsets, strict=True)),
        60,
        [router.log],
    )
    stop = threading.Event()
    errors: list[BaseException] = []
    rng = random.Random(3)
    v2_prompts = [rng.choices(range(3, 480), k=200) for _ in range(3)]

    def traffic() -> None:
        async def run() -> None:
            eager = asyncio.ensure_future(later.groups(v2_prompts, 4))  # waits at the fence
            eager.add_done_callback(lambda t: t.exception() and errors.append(t.exception()))
            for _ in range(200):  # bounded; ends once v2 has been served
                if stop.is_set() and eager.done():
                    break
                await v1.groups([rng.choices(range(3, 480), k=200)], 2)
            await eager

        try:
            asyncio.run(run())
        except BaseException as exc:
            errors.append(exc)

    rollouts = threading.Thread(target=traffic)
    rollouts.start()
    try:
        wait_for(
            "the v2 rollouts wait at the fence",
            lambda: router.get("/router/status").json()["fence"]["waiting"] == 12,
            60,
            [router.log],
            lambda: f"the rollouts failed: {errors[0]!r}" if errors else None,
        )
        wait_for(
            "both replicas answer v2's load 404 again",
            lambda: all(load_404s(r, o) >= 2 for r, o in zip(fleet, offsets, strict=True)),
            60,
            [router.log],
        )
        arrive(v2)
        loader.join(timeout=120)
        assert loaded == [200]
    finally:
        stop.set()
        rollouts.join(timeout=300)
    assert not rollouts.is_alive() and errors == []

    texts = [replica_log.text_since(r.log, o) for r, o in zip(fleet, offsets, strict=True)]
    v2_loaded = [min(t for t, name in replica_log.loads(text) if name == V2) for text in texts]
    requests = [r for text in texts for r in replica_log.requests(text)]
    v2_requests = [r for r in requests if r.adapter == V2]
    assert len(v2_requests) == 12
    assert min(r.t for r in v2_requests) > max(v2_loaded)  # none before every replica had it
    v1_during = [r for r in requests if r.adapter == V1 and r.t < max(v2_loaded)]
    assert v1_during  # the rollouts under v1 went on while v2's files lagged
    completions = [
        a for text in texts for a in replica_log.accesses(text) if a.path == "/v1/completions"
    ]
    assert {a.status for a in completions} == {200}


def _body(name: str, path: str) -> dict[str, object]:
    return {"lora_name": name, "lora_path": path, "load_inplace": False}
