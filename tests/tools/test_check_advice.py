"""Every piece of advice `lora-router --check` gives, followed as printed.

Each scenario starts emulated replicas from the emulator's own command-line flags with one
problem, runs `python -m lora_router --check` as a process, reads the advice from its output,
follows each alternative of it on a fresh copy of the scenario (restart a replica with the
`vllm serve` flag or variable it names, run the router with the `--unload-stale` it printed,
use the URL it printed, ...), runs `--check` again and requires the problem gone, with no new
one. The advice is parsed, never assumed, so advice that does not work fails here; advice this
module does not know how to follow fails too, so that new advice gets a test.

Not followed here: data_parallel_size > 1 and a load balancer behind one URL, which the
emulator's flags cannot show, and a TLS failure (test_check.py gives the --ca-file it advises).
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import aiohttp
import pytest
from helpers import free_port

from lora_router.emulator import Emulator, start_emulator, write_adapter
from lora_router.emulator.cli import build_parser, config_from_args

pytestmark = pytest.mark.timeout(120)

PROCESS_TIMEOUT = 30.0  # seconds for one `--check`, or for a router to start
TOKEN = "right-t0ken"  # the API key of the replicas started with --api-key

# What an emulator flag stands for, as `vllm serve` is told it: advice to start a replica with
# the left-hand side is followed by starting the emulator without the right-hand flag.
WITHOUT = {
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1": "--no-runtime-lora-updating",
    "VLLM_SERVER_DEV_MODE=1": "--no-dev-mode",
    "--enable-lora": "--no-lora",
}
PLACEHOLDER_RANK = "16"  # what the test picks for "--max-lora-rank R"


@dataclass(frozen=True)
class Advice:
    """One problem (or note) of a report, with its fix."""

    replica: str
    what: str
    fix: str
    fatal: bool


def advice_of(text: str) -> list[Advice]:
    """The problems and notes `--check` printed, each with the `fix:` line under it."""
    lines = text.splitlines()
    found = []
    for line, below in zip(lines, [*lines[1:], ""], strict=True):
        m = re.fullmatch(r"  (\d+\.|note:) (\S+): (.*)", line)
        if m:
            fix = below.strip().removeprefix("fix: ") if below.startswith("     fix: ") else ""
            found.append(Advice(m.group(2), m.group(3), fix, m.group(1) != "note:"))
    return found


@dataclass
class Scenario:
    """Replicas (emulator flags each), adapters loaded on them, and the `--check` flags."""

    replicas: list[list[str]]
    adapters: list[list[str]] = field(default_factory=list)  # per replica, loaded at start
    flags: list[str] = field(default_factory=lambda: ["--no-token"])
    path: str = ""  # appended to every replica URL
    absent: bool = False  # nothing listens at the first replica's port (until advised)


@dataclass
class Fleet:
    """The scenario running: its emulators (None: not started) and how `--check` is run."""

    scenario: Scenario
    ports: list[int]
    emulators: list[Emulator | None]
    urls: list[str]
    flags: list[str]
    env: dict[str, str] = field(default_factory=dict)
    router_flags: list[str] = field(default_factory=list)  # for a router run before the check


async def emulator(flags: list[str], port: int) -> Emulator:
    args = build_parser().parse_args([*flags, "--host", "127.0.0.1", "--port", str(port)])
    return await start_emulator(config_from_args(args))


@asynccontextmanager
async def running(scenario: Scenario, ports: list[int], tmp_path: Path) -> AsyncIterator[Fleet]:
    """The scenario on `ports` (the same for each copy, so that its reports name the same
    replicas)."""
    fleet = Fleet(scenario, ports, [], [], list(scenario.flags))
    try:
        for i, flags in enumerate(scenario.replicas):
            absent = scenario.absent and i == 0
            fleet.emulators.append(None if absent else await emulator(flags, ports[i]))
        fleet.urls = [f"http://127.0.0.1:{p}{scenario.path}" for p in ports]
        async with aiohttp.ClientSession() as http:
            for emu, names in zip(fleet.emulators, scenario.adapters, strict=False):
                for name in names:
                    assert emu is not None
                    path = write_adapter(tmp_path / emu.url.rsplit(":", 1)[1] / name, rank=1)
                    body = {"lora_name": name, "lora_path": str(path)}
                    async with http.post(emu.url + "/v1/load_lora_adapter", json=body) as r:
                        assert r.status == 200, await r.text()
        yield fleet
    finally:
        for emu in fleet.emulators:
            if emu is not None:
                await emu.stop()


async def restart(fleet: Fleet, i: int, flags: list[str]) -> None:
    """Restart replica `i` on its port with `flags` (a restart forgets every adapter)."""
    old = fleet.emulators[i]
    if old is not None:
        await old.stop()
    fleet.emulators[i] = None
    fleet.emulators[i] = await emulator(flags, fleet.ports[i])
    fleet.scenario.replicas[i] = flags


async def run(*argv: str, env: dict[str, str]) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lora_router",
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **env},
    )
    try:
        async with asyncio.timeout(PROCESS_TIMEOUT):
            out, _ = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert proc.returncode is not None
    return proc.returncode, out.decode()


async def check(fleet: Fleet) -> tuple[int, str]:
    return await run("--check", "--replicas", ",".join(fleet.urls), *fleet.flags, env=fleet.env)


async def run_router(fleet: Fleet) -> None:
    """Start a router with the check's flags plus `router_flags`; stop it once it listens (it
    listens only after its start-up, --unload-stale included)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "lora_router",
        "--replicas",
        ",".join(fleet.urls),
        *fleet.flags,
        *fleet.router_flags,
        "--port",
        "0",
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **fleet.env},
    )
    assert proc.stderr is not None
    log = b""
    try:
        async with asyncio.timeout(PROCESS_TIMEOUT):
            while b"listening on" not in log:
                line = await proc.stderr.readline()
                assert line, log.decode()
                log += line
            proc.send_signal(signal.SIGTERM)
            await proc.wait()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def drop_flag(flags: list[str], flag: str) -> list[str]:
    """`flags` without `flag` and the value after it."""
    out, skip = [], False
    for arg in flags:
        if arg == flag:
            skip = True
        elif skip:
            skip = False
        else:
            out.append(arg)
    return out


def set_flag(flags: list[str], flag: str, value: str) -> list[str]:
    """`flags` with `flag` given once, as `value`."""
    return [*drop_flag(flags, flag), flag, value]


def emulator_flags(current: list[str], serve_flags: list[str]) -> list[str]:
    """Emulator flags for "start it with SERVE_FLAGS" (`vllm serve` flags and variables)."""
    flags = list(current)
    words = iter(serve_flags)
    for word in words:
        if word in WITHOUT:
            flags = [f for f in flags if f != WITHOUT[word]]
        elif word in ("--max-loras", "--max-lora-rank"):
            value = next(words)
            flags = set_flag(flags, word, PLACEHOLDER_RANK if value == "R" else value)
        else:
            raise AssertionError(f"advice the test cannot follow: start it with {word}")
    return flags


def alternatives(fix: str) -> list[str]:
    """The ways a fix offers: "A, or B" and "A; B" are two, without their explanations."""
    parts = re.split(r", or |; ", fix)
    return [re.sub(r"\s*\(.*\)$", "", p).strip() for p in parts]


async def follow(fleet: Fleet, advice: Advice, way: str) -> None:
    """Do what `way` (one alternative of `advice.fix`) says, to `fleet`."""
    i = next((n for n, u in enumerate(fleet.urls) if u == advice.replica), None)
    if m := re.fullmatch(r"train with max_staleness (\d+)", way):
        fleet.flags = set_flag(fleet.flags, "--max-staleness", m.group(1))
    elif m := re.fullmatch(r"start it with (.+)", way):
        assert i is not None, advice
        flags = emulator_flags(fleet.scenario.replicas[i], shlex.split(m.group(1)))
        await restart(fleet, i, flags)
    elif way == "restart the replica":
        assert i is not None, advice
        # A restarted engine is alive again: the emulator's --dead is that fault.
        await restart(fleet, i, [f for f in fleet.scenario.replicas[i] if f != "--dead"])
    elif way == "start every replica with the same model and LoRA flags":
        for n in range(len(fleet.urls)):
            await restart(fleet, n, list(fleet.scenario.replicas[0]))
    elif m := re.fullmatch(r"(?:to clear them, )?give --unload-stale (.+)", way):
        # The router clears them at its start; the check after it is run without the flag, so
        # that a leftover the router did not unload shows again.
        (pattern,) = shlex.split(m.group(1))
        fleet.flags = drop_flag(fleet.flags, "--unload-stale")
        fleet.router_flags = ["--unload-stale", pattern]
    elif m := re.fullmatch(
        r"give --token-env (\w+) holding its token"
        r"|export in (\w+) the one token every replica accepts",
        way,
    ):
        variable = m.group(1) or m.group(2)
        fleet.env[variable] = TOKEN
        fleet.flags = [f for f in fleet.flags if f != "--no-token"]
        fleet.flags = set_flag(fleet.flags, "--token-env", variable)
    elif m := re.fullmatch(r"give the server's root URL: (\S+)", way):
        assert i is not None, advice
        fleet.urls[i] = m.group(1)
    elif way == "check the URL and that `vllm serve` is running there":
        assert i is not None, advice
        await restart(fleet, i, list(fleet.scenario.replicas[i]))
    else:
        raise AssertionError(f"advice the test cannot follow: {way!r} ({advice})")


SCENARIOS = {
    "runtime-loading-off": Scenario([["--no-runtime-lora-updating"]]),
    "dev-mode-off": Scenario([["--no-dev-mode"]]),
    "lora-off": Scenario([["--no-lora"]]),
    "too-few-slots": Scenario([["--max-loras", "5"]]),
    "dead-engine": Scenario([["--dead"]]),
    "rejected-token": Scenario([["--api-key", TOKEN]]),
    "nothing-listening": Scenario([[]], absent=True),
    "openai-base-url": Scenario([[], []], path="/v1"),
    "rank-disagreement": Scenario([["--max-lora-rank", "16"], ["--max-lora-rank", "8"]]),
    "trainer-named-leftover": Scenario([[]], adapters=[["trl-policy-v1"]]),
    "other-leftover": Scenario([[]], adapters=[["my-adapter"]]),
    "leftovers-across-the-fleet": Scenario(
        [[], []], adapters=[["trl-policy-v1", "my-adapter"], ["trl-policy-v3", "base-sft"]]
    ),
    "leftovers-beyond-the-given-pattern": Scenario(
        [[]],
        adapters=[["trl-policy-v2", "grpo-run-v7"]],
        flags=["--no-token", "--unload-stale", "trl-*"],
    ),
}


def copy(scenario: Scenario) -> Scenario:
    return replace(
        scenario,
        replicas=[list(f) for f in scenario.replicas],
        adapters=[list(a) for a in scenario.adapters],
        flags=list(scenario.flags),
    )


@pytest.mark.parametrize("name", SCENARIOS)
async def test_each_advice_followed_clears_its_problem(name: str, tmp_path: Path) -> None:
    ports = [free_port() for _ in SCENARIOS[name].replicas]
    async with running(copy(SCENARIOS[name]), ports, tmp_path / "first") as fleet:
        status, text = await check(fleet)
    first = advice_of(text)
    given = [a for a in first if a.fix]
    assert given, text
    assert status == (1 if any(a.fatal for a in given) else 0), text
    for n, advice in enumerate(given):
        for k, way in enumerate(alternatives(advice.fix)):
            async with running(copy(SCENARIOS[name]), ports, tmp_path / f"{n}-{k}") as fleet:
                await follow(fleet, advice, way)
                if fleet.router_flags:
                    await run_router(fleet)
                again, again_text = await check(fleet)
            left = advice_of(again_text)
            what = f"followed {way!r} for {advice.what!r}:\n{text}\nthen:\n{again_text}"
            problems = {(a.replica, a.what) for a in left}
            assert (advice.replica, advice.what) not in problems, what
            # Nothing new: what is left was there before (its fix may differ: a glob is built
            # from the leftovers that remain).
            assert problems <= {(a.replica, a.what) for a in first}, what
            assert again == (1 if any(a.fatal for a in left) else 0), what
