"""`--policy kv` against a real vLLM 0.32 CPU replica started with `--kv-events-config`: the
router finds the publisher through `/kv_event_sources`, decodes its batches, files the blocks a
prompt stored under the router's own keys (vLLM's hashes and seed are never reproduced), and
routes that prompt's next turn, a new family to the router, as a `kv` decision; a routed prompt's
computed blocks are announced in time for the silence check. When the replica
is killed and started again, what the router filed for it is dropped, and routing by its events
resumes once the new process publishes in sequence."""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lora_router.testbed.trl_client import LORA_NAME, vllm_client
from lora_router.testbed.vllm_harness import (
    REPLICA_START_S,
    TOKEN,
    Replica,
    Router,
    free_port,
    http,
    start_replicas,
    start_router,
    wait_for,
)

BLOCK = 128  # vLLM's CPU build
VOCAB = range(3, 480)


def status(router_url: str) -> dict[str, Any]:
    answer = http("GET", router_url + "/router/status")
    assert answer.status == 200, answer.text
    return answer.json()


def publisher(pub: int, replay: int) -> tuple[str, ...]:
    """The flags that make a replica publish its KV events on these two ports."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{pub}",
        "replay_endpoint": f"tcp://*:{replay}",
        "topic": "kv",
    }
    return ("--kv-events-config", json.dumps(events))


def pub_port(replica: Replica) -> int:
    """The port a replica started with `publisher` publishes on."""
    endpoint: str = json.loads(replica.extra[1])["endpoint"]
    return int(endpoint.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def replica(model: Path, logs: Path) -> Iterator[Replica]:
    """One replica publishing its KV events, on two ports chosen just before it starts and kept
    for the module (a restart publishes there again). vLLM binds them itself, so a port another
    process took in between (CI saw it once) is chosen again: at most three starts."""
    log = logs / "replica-kv-events.log"
    for attempt in range(3):
        replica = Replica(model=model / "model", log=log, extra=publisher(free_port(), free_port()))
        start = replica.log_size()
        try:
            start_replicas([replica])
            break
        except AssertionError:
            replica.stop()
            taken = b"Address already in use" in log.read_bytes()[start:]
            if attempt == 2 or not taken:
                raise
    try:
        yield replica
    finally:
        replica.stop()


def kv(router: Router, replica: Replica) -> dict[str, Any]:
    seen: dict[str, Any] = status(router.url)["kv_events"]["replicas"][replica.url]
    return seen


def kv_router(replica: Replica, log: Path, adapter: tuple[str, str], *flags: str) -> Router:
    """`lora-router --policy kv` in front of the replica, `adapter` (name, path) loaded through
    it as TRL loads one."""
    router = start_router([replica], log, "--health-interval", "0.5", "--policy", "kv", *flags)
    client = vllm_client(router.url)
    client.pause()
    client.load_lora_adapter(*adapter)
    client.resume()
    return router


def filed(router: Router, replica: Replica, blocks: int) -> Callable[[], bool]:
    """Whether the router's index holds at least `blocks` of the replica's, its stream live."""

    def check() -> bool:
        seen = kv(router, replica)
        return bool(seen["blocks"] >= blocks and seen["state"] == "live")

    return check


def test_real_kv_events_route_a_new_family_to_its_prefix(
    replica: Replica, logs: Path, publish: Callable[..., str]
) -> None:
    sources = replica.get("/kv_event_sources").json()
    pub = pub_port(replica)
    assert sources["0"]["endpoint"] == f"tcp://*:{pub}" and sources["0"]["topic"] == "kv"
    name = f"{LORA_NAME}-v1"
    router = kv_router(replica, logs / "router-kv-events.log", (name, publish(name, 0)))
    try:
        assert kv(router, replica)["endpoint"] == f"tcp://127.0.0.1:{pub}"

        # ZMQ's subscriber joins a moment after it connects, and the events published before
        # are not sent again (a prompt computed once is a cache hit after): on a loaded
        # machine the first prompt's events were lost once. A replica that did not answer the
        # router's start in time is keyed by the default block size until it is readmitted.
        # A new prompt each try, until one's two blocks are filed.
        for attempt in range(6):
            first = [VOCAB[(i * 7 + attempt) % len(VOCAB)] for i in range(300)]  # two blocks
            body = {"model": name, "prompt": first, "max_tokens": 1, "seed": 1}
            direct = http("POST", replica.url + "/v1/completions", body, token=TOKEN)
            assert direct.status == 200, direct.text
            try:
                wait_for("the prompt's blocks filed", filed(router, replica, 2), 10, [router.log])
                break
            except AssertionError as exc:
                if attempt == 5:
                    raise AssertionError(f"{exc}\nits KV events: {kv(router, replica)}") from None
        # The replicas' block size, read from their /server_info (at start, or when a replica
        # that did not answer then is readmitted: fleet/replay.py).
        assert status(router.url)["block_size"] == BLOCK
        later = {**body, "prompt": [*first, *VOCAB[:40]], "seed": 2}
        answer = http("POST", router.url + "/v1/completions", later)
        assert answer.status == 200, answer.text
        after = status(router.url)
        assert after["routing"]["kv"] == 1 and after["routing"]["fresh"] == 0, after["routing"]
        assert kv(router, replica)["orphans"] == 0

        # A routed prompt that computes two blocks: its batch comes, and the silence check,
        # run until it could have judged the stream, finds nothing owed.
        batches = kv(router, replica)["batches"]
        fresh = {**body, "prompt": [VOCAB[(i * 11) % len(VOCAB)] for i in range(300)]}
        answer = http("POST", router.url + "/v1/completions", fresh)
        assert answer.status == 200, answer.text
        assert answer.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_for("its batch", lambda: kv(router, replica)["batches"] > batches, 30, [router.log])
        events = status(router.url)["kv_events"]
        enough = events["silence_checks"] + round(events["silence_s"] / 0.5) + 2
        wait_for(
            "the silence check run past its limit",
            lambda: status(router.url)["kv_events"]["silence_checks"] >= enough,
            30,
            [router.log],
        )
        seen = kv(router, replica)
        assert seen["state"] == "live" and seen["silences"] == 0, seen
    finally:
        router.stop()


def test_a_restarted_replica_is_routed_by_its_events_again_only_once_they_resume(
    replica: Replica, logs: Path, publish: Callable[..., str]
) -> None:
    """SIGKILL and start again on the same ports: the router stops looking the replica up when
    its publisher goes; the new process's first batch tells it the stream started again (a
    gap or a restart: the old process's blocks dropped), the next one in sequence brings it
    back to `live`, and a new family's next turn is routed by what the new process holds, an
    old one's not."""
    name = f"{LORA_NAME}-v2"
    log = logs / "router-kv-events-restart.log"
    router = kv_router(replica, log, (name, publish(name, 1)), "--health-failures", "1")
    try:
        rng = random.Random()
        before = rng.choices(VOCAB, k=300)
        body = {"model": name, "prompt": before, "max_tokens": 1, "seed": 1}
        # Sent past the router: only the replica's events can tell it where these blocks are.
        assert http("POST", replica.url + "/v1/completions", body, token=TOKEN).status == 200
        wait_for("the prompt's blocks filed", filed(router, replica, 2), 60, [router.log])

        replica.kill()
        replica.start()
        replica.wait_healthy(REPLICA_START_S)

        # Its publisher went away with it: not looked up (`stale`) until the new one publishes.
        assert kv(router, replica)["state"] == "stale", kv(router, replica)
        wait_for(
            "the restarted replica replayed and serving",
            lambda: [r["state"] for r in router.replicas()] == ["serving"],
            120,
            [router.log],
        )
        # Two new families past the router: the new process's first batches, the second in
        # sequence, which ends the fault.
        after = [rng.choices(VOCAB, k=300) for _ in range(2)]
        for k, prompt in enumerate(after):
            again = {**body, "prompt": prompt, "seed": 10 + k}
            answer = http("POST", replica.url + "/v1/completions", again, token=TOKEN)
            assert answer.status == 200, answer.text
        wait_for("the stream live again", filed(router, replica, 4), 60, [router.log])
        seen = kv(router, replica)
        assert seen["gaps"] + seen["restarts"] >= 1, seen
        routing = status(router.url)["routing"]
        later = {**body, "prompt": [*after[1], *VOCAB[:40]], "seed": 20}
        assert http("POST", router.url + "/v1/completions", later).status == 200
        # The old process's blocks are not looked up: that prompt's next turn is fresh.
        old = {**body, "prompt": [*before, *VOCAB[:40]], "seed": 21}
        assert http("POST", router.url + "/v1/completions", old).status == 200
        now = status(router.url)["routing"]
        assert now["kv"] == routing["kv"] + 1, (routing, now)
        assert now["fresh"] == routing["fresh"] + 1, (routing, now)
    finally:
        router.stop()
