"""`--policy kv` against a real vLLM 0.32 CPU replica started with `--kv-events-config`: the
router finds the publisher through `/kv_event_sources`, decodes its batches, files the blocks a
prompt stored under the router's own keys (vLLM's hashes and seed are never reproduced), and
routes that prompt's next turn, a new family to the router, as a `kv` decision."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trl_client import LORA_NAME, vllm_client
from vllm_harness import TOKEN, Replica, free_port, http, start_replicas, start_router, wait_for

BLOCK = 128  # vLLM's CPU build
VOCAB = range(3, 480)


def status(router_url: str) -> dict[str, Any]:
    answer = http("GET", router_url + "/router/status")
    assert answer.status == 200, answer.text
    return answer.json()


def test_real_kv_events_route_a_new_family_to_its_prefix(
    model: Path, logs: Path, publish: Callable[..., str]
) -> None:
    pub, replay = free_port(), free_port()
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv",
    }
    replica = Replica(
        model=model / "model",
        log=logs / "replica-kv-events.log",
        extra=("--kv-events-config", json.dumps(events)),
    )
    try:
        start_replicas([replica])
        sources = replica.get("/kv_event_sources").json()
        assert sources["0"]["endpoint"] == f"tcp://*:{pub}" and sources["0"]["topic"] == "kv"
        router = start_router(
            [replica], logs / "router-kv-events.log", "--health-interval", "0.5", "--policy", "kv"
        )
        try:
            name = f"{LORA_NAME}-v1"
            client = vllm_client(router.url)
            client.pause()
            client.load_lora_adapter(name, publish(name, 0))
            client.resume()
            seen = status(router.url)["kv_events"]["replicas"][replica.url]
            assert seen["endpoint"] == f"tcp://127.0.0.1:{pub}", seen

            first = [VOCAB[(i * 7) % len(VOCAB)] for i in range(300)]  # two full blocks
            body = {"model": name, "prompt": first, "max_tokens": 1, "seed": 1}
            direct = http("POST", replica.url + "/v1/completions", body, token=TOKEN)
            assert direct.status == 200, direct.text

            def filed() -> bool:
                kv = status(router.url)["kv_events"]["replicas"][replica.url]
                return kv["blocks"] >= 2 and kv["state"] == "live"

            wait_for("the router to file the prompt's blocks", filed, 60, [router.log])
            later = {**body, "prompt": [*first, *VOCAB[:40]], "seed": 2}
            answer = http("POST", router.url + "/v1/completions", later)
            assert answer.status == 200, answer.text
            after = status(router.url)
            assert after["routing"]["kv"] == 1 and after["routing"]["fresh"] == 0, after["routing"]
            assert after["kv_events"]["replicas"][replica.url]["orphans"] == 0
        finally:
            router.stop()
    finally:
        replica.stop()
