"""The architecture's rules that code can check (issue 41):

- docs/architecture.md's request-path walk names only code that exists: every `Class.attr` and
  `package/module.attr` written in backticks in its section resolves in the package;
- composition, not inheritance: no class of the package inherits from another of its classes,
  except exceptions, enums, protocols and record bases;
- no code reads another class's underscore attributes.
"""

from __future__ import annotations

import ast
import enum
import importlib
import re
from functools import cache
from pathlib import Path

import msgspec

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


def package_classes() -> list[type]:
    """Every class defined in the package (the emulator and tools included)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__main__":
            continue  # running it runs the command
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        module = importlib.import_module(name)
        found += [
            obj
            for obj in vars(module).values()
            if isinstance(obj, type) and obj.__module__ == module.__name__
        ]
    return found


def shared_by_kind(cls: type) -> bool:
    """The bases issue 41 allows: exceptions, enums, protocols, and record bases (a msgspec
    tagged union's parent, as vLLM's KV events declare theirs)."""
    return (
        issubclass(cls, BaseException)
        or issubclass(cls, enum.Enum)
        or bool(getattr(cls, "_is_protocol", False))
        or issubclass(cls, msgspec.Struct)
    )


def test_no_class_inherits_from_another_class_of_the_package() -> None:
    classes = package_classes()
    assert len(classes) > 100  # the package was read
    inherited = [
        f"{cls.__module__}.{cls.__qualname__}({base.__qualname__})"
        for cls in classes
        for base in cls.__mro__[1:]
        if base.__module__.startswith("lora_router") and not shared_by_kind(base)
    ]
    assert not inherited, inherited


# Underscore attributes read on purpose: `os._exit` (a module's function, the documented way
# out of a forked child), and TRL's own rollout loop, which the testbed drives as TRL's
# trainer does (its private state is TRL's interface there).
ALLOWED_READS = {"os._exit", "loop._counters", "loop._model_version_value"}
ALLOWED_READS |= {"self._loop._counters", "self._loop._generate_one_turn"}


def private_reads(tree: ast.AST) -> list[str]:
    """`x._name` where x is not `self` or `cls` and `_name` is not an attribute of the class
    the code is in (a leading-underscore attribute of another class), in one module."""
    found = []

    def visit(node: ast.AST, own: set[str]) -> None:
        if isinstance(node, ast.ClassDef):
            own = {
                n.attr
                for n in ast.walk(node)
                if isinstance(n, ast.Attribute)
                and isinstance(n.value, ast.Name)
                and n.value.id == "self"
            } | {n.name for n in ast.walk(node) if isinstance(n, ast.FunctionDef)}
        elif (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
            and node.attr not in own
        ):
            found.append(f"{ast.unparse(node.value)}.{node.attr}")
        for child in ast.iter_child_nodes(node):
            visit(child, own)

    visit(tree, set())
    return [read for read in found if read not in ALLOWED_READS]


def test_no_code_reads_another_objects_underscore_attributes() -> None:
    found = {
        str(path.relative_to(ROOT)): reads
        for path in sorted(PACKAGE.rglob("*.py"))
        if (reads := private_reads(ast.parse(path.read_text())))
    }
    assert not found, found


def test_a_private_read_is_seen() -> None:
    tree = ast.parse(
        "class A:\n"
        "    def f(self, other):\n"
        "        self._mine = other._mine + other._theirs + cls._ok + other.__dict__\n"
    )
    assert private_reads(tree) == ["other._theirs"]
