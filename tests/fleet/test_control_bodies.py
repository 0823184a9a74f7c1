"""The control routes that decode their body whole (adapter loads and unloads, aborts,
`/finish_session`, `POST /router/replicas`) read at most `CONTROL_BODY_BYTES` of it, a 413 in
vLLM's shape beyond, which no replica sees (proxy/body.py's `control_body`); before, a 60 MB
body of `{}`s cost 1.9 GB on any of them but the abort. A replica id of any length is looked
up, an unknown one a 404 (before, 4,301 digits were a 500). Over real sockets, to emulated
replicas.
"""

from __future__ import annotations

import aiohttp
import orjson
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import call

from lora_router.proxy.body import CONTROL_BODY_BYTES

CONTROL = (
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/abort_requests",
    "/finish_session",
    "/router/replicas",
)


@pytest.mark.parametrize("path", CONTROL)
async def test_a_control_body_over_its_cap_is_a_413_no_replica_sees(
    path: str, emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(2)
    rt = await router(emus)
    over = b'{"x": [%s]}' % b",".join([b"{}"] * (CONTROL_BODY_BYTES // 3))
    status, data, _ = await call(client, "POST", rt.url + path, data=over)
    assert status == 413, data
    assert orjson.loads(data) == {
        "error": {
            "message": f"Request body over {CONTROL_BODY_BYTES} bytes.",
            "type": "RequestEntityTooLarge",
            "param": None,
            "code": 413,
        }
    }
    assert not [r for e in emus for r in e.requests if r.path == path]
    # At the cap, the body is read and judged: what it lacks is named.
    at = b'{"x": "%s"}' % (b"a" * (CONTROL_BODY_BYTES - 9))
    assert len(at) == CONTROL_BODY_BYTES
    status, data, _ = await call(client, "POST", rt.url + path + "?session_id=s", data=at)
    assert status in (200, 400), data


@pytest.mark.parametrize("digits", [1, 21, 4300, 4301, 5000])
async def test_an_unknown_replica_id_of_any_length_is_a_404(
    digits: int, emulators: StartEmulators, router: StartRouter, client: aiohttp.ClientSession
) -> None:
    emus = await emulators(1)
    rt = await router(emus)
    status, data, _ = await call(client, "DELETE", f"{rt.url}/router/replicas/{'9' * digits}")
    assert status == 404, data
    assert orjson.loads(data)["error"]["message"].startswith("No replica with id '9")
    assert rt.fleet is not None and len(rt.fleet.replicas) == 1
