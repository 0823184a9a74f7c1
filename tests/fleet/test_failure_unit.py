"""The classification of a replica's failure (fleet/failure.py), rule by rule: each answer
gets its cause and that cause's fix."""

from __future__ import annotations

import pytest

from lora_router.fleet.failure import FIX, Cause, classify

ROOT = "http://10.0.0.5:8000"


@pytest.mark.parametrize(
    ("url", "path", "status", "extra", "cause"),
    [
        (ROOT, "/health", 0, {"transport": Cause.REFUSED, "error": "refused"}, Cause.REFUSED),
        (ROOT, "/health", 0, {"transport": Cause.TIMEOUT, "error": "no answer"}, Cause.TIMEOUT),
        (ROOT, "/health", 0, {"transport": Cause.TLS, "error": "TLS handshake"}, Cause.TLS),
        (ROOT, "/health", 307, {"error": "HTTP 307, a redirect to x"}, Cause.PATH),
        (ROOT, "/v1/models", 401, {}, Cause.TOKEN),
        (ROOT, "/v1/models", 403, {}, Cause.TOKEN),
        (ROOT + "/v1", "/health", 404, {}, Cause.PATH),
        (ROOT + "/v1", "/v1/models", 404, {}, Cause.PATH),
        (ROOT, "/v1/models", 404, {}, Cause.NOT_VLLM),
        (ROOT, "/v1/models", 200, {"model_list": False}, Cause.NOT_VLLM),
        (ROOT, "/pause", 404, {"route_missing": True}, Cause.DEV_MODE),
        (ROOT, "/server_info", 404, {"route_missing": True}, Cause.DEV_MODE),
        (ROOT, "/v1/load_lora_adapter", 404, {"route_missing": True}, Cause.RUNTIME_LOADING),
        (ROOT, "/v1/load_lora_adapter", 404, {"message": "No adapter found"}, Cause.OTHER),
        (ROOT, "/health", 503, {}, Cause.DEAD),
        (ROOT, "/v1/models", 500, {"message": "boom"}, Cause.OTHER),
    ],
)
def test_each_answer_gets_its_cause(
    url: str, path: str, status: int, extra: dict[str, object], cause: Cause
) -> None:
    failure = classify(url, path, status, **extra)  # type: ignore[arg-type]
    assert failure.cause is cause
    if cause is not Cause.PATH or status != 307:
        assert failure.fix == FIX[cause]
    assert str(failure) == f"{failure.what}; fix: {failure.fix}"


def test_a_transport_failure_keeps_its_reason_and_an_http_one_names_the_path() -> None:
    tls = classify(ROOT, "/health", 0, transport=Cause.TLS, error="TLS certificate not trusted")
    assert tls.what == "TLS certificate not trusted"
    token = classify(ROOT, "/v1/models", 401)
    assert token.what == "HTTP 401 on /v1/models: the token was rejected"
