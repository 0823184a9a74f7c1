"""Suite-wide settings and fixtures.

- The Hypothesis profile (tests/hypothesis_profiles.py: `dev` by default, `ci` with
  HYPOTHESIS_PROFILE=ci or CI set), applied to every collected property test. Every test stays
  bounded by pytest-timeout; no example has a time limit.
- Every async test runs on uvloop, the router's own loop.
- `client`, an HTTP client session, and `adapter`, adapter directories as TRL lays them out:
  the fixtures every folder uses; tests/emulated_fleet.py adds emulated replicas and `router`,
  the one way a test starts a router in-process (the shared helpers are tests/helpers.py).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import uvloop
from helpers import Adapter
from hypothesis import settings
from hypothesis_profiles import PROFILE, scaled

from lora_router.emulator import write_adapter

settings.load_profile(PROFILE)

pytest_plugins = ["emulated_fleet"]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Hypothesis reads a test's settings from this attribute when it runs the test (its own
    # decorators set it the same way); tests that are not property tests have none.
    for item in items:
        test = getattr(getattr(item, "obj", None), "__func__", getattr(item, "obj", None))
        given = getattr(test, "_hypothesis_internal_use_settings", None)
        if isinstance(given, settings):
            test._hypothesis_internal_use_settings = scaled(given)  # type: ignore[union-attr]


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def adapter(tmp_path: Path) -> Adapter:
    """Write an adapter directory as TRL lays it out (`rank` its LoRA rank); its absolute path."""

    def write(name: str = "trl-policy-v1", rank: int = 1) -> str:
        return str(write_adapter(tmp_path / ".vllm_lora" / name, rank=rank))

    return write


def pytest_asyncio_loop_factories(config: Any, item: Any) -> dict[str, Callable[[], Any]]:
    return {"uvloop": uvloop.new_event_loop}
