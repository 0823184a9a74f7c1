"""Leftover adapters on reused replicas, as the router warns of them at start (replay.py) and
`--check` judges them (tools/check.py), and the `--unload-stale` glob that clears them.

Rules:
- *Fatal or not, by name.* A leftover the trainer may load again — its name matched by
  `--lineage-pattern`, TRL's `{lora_name}-v{N}` by default (routing/keys.py, `Lineages`) — is
  fatal: TRL's load of that name is answered 400 "already loaded". Any other name cannot
  collide with the trainer's loads and is a note.
- *Covered is fine.* A leftover the given `--unload-stale` matches is a note: the router
  unloads it at start (fleet/replay.py), matching as `fnmatch.fnmatchcase` does.
- *One glob for the fleet.* The router takes one `--unload-stale` pattern, so the advice names
  one glob built from the leftovers seen on every replica (`stale_glob`), never a fixed one:
  for the fatal leftovers, the glob matches each of them and each the present flag already
  clears (the new flag replaces it); for a note, every leftover of the fleet.

Pure: no I/O. `judge` returns (what, fix, note) triples: check.py makes them problems, the
router's start logs the ones that are not notes.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from lora_router.routing import Lineages

Finding = tuple[str, str, bool]  # what, fix, note


def stale_glob(names: Sequence[str]) -> str:
    """One `--unload-stale` glob matching every name of `names` (as the router matches it,
    `fnmatchcase`): a single name is itself; more are their common start, `*`, and their common
    end. Glob characters in a name are escaped. Empty for no name."""
    if not names:
        return ""
    if len(set(names)) == 1:
        return _escape(names[0])
    head = _common_start(names)
    tail = _common_start([n[len(head) :][::-1] for n in names])[::-1]
    return f"{_escape(head)}*{_escape(tail)}"


def _common_start(texts: Sequence[str]) -> str:
    """The longest string every one of `texts` starts with (by character)."""
    first, last = min(texts), max(texts)  # what these two share, every text between shares
    same = (i for i, (a, b) in enumerate(zip(first, last, strict=False)) if a != b)
    return first[: next(same, len(first))]


def _escape(text: str) -> str:
    return re.sub(r"[*?[]", lambda m: f"[{m.group()}]", text)


def _shown(names: Sequence[str]) -> str:
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


@dataclass(frozen=True, slots=True)
class Leftovers:
    """How the leftovers of one fleet are judged (module docstring): the present
    `--unload-stale`, the trainer's naming, and the globs that clear the fatal leftovers
    (`fatal`) or all of them (`every`)."""

    stale: str | None
    lineages: Lineages
    fatal: str
    every: str

    @classmethod
    def of(
        cls, held: Sequence[Sequence[str]], stale: str | None, lineage_pattern: str | None
    ) -> Leftovers:
        """The judge for a fleet whose replicas hold the adapters `held` (one list each), given
        `--unload-stale` `stale` and `--lineage-pattern` (None: TRL's naming)."""
        lineages = Lineages() if lineage_pattern is None else Lineages(lineage_pattern)
        names = sorted({a for adapters in held for a in adapters})
        must = [a for a in names if lineages.versioned(a) or _covered(a, stale)]
        return cls(stale, lineages, stale_glob(must), stale_glob(names))

    def judge(self, adapters: Sequence[str]) -> list[Finding]:
        """What one replica holding `adapters` is told."""
        covered = [a for a in adapters if _covered(a, self.stale)]
        left = [a for a in adapters if a not in covered]
        colliding = [a for a in left if self.lineages.versioned(a)]
        harmless = [a for a in left if not self.lineages.versioned(a)]
        out: list[Finding] = []
        if colliding:
            out.append(
                (
                    f"{len(colliding)} leftover adapter(s) from an earlier run: "
                    f"{_shown(colliding)}, named as the trainer names its versions "
                    "({lora_name}-v{N}, --lineage-pattern): TRL's load of such a name is "
                    "answered 400 'already loaded', fatal for TRL",
                    f"give --unload-stale {shlex.quote(self.fatal)} (the router unloads them "
                    "at start), or restart the replica",
                    False,
                )
            )
        if harmless:
            out.append(
                (
                    f"{len(harmless)} leftover adapter(s) from an earlier run: "
                    f"{_shown(harmless)}, not named as the trainer names its versions, so no "
                    "load of the trainer's collides with them; they stay loaded",
                    f"to clear them, give --unload-stale {shlex.quote(self.every)}, or restart "
                    "the replica",
                    True,
                )
            )
        if covered:
            out.append(
                (
                    f"{len(covered)} leftover adapter(s) ({_shown(covered)}) will be unloaded "
                    f"at start (--unload-stale {shlex.quote(self.stale or '')})",
                    "",
                    True,
                )
            )
        return out


def _covered(name: str, stale: str | None) -> bool:
    return stale is not None and fnmatch.fnmatchcase(name, stale)
