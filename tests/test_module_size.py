"""The package's modules stay small enough to read: at most 600 lines each (the emulator, a
stand-in for vLLM rather than part of the router, aside), and a module docstring of at most 40
lines, the emulator's included. A docstring keeps the rules, the invariants, the complexity and
the "never"s; measurements, history and rejected designs live in docs/design/.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lora_router"
MAX_LINES = 600
MAX_DOCSTRING_LINES = 40


def _modules() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE)): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = _modules()


def docstring_lines(source: str) -> int:
    """How many source lines the module docstring spans, its quotes included (0: none)."""
    body = ast.parse(source).body
    first = body[0] if body else None
    if not (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    ):
        return 0
    assert first.end_lineno is not None
    return first.end_lineno - first.lineno + 1


def test_no_module_exceeds_600_lines() -> None:
    long = {
        name
        for name, source in MODULES.items()
        if len(source.splitlines()) > MAX_LINES and not name.startswith("emulator/")
    }
    assert not long, long


def test_no_module_docstring_exceeds_40_lines() -> None:
    long = {
        name for name, source in MODULES.items() if docstring_lines(source) > MAX_DOCSTRING_LINES
    }
    assert not long, long


def test_a_docstring_is_measured_from_quote_to_quote() -> None:
    assert docstring_lines('"""One line."""\n\nx = 1\n') == 1
    assert docstring_lines('"""Two\nlines.\n"""\n') == 3
    assert docstring_lines("x = 1\n") == 0
