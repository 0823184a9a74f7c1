"""The package's layering, read from the source: which module may import which.

- routing/ is pure: it imports neither http/ nor fleet/;
- http/ is the protocol alone: it imports only itself and config.py;
- nothing imports cli (the command line is the outermost layer);
- the router never imports the emulator: only tools/demo.py (the emulator's client) and the
  emulator itself do;
- in the router, only fleet/client.py opens an aiohttp session (the control plane's requests
  to replicas; the data plane has http/upstream.py); tools/ holds clients of the router, not
  parts of it;
- proxy/ (the request path) may import fleet/ and routing/; fleet/ imports neither proxy/ nor
  http/errors.py: it returns outcome values, which proxy/answers.py renders as vLLM's answers;
- observe/ reads, never writes: it imports none of the writers (proxy/, http/, the runtime,
  the command line, tools/), and its views assign no attribute; its metrics.py,
  which the request path and the fleet record into, imports nothing of the router, and is all
  that fleet/, routing/ and http/ may import of observe/;
- tools/ imports only the package's public entry points (`PUBLIC`, tools/__init__.py says
  why each one), and nothing but cli imports tools/;
- the router has no import cycle, type-only imports (under `TYPE_CHECKING`) included.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "lora_router"


def _modules() -> dict[str, ast.Module]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = ast.parse(path.read_text(), str(path))
    return out


MODULES = _modules()


def imports(module: str) -> set[str]:
    """Every module `module` imports (absolute names; relative imports resolved)."""
    out = set()
    for node in ast.walk(MODULES[module]):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: -node.level]
                base = ".".join([*package, base] if base else package)
            out.add(base)
            out.update(f"{base}.{alias.name}" for alias in node.names)
    return out


def importers_of(prefix: str) -> set[str]:
    return {
        m
        for m in MODULES
        if any(i == prefix or i.startswith(prefix + ".") for i in imports(m))
        and not (m == prefix or m.startswith(prefix + "."))
    }


def test_the_graph_was_read() -> None:
    assert "lora_router.routing.policy" in MODULES and "lora_router.fleet.client" in MODULES
    assert "lora_router.fleet.fleet" in imports("lora_router.fleet.health")


def test_routing_imports_neither_http_nor_fleet() -> None:
    for module in (m for m in MODULES if m.startswith("lora_router.routing")):
        bad = {
            i for i in imports(module) if i.startswith(("lora_router.http", "lora_router.fleet"))
        }
        assert not bad, f"{module} imports {bad}"


def test_http_imports_only_itself_and_the_config() -> None:
    for module in (m for m in MODULES if m.startswith("lora_router.http")):
        bad = {
            i
            for i in imports(module)
            if i.startswith("lora_router")
            and not i.startswith(("lora_router.http.", "lora_router.config."))
            and i not in ("lora_router.http", "lora_router.config")
        }
        assert not bad, f"{module} imports {bad}"


def test_nothing_imports_cli() -> None:
    assert importers_of("lora_router.cli") == {"lora_router.__main__"}


def test_the_router_never_imports_the_emulator() -> None:
    assert importers_of("lora_router.emulator") == {"lora_router.tools.demo"}


def test_the_fence_imports_no_http() -> None:
    assert not {i for i in imports("lora_router.fleet.fence") if i.startswith("lora_router.http")}


def test_only_the_replica_client_opens_an_aiohttp_session_in_the_router() -> None:
    clients = ("lora_router.emulator", "lora_router.tools", "lora_router.testbed")
    router = {m for m in MODULES if not m.startswith(clients)}
    users = {m for m in router if "aiohttp" in imports(m)}
    assert users == {"lora_router.fleet.client"}


def test_the_fleet_imports_neither_the_proxy_nor_http_errors() -> None:
    for module in (m for m in MODULES if m.startswith("lora_router.fleet")):
        bad = {
            i
            for i in imports(module)
            if i.startswith(("lora_router.proxy", "lora_router.http.errors"))
        }
        assert not bad, f"{module} imports {bad}"


def test_the_proxy_is_imported_only_by_the_wiring_and_the_views() -> None:
    outside = {
        m for m in importers_of("lora_router.proxy") if not m.startswith("lora_router.proxy")
    }
    assert outside == {"lora_router.runtime"}


OBSERVE = "lora_router.observe"
WRITERS = (
    "lora_router.proxy",
    "lora_router.http",
    "lora_router.runtime",
    "lora_router.cli",
    "lora_router.tools",
)


def test_observe_imports_no_writer() -> None:
    for module in (m for m in MODULES if m.startswith(OBSERVE)):
        bad = {i for i in imports(module) if i.startswith(WRITERS)}
        assert not bad, f"{module} imports {bad}"


def test_the_views_write_no_attribute() -> None:
    """observe/'s views (all but metrics.py, which is written to) assign or delete no attribute
    of anything, at any depth (`a.b = x`, `a.b[k] = x`, `a.b += x`): they read."""
    views = (m for m in MODULES if m.startswith(OBSERVE) and m != f"{OBSERVE}.metrics")
    for module in views:
        for node in ast.walk(MODULES[module]):
            if isinstance(node, ast.Assign | ast.Delete):
                targets = node.targets
            elif isinstance(node, ast.AugAssign | ast.AnnAssign):
                targets = [node.target]
            else:
                continue
            for target in targets:
                assert not writes_attribute(target), (
                    f"{module}:{node.lineno} writes {ast.unparse(target)}"
                )


def writes_attribute(target: ast.expr) -> bool:
    """Whether assigning to `target` changes an attribute: `a.b`, `a.b[k]`, `(x, a.b)`; not
    `x` or `x[a.b]` (a local, indexed by what it reads)."""
    if isinstance(target, ast.Tuple | ast.List):
        return any(writes_attribute(element) for element in target.elts)
    if isinstance(target, ast.Starred):
        return writes_attribute(target.value)
    while isinstance(target, ast.Subscript):
        target = target.value
    return isinstance(target, ast.Attribute)


def test_the_recorded_counters_import_nothing_of_the_router() -> None:
    assert not {i for i in imports(f"{OBSERVE}.metrics") if i.startswith("lora_router")}


def test_the_core_imports_only_the_recorded_counters_of_observe() -> None:
    core = ("lora_router.fleet", "lora_router.routing", "lora_router.http")
    for module in (m for m in MODULES if m.startswith(core)):
        bad = {
            i
            for i in imports(module)
            if i.startswith(OBSERVE) and not i.startswith(f"{OBSERVE}.metrics")
        }
        assert not bad, f"{module} imports {bad}"


TOOLS = "lora_router.tools"
# What a tool may import of the package (tools/__init__.py says why each one).
PUBLIC = {
    "lora_router.config",
    "lora_router.command",
    "lora_router.runtime",
    "lora_router.fleet.aliases",
    "lora_router.fleet.client",
    "lora_router.fleet.discovery",
    "lora_router.fleet.failure",
    "lora_router.fleet.leftovers",
    "lora_router.fleet.readiness",
    "lora_router.routing",
}


def public(name: str) -> bool:
    """Whether `name` (a module, or a name imported from one) is a public entry point."""
    module = name if name in MODULES else name.rpartition(".")[0]
    return module in PUBLIC or module.startswith(("lora_router.emulator", TOOLS))


def test_tools_import_only_public_entry_points() -> None:
    for module in (m for m in MODULES if m.startswith(TOOLS)):
        bad = {i for i in imports(module) if i.startswith("lora_router.") and not public(i)}
        assert not bad, f"{module} imports {bad}"


def test_only_the_command_line_imports_the_tools() -> None:
    assert importers_of(TOOLS) == {"lora_router.cli"}


def cycle(modules: set[str]) -> list[str] | None:
    """One import cycle among `modules` (every import counts, type-only ones too), or None."""
    graph = {m: {i for i in imports(m) if i in modules and i != m} for m in modules}
    done: set[str] = set()
    for start in sorted(modules):
        path: list[str] = []
        on_path: set[str] = set()
        todo = [(start, iter(sorted(graph[start])))] if start not in done else []
        if todo:
            path.append(start)
            on_path.add(start)
        while todo:
            node, rest = todo[-1]
            nxt = next(rest, None)
            if nxt is None:
                todo.pop()
                path.pop()
                on_path.discard(node)
                done.add(node)
            elif nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            elif nxt not in done:
                todo.append((nxt, iter(sorted(graph[nxt]))))
                path.append(nxt)
                on_path.add(nxt)
    return None


def test_the_router_has_no_import_cycle() -> None:
    router = {m for m in MODULES if not m.startswith("lora_router.emulator")}
    assert cycle(router) is None


def test_a_type_only_import_closes_a_cycle_too() -> None:
    """The check reads imports under `TYPE_CHECKING` (as `ast.walk` does every import)."""
    source = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lora_router.b import B\n"
    )
    MODULES["lora_router.a"] = ast.parse(source)
    MODULES["lora_router.b"] = ast.parse("from lora_router.a import A\n")
    try:
        assert cycle({"lora_router.a", "lora_router.b"}) is not None
    finally:
        del MODULES["lora_router.a"], MODULES["lora_router.b"]


def test_an_attribute_write_is_seen_at_any_depth() -> None:
    def target(source: str) -> ast.expr:
        statement = ast.parse(source).body[0]
        assert isinstance(statement, ast.Assign | ast.AugAssign)
        return statement.targets[0] if isinstance(statement, ast.Assign) else statement.target

    assert all(
        map(writes_attribute, map(target, ["a.b = 1", "a.b[k] = 1", "x, a.b = y", "a.b += 1"]))
    )
    assert not any(map(writes_attribute, map(target, ["x = a.b", "x[a.b] = 1", "x += a.b"])))


def test_bench_and_tests_do_not_import_each_other() -> None:
    """bench/ and tests/ share code through lora_router/testbed/ only: neither imports a module
    of the other (by name, or by putting the other's folder on sys.path or loading its file)."""
    root = PACKAGE.parent
    loaders = ("sys.path.insert", "sys.path.append", "spec_from_file_location", "run_path")

    def modules(folder: str) -> set[str]:
        files = [p for p in (root / folder).rglob("*.py") if "results" not in p.parts]
        return {p.stem for p in files} | {p.parent.name for p in files} | {folder}

    bad = []
    for here, there in (("bench", "tests"), ("tests", "bench")):
        theirs = modules(there) - modules(here) - {"__init__", "conftest"}
        for path in (p for p in (root / here).rglob("*.py") if "results" not in p.parts):
            tree = ast.parse(path.read_text(), str(path))
            named = {  # module-level `NAME = expression`, to read a loader's argument through
                t.id: ast.unparse(node.value)
                for node in tree.body
                if isinstance(node, ast.Assign)
                for t in node.targets
                if isinstance(t, ast.Name)
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.Import | ast.ImportFrom) and not getattr(node, "level", 0):
                    tops = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                    tops += (
                        [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
                    )
                    found = {t.split(".")[0] for t in tops} & theirs
                elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith(loaders):
                    source = " ".join(ast.unparse(a) for a in node.args)
                    source += " ".join(
                        named.get(n.id, "")
                        for a in node.args
                        for n in ast.walk(a)
                        if isinstance(n, ast.Name)
                    )
                    found = {there} if f"'{there}'" in source or f"'{there}/" in source else set()
                else:
                    continue
                bad += (
                    [f"{path.relative_to(root)}:{node.lineno}: {', '.join(sorted(found))}"]
                    if found
                    else []
                )
    assert not bad, "\n".join(bad)


def test_the_package_imports_nothing_of_tests_or_bench() -> None:
    """The package stands alone: no module of it imports a module of tests/ or bench/ (the
    testbed holds what they share), which would work under pytest and fail anywhere else."""
    root = PACKAGE.parent
    theirs = {
        p.stem
        for folder in ("tests", "bench")
        for p in (root / folder).rglob("*.py")
        if p.stem not in ("__init__", "conftest")
    } | {"tests", "bench", "lib"}
    bad = {
        f"{module} imports {name}"
        for module in MODULES
        for name in imports(module)
        if name.split(".")[0] in theirs
    }
    assert not bad, sorted(bad)
