"""The version fence: which adapter names the fleet serves, and requests waiting for one.

THE INVARIANT this package exists for:

    A completion naming adapter A is forwarded only to a replica that has A loaded, and only
    after every live replica has acknowledged loading A.

The fence holds the first half of it: a name is *live* here only once its load broadcast
succeeded on every live replica (broadcast.py). The second half is `Fleet.routable`, which
lists only replicas whose acknowledged adapters include A; a replica coming back serves only
after every live adapter was replayed onto it (replay.py, admitted by lifecycle.py).

Each name the router knows is in one state:
- **loading**: set when the load request *arrives* (so an eager client may name the version
  right after asking for it); completions for it wait here, up to `fence_timeout`, then get
  a clear 503;
- **live**: completions pass;
- **unloading**: set when the unload request arrives: new completions get vLLM's 404 at once,
  while in-flight ones finish on their replicas.
A name in none of these states is unknown: vLLM's own 404 `model_not_found`, answered by the
router. The base model (and `model` absent) always passes.

Requests admitted under a name are counted until answered (`hold` as they pass, `release` when
the replica's response head arrives or the request ends); an unload is broadcast only once its
name's count is zero (`drain`, bounded by `--unload-wait`): no client gets a 404 for a name
that was live when its request arrived.

Every request for a name creates or joins an *entry*; outcomes are reported back on the entry
they were given, so a late outcome never overwrites a newer request's state. Loading one name
at two paths, or re-pointing a live name (`load_inplace`), is refused. A load of a live name at
its path is a **reload**: a new loading entry (`replacing`; `held`: the `files` digest of what
the fleet serves) takes the name out of service until the broadcaster settles it. Why:
docs/design/fleet.md#the-fence.

Sizes are bounded whatever a client sends: at most `MAX_NAMES` names known at once, names and
paths of at most `MAX_NAME_BYTES` bytes, and an entry keeps only what a replay needs (its
name and path; `AdapterEntry.body` is rebuilt from them), never the client's request.

Pure state and waiting: no I/O, and no HTTP. A refusal is one of the fence's own outcome types
(`UnknownAdapter`, `StillLoading`, `LoadRefused`, all `FenceRefusal`s), which proxy/answers.py
renders as vLLM's answers. It must never let a completion through for a name that is not live
(a reloaded one included), nor refuse as unknown a name still loading.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterable

import orjson

MAX_NAMES = 4096  # names known at once (live, loading, unloading); TRL keeps about six
MAX_NAME_BYTES = 4096  # an adapter name or path, in UTF-8 (Linux's PATH_MAX)


class FenceRefusal(Exception):
    """Why the fence refuses a request (rendered by the HTTP layer); `message` is what the
    client reads."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name
        self.message = message


class UnknownAdapter(FenceRefusal):
    """No such name (never loaded, unloaded, or its load failed: `failure` says why)."""

    def __init__(self, name: str, failure: str | None = None) -> None:
        # vLLM's own words; vLLM 0.33 appends the reason to this message too, so clients
        # match on its start.
        message = f"The model `{name}` does not exist."
        if failure is not None:
            message += f" Its load failed: {failure}"
        super().__init__(name, message)
        self.failure = failure


class StillLoading(FenceRefusal):
    """The name's load was still being broadcast when the fence's wait ran out."""

    def __init__(self, name: str, timeout: float) -> None:
        super().__init__(
            name,
            f"The adapter `{name}` is still being loaded on the replicas after {timeout:g} s "
            "(--fence-timeout); retry once its load has answered.",
        )


# The fix for a load of a name the fleet holds from another path: what a trainer restarted
# against a running router (a new output_dir) meets at its first load.
RESTARTED_TRAINER_FIX = (
    "If a trainer was restarted against a running router, restart the router with "
    "--unload-stale 'trl-policy-*': it unloads the earlier run's adapters from the replicas "
    "at start."
)


class LoadRefused(FenceRefusal):
    """A load the fence will not take: `in_place` (re-pointing a live name) or another path."""

    def __init__(self, name: str, message: str, *, in_place: bool) -> None:
        super().__init__(name, message)
        self.in_place = in_place


class AdapterState(enum.Enum):
    LOADING = "loading"
    LIVE = "live"
    UNLOADING = "unloading"


class AdapterEntry:
    """One name's state as set by one run of requests (see the module docstring)."""

    __slots__ = (
        "failure",
        "files",
        "held",
        "name",
        "path",
        "pending",
        "replacing",
        "settled",
        "state",
    )

    def __init__(self, name: str, state: AdapterState, path: str) -> None:
        self.name = name
        self.state = state
        self.path = path
        self.pending = 1  # control operations still to report on this entry
        self.settled = asyncio.Event()  # set when waiters should look again
        self.failure: str | None = None  # why its load failed, for the waiters' 404
        self.files: str | None = None  # digest of the files behind it (module docstring)
        self.replacing = False  # a reload: the fleet served the name when this load arrived
        self.held: str | None = None  # for a reload: the `files` of the entry it replaced

    @property
    def body(self) -> bytes:
        """The load request a replay sends (the trainer's fields; never in place)."""
        return orjson.dumps({"lora_name": self.name, "lora_path": self.path, "load_inplace": False})


class AdapterFence:
    """Adapter names and their states; the routed path's gate (`admits`, `wait`)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._entries: dict[str, AdapterEntry] = {}
        self.base_models: set[str] = set()
        # Bumped whenever the set of live names changes; readers (status, replay) compare it.
        self.version = 0
        # Requests admitted under each adapter name and not answered yet (hold / release), and
        # the unloads waiting for a name's count to reach zero.
        self._held: dict[str, int] = {}
        self._drained: dict[str, asyncio.Event] = {}
        # Plain counters for metrics and the status page.
        self.unload_waits = 0  # unloads that had to wait for admitted requests
        self.unload_wait_timeouts = 0
        self.waiting = 0
        self.waits = 0
        self.wait_seconds = 0.0
        self.wait_timeouts = 0

    # -- the routed path --------------------------------------------------------------------

    def admits(self, model: str | None) -> bool:
        """Whether a completion for `model` may be routed now, without waiting (the base model
        and live adapters); otherwise the caller awaits `wait`."""
        if model is None or model in self.base_models:
            return True
        entry = self._entries.get(model)
        return entry is not None and entry.state is AdapterState.LIVE

    async def wait(self, model: str) -> None:
        """Return once a completion for `model` may be routed; raise UnknownAdapter, or
        StillLoading after `timeout`, when it never may."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        deadline = start + self.timeout
        outcome = "unknown"
        self.waiting += 1
        try:
            # Bounded: each pass either returns, raises, or waits for a state change that
            # happens at most a few times per control operation, all before the deadline.
            while True:
                entry = self._entries.get(model)
                if entry is None or entry.state is AdapterState.UNLOADING:
                    raise UnknownAdapter(model)
                if entry.state is AdapterState.LIVE:
                    outcome = "live"
                    return
                remaining = deadline - loop.time()
                if remaining <= 0:
                    outcome = "timeout"
                    raise StillLoading(model, self.timeout)
                try:
                    await asyncio.wait_for(entry.settled.wait(), remaining)
                except TimeoutError:
                    outcome = "timeout"
                    raise StillLoading(model, self.timeout) from None
                if entry.failure is not None and self._entries.get(model) is None:
                    outcome = "failed"
                    raise UnknownAdapter(model, entry.failure)
        finally:
            self.waiting -= 1
            waited = loop.time() - start
            if outcome != "unknown":
                self.waits += 1
                self.wait_seconds += waited
                if outcome == "timeout":
                    self.wait_timeouts += 1

    def hold(self, model: str) -> None:
        """A request for adapter `model` was admitted (in the same step as `admits`/`wait`);
        counted until `release`."""
        held = self._held
        held[model] = held.get(model, 0) + 1

    def release(self, model: str) -> None:
        """The request held under `model` was answered (its head arrived) or ended."""
        left = self._held[model] - 1
        if left:
            self._held[model] = left
            return
        del self._held[model]
        drained = self._drained.pop(model, None)
        if drained is not None:
            drained.set()

    def held(self, model: str) -> int:
        return self._held.get(model, 0)

    async def drain(self, name: str, timeout: float) -> int:
        """Wait until no request admitted under `name` is unanswered, at most `timeout` s;
        returns how many still are."""
        if not self._held.get(name):
            return 0
        self.unload_waits += 1
        drained = self._drained.get(name)
        if drained is None:
            drained = self._drained[name] = asyncio.Event()
        try:
            await asyncio.wait_for(drained.wait(), timeout)
        except TimeoutError:
            self.unload_wait_timeouts += 1
        return self._held.get(name, 0)

    # -- what the control plane reports -----------------------------------------------------

    def begin_load(self, name: str, path: str, inplace: bool) -> AdapterEntry:
        """A load request arrived: from now on completions for `name` wait (instead of 404,
        or instead of passing, for a live name: a reload)."""
        for field, value in (("name", name), ("path", path)):
            if len(value.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
                raise LoadRefused(
                    name[:64],
                    f"The adapter's {field} is longer than {MAX_NAME_BYTES} bytes.",
                    in_place=False,
                )
        current = self._entries.get(name)
        if current is None and len(self._entries) >= MAX_NAMES:
            raise LoadRefused(
                name,
                f"The fleet already knows {MAX_NAMES} adapter names; unload some before "
                "loading more.",
                in_place=False,
            )
        if current is not None and current.state is not AdapterState.UNLOADING:
            if inplace:
                raise LoadRefused(
                    name,
                    f"The lora adapter '{name}' is already loaded; lora-router does not load "
                    "adapters in place: replicas would serve a mix of old and new weights "
                    "under one name while the reload is broadcast, and vLLM keys cached KV "
                    "blocks by name. Load the new weights under a new name.",
                    in_place=True,
                )
            if current.path != path:
                raise LoadRefused(
                    name,
                    f"The lora adapter '{name}' has already been loaded from "
                    f"'{current.path}', not '{path}'. Unload it first, or load the new "
                    f"weights under a new name. {RESTARTED_TRAINER_FIX}",
                    in_place=False,
                )
            if current.state is AdapterState.LOADING:
                # The same load again: it joins the entry and, in its turn, finds it live
                # (its files are then compared again) or, if the first attempt failed,
                # tries itself.
                current.pending += 1
                return current
        entry = AdapterEntry(name, AdapterState.LOADING, path)
        if current is not None and current.state is AdapterState.LIVE:
            entry.replacing, entry.held = True, current.files  # a reload (module docstring)
        self._replace(name, entry)
        return entry

    def finish_load(self, entry: AdapterEntry, ok: bool, failure: str | None = None) -> None:
        entry.pending -= 1
        current = self._entries.get(entry.name) is entry
        if ok:
            if entry.state is not AdapterState.LIVE:
                entry.state = AdapterState.LIVE
                if current:
                    self.version += 1
            entry.settled.set()
            return
        if entry.state is AdapterState.LIVE or entry.pending > 0:
            return  # an earlier load of this entry succeeded, or a later one will try
        entry.failure = failure or "its load failed"
        if current:
            del self._entries[entry.name]
        entry.settled.set()

    def begin_unload(self, name: str) -> AdapterEntry:
        """An unload request arrived: the name stops being routable now."""
        current = self._entries.get(name)
        if current is not None and current.state is AdapterState.UNLOADING:
            current.pending += 1
            return current
        entry = AdapterEntry(name, AdapterState.UNLOADING, current.path if current else "")
        self._replace(name, entry)
        return entry

    def finish_unload(self, entry: AdapterEntry) -> None:
        entry.pending -= 1
        if entry.pending == 0 and self._entries.get(entry.name) is entry:
            del self._entries[entry.name]
            entry.settled.set()

    def mark_live(self, name: str, path: str) -> None:
        """A name found on every replica at start (static `--lora-modules`)."""
        entry = AdapterEntry(name, AdapterState.LIVE, path)
        entry.pending = 0
        self._replace(name, entry)
        self.version += 1

    def _replace(self, name: str, entry: AdapterEntry) -> None:
        old = self._entries.pop(name, None)  # pop, so the new entry goes last (load order)
        self._entries[name] = entry
        if old is not None:
            if old.state is AdapterState.LIVE:
                self.version += 1
            old.settled.set()  # its waiters look again and find the new state

    # -- readers ----------------------------------------------------------------------------

    def current(self, entry: AdapterEntry) -> bool:
        """Whether `entry` is still its name's entry (no later request superseded it)."""
        return self._entries.get(entry.name) is entry

    def state(self, name: str) -> AdapterState | None:
        entry = self._entries.get(name)
        return entry.state if entry is not None else None

    def live(self) -> dict[str, AdapterEntry]:
        """Live names in load order (the order `/v1/models` lists them)."""
        return {n: e for n, e in self._entries.items() if e.state is AdapterState.LIVE}

    def loading(self) -> list[AdapterEntry]:
        """Names whose load has arrived and is not settled yet, in arrival order."""
        return [e for e in self._entries.values() if e.state is AdapterState.LOADING]

    def entries(self) -> Iterable[AdapterEntry]:
        return list(self._entries.values())
