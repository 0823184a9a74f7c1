"""Every relative link in the docs resolves, and every file, test and symbol they name exists.

Links: `[text](target)` and images in README.md, docs/**/*.md, bench/README.md and every
bench/results/**/README.md, resolved against the linking file's directory; a `#fragment` on a
markdown target must name one of its headings (GitHub's anchors). Results: every
`bench/results/...` written out in README.md, docs, bench/README.md, lora_router/ and tests/
names a file or directory of the tree, or a prefix of one (`REV:bench/results/...` names a
path in git's history and is skipped). Not checked for paths: the result files (records of the
commands as run) and the bench scripts (which name where they write).

The tree's own names (`named_in`): in README.md, docs/**/*.md, bench/README.md, and the
docstrings and comments of lora_router/, tests/ and bench/ (not bench/results: records of their
day), every
- path under lora_router/, tests/, bench/ or docs/ (a package's own `http/cork.py` is taken under
  lora_router/ or tests/), and a test named `tests/x.py::test_y`, exists;
- `module.name` (`retry.verdict`, `lora_router.routing.policy.PrefixAffinity`, a path's
  `routing/keys.completion_key`) names something the module defines, or an attribute of one of
  its classes; `Class.attribute` (`Fleet.routable`, `Exchange.then()`) one the class or a base
  in the tree defines, `self.x = ...` included; and `file.py's `name`` one that file defines.
A dotted name whose head is not a module or class of the tree (`asyncio.sleep`, `self.fence`)
is not checked, nor a class with a base from outside the tree other than those in
`CLOSED_BASES` (it may inherit anything). `REV:path` names git's history and is skipped.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
RESULTS_PATH = re.compile(r"(?<![\w:/])bench/results/[\w./-]*")  # not `git show REV:path`
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def linking_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += [ROOT / "bench" / "README.md"] if (ROOT / "bench" / "README.md").exists() else []
    return files + sorted((ROOT / "bench" / "results").rglob("README.md"))


def naming_files() -> list[Path]:
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    files += [p for p in [ROOT / "bench" / "README.md"] if p.exists()]
    files += sorted((ROOT / "lora_router").rglob("*.py"))
    return files + [p for p in sorted((ROOT / "tests").rglob("*.py")) if p != Path(__file__)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def broken_links(path: Path, root: Path = ROOT) -> list[str]:
    text = CODE.sub("", FENCE.sub("", path.read_text()))
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        name, _, fragment = target.partition("#")
        dest = (path.parent / name).resolve() if name else path
        if not dest.exists():
            bad.append(f"{path.relative_to(root)}: {target} (no such file)")
        elif fragment and dest.suffix == ".md" and fragment not in anchors(dest):
            bad.append(f"{path.relative_to(root)}: {target} (no such heading)")
    return bad


def test_every_relative_link_in_the_docs_resolves() -> None:
    bad = [b for path in linking_files() for b in broken_links(path)]
    assert not bad, "\n".join(bad)


def test_every_bench_results_path_named_in_docs_and_code_exists() -> None:
    tree = [str(p.relative_to(ROOT)) for p in (ROOT / "bench" / "results").rglob("*")]
    bad = []
    for path in naming_files():
        for named in RESULTS_PATH.findall(path.read_text()):
            named = named.rstrip(".,;:/")
            if not (ROOT / named).exists() and not any(t.startswith(named) for t in tree):
                bad.append(f"{path.relative_to(ROOT)}: {named}")
    assert not bad, "\n".join(bad)


def test_the_checks_catch_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    (tmp_path / "there.md").write_text("# A heading: here\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md#a-heading-here) [gone](missing.md) [no](there.md#elsewhere) "
        "`[code](skipped.md)` [web](https://example.com)\n"
    )
    assert broken_links(page, tmp_path) == [
        "page.md: missing.md (no such file)",
        "page.md: there.md#elsewhere (no such heading)",
    ]


# --- The tree's own names -------------------------------------------------------------------

SOURCES = ("lora_router", "tests", "bench")
SUBPACKAGES = "|".join(sorted(p.parent.name for p in ROOT.glob("lora_router/*/__init__.py")))
TREE_PATH = re.compile(
    rf"(?<![\w/.:@~-])((?:{'|'.join(SOURCES)}|docs|{SUBPACKAGES})/[\w/.-]*[\w/])(?:::(\w+))?"
)
DOTTED = re.compile(r"(?<![\w./:@-])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)")
FILE_S_NAME = re.compile(r"(?<![\w/.-])([\w/.-]*\w\.py)'s\s+`(\w+(?:\.\w+)*)(?:\([^`]*\))?`")
EXTENSIONS = frozenset(
    ["py", "md", "json", "txt", "png", "sh", "toml", "cfg", "yml", "yaml", "jsonl", "html", "csv"]
)
# Bases whose attributes are all known (fields are annotations): a subclass is checked.
CLOSED_BASES = frozenset(
    {
        *("object", "Exception", "ValueError", "RuntimeError", "KeyError", "LookupError"),
        *("OSError", "ConnectionError", "TimeoutError", "Enum", "IntEnum", "StrEnum"),
        *("Protocol", "NamedTuple", "Generic", "TypedDict", "Struct"),
    }
)
# vLLM's answer fields that share a module's name: `usage.prompt_tokens` is not proxy/usage.py.
ANSWER_FIELDS = frozenset({"usage"})


@dataclass
class Namespace:
    """The names a module or a class binds, and a class's bases by their last name."""

    names: set[str] = field(default_factory=set)
    bases: list[str] = field(default_factory=list)


def _bound(body: list[ast.stmt]) -> set[str]:
    """The names a block binds, through if/try/with blocks (not into functions or classes)."""
    out: set[str] = set()
    for node in body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            out.add(node.name)
            continue
        if isinstance(node, ast.Assign):
            out |= {n.id for t in node.targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, ast.AnnAssign | ast.AugAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
        elif isinstance(node, ast.Import | ast.ImportFrom):
            out |= {(a.asname or a.name).split(".")[0] for a in node.names}
        for inner in ast.iter_child_nodes(node):
            if isinstance(inner, ast.ExceptHandler):
                out |= _bound(inner.body)
        for block in ("body", "orelse", "finalbody"):
            out |= _bound([s for s in getattr(node, block, []) if isinstance(s, ast.stmt)])
    return out


def _class(node: ast.ClassDef) -> Namespace:
    names = _bound(node.body)
    for sub in ast.walk(node):
        store = isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
        if store and isinstance(sub.value, ast.Name) and sub.value.id in ("self", "cls"):
            names.add(sub.attr)
    unsubscripted = [b.value if isinstance(b, ast.Subscript) else b for b in node.bases]
    bases = [ast.unparse(b).split(".")[-1] for b in unsubscripted]
    return Namespace(names, bases)


@dataclass
class Tree:
    """The modules and classes of lora_router/, tests/ and bench/, by the names docs use."""

    root: Path
    files: dict[str, Namespace] = field(default_factory=dict)  # path -> its top-level names
    modules: dict[str, list[str]] = field(default_factory=dict)  # short or dotted -> paths
    classes: dict[str, list[Namespace]] = field(default_factory=dict)
    file_classes: dict[str, list[str]] = field(default_factory=dict)

    def attributes(self, cls: str, seen: frozenset[str] = frozenset()) -> set[str] | None:
        """The attributes of the classes named `cls`, inherited ones too; None: not all known."""
        out: set[str] = set()
        for ns in self.classes.get(cls, []):
            out |= ns.names
            for base in ns.bases:
                inherited = self.attributes(base, seen | {cls}) if base not in seen else set()
                if base in self.classes and inherited is not None:
                    out |= inherited
                elif base not in CLOSED_BASES:
                    return None
        return out

    def defines(self, path: str, name: str) -> bool:
        """Whether module `path` binds `name`, has it as a submodule, or a class of it does."""
        folder = (self.root / path).parent
        package = path.endswith("__init__.py") and (
            (folder / name).is_dir() or (folder / f"{name}.py").is_file()
        )
        in_class = any(name in (self.attributes(c) or ()) for c in self.file_classes[path])
        return name in self.files[path].names or package or in_class

    def chain(self, paths: list[str], parts: list[str]) -> str | None:
        """Why `parts` is not a name in the modules `paths` (then an attribute of it), or None."""
        if not any(self.defines(p, parts[0]) for p in paths):
            return f"{parts[0]} is not in {paths[0]}"
        if len(parts) > 1 and parts[0] in self.classes:
            attrs = self.attributes(parts[0])
            if attrs is not None and parts[1] not in attrs:
                return f"{parts[0]} has no {parts[1]}"
        return None


def read_tree(root: Path) -> Tree:
    tree = Tree(root)
    for path in sorted(p for top in SOURCES for p in (root / top).rglob("*.py")):
        name = str(path.relative_to(root))
        if name.startswith("bench/results/"):
            continue
        module = ast.parse(path.read_text(), name)
        tree.files[name] = Namespace(_bound(module.body))
        tree.file_classes[name] = [n.name for n in module.body if isinstance(n, ast.ClassDef)]
        for node in ast.walk(module):
            if isinstance(node, ast.ClassDef):
                tree.classes.setdefault(node.name, []).append(_class(node))
        parts = path.relative_to(root).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        for key in {parts[-1], ".".join(parts)}:
            tree.modules.setdefault(key, []).append(name)
    return tree


def prose(path: Path) -> list[str]:
    """A document's lines, or a Python file's docstrings and comments at their line numbers."""
    text = path.read_text()
    if path.suffix != ".py":
        return text.splitlines()
    lines = [""] * (text.count("\n") + 2)
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            doc = node.body[0] if node.body else None
            text_of = (
                doc.value.value
                if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                else None
            )
            if isinstance(text_of, str):
                for n, line in enumerate(text_of.splitlines(), doc.lineno):
                    lines[n] += " " + line
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            lines[token.start[0]] += " " + token.string
    return lines[1:]


def _in_tree(named: str, tree: Tree) -> list[str]:
    """The tree's paths a written path may mean (`http/x.py`: lora_router/ or tests/)."""
    bare = re.match(rf"(?:{SUBPACKAGES})/", named)
    candidates = [named, *([f"lora_router/{named}", f"tests/{named}"] if bare else [])]
    return [c for c in candidates if (tree.root / c).exists()]


def _path_drift(named: str, test: str, tree: Tree) -> str | None:
    named = named.rstrip("/.")
    parts = named.split("/")
    if named.startswith("bench/results") or "*" in named or any(p[:1] == "." for p in parts):
        return None  # results: the test above; globs; ignored directories (bench/.peers)
    found = _in_tree(named, tree)
    if not found and "." in parts[-1] and parts[-1].rsplit(".", 1)[1] not in EXTENSIONS:
        module, _, symbol = named.rpartition(".")  # `routing/keys.completion_key`
        if paths := [p for p in _in_tree(f"{module}.py", tree) if p in tree.files]:
            problem = tree.chain(paths, symbol.split("."))
            return f"{named} ({problem})" if problem else None
    if not found:
        return f"{named} (no such file)"
    if test and not any(p in tree.files and test in tree.files[p].names for p in found):
        return f"{named}::{test} (no such test)"
    return None


def _dotted_drift(dotted: str, tree: Tree) -> str | None:
    parts = dotted.split(".")
    if parts[-1] in EXTENSIONS or parts[0] in ANSWER_FIELDS:
        return None
    for cut in range(len(parts) - 1, 0, -1):  # the longest module prefix, then names in it
        paths = tree.modules.get(".".join(parts[:cut]))
        if paths and (cut == 1 or parts[0] == "lora_router"):
            problem = tree.chain(paths, parts[cut:])
            return f"{dotted} ({problem})" if problem else None
    attrs = tree.attributes(parts[0]) if parts[0] in tree.classes else None
    return f"{dotted} ({parts[0]} has no {parts[1]})" if attrs and parts[1] not in attrs else None


def _file_s_drift(file: str, name: str, tree: Tree) -> str | None:
    paths = [p for p in _in_tree(file, tree) if p in tree.files]
    if not paths and "/" not in file:
        paths = [p for p in tree.files if p.endswith(f"/{file}")]
    problem = tree.chain(paths, name.split(".")) if paths else None  # else: another project's
    return f"{file}'s {name} ({problem})" if problem else None


def drifts(path: Path, tree: Tree) -> list[tuple[str, str]]:
    """(reference, why) for every path, test or symbol `path` names that the tree lacks."""
    out = []
    for n, line in enumerate(prose(path), 1):
        found = [_path_drift(named, test, tree) for named, test in TREE_PATH.findall(line)]
        found += [_dotted_drift(dotted, tree) for dotted in DOTTED.findall(line)]
        found += [_file_s_drift(file, name, tree) for file, name in FILE_S_NAME.findall(line)]
        out += [(why.split(" (")[0], f"{n}: {why}") for why in found if why]
    return out


def named_in(root: Path) -> list[Path]:
    """The files whose references to the tree are checked."""
    files = [root / "README.md", *sorted((root / "docs").rglob("*.md")), root / "bench/README.md"]
    files += sorted(p for top in SOURCES for p in (root / top).rglob("*.py"))
    here = Path(__file__).resolve()
    return [f for f in files if f.exists() and "results" not in f.parts and f.resolve() != here]


def test_every_file_test_and_symbol_the_docs_and_docstrings_name_exists() -> None:
    tree = read_tree(ROOT)
    found = {
        (str(f.relative_to(ROOT)), ref, why) for f in named_in(ROOT) for ref, why in drifts(f, tree)
    }
    bad = sorted(f"{name}:{why}" for name, _, why in found)
    assert not bad, "\n".join(bad)


def test_the_check_catches_a_missing_file_test_and_symbol(tmp_path: Path) -> None:
    fleet = tmp_path / "lora_router" / "fleet"
    fleet.mkdir(parents=True)
    (fleet / "__init__.py").write_text("")
    (fleet / "fence.py").write_text(
        "import enum\n\n\n"
        "class Base:\n    def wait(self):\n        self.held = 0\n\n\n"
        "class AdapterFence(Base):\n    def admits(self):\n        pass\n\n\n"
        "class State(enum.Enum):\n    LIVE = 1\n\n\n"
        "def verdict():\n    pass\n"
    )
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_fence.py").write_text(
        "def test_admits():\n"
        '    """fleet/fence.py\'s `verdict()` and `AdapterFence.held`; `fence.gone()`."""\n'
        "    # tests/test_fence.py::test_gone, tests/test_fence.py::test_admits\n"
    )
    (tmp_path / "docs").mkdir()
    page = tmp_path / "docs" / "page.md"
    page.write_text(
        "`fence.admits` `fence.admit` `fence.verdict()` `AdapterFence.wait` `AdapterFence.admit`\n"
        "lora_router.fleet.fence.AdapterFence.held, lora_router.fleet.fence.Gone; State.LIVE,\n"
        "State.DEAD; asyncio.sleep, self.fence.admit, usage.prompt_tokens, fleet/fence.verdict\n"
        "http/fence.py, lora_router/fleet/, lora_router/fleet/gone.py, fleet/fence.missing\n"
        "docs/page.md, docs/gone.md, bench/results/x.md, 0b05e94:lora_router/body.py\n"
        "fence.py's `admits` (a class's), fence.py's `missing()`, worker.py's `_generate`\n"
    )
    tree = read_tree(tmp_path)
    assert [why for _, why in drifts(page, tree)] == [
        "1: fence.admit (admit is not in lora_router/fleet/fence.py)",
        "1: AdapterFence.admit (AdapterFence has no admit)",
        "2: lora_router.fleet.fence.Gone (Gone is not in lora_router/fleet/fence.py)",
        "3: State.DEAD (State has no DEAD)",
        "4: http/fence.py (no such file)",
        "4: lora_router/fleet/gone.py (no such file)",
        "4: fleet/fence.missing (missing is not in lora_router/fleet/fence.py)",
        "5: docs/gone.md (no such file)",
        "6: fence.py's missing (missing is not in lora_router/fleet/fence.py)",
    ]
    assert [why for _, why in drifts(tmp_path / "tests" / "test_fence.py", tree)] == [
        "2: fence.gone (gone is not in lora_router/fleet/fence.py)",
        "3: tests/test_fence.py::test_gone (no such test)",
    ]
