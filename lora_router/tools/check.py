"""`lora-router --check`: a preflight of the replicas, run before a training run starts.

It asks every replica, with the router's token and TLS settings, the questions whose wrong
answer would otherwise surface an hour into a run as a fatal TRL error, and prints them as one
table plus a numbered list of problems, each with the fix. Exit status 0 only when the fleet is
ready. What is probed (why TRL 1.16 needs each: docs/trl-guide.md, steps 2 and 4; why each
probe reads as it does: docs/design/check.md):

| question | probe | a "no" |
| --- | --- | --- |
| reachable, engine alive | `GET /health` | no connection; 503 (engine dead) |
| token accepted | `GET /v1/models` (vLLM's `--api-key` guards `/v1/*` only) | 401 / 403 |
| base model, leftover adapters | `GET /v1/models` | entries after the base card |
| one server behind the URL | `GET /v1/models` again | the two listings disagree |
| one URL per server | the host's addresses (resolved) | two URLs reach one address (a note) |
| LoRA, rank, slots, block, DP | `GET /server_info?config_format=json` | no `lora_config`; DP > 1 |
| dev mode | `GET /is_paused` (read-only; `/pause` itself would pause) | 404 |
| runtime loading | `POST /v1/load_lora_adapter` with `{}` | 404 `{"detail":"Not Found"}` |

The load probe never loads anything: `lora_name` and `lora_path` are required fields, so a
server that has the route answers the empty body with its 400 validation error.

Then the fleet as a whole: replicas must agree on base model, `max_lora_rank`, `max_loras` and
block size; `max_loras` must be at least `--max-staleness + 2` (TRL raises otherwise);
`data_parallel_size` must be 1. Two URLs whose hosts resolve to one address (fleet/aliases.py's
rule, as the router warns of it) are very likely one server listed twice: a note, not a
failure, as a proxy there may route by host name to different servers. A URL whose `/health`
or `/v1/models` the router would take for no vLLM server (fleet/failure.py: a 404 on either,
or a `/v1/models` that is no model list) is that one problem, in the router's words ("give the
server's root URL" when the URL has a path), not several missing routes.

Leftover adapters (listed after the base card) are judged by name, by fleet/leftovers.py: fatal only
when the trainer may load the same name again (`--lineage-pattern`), and fine once
`--unload-stale` matches them; its advice names the glob, built from the leftovers found.

Probing is I/O (`probe_replica`), over the router's own replica client and its parser of
`/v1/models` and `/server_info` (fleet/client.py), so `--check` reads a replica exactly as the
router will; the facts every replica must agree on are the client's `AGREEMENT`, and the fixes
are the ones the router's own reports give (fleet/failure.py). Judging is a pure function of
what was seen (`judge`), so each rule is testable without sockets. This module must never
change a replica's state: no load, no unload, no pause.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import lora_router.fleet.leftovers as leftovers
from lora_router.config import Config, ReplicaAddress
from lora_router.fleet.aliases import ALIAS_FIX, aliases, resolve
from lora_router.fleet.client import (
    AGREE_FIX,
    AGREEMENT,
    Answer,
    Facts,
    ReplicaClient,
    disagreement,
    parse_models,
    parse_server_info,
)
from lora_router.fleet.discovery import read_sources
from lora_router.fleet.failure import FIX, Cause
from lora_router.fleet.readiness import SyncFacts, loras_needed, sync_problems
from lora_router.tools.table import render_table
from lora_router.tools.terminal import shown

PROBE_TIMEOUT = 10.0  # seconds for one probe's whole answer


class ProbeFailed(Exception):
    """A probe that ends the replica's check; `fix` in the router's words (fleet/failure.py)."""

    def __init__(self, reason: str, fix: str) -> None:
        super().__init__(reason)
        self.fix = fix


class Unauthorized(ProbeFailed):
    """The replica rejected the token."""


class Unreachable(ProbeFailed):
    """No HTTP answer (the replica client's reason)."""


@dataclass(slots=True)
class ReplicaFacts:
    """What one replica told us. `None` means "could not tell" (an earlier probe failed).
    An `answer` of "wrong path": no vLLM server under the URL's path (`detail` says why)."""

    name: str
    answer: str = "ok"  # ok | unreachable | unauthorized | dead | wrong path | not vllm
    detail: str = ""  # why, when `answer` is not ok
    fix: str = ""  # its fix, when unreachable or unauthorized
    version: str | None = None
    base_model: str | None = None
    max_model_len: int | None = None
    lora: bool | None = None  # lora_config present
    max_lora_rank: int | None = None
    max_loras: int | None = None
    block_size: int | None = None
    data_parallel_size: int | None = None
    dev_mode: bool | None = None
    runtime_loading: bool | None = None
    paused: bool | None = None
    adapters: list[str] = field(default_factory=list)
    relisted: list[str] | None = None  # the adapters of a second listing, when it differed
    addresses: frozenset[str] = frozenset()  # what its host resolved to (fleet/aliases.py)
    oddities: list[str] = field(default_factory=list)  # answers the contract does not predict


@dataclass(frozen=True, slots=True)
class Problem:
    """One finding. `replica` None: about the fleet. Notes are shown but do not fail the check."""

    replica: str | None
    what: str
    fix: str = ""
    note: bool = False


# --- probing --------------------------------------------------------------------------------


async def probe_fleet(
    config: Config, addresses: Sequence[ReplicaAddress] | None = None
) -> list[ReplicaFacts]:
    """Probe every replica at once (`addresses`, else `--replicas`), with the router's token
    and TLS context."""
    targets = config.replicas if addresses is None else addresses
    async with ReplicaClient(config) as client:
        return list(await asyncio.gather(*(probe_replica(client, r) for r in targets)))


async def find_fleet(config: Config) -> tuple[list[ReplicaAddress], list[Problem]]:
    """The replicas the router would serve: `--replicas` and every discovery source read
    once as the router reads it (fleet/discovery.py), with a problem for each source that
    fails, a note for each entry skipped, and one for a fleet with no replica at all."""
    found, errors, skipped = await read_sources(config)
    addresses = list({a.name: a for a in (*config.replicas, *found)}.values())
    problems = [
        Problem(None, error, "fix the source, or name the replicas with --replicas")
        for error in errors
    ]
    problems += [Problem(None, f"skipped {entry}", note=True) for entry in skipped[:5]]
    if not addresses:
        problems.append(
            Problem(
                None,
                "no replica to check: --replicas names none and discovery found none",
                "give --replicas URL,... or a discovery source that names at least one",
            )
        )
    return addresses, problems


async def probe_replica(client: ReplicaClient, address: ReplicaAddress) -> ReplicaFacts:
    facts = ReplicaFacts(name=address.name, addresses=await resolve(address, PROBE_TIMEOUT))
    try:
        health = await _ask(client, address, "GET", "/health")
        answer = await _ask(client, address, "GET", "/v1/models")
        for path, reply in (("/health", health), ("/v1/models", answer)):
            # Not vLLM, or not its root, by the router's own rule: no further question.
            failure = reply.failure(path)
            if failure.cause in (Cause.PATH, Cause.NOT_VLLM):
                facts.answer = "wrong path" if failure.cause is Cause.PATH else "not vllm"
                facts.detail = failure.what
                return facts
        if health.status == 503:
            facts.answer, facts.detail = "dead", "/health answers 503: the engine is dead"
        elif health.status != 200:
            facts.oddities.append(f"/health answered {health.status}")
        listed = parse_models(answer.parsed()) if answer.status == 200 else None
        if listed is None:
            facts.oddities.append(f"/v1/models answered {answer.status}")
        else:  # a 200 with a model list: `failure` named any other as not vLLM
            _read_models(facts, listed)
            answer = await _ask(client, address, "GET", "/v1/models")
            again = parse_models(answer.parsed()) if answer.status == 200 else None
            if again is not None and sorted(again.adapters) != sorted(facts.adapters):
                facts.relisted = list(again.adapters)
        answer = await _ask(client, address, "GET", "/server_info", query="config_format=json")
        if answer.status == 200:
            info = parse_server_info(answer.parsed())
            if info is None:
                facts.oddities.append("/server_info has no vllm_config (not the JSON form?)")
            else:
                _read_server_info(facts, info)
        elif answer.status == 404:
            facts.dev_mode = False
        else:
            facts.oddities.append(f"/server_info answered {answer.status}")
        answer = await _ask(client, address, "GET", "/is_paused")
        if answer.status == 200:
            facts.dev_mode = True
            body = answer.parsed()
            paused = body.get("is_paused") if isinstance(body, dict) else None
            facts.paused = paused if isinstance(paused, bool) else None
        elif answer.status == 404:
            facts.dev_mode = False
        answer = await _ask(client, address, "POST", "/v1/load_lora_adapter", body=b"{}")
        if answer.status == 404 and _is_missing_route(answer.parsed()):
            facts.runtime_loading = False
        elif answer.status in (400, 422):
            facts.runtime_loading = True
        else:
            facts.oddities.append(f"an empty load request answered {answer.status}, not 400")
        answer = await _ask(client, address, "GET", "/version")
        body = answer.parsed() if answer.status == 200 else None
        if isinstance(body, dict) and isinstance(body.get("version"), str):
            facts.version = body["version"]
    except ProbeFailed as exc:
        facts.answer = "unauthorized" if isinstance(exc, Unauthorized) else "unreachable"
        facts.detail, facts.fix = str(exc), exc.fix
    return facts


async def _ask(
    client: ReplicaClient,
    address: ReplicaAddress,
    method: str,
    path: str,
    *,
    query: str = "",
    body: bytes | None = None,
) -> Answer[ReplicaAddress]:
    answer = await client.call(address, method, path, query=query, body=body, timeout=PROBE_TIMEOUT)
    if answer.status == 0 or 300 <= answer.status < 400:  # a redirect is never followed
        raise Unreachable(answer.error, answer.failure(path).fix)
    if answer.status in (401, 403):
        failure = answer.failure(path)
        raise Unauthorized(failure.what, failure.fix)
    return answer


def _is_missing_route(body: Any) -> bool:
    """FastAPI's answer for a route that was never registered: `{"detail": "Not Found"}`."""
    return isinstance(body, dict) and body.get("detail") == "Not Found"


def _read_models(facts: ReplicaFacts, listed: Facts) -> None:
    facts.base_model = listed.base_model
    facts.max_model_len = listed.max_model_len
    facts.adapters = list(listed.adapters)


def _read_server_info(facts: ReplicaFacts, info: Facts) -> None:
    facts.dev_mode = True
    facts.lora = info.lora
    facts.max_lora_rank = info.max_lora_rank
    facts.max_loras = info.max_loras
    facts.block_size = info.block_size
    facts.data_parallel_size = info.data_parallel_size
    if facts.base_model is None:
        facts.base_model = info.config_model


# --- judging --------------------------------------------------------------------------------


def judge(
    fleet: Sequence[ReplicaFacts],
    *,
    max_staleness: int,
    unload_stale: str | None = None,
    lineage_pattern: str | None = None,
) -> list[Problem]:
    """Every problem that would break (or notably slow) a TRL run on this fleet.
    `lineage_pattern`: how the trainer names its versions (None: TRL's, routing/keys.py)."""
    stale = leftovers.Leftovers.of([f.adapters for f in fleet], unload_stale, lineage_pattern)
    problems: list[Problem] = []
    for f in fleet:
        problems += _judge_replica(f, max_staleness=max_staleness, stale=stale)
    live = [f for f in fleet if f.answer in ("ok", "dead")]
    for attr, label in AGREEMENT:
        problems += _disagreement(live, attr, label)
    problems += _disagreement(live, "max_model_len", "max_model_len", note=True)
    problems += _disagreement(live, "version", "vLLM version", note=True)
    located = {f.name: (ReplicaAddress.parse(f.name), f.addresses) for f in fleet}
    problems += [Problem(None, what, ALIAS_FIX, note=True) for what in aliases(located)]
    return problems


def _root_url(name: str) -> str:
    """The URL of a replica without its path: scheme, host and port."""
    address = ReplicaAddress.parse(name)
    return address.name.removesuffix(address.path_prefix)


def _judge_replica(
    f: ReplicaFacts, *, max_staleness: int, stale: leftovers.Leftovers
) -> list[Problem]:
    if f.answer == "wrong path":
        return [
            Problem(
                f.name,
                f"{f.detail} (a replica URL is the server's root, not the OpenAI base URL "
                "ending in /v1)",
                f"give the server's root URL: {_root_url(f.name)}",
            )
        ]
    need = loras_needed(max_staleness)
    out: list[Problem] = []
    name = f.name
    if f.answer == "not vllm":
        return [Problem(name, f.detail, FIX[Cause.NOT_VLLM])]
    if f.answer == "unreachable":
        return [Problem(name, f"unreachable: {f.detail}", f.fix)]
    if f.answer == "unauthorized":
        return [Problem(name, f"unauthorized: {f.detail}", f.fix)]
    if f.answer == "dead":
        out.append(Problem(name, f.detail, FIX[Cause.DEAD]))
    seen = SyncFacts(lora=f.lora, dev_mode=f.dev_mode, runtime_loading=f.runtime_loading)
    out += [Problem(name, p.what, p.fix) for p in sync_problems(seen, need)]
    if f.max_loras is not None and f.max_loras < need:
        out.append(
            Problem(
                name,
                f"max_loras is {f.max_loras}, below max_staleness + 2 = {need} "
                "(TRL refuses to start)",
                f"start it with --max-loras {need}, or train with max_staleness "
                f"{max(f.max_loras - 2, 0)} (--max-staleness {max(f.max_loras - 2, 0)})",
            )
        )
    if f.data_parallel_size is not None and f.data_parallel_size > 1:
        out.append(
            Problem(
                name,
                f"data_parallel_size is {f.data_parallel_size}: TRL falls back to "
                "merged-weight sync with DP > 1 (a runtime load reaches one engine only), "
                "which lora-router refuses",
                "run one vLLM server per GPU group (--data-parallel-size 1) and list each "
                "in --replicas",
            )
        )
    out += [Problem(name, *found) for found in stale.judge(f.adapters)]
    if f.relisted is not None:
        first = ", ".join(f.adapters) or "no adapter"
        second = ", ".join(f.relisted) or "no adapter"
        out.append(
            Problem(
                name,
                f"two reads of /v1/models disagree ({first}; then {second}): the URL is not one "
                "vLLM server (a load balancer?), so adapter loads would not show in its listing",
                "give each vLLM server its own --replicas URL",
            )
        )
    if f.paused:
        out.append(
            Problem(
                name,
                "the replica is paused (an earlier run stopped between /pause and /resume); "
                "TRL's first sync resumes it",
                note=True,
            )
        )
    out += [
        Problem(name, f"unexpected answer: {odd}", "see the replica's log", note=True)
        for odd in f.oddities
    ]
    return out


def _disagreement(
    fleet: Sequence[ReplicaFacts], attr: str, label: str, note: bool = False
) -> list[Problem]:
    what = disagreement(label, {f.name: getattr(f, attr) for f in fleet})
    return [] if what is None else [Problem(None, what, "" if note else AGREE_FIX, note=note)]


# --- reporting ------------------------------------------------------------------------------


def _flag(value: int | None, bad: bool) -> str | int | None:
    """A number, marked with `!` when it is one of the problems listed under the table."""
    return f"{value}!" if bad and value is not None else value


def _yes_no(value: bool | None) -> str:
    return "-" if value is None else ("yes" if value else "NO")


def report(fleet: Sequence[ReplicaFacts], problems: Sequence[Problem], max_staleness: int) -> str:
    """The text `--check` prints: the table, the problems with their fixes, the verdict."""
    need = loras_needed(max_staleness)
    headers = (
        "replica",
        "status",
        "base model",
        "vLLM",
        "rank",
        "loras",
        "block",
        "DP",
        "load API",
        "dev mode",
        "adapters",
    )
    stale = [p.replica for p in problems if not p.note and "leftover" in p.what]
    rows = [
        (
            f.name,
            "up" if f.answer == "ok" else f.answer.upper(),
            f.base_model,
            f.version,
            "off" if f.lora is False else f.max_lora_rank,
            _flag(f.max_loras, f.max_loras is not None and f.max_loras < need),
            f.block_size,
            _flag(f.data_parallel_size, (f.data_parallel_size or 1) > 1),
            _yes_no(f.runtime_loading),
            _yes_no(f.dev_mode),
            _flag(len(f.adapters), f.name in stale) if f.answer in ("ok", "dead") else None,
        )
        for f in fleet
    ]
    lines = [
        f"lora-router --check: {len(fleet)} replica(s); --max-staleness {max_staleness} "
        f"needs max_loras >= {need}",
        "",
        render_table(headers, rows),
        "",
    ]
    errors = [p for p in problems if not p.note]
    notes = [p for p in problems if p.note]
    if errors:
        lines.append("Problems (NO, UPPER CASE and ! in the table):")
    # A problem names replicas, adapters and models, and quotes their answers: `shown`.
    for n, p in enumerate(errors, 1):
        lines.append(f"  {n}. {shown(p.replica or 'fleet')}: {shown(p.what)}")
        if p.fix:
            lines.append(f"     fix: {shown(p.fix)}")
    for p in notes:
        lines.append(f"  note: {shown(p.replica or 'fleet')}: {shown(p.what)}")
        if p.fix:
            lines.append(f"     fix: {shown(p.fix)}")
    if errors or notes:
        lines.append("")
    if errors:
        lines.append(f"NOT READY: {len(errors)} problem(s) would break a training run.")
    else:
        f0 = fleet[0] if fleet else None
        summary = (
            f" ({shown(str(f0.base_model))}, max_lora_rank {f0.max_lora_rank}, "
            f"max_loras {f0.max_loras}, block size {f0.block_size})"
            if f0 is not None
            else ""
        )
        lines.append(f"READY: {len(fleet)} replica(s) agree{summary}.")
    # The summary reads the first replica: with no error, every replica agrees with it.
    return "\n".join(lines)


async def check(config: Config) -> tuple[list[ReplicaFacts], list[Problem]]:
    """Probe the fleet of `config` and judge it."""
    addresses, found = await find_fleet(config)
    fleet = await probe_fleet(config, addresses)
    problems = judge(
        fleet,
        max_staleness=config.max_staleness,
        unload_stale=config.unload_stale,
        lineage_pattern=config.lineage_pattern,
    )
    return fleet, found + problems


def run_check(config: Config, out: TextIO | None = None) -> int:
    """The `--check` command: print the report, return the exit status (0: ready)."""
    fleet, problems = asyncio.run(check(config))
    print(report(fleet, problems, config.max_staleness), file=out or sys.stdout)
    return 1 if any(not p.note for p in problems) else 0
