"""A rejected token is named by its case (fleet/failure.py): the variable whose value the
replica rejected, or that no token was sent at all, each with its own fix; a `--token-env`
argument that looks like the token itself gets a hint, never an echo (config.py)."""

from __future__ import annotations

import logging

import aiohttp
import pytest
from emulated_fleet import StartEmulators, StartRouter
from helpers import call, until

from lora_router.cli import UsageError, build_config, build_parser
from lora_router.config import Secret
from lora_router.fleet.failure import Cause, classify

GUARD = "s3cret-guard"


@pytest.mark.parametrize(
    ("settings", "what", "fix"),
    [
        (
            {"token_env": "HF_TOKEN", "token": Secret("wrong")},
            "HTTP 401 on /v1/models: the token in HF_TOKEN was rejected",
            "fix: export in HF_TOKEN the one token every replica accepts",
        ),
        (
            {},
            "HTTP 401 on /v1/models: the replica needs a token and none was sent (--no-token)",
            "fix: give --token-env NAME holding its token",
        ),
    ],
)
async def test_a_rejected_token_is_named_by_its_case(
    emulators: StartEmulators,
    router: StartRouter,
    client: aiohttp.ClientSession,
    settings: dict[str, object],
    what: str,
    fix: str,
) -> None:
    (emu,) = await emulators(1, api_key=GUARD)
    rt = await router([emu], **settings)
    status, body, _ = await call(client, "GET", rt.url + "/router/status")
    assert status == 200
    assert f"{what}; {fix}".encode() in body
    assert b"wrong" not in body  # the value is never shown


def test_a_token_pasted_in_place_of_its_variable_gets_the_hint_without_an_echo() -> None:
    pasted = "hf_AbCdEfGhIjKlMnOpQrStUvWxYz0123456789"
    args = build_parser().parse_args(["--replicas", "http://127.0.0.1:9", "--token-env", pasted])
    with pytest.raises(UsageError) as caught:
        build_config(args, {})
    assert "did you pass the secret itself?" in str(caught.value)
    assert pasted not in str(caught.value)


def test_an_unknown_source_keeps_the_general_words() -> None:
    failure = classify("http://r:8000", "/v1/models", 403)
    assert failure.cause is Cause.TOKEN
    assert failure.what == "HTTP 403 on /v1/models: the token was rejected"


async def test_a_replica_kept_out_for_one_reason_is_logged_once_not_every_check(
    emulators: StartEmulators, router: StartRouter, caplog: pytest.LogCaptureFixture
) -> None:
    (emu,) = await emulators(1, api_key=GUARD)  # /health passes, every replay meets a 401
    with caplog.at_level(logging.WARNING, logger="lora_router"):
        rt = await router([emu], health_interval=0.02, health_successes=1)
        try:
            await until(lambda: rt.health is not None and rt.health.readmission_failures >= 10)
        finally:
            await rt.stop()
    lines = [r.getMessage() for r in caplog.records if "stays out of service" in r.getMessage()]
    assert len(lines) == 1, lines
    assert "none was sent" in lines[0]
