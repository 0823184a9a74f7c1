"""Fixtures of the real-vLLM tier: the cached tiny model, two shared vLLM CPU replicas, routers.

Every test under tests/vllm/ carries the `vllm` marker, which the default `python -m pytest`
deselects (pyproject's addopts). Run the tier with its own environment:
`tests/vllm/install.sh && .venv-vllm/bin/python -m pytest tests/vllm -m vllm`.
Selected without vLLM installed, the tier fails at once: it never passes without the real
server.

The two replicas are started once per session, in parallel, and shared; after each test every
adapter is unloaded from them and they are resumed, so tests do not see each other's state.
Logs go to files under the session's temporary directory (or `$VLLM_TIER_LOGS`); a failed wait
shows their tails.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from lora_router.testbed.tiny_model import adapter_dir, model_dir
from lora_router.testbed.vllm_harness import Replica, Router, start_replicas, start_router

HERE = Path(__file__).parent
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
# Router logs are numbered once per session: a name built from an object's id() can come back
# in a later test (ids are reused), and its log then holds an earlier router's lines.
_ROUTER_LOGS = itertools.count(1)
TIER_TIMEOUT_S = 900  # per test, fixture set-up included (the first one starts the replicas)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.vllm)
            item.add_marker(pytest.mark.timeout(TIER_TIMEOUT_S))


@pytest.fixture(scope="session")
def logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    chosen = os.environ.get("VLLM_TIER_LOGS")
    if chosen:
        Path(chosen).mkdir(parents=True, exist_ok=True)
        return Path(chosen)
    return tmp_path_factory.mktemp("vllm-logs")


@pytest.fixture(scope="session")
def model() -> Path:
    """The tiny model's directory (`model/`, `adapters/adapter-N/`), built once and cached."""
    if importlib.util.find_spec("vllm") is None:
        pytest.fail(
            "the vllm tier needs vLLM: run tests/vllm/install.sh, then "
            ".venv-vllm/bin/python -m pytest tests/vllm -m vllm",
            pytrace=False,
        )
    return model_dir()


@pytest.fixture(scope="session")
def base(model: Path) -> str:
    """The base model's name as the replicas serve it: the path it was loaded from."""
    return str(model / "model")


@pytest.fixture(scope="session")
def fleet(model: Path, logs: Path) -> Iterator[list[Replica]]:
    """Two real vLLM CPU replicas with `--api-key`, started in parallel, shared by the tier."""
    replicas = [Replica(model=model / "model", log=logs / f"replica-{i}.log") for i in range(2)]
    try:
        start_replicas(replicas)
        yield replicas
    finally:
        for replica in replicas:
            replica.stop()


@pytest.fixture(autouse=True)
def _clean_fleet(request: pytest.FixtureRequest) -> Iterator[None]:
    """After a test that used the fleet: no adapter left on any replica, none paused."""
    yield
    if "fleet" not in request.fixturenames:
        return
    for replica in request.getfixturevalue("fleet"):
        if replica.died() is not None or not replica.healthy():
            continue
        replica.post("/resume")
        for name in replica.adapters():
            replica.post("/v1/unload_lora_adapter", {"lora_name": name})


@pytest.fixture
def routers(fleet: list[Replica], logs: Path) -> Iterator[Callable[..., Router]]:
    """Start `lora-router` processes in front of the fleet with extra flags; stopped after."""
    started: list[Router] = []

    def _start(*flags: str, replicas: list[Replica] | None = None) -> Router:
        log = logs / f"router-{os.getpid()}-{next(_ROUTER_LOGS)}.log"
        router = start_router(replicas or fleet, log, "--health-interval", "0.5", *flags)
        started.append(router)
        return router

    yield _start
    for router in started:
        router.stop()


@pytest.fixture
def router(routers: Callable[..., Router]) -> Router:
    """A router with default flags in front of the two shared replicas."""
    return routers()


@pytest.fixture
def publish(model: Path, tmp_path: Path) -> Callable[..., str]:
    """Publish an adapter as TRL does: written beside its final place, then renamed into
    `<output_dir>/.vllm_lora/<name>`. Returns the absolute path TRL sends as `lora_path`.

    With `rename=False` the directory is only staged, and the path returned is on a mount that
    has not caught up: under a parent nobody sees yet, the router included (it judges a missing
    path only beside a parent it sees, fleet/adapter_files.py, and leaves the rest to the
    replicas' answers); `arrive(path)` renames it into place."""
    root = tmp_path / ".vllm_lora"
    root.mkdir()

    def _publish(name: str, index: int = 0, *, rename: bool = True) -> str:
        staging = root / f".{name}.tmp"
        shutil.copytree(adapter_dir(model, index), staging)
        if rename:
            staging.rename(root / name)
            return str(root / name)
        return str(tmp_path / "mount-catching-up" / ".vllm_lora" / name)

    return _publish


@pytest.fixture
def arrive(tmp_path: Path) -> Callable[[str], None]:
    """The lagging mount of `publish(..., rename=False)` catches up: the staged directory is
    renamed to the path `publish` returned."""

    def _arrive(path: str) -> None:
        final = Path(path)
        final.parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / ".vllm_lora" / f".{final.name}.tmp").rename(final)

    return _arrive
