"""Every module of the package opens with a docstring: its rules, its invariants and its
"never"s, what a reader needs before the code (measurements, history and rejected designs live
in docs/design/); a package's `__init__.py` says what its modules are for.

Length is not tested: a long module is a reason to split it by concept in review, not a
failing test (#41).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lora_router"


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


def test_every_module_opens_with_a_docstring() -> None:
    bare = {name for name, source in MODULES.items() if docstring_lines(source) == 0}
    assert not bare, bare


def test_a_docstring_is_measured_from_quote_to_quote() -> None:
    assert docstring_lines('"""One line."""\n\nx = 1\n') == 1
    assert docstring_lines('"""Two\nlines.\n"""\n') == 3
    assert docstring_lines("x = 1\n") == 0
