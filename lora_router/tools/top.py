"""`lora-router top`: a live terminal view of a running router, in the spirit of `htop`.

It reads only the router's `GET /router/status` (with `--api-key-env NAME` when the router wants
a key), so it works against any router the user can reach (`--url HOST:PORT` or a full URL),
and redraws every `--interval` seconds on a terminal; without one (a pipe, a log file) it
prints each frame as plain text instead, one after the other. `--once` prints one frame as
plain text and exits (for scripts and CI logs), with status 1 if the router cannot be read.
A frame shows:

- the router: replicas serving, paused or not, the fence's version and the adapters it lets
  through (live) or holds back (loading, unloading);
- one row per replica: state, requests in flight from the router, running / waiting, KV use,
  prefix-cache hit rate (last interval / since the replica started), generated tokens per
  second, busy share (from the replica's own `/metrics`, fleet/telemetry.py; "unknown" and why
  when it does not report), cached tokens reported over predicted (`rep/pred`), adapters held;
- under the table, each replica out of service with why it is out and the fix (its
  `last_error`, named by fleet/failure.py);
- each discovery source (fleet/discovery.py): its members by replica id, when it was last read
  and, when its last read failed, why (its last good set is kept);
- the fleet's totals, its cache reports against the predictions (`routing_accuracy`, flagged
  when overpredicting) and the recent weight syncs (pause → resume) with their durations;
- a one-line verdict, with the numbers it was judged on.

The verdict. Let *paused* be the share of the last window (`syncs.paused_share_window`, 300 s)
the fleet spent paused for weight syncs, and *busy* the mean over the reporting replicas of the
share of unpaused scrapes in which a replica was running or queueing any request
(`telemetry.busy_share`). A stall is named before any share is judged, so that a stopped
fleet never reads as an idle one:

1. no replica in service: **down**, with the first one's cause and fix (`last_error`);
2. a load waits for a replica's mount: **syncing**, with the replica, the adapter and how long
   (it ends at `--load-deadline`, or when the client that asked leaves); a broadcast has waited
   long for a replica's answer (`waiting_for`, which lists only those: a hung replica whose
   health checks pass), or broadcasts queue behind a replay's final pass, which holds the
   broadcast lock (`replay_holding_lock`): **syncing**, with the replica and how long;
3. the fleet is paused (`/pause` broadcast, no `/resume` since) while requests are in flight or
   wait at the fence: **paused**, with their count and the way out (`POST /resume`);
4. a serving replica has computed nothing, no prompt token and no generated one, over
   `STILL_SCRAPES` scrapes while the router held requests on it (its `still_s`, 40 s at the
   default `--health-interval`): **stalled**, with the replica and the fix (its `/health`
   answers: an engine that hangs, which the router ejects at `--stall-timeout`, health.py);
5. no replica in service can take part in a weight sync: **misconfigured**, with the first
   problem and its fix (fleet/readiness.py);
6. the replicas disagree on a fact they must share (base model, LoRA limits, block size):
   **misconfigured**, with the first disagreement and its fix (`Fleet.disagreements`);
7. members reach the same address (very likely one server listed under two names, which
   takes twice its share and every load twice): **misconfigured**, with the first such group
   and its fix (`Fleet.aliases`, fleet/aliases.py).

Then, on the shares:

1. no replica reports: **unknown**;
2. paused ≥ 25 %: **trainer-bound** — generation stands still a quarter of the time while the
   trainer saves and loads weights;
3. busy = 0 (not one unpaused sample with a request): **idle** — no run is going on;
4. busy ≥ 90 %: **inference-bound** — the replicas never run dry, the trainer waits for
   rollouts (more replicas, or shorter completions, would speed the run);
5. busy < 50 %: **trainer-bound** — the replicas idle half the unpaused time, waiting for the
   trainer to ask for more;
6. otherwise **balanced**.

It never writes to the router; it shows each string read `terminal.shown`, as `Text`, not markup.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

import orjson
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from lora_router.command import HelpFormatter, Parser, interrupted
from lora_router.config import secret_from_env
from lora_router.tools.terminal import shown, shown_json

PAUSED_TRAINER_BOUND = 0.25
# Scrapes without a token computed while holding requests that make a replica stalled: long
# enough for a long prompt's prefill (vLLM counts its tokens when it ends) on a busy replica.
STILL_SCRAPES = 20
BUSY_INFERENCE_BOUND = 0.90
BUSY_TRAINER_BOUND = 0.50
_ONCE_WIDTH = 160  # plain-text frames are not cut to an 80-column guess


class StatusError(Exception):
    """The router's status could not be read; the message is the one line the user sees."""


def fetch(url: str, api_key: str = "", timeout: float = 5.0) -> dict[str, Any]:
    """`GET {url}/router/status`, decoded, every string in it `shown`."""
    request = urllib.request.Request(url.rstrip("/") + "/router/status")
    if api_key:
        request.add_header("Authorization", f"Bearer {api_key}")
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            data = response.read()
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            raise StatusError(
                f"{url} wants an API key: pass --api-key-env NAME (the variable holding it)"
            ) from None
        raise StatusError(f"{url}/router/status answered HTTP {exc.code}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise StatusError(f"cannot reach {url}: {reason}") from None
    try:
        doc = orjson.loads(data)
    except orjson.JSONDecodeError:
        raise StatusError(f"{url}/router/status is not JSON: is it a lora-router?") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("replicas"), list):
        raise StatusError(f"{url}/router/status is not a lora-router status")
    return shown_json(doc)


def stall(status: dict[str, Any]) -> str | None:
    """The stall the fleet is in (the module docstring's first list), or None."""
    replicas = status.get("replicas") or []
    serving = [r for r in replicas if _state(r) == "serving"]
    if replicas and not serving:
        first = replicas[0]
        why = first.get("last_error") or _state(first)
        return f"down: no replica is in service; replica {first.get('id')}: {why}"
    waits = (status.get("broadcasts") or {}).get("mount_waits") or []
    if waits:
        w = max(waits, key=lambda w: float(w.get("seconds") or 0.0))
        return (
            f"syncing: load {w.get('adapter')!r} waits for replica {w.get('replica')}, which has "
            f"answered 'No adapter found' for {float(w.get('seconds') or 0.0):.0f} s (it ends at "
            "--load-deadline, or when the client that asked disconnects)"
        )
    slow = _slow_broadcast(status.get("broadcasts") or {})
    if slow is not None:
        return slow
    fence_waiting = int((status.get("fence") or {}).get("waiting") or 0)
    in_flight = sum(int(r.get("in_flight") or 0) for r in replicas)
    if status.get("paused") is not None and (in_flight or fence_waiting):
        return (
            f"paused: the fleet is paused ({status['paused'] or 'pause'}) with {in_flight} "
            f"request(s) in flight and {fence_waiting} waiting at the fence; a trainer that "
            "stopped between /pause and /resume? POST /resume to the router resumes it"
        )
    for r in serving:
        report = r.get("reported") or {}
        still, interval = float(report.get("still_s") or 0.0), float(report.get("interval_s") or 0)
        if interval > 0 and still >= STILL_SCRAPES * interval:
            return (
                f"stalled: replica {r.get('id')} has computed no token for {still:.0f} s with "
                f"{r.get('in_flight')} request(s) in flight, though its /health answers (an "
                "engine that hangs?); the router ejects it once it has been still for "
                "--stall-timeout and retries its waiting requests on the others: restart it"
            )
    problems = [r.get("sync_problems") or [] for r in serving]
    if serving and all(problems):
        return (
            "misconfigured: no replica in service can take part in a weight sync; replica "
            f"{serving[0].get('id')}: {problems[0][0]}"
        )
    disagreements = status.get("disagreements") or []
    if disagreements:
        return f"misconfigured: {disagreements[0]}"
    aliases = status.get("aliases") or []
    if aliases:
        return f"misconfigured: {aliases[0]}"
    return None


def _slow_broadcast(broadcasts: dict[str, Any]) -> str | None:
    """The second stall's other cases: a broadcast waits for a replica, or behind a replay."""
    slow = broadcasts.get("waiting_for") or []
    if slow:
        w = max(slow, key=_seconds)
        return (
            f"syncing: {w.get('call')} waits for replica {w.get('replica')}, which has not "
            f"answered for {_seconds(w):.0f} s (it ends at --control-timeout, or when its health "
            "checks eject it)"
        )
    held = broadcasts.get("replay_holding_lock")
    pending = int(broadcasts.get("pending") or 0)
    if held and pending:
        return (
            f"syncing: {pending} broadcast(s) wait for the replay of replica "
            f"{held.get('replica')}, whose final pass has held the broadcast lock for "
            f"{_seconds(held):.0f} s (a replay that hangs fails and backs off)"
        )
    return None


def _seconds(doc: dict[str, Any]) -> float:
    return float(doc.get("seconds") or 0.0)


def verdict(status: dict[str, Any]) -> str:
    """The one-line verdict of the module docstring, with the numbers it was judged on."""
    stopped = stall(status)
    if stopped is not None:
        return stopped
    fleet = status.get("fleet") or {}
    syncs = status.get("syncs") or {}
    if not fleet.get("reporting"):
        return "unknown: no replica reports its /metrics"
    paused = float(syncs.get("paused_share_window") or 0.0)
    busy = fleet.get("busy_share")
    window = float(syncs.get("window_s") or 0.0)
    numbers = (
        f"busy {_pct(busy)} of unpaused time, paused for syncs {_pct(paused)} of the last "
        f"{window:g} s, {fleet.get('waiting', 0)} waiting, {fleet.get('running', 0)} running"
    )
    if paused >= PAUSED_TRAINER_BOUND:
        return f"trainer-bound: {numbers} (paused >= 25%: generation waits on weight syncs)"
    if busy is None:
        return f"unknown: no unpaused sample yet; {numbers}"
    if busy == 0:
        return f"idle: {numbers} (the replicas had nothing to do)"
    if busy >= BUSY_INFERENCE_BOUND:
        return f"inference-bound: {numbers} (busy >= 90%: the replicas never run dry)"
    if busy < BUSY_TRAINER_BOUND:
        return f"trainer-bound: {numbers} (busy < 50%: the replicas wait for the trainer)"
    return f"balanced: {numbers}"


def frame(status: dict[str, Any], url: str) -> RenderableType:
    """One screen of `top` from one status document."""
    replicas = status.get("replicas") or []
    serving = sum(1 for r in replicas if _state(r) == "serving")
    fence = status.get("fence") or {}
    paused = status.get("paused")
    head = Text(
        f"lora-router {shown(url)}  {serving}/{len(replicas)} replicas serving  "
        f"paused: {'yes (' + paused + ')' if paused is not None else 'no'}  "
        f"fence v{fence.get('version', '?')} ({fence.get('waiting', 0)} waiting, "
        f"{fence.get('waits', 0)} waits, {fence.get('wait_timeouts', 0)} timeouts)",
        style="bold",
    )
    adapters = status.get("adapters") or {}
    by_state: dict[str, list[str]] = {}
    for name, entry in adapters.items():
        by_state.setdefault(str(entry.get("state")), []).append(name)
    versions = Text(
        f"live: {compact(by_state.get('live', []))}"
        + "".join(
            f"   {state}: {compact(names)}"
            for state, names in sorted(by_state.items())
            if state != "live"
        )
    )
    return Group(
        head,
        versions,
        _replica_table(replicas, status.get("routing_accuracy")),
        *_out_of_service(replicas),
        *_sources(status.get("discovery") or [], replicas),
        Text(_fleet_line(status.get("fleet") or {}, replicas)),
        Text(_accuracy_line(status.get("routing_accuracy") or {})),
        Text(_syncs_line(status.get("syncs") or {})),
        Text("verdict: " + verdict(status), style="bold"),
    )


def _replica_table(
    replicas: Sequence[dict[str, Any]], accuracy: dict[str, Any] | None = None
) -> Table:
    table = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name, justify in (
        ("id", "right"),
        ("state", "left"),
        ("in flight", "right"),
        ("run/wait", "right"),
        ("KV", "right"),
        ("hit last/all", "right"),
        ("tok/s", "right"),
        ("busy", "right"),
        ("rep/pred", "right"),
        ("adapters held", "left"),
    ):
        table.add_column(name, justify=justify)  # type: ignore[arg-type]
    by_replica = (accuracy or {}).get("replicas") or {}
    for r in replicas:
        rep = r.get("reported") or {}
        ratio = _pct((by_replica.get(str(r.get("id"))) or {}).get("ratio"))
        held = compact(r.get("adapters") or [])
        state = _state(r)
        cells = [str(r.get("id")), state, str(r.get("in_flight", 0))]
        if rep.get("status") == "ok":
            cells += [
                f"{rep.get('running')}/{rep.get('waiting')}",
                _pct(rep.get("kv_cache_usage")),
                f"{_pct(rep.get('prefix_cache_hit_rate'))} / "
                f"{_pct(rep.get('prefix_cache_hit_rate_total'))}",
                _num(rep.get("generation_tokens_per_s")),
                _pct(rep.get("busy_share")),
                ratio,
                held,
            ]
        else:
            why = rep.get("reason") or "not scraped"
            cells += ["unknown", "", "", "", "", ratio, f"{held}  (figures unknown: {why})"]
        table.add_row(*(Text(cell) for cell in cells))  # never parsed as markup
    return table


def _out_of_service(replicas: Sequence[dict[str, Any]]) -> list[Text]:
    """Why each replica out of service is out, and the fix, as the router names it
    (fleet/failure.py): one line each under the table, too long for a cell."""
    return [
        Text(f"replica {r.get('id')} {_state(r)}: {r['last_error']}", style="red")
        for r in replicas
        if r.get("last_error") and _state(r) != "serving"
    ]


def _sources(sources: Sequence[dict[str, Any]], replicas: Sequence[dict[str, Any]]) -> list[Text]:
    """One line per discovery source: its members (by replica id), its last good read, and
    the error its last read met, if any."""
    lines = []
    for s in sources:
        ids = [str(r.get("id")) for r in replicas if r.get("origin") == s.get("source")]
        read = s.get("last_ok")
        age = f"read {max(0.0, time.time() - read):.0f} s ago" if read else "never read"
        n = s.get("members")
        text = f"source {s.get('source')}: {n} member{'' if n == 1 else 's'}"
        text += f" (replicas {', '.join(ids)})" if ids else ""
        text += f", {age}"
        skipped = s.get("skipped_count", len(s.get("skipped") or []))
        if skipped:
            text += f", entries skipped: {skipped}"
        if s.get("error"):
            lines.append(Text(f"{text}; last read failed: {s['error']}", style="red"))
        else:
            lines.append(Text(text))
    return lines


def compact(names: Sequence[str]) -> str:
    """Adapter names in little space: TRL's versions share a prefix, so
    `trl-policy-v7, trl-policy-v8, trl-policy-v9` reads `trl-policy-v{7,8,9}`."""
    if not names:
        return "-"
    if len(names) == 1:
        return names[0]
    prefix = os.path.commonprefix(list(names))  # noqa: RUF071 (characters, not paths)
    if len(prefix) < 3:
        return ", ".join(sorted(names))
    rest = sorted((n[len(prefix) :] for n in names), key=lambda n: (len(n), n))  # 9 before 10
    return prefix + "{" + ",".join(rest) + "}"


def _state(r: dict[str, Any]) -> str:
    state = r.get("state")
    if isinstance(state, str) and state != "serving":
        return state  # its lifecycle state (fleet/lifecycle.py)
    if state is None:  # a router from before the lifecycle: its three flags
        if r.get("draining"):
            return "draining"
        if not r.get("healthy"):
            return "ejected"
        if not r.get("admitted"):
            return "joining"
    if r.get("breaker") not in (None, "closed"):
        return f"breaker {r.get('breaker')}"
    return "serving"


def _fleet_line(fleet: dict[str, Any], replicas: Sequence[dict[str, Any]]) -> str:
    if not fleet.get("reporting"):
        return f"fleet: 0/{fleet.get('replicas', 0)} replicas report their /metrics"
    ages = [
        float(r["reported"]["age_s"])
        for r in replicas
        if isinstance(r.get("reported"), dict) and "age_s" in r["reported"]
    ]
    age = f" (replica figures up to {max(ages):.1f} s old)" if ages else ""
    return (
        f"fleet: {fleet['reporting']}/{fleet.get('replicas')} reporting, "
        f"{fleet.get('running', 0)} running, {fleet.get('waiting', 0)} waiting, "
        f"prefix-cache hit {_pct(fleet.get('prefix_cache_hit_rate'))} "
        f"({_pct(fleet.get('prefix_cache_hit_rate_total'))} since start), "
        f"{_num(fleet.get('generation_tokens_per_s'))} tok/s{age}"
    )


def _accuracy_line(accuracy: dict[str, Any]) -> str:
    """Cached tokens the routing predicted against those the replicas reported."""
    if not accuracy.get("answers"):
        unreported = accuracy.get("unreported", 0)
        return f"cache reports: none ({unreported} answers without one)"
    flag = "  [OVERPREDICTING]" if accuracy.get("overpredicting") else ""
    return (
        f"cache reports: {accuracy['answers']} answers, reported "
        f"{_num(accuracy.get('reported_cached_tokens'))} of "
        f"{_num(accuracy.get('predicted_cached_tokens'))} predicted cached tokens "
        f"({_pct(accuracy.get('ratio'))}), {accuracy.get('unreported', 0)} unreported{flag}"
    )


def _syncs_line(syncs: dict[str, Any]) -> str:
    recent = syncs.get("recent") or []
    shown = ", ".join(
        f"{s.get('seconds', 0):.2f} s ({s.get('ended_s_ago', 0):.0f} s ago)" for s in recent[:5]
    )
    now = "  [paused now]" if syncs.get("paused_now") else ""
    return (
        f"syncs: {syncs.get('count', 0)}, paused {_pct(syncs.get('paused_share_window'))} of the "
        f"last {float(syncs.get('window_s') or 0):g} s ({_pct(syncs.get('paused_share'))} since "
        f"start); recent: {shown or '-'}{now}"
    )


def _pct(value: object) -> str:
    return f"{float(value):.0%}" if isinstance(value, int | float) else "-"


def _num(value: object) -> str:
    return f"{float(value):,.0f}" if isinstance(value, int | float) else "-"


def router_url(text: str) -> str:
    """`--url`: a full URL (`http://host:8000`) or `HOST:PORT` (`127.0.0.1:8000`, http), with
    no trailing slash; anything else is a usage error naming the forms."""
    url = text if "://" in text else "http://" + text
    parts = urllib.parse.urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a router address: give HOST:PORT (127.0.0.1:8000) or a URL "
            "(http://127.0.0.1:8000)"
        )
    return url.rstrip("/")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="lora-router top",
        description="A live view of a running lora-router, read from its /router/status.\n"
        "Without a terminal (a pipe, a log file) each frame is printed as plain text.",
        formatter_class=HelpFormatter,
    )
    p.add_argument(
        "--url",
        type=router_url,
        default="http://127.0.0.1:8000",
        help="the router: HOST:PORT or its base URL",
    )
    p.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="environment variable holding the router's API key (default: none, no key sent)",
    )
    p.add_argument("--interval", type=float, default=2.0, help="seconds between frames")
    p.add_argument("--once", action="store_true", help="print one frame as plain text and exit")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`lora-router top`; Ctrl-C ends it with one line and status 130."""
    args = build_parser().parse_args(argv)
    api_key = ""
    if args.api_key_env:
        try:
            api_key = secret_from_env("--api-key-env", args.api_key_env, os.environ).reveal()
        except ValueError as exc:  # never echoes a key pasted in place of the name
            print(f"lora-router top: error: {exc}", file=sys.stderr)
            return 2
    try:
        if args.once:
            try:
                status = fetch(args.url, api_key)
            except StatusError as exc:
                print(f"lora-router top: {shown(str(exc))}", file=sys.stderr)
                return 1
            _plain().print(frame(status, args.url))
            return 0
        interval = max(0.2, args.interval)
        if not sys.stdout.isatty():
            return _frames(args.url, api_key, interval)
        return _live(args.url, api_key, interval)
    except KeyboardInterrupt:
        return interrupted("lora-router top")


def _plain() -> Console:
    """A console for frames as plain text: no colour, and on a pipe as wide as `_ONCE_WIDTH`."""
    return Console(
        width=None if sys.stdout.isatty() else _ONCE_WIDTH, color_system=None, highlight=False
    )


def _current(url: str, api_key: str, interval: float) -> RenderableType:
    """The frame to show now: the router's status, or why it cannot be read."""
    try:
        return frame(fetch(url, api_key, timeout=max(1.0, interval)), url)
    except StatusError as exc:
        return Text(
            f"lora-router top: {shown(str(exc))} (retrying every {interval:g} s)", style="red"
        )


def _live(url: str, api_key: str, interval: float) -> int:
    """On a terminal: one frame, redrawn in place every `interval` seconds."""
    with Live(_current(url, api_key, interval), auto_refresh=False, screen=False) as live:
        while True:
            time.sleep(interval)
            live.update(_current(url, api_key, interval), refresh=True)


def _frames(url: str, api_key: str, interval: float) -> int:
    """Without a terminal: every `interval` seconds a new frame as plain text, a blank line
    between two frames (a redraw in place would never reach a pipe)."""
    console = _plain()
    while True:
        console.print(_current(url, api_key, interval))
        console.file.flush()
        time.sleep(interval)
        console.print()
