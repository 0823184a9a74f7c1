"""Reading a command's `--help`: every flag described, and its default shown exactly once."""

from __future__ import annotations

import argparse
import re


def help_entries(text: str) -> dict[str, str]:
    """Each option of `--help` (its first flag) -> the whole text shown for it."""
    entries: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        match = re.match(r"^  (-\S+)", line)
        if match:
            current = match.group(1).split(",")[0]
            entries[current] = line
        elif current is not None and line.startswith("    "):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


def assert_every_flag_described(parser: argparse.ArgumentParser, text: str) -> None:
    """`text` (the `--help` of `parser`) lists every flag, each with help and one default."""
    entries = help_entries(text)
    options = {
        a.option_strings[-1] if a.option_strings[0] == "-h" else a.option_strings[0]
        for a in parser._actions
    }
    assert set(entries) == {"-h"} | (options - {"--help"})
    for flag, shown in entries.items():
        if flag in ("-h", "--version"):
            continue
        flag_and_metavar = re.match(r"\s*-\S+(?: [A-Z_]+| \{[^}]+\})?", shown)
        assert flag_and_metavar is not None
        described = shown[flag_and_metavar.end() :].strip()
        assert described and not described.startswith("("), f"{flag} has no help"
        marks = shown.count("(default") + shown.count("(required")
        assert marks == 1, f"{flag}: default shown {marks} times: {shown}"
        assert "(default: None)" not in shown, f"{flag} shows a meaningless default"
