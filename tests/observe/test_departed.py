"""What the router counts per replica leaves with the replica (observe/metrics.py
`RequestStats.forget`): a member removed for good has its request and cached-token rows folded
into one `departed` label, so members that come and go grow `/metrics` by nothing and every
total stays as it was. A router in front of emulated replicas over loopback, one of them added
and removed through `/router/replicas` again and again."""

from __future__ import annotations

import aiohttp
import orjson
from emulated_fleet import StartEmulators, StartRouter
from helpers import call, complete, router_status, samples


async def test_a_removed_replicas_counts_fold_into_departed(
    emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    home, visitor = await emulators(2)
    rt = await router([home], replica_hosts=("127.0.0.1",))
    sent = 0
    for visit in range(4):
        code, body, _ = await call(
            client, "POST", rt.url + "/router/replicas", {"url": visitor.url}
        )
        assert code == 200, body
        rid = orjson.loads(body)["id"]
        answers = [(await complete(client, rt.url, prompt=[visit, i] * 20))[0] for i in range(8)]
        assert answers == [200] * 8
        sent += 8
        assert (await call(client, "DELETE", rt.url + f"/router/replicas/{rid}"))[0] == 200
    visited = sum(r.path == "/v1/completions" for r in visitor.requests)
    assert 0 < visited < sent  # the new families were dealt to both

    page = samples((await call(client, "GET", rt.url + "/metrics"))[1].decode())
    routed = {
        dict(labels)["replica"]: value
        for (name, labels), value in page.items()
        if name == "lora_router_requests_total"
        and dict(labels)["route"] == "/v1/completions"
        and dict(labels)["status"] == "200"
    }
    # One series for the member left and one for the four that came and went, not five.
    assert routed == {"0": sent - visited, "departed": visited}
    status = await router_status(client, rt.url)
    assert status["requests"]["/v1/completions 200"] == sent
    accuracy = status["routing_accuracy"]
    assert list(accuracy["replicas"]) == ["0", "departed"]  # ids first, departed last
    assert accuracy["replicas"]["departed"]["answers"] == visited
