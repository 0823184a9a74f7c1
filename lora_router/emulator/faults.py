"""The failure switches of an emulated replica, flipped by tests, CLI flags or `/emulator/faults`.

Each switch reproduces a failure the router meets in production (see the contract, §2):
mount lag on a network bucket, failed or slow adapter loads, 5xx answers, a request that never
answers, a connection cut mid-stream, a dead engine, a listing that does not show the loads (a
load balancer over several servers). `Faults` only holds the switches and makes
the random draws; the server decides where each one bites. It must never do I/O itself.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field, fields
from typing import Any


@dataclass(slots=True)
class Faults:
    """Mutable fault switches; all off by default."""

    # Adapter loads
    mount_lag: int = 0  # the first K load attempts of each path answer 404 "No adapter found"
    load_failures: int = 0  # the next N loads answer 500 (-1: every load)
    load_delay_s: float = 0.0  # every load takes this long before answering
    # Completions
    error_rate: float = 0.0  # share of completions answered with `error_status` (0..1)
    error_status: int = 500
    error_seed: int | None = None  # a seed makes the sequence of failing requests reproducible
    stall: bool = False  # completions wait until stall is set False again
    crash_after_frames: int | None = None  # cut the connection after N SSE frames (0: at once)
    # Listing: every Nth `/v1/models` answer lists no adapter (1: none ever does; 2: every other
    # one, as a load balancer over two servers of which only one took the loads), and a load of
    # a name it holds is accepted again (it reached the other server)
    hide_adapters: int = 0
    # Engine
    dead: bool = False  # /health and /ping answer 503, completions 500
    # Requests whose path starts with this get no answer while it is set, as from a process
    # stopped (SIGSTOP) in the middle of a sync; "/" hangs every route. None: off.
    hang: str | None = None

    _load_attempts: dict[str, int] = field(default_factory=dict, repr=False)
    _listings: int = field(default=0, repr=False)
    _rng: random.Random = field(default_factory=random.Random, repr=False)
    _rng_seed: int | None = field(default=None, repr=False)
    _stall_released: asyncio.Event | None = field(default=None, repr=False)
    _stalled: int = field(default=0, repr=False)
    _hang_released: asyncio.Event | None = field(default=None, repr=False)

    def __setattr__(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)
        if name == "hang" and value is None:
            released = getattr(self, "_hang_released", None)
            if released is not None:
                released.set()
        if name == "stall" and not value:
            # Turning the stall off by plain assignment (as tests do) must wake the waiters.
            released = getattr(self, "_stall_released", None)
            if released is not None:
                released.set()

    # --- adapter loads ---------------------------------------------------------------------

    def mount_lagging(self, path: str) -> bool:
        """Count a load attempt of `path`; True while it is still within the first K."""
        attempt = self._load_attempts.get(path, 0) + 1
        self._load_attempts[path] = attempt
        return attempt <= self.mount_lag

    def load_fails(self) -> bool:
        """Consume one injected load failure, if any is pending."""
        if self.load_failures == 0:
            return False
        if self.load_failures > 0:
            self.load_failures -= 1
        return True

    # --- listing ---------------------------------------------------------------------------

    def listing_hides_adapters(self) -> bool:
        """Count a `/v1/models` answer; True when this one is to list no adapter."""
        if self.hide_adapters <= 0:
            return False
        self._listings += 1
        return self._listings % self.hide_adapters == 0

    # --- completions -----------------------------------------------------------------------

    def completion_fails(self) -> bool:
        """Draw whether this completion gets an injected 5xx."""
        if self.error_rate <= 0.0:
            return False
        if self.error_seed != self._rng_seed:
            # Re-seeding when the seed changes keeps a seeded run reproducible even when the
            # seed is set after construction (tests flip attributes directly).
            self._rng.seed(self.error_seed)
            self._rng_seed = self.error_seed
        return self._rng.random() < self.error_rate

    async def wait_stall(self) -> None:
        """Block while `stall` is on; returns at once otherwise."""
        while self.stall:
            if self._stall_released is None or self._stall_released.is_set():
                self._stall_released = asyncio.Event()
            self._stalled += 1
            try:
                await self._stall_released.wait()
            finally:
                self._stalled -= 1

    async def wait_hang(self, path: str) -> None:
        """Block while `hang` covers `path`; returns at once otherwise."""
        while self.hang is not None and path.startswith(self.hang):
            if self._hang_released is None or self._hang_released.is_set():
                self._hang_released = asyncio.Event()
            await self._hang_released.wait()

    @property
    def stalled(self) -> int:
        """Completions currently held by the stall."""
        return self._stalled

    # --- runtime control -------------------------------------------------------------------

    def update(self, changes: dict[str, Any]) -> None:
        """Apply a JSON object of switches (the admin endpoint's body); unknown keys raise."""
        public = {f.name: f for f in fields(self) if not f.name.startswith("_")}
        for key in changes:
            if key not in public:
                raise ValueError(f"unknown fault {key!r}; known: {', '.join(sorted(public))}")
        for key, value in changes.items():
            _check_type(key, value, public[key].type)
        for key, value in changes.items():
            setattr(self, key, value)

    def snapshot(self) -> dict[str, Any]:
        """The public switches as a JSON-ready dict."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    def reset_load_attempts(self) -> None:
        """Forget counted load attempts (a restarted replica mounts the bucket afresh)."""
        self._load_attempts.clear()


def _check_type(key: str, value: Any, annotation: object) -> None:
    """Refuse a switch of the wrong JSON type before anything is changed."""
    spelled = str(annotation)
    if value is None and "None" in spelled:
        return
    if spelled.startswith("str"):
        ok = isinstance(value, str)
    elif spelled.startswith("bool"):
        ok = isinstance(value, bool)
    elif spelled.startswith("int"):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:  # float
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise TypeError(f"fault {key!r} must be {spelled}, not {type(value).__name__}")
