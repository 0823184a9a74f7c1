"""Predicted against reported cached tokens (`routing_accuracy`), over real sockets: the router's
prediction for each answer beside what the emulated replicas report in `usage`, in
`/router/status`, `/metrics` and the log line."""

from __future__ import annotations

from typing import Any

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import Adapter, call, completed, load, router_status, samples, unload

from lora_router.observe import metrics
from lora_router.observe.accuracy import MIN_ANSWERS
from lora_router.observe.status import summary_line

G = 4  # samples of each prompt, sent as separate identical requests as TRL sends them


async def status(client: aiohttp.ClientSession, url: str) -> Any:
    return (await router_status(client, url))["routing_accuracy"]


async def rollouts(
    client: aiohttp.ClientSession, url: str, model: str, prompts: int, turns: int = 2
) -> int:
    """`prompts` families of G samples over `turns` turns, each later turn the previous prompt,
    the first sample's completion ids and 8 new tokens; the cached tokens the replicas
    reported, added up."""
    reported = 0
    for p in range(prompts):
        prompt = [1000 * p + t for t in range(64)]
        for _ in range(turns):
            for _ in range(G):
                body = await completed(
                    client, url, model, prompt=prompt, max_tokens=4, return_token_ids=True
                )
                reported += body["usage"]["prompt_tokens_details"]["cached_tokens"]
            prompt = prompt + body["choices"][0]["token_ids"] + [7] * 8
    return reported


async def test_predictions_meet_the_reports_on_siblings_and_later_turns(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession, adapter: Adapter
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    assert (await load(client, rt.url, "trl-policy-v1", adapter("trl-policy-v1")))[0] == 200
    reported = await rollouts(client, rt.url, "trl-policy-v1", prompts=6)
    got = await status(client, rt.url)
    answers = 6 * 2 * G
    # The first sample of each family predicts and finds nothing; its siblings find the prompt
    # but its last block (48 of 64); a later turn finds the earlier prompt's 4 blocks.
    assert reported == 6 * ((G - 1) * 48 + G * 64)
    assert got["answers"] == answers and got["unreported"] == 0
    assert got["reported_cached_tokens"] == reported
    assert got["predicted_cached_tokens"] == reported and got["ratio"] == 1.0
    assert not got["overpredicting"]
    assert got["lineages"]["trl-policy"]["answers"] == answers
    by_replica = got["replicas"]
    assert sum(r["answers"] for r in by_replica.values()) == answers
    assert sum(r["reported_cached_tokens"] for r in by_replica.values()) == reported

    _, body, _ = await call(client, "GET", rt.url + "/metrics")
    metrics = samples(body.decode())
    for name, want in (
        ("lora_router_cache_reports_total", answers),
        ("lora_router_predicted_cached_tokens_total", reported),
        ("lora_router_reported_cached_tokens_total", reported),
    ):
        values = [
            v
            for (n, labels), v in metrics.items()
            if n == name and ("lineage", "trl-policy") in labels
        ]
        assert sum(values) == want, name
    assert metrics[("lora_router_overpredicting", ())] == 0


async def test_a_stream_with_usage_is_counted_and_one_without_is_not(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(1)
    rt = await router(emus)
    body = {"prompt": list(range(64)), "max_tokens": 4, "stream": True}
    for options in ({"include_usage": True}, {"include_usage": True}, None):
        fields = {**body, "stream_options": options} if options else body
        code, data, _ = await call(client, "POST", rt.url + "/v1/completions", fields)
        assert code == 200 and data.endswith(b"data: [DONE]\n\n")
    got = await status(client, rt.url)
    assert got["answers"] == 2 and got["unreported"] == 1
    assert got["predicted_cached_tokens"] == got["reported_cached_tokens"] == 48


async def test_replicas_without_prompt_token_details_leave_answers_unreported(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2, prompt_tokens_details=False)
    rt = await router(emus)
    for _ in range(3):
        body = await completed(client, rt.url, prompt=list(range(64)))
        assert body["usage"]["prompt_tokens_details"] is None
    await completed(client, rt.url, prompt="a text prompt is not counted")
    got = await status(client, rt.url)
    assert got["answers"] == 0 and got["unreported"] == 3 and got["ratio"] is None


async def test_a_cache_emptied_behind_the_routers_back_is_flagged(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    """Siblings routed to a replica whose prefix cache is reset before each of them: every
    prediction is 48 tokens, every report 0, and once there are enough answers the fleet is
    flagged, in the status, the metrics and the log line."""
    emus = await emulators(1)
    rt = await router(emus)
    prompt = list(range(64))
    await completed(client, rt.url, prompt=prompt)
    for _ in range(MIN_ANSWERS):
        assert (await call(client, "POST", emus[0].url + "/reset_prefix_cache"))[0] == 200
        body = await completed(client, rt.url, prompt=prompt)
        assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    got = await status(client, rt.url)
    assert got["predicted_cached_tokens"] == 48 * MIN_ANSWERS
    assert got["reported_cached_tokens"] == 0 and got["overpredicting"]
    _, metrics, _ = await call(client, "GET", rt.url + "/metrics")
    assert samples(metrics.decode())[("lora_router_overpredicting", ())] == 1
    assert "routing predicts far more cached tokens than the replicas report" in summary_line(
        rt.app.state
    )


async def test_a_034_usage_without_details_is_read_as_unreported_and_one_with_them_counted(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    """vLLM 0.34 leaves `prompt_tokens_details` out when it has nothing to report (0.32 sends
    `null`): read the same; with the details on, a 0.34 report is counted like any other."""
    bare = await emulators(1, vllm_version="0.34", prompt_tokens_details=False)
    rt = await router(bare)
    for _ in range(2):
        body = await completed(client, rt.url, prompt=list(range(64)))
        assert "prompt_tokens_details" not in body["usage"]
    got = await status(client, rt.url)
    assert got["answers"] == 0 and got["unreported"] == 2
    detailed = await emulators(1, vllm_version="0.34")
    rt = await router(detailed)
    reported = await rollouts(client, rt.url, detailed[0].config.model, prompts=1)
    got = await status(client, rt.url)
    assert got["answers"] == 2 * G and got["reported_cached_tokens"] == reported > 0


async def test_ever_new_lineages_are_counted_within_a_cap(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    adapter: Adapter,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Adapters of ever new names, each loaded, asked once and unloaded: each name is a lineage
    # of its own, and the figures kept per lineage (and their /metrics series) must not grow
    # with every one.
    monkeypatch.setattr(metrics, "MAX_LINEAGES", 3)
    (emu,) = await emulators(1)
    rt = await router([emu])
    for i in range(6):
        name = f"team{i}"
        assert (await load(client, rt.url, name, adapter(name)))[0] == 200
        await completed(client, rt.url, name, prompt=list(range(64)), max_tokens=1)
        assert (await unload(client, rt.url, name))[0] == 200
    got = await status(client, rt.url)
    assert got["answers"] == 6
    assert len(got["lineages"]) == 3 + 1  # three kept apart, the rest together
    assert set(got["lineages"]) == {"team0", "team1", "team2", metrics.OTHER_LINEAGE}
    assert got["lineages"][metrics.OTHER_LINEAGE]["answers"] == 3
    _, page, _ = await call(client, "GET", rt.url + "/metrics")
    series = samples(page.decode())
    lineages = {
        dict(labels)["lineage"]
        for name, labels in series
        if name == "lora_router_cache_reports_total"
    }
    assert len(lineages) == 4
