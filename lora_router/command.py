"""What every command of the package shares: bad flags, `--help`, and how Ctrl-C ends.

- A bad flag costs one line, `PROG: error: ... (see --help)`, and exit status 2 (`Parser`).
- `--help`: every flag's help ends with its default (see `HelpFormatter`); a description or
  epilog is printed as written, so examples keep their columns.
- Ctrl-C (SIGINT) ends any command (`lora-router`, `--demo`, `--check`, `top`,
  `lora-router-emulator`) with one line on stderr, `PROG: interrupted`, and exit status 130
  (128 + SIGINT, the shell's convention), never with a traceback. A server that catches SIGINT
  itself to stop in order ends the same way once it has stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from typing import NoReturn

INTERRUPTED = 128 + signal.SIGINT  # 130


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag costs one line (not the whole usage) and exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default: the value, "off" for a switch, or the words
    its help already gives (a flag whose default is computed says so itself)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or "(required" in text or action.default is argparse.SUPPRESS:
            return text
        if action.default is False:
            return f"{text} (default: off)"
        if action.default == []:  # a repeatable flag given no time
            return f"{text} (default: none; repeatable)"
        return f"{text} (default: %(default)s)"


def interrupted(prog: str) -> int:
    """Say that `prog` was interrupted, in one line on stderr; the exit status to return."""
    print(f"{prog}: interrupted", file=sys.stderr, flush=True)
    return INTERRUPTED


def first_signal(*signals: signal.Signals) -> asyncio.Future[signal.Signals]:
    """A future of the running loop that the first of `signals` to arrive completes with; from
    then on those signals no longer end the process (Python's default for SIGINT is gone)."""
    loop = asyncio.get_running_loop()
    received: asyncio.Future[signal.Signals] = loop.create_future()

    def arrived(sig: signal.Signals) -> None:
        if not received.done():
            received.set_result(sig)

    for sig in signals:
        loop.add_signal_handler(sig, arrived, sig)
    return received
