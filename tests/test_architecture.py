"""docs/architecture.md's request-path walk names only code that exists: every `Class.attr`
and `package/module.attr` written in backticks in its section resolves in the package.
"""

from __future__ import annotations

import ast
import importlib
import re
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lora_router"
DOC = ROOT / "docs" / "architecture.md"
NAMED = re.compile(r"`([A-Za-z_][\w/]*)\.([A-Za-z_]\w*)`")


def request_path_section() -> str:
    text = DOC.read_text()
    start = text.index("## The request path")
    return text[start : text.index("\n## ", start + 1)]


@cache
def members() -> dict[str, set[str]]:
    """Each class of the package: what it defines, its methods, class attributes and the
    attributes its methods set on `self` (read from the source, so an instance's own count)."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            names = found.setdefault(node.name, set())
            for inner in ast.walk(node):
                if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(inner.name)
                elif isinstance(inner, ast.AnnAssign) and isinstance(inner.target, ast.Name):
                    names.add(inner.target.id)
                elif isinstance(inner, ast.Attribute) and isinstance(inner.ctx, ast.Store):
                    if isinstance(inner.value, ast.Name) and inner.value.id == "self":
                        names.add(inner.attr)
                elif isinstance(inner, ast.Name) and isinstance(inner.ctx, ast.Store):
                    names.add(inner.id)
    return found


def resolves(owner: str, attr: str) -> bool:
    if "/" in owner:  # a module, by its path under lora_router/
        module = importlib.import_module("lora_router." + owner.replace("/", "."))
        return hasattr(module, attr)
    return attr in members().get(owner, set())


def test_the_request_path_names_only_what_exists() -> None:
    names = [(o, a) for o, a in NAMED.findall(request_path_section()) if a not in ("py", "md")]
    assert len(names) > 20  # the walk was read
    missing = [f"{o}.{a}" for o, a in names if not resolves(o, a)]
    assert not missing, missing


def test_a_missing_name_is_found() -> None:
    assert not resolves("RouterApp", "handle_now") and not resolves("http/target", "nope")
    assert resolves("RouterApp", "handle") and resolves("http/target", "canonical")
