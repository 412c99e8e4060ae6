"""DESIGN.md's import rule, enforced over every package with no exception: `monitors` depends on
torch (and numpy) only; `trainer` may import `monitors`, never `supervisor`; `supervisor` imports
`monitors` but never `trainer`. The top-level `thermowatch` package holds the public client
(torch only: it never imports the bundled trainer; the bundled trainer uses its transport, so one
implementation of the protocol serves both) and the composition (`thermowatch train`, `demo`, the
command line), which nothing imports. Every import counts,
including those inside functions; every name is spelled `thermowatch.<package>` (issue 22)."""

from __future__ import annotations

import ast
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("monitors", "trainer", "supervisor", "migrations")
# The top-level package's own modules: the composition (cli, launch, demo) and the client (the rest).
COMPOSITION = {"thermowatch.cli", "thermowatch.launch", "thermowatch.demo", "thermowatch.__main__"}
FORBIDDEN = {"monitors": {"trainer", "supervisor", "client", "composition"},
             "trainer": {"supervisor", "composition"},
             "supervisor": {"trainer", "client", "composition"},
             "migrations": {"trainer", "client", "composition"},
             # the client may start an embedded supervisor (no server configured), never the trainer
             "client": {"trainer", "composition"}, "composition": set()}
OLD_NAMES = set(PACKAGES)


def _parse(path: Path) -> ast.Module:
    """ast.parse, again after CPython 3.11's "AST constructor recursion depth mismatch": its
    recursion count is the interpreter's, not the thread's (gh-106905, fixed in 3.12), and a
    thread of an earlier test formatting a traceback (3.11's carets parse source) can race it."""
    for attempt in range(5):
        try:
            return ast.parse(path.read_text(), str(path))
        except SystemError:
            if attempt == 4:
                raise
            time.sleep(0.05)
    raise AssertionError("unreachable")


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            # `from supervisor import jobs` imports the module supervisor.app.jobs
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def _package_of(name: str) -> str | None:
    """thermowatch.trainer.x -> trainer; thermowatch.cli -> composition; thermowatch.transport or
    `from thermowatch import watch` -> client."""
    parts = name.split(".")
    if parts[0] != "thermowatch":
        return None
    if len(parts) > 1 and parts[1] in PACKAGES:
        return parts[1]
    return "composition" if ".".join(parts[:2]) in COMPOSITION else "client"


def _top_modules():
    """(package, path) for thermowatch/*.py: composition or client."""
    for path in sorted((ROOT / "thermowatch").rglob("*.py")):
        name = "thermowatch." + ".".join(path.relative_to(ROOT / "thermowatch").with_suffix("").parts)
        yield ("composition" if name in COMPOSITION else "client"), path


def _sources():
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))
    yield from sorted((ROOT / "thermowatch").rglob("*.py"))


def test_packages_import_only_what_design_allows():
    bad = []
    files = [(p, path) for p in PACKAGES for path in sorted((ROOT / p).rglob("*.py"))] + list(_top_modules())
    assert any(p == "client" for p, _ in files) and any(p == "composition" for p, _ in files)
    for package, path in files:
        rel = path.relative_to(ROOT).as_posix()
        for line, name in _imports(path):
            if _package_of(name) in FORBIDDEN[package]:
                bad.append(f"{rel}:{line} imports {name}")
    assert bad == [], "imports against DESIGN.md's rule:\n" + "\n".join(bad)


def test_every_import_uses_the_one_import_name():
    """`import supervisor` would load a second copy of a module beside thermowatch.supervisor's
    (two registries, two engines); in a wheel it would not import at all."""
    everything = [*_sources(), *sorted((ROOT / "tests").rglob("*.py")), *sorted((ROOT / "bench").rglob("*.py"))]
    bad = [f"{p.relative_to(ROOT)}:{line} imports {name}"
           for p in everything for line, name in _imports(p) if name.split(".")[0] in OLD_NAMES]
    assert bad == [], "\n".join(bad)


def test_the_rule_sees_function_level_imports():
    # The checker must catch the form the composition modules use, or it proves nothing.
    names = [n for _, n in _imports(ROOT / "thermowatch/launch.py")]
    assert "thermowatch.trainer.controller" in names and _package_of("thermowatch.trainer.controller") == "trainer"
    assert _package_of("thermowatch.cli") == "composition" and _package_of("thermowatch") == "client"
    assert _package_of("thermowatch.transport.HttpSink") == "client"


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


# Inside the supervisor, one folder per stage of its loop (supervisor/__init__.py,
# docs/architecture.md's tree); each may import only the stages named here (and itself).
# "root" is supervisor/{errors,db,limits}.py, which every stage may import.
STAGES = {
    "root": set(),
    "store": {"root"},
    "charts": {"store", "root"},
    "ingest": {"store", "root"},
    "decide": {"store", "root"},
    "notify": {"decide", "charts", "store", "root"},
    "judge": {"notify", "store", "root"},
    "act": {"judge", "decide", "notify", "store", "root"},
    "simulate": {"app", "decide", "root"},  # `thermowatch simulate`: goodput at scale; reads a config file
    "app": {"ingest", "judge", "decide", "act", "notify", "charts", "store", "root"},
    "serve": {"app", "ingest", "judge", "decide", "act", "notify", "charts", "store", "root"},
    "operate": {"act", "root"},  # clients of the HTTP API; act.outcome is how an outcome prints
}


def _stage(module: str) -> str | None:
    parts = module.split(".")
    if parts[:2] != ["thermowatch", "supervisor"]:
        return None
    return parts[2] if len(parts) > 2 and (ROOT / "supervisor" / parts[2]).is_dir() else "root"


def _graph(paths: dict[str, Path]) -> dict[str, set[str]]:
    return {m: {n for _, n in _imports(p) if n in paths and n != m} for m, p in paths.items()}


def _all_modules() -> dict[str, Path]:
    out = {}
    for package in (*PACKAGES, "thermowatch"):
        for p in (ROOT / package).rglob("*.py"):
            name = _module(p)
            out[name if package == "thermowatch" else "thermowatch." + name] = p
    return out


def test_each_supervisor_stage_imports_only_the_stages_below_it():
    modules = {m: p for m, p in _all_modules().items() if _stage(m)}
    assert set(STAGES) == {_stage(m) for m in modules}, "a new folder under supervisor/ needs a row in STAGES"
    bad = []
    for m, p in sorted(modules.items()):
        here = _stage(m)
        for line, name in _imports(p):
            there = _stage(name)
            if there and there != here and there not in STAGES[here]:
                bad.append(f"{p.relative_to(ROOT)}:{line} ({here}) imports {name} ({there})")
    assert bad == [], "imports against the stage table:\n" + "\n".join(bad)


def test_the_api_and_the_web_pages_never_import_each_other():
    """They share the store's read model (store/views.py), serve.guard and charts/, not each other."""
    modules = _all_modules()
    bad = [f"{p.relative_to(ROOT)}:{line} imports {name}"
           for m, p in modules.items() for side, other in (("api", "web"), ("web", "api"))
           if m.startswith(f"thermowatch.supervisor.serve.{side}")
           for line, name in _imports(p) if name.startswith(f"thermowatch.supervisor.serve.{other}")]
    assert bad == [], "\n".join(bad)


def test_no_import_cycles_in_any_package():
    """A cycle (jobs <-> service was one, hidden behind TYPE_CHECKING and a function-level import;
    the controller and its command handlers were another) means two modules are one concept split
    in two files, or a missing seam."""
    graph = _graph(_all_modules())
    cycles, state = [], {}

    def visit(m, stack):
        state[m] = "open"
        for n in sorted(graph[m]):
            if state.get(n) == "open":
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack + [n])
        state[m] = "done"

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == [], "import cycles: " + "; ".join(" -> ".join(c) for c in cycles)


def summary() -> str:
    """The import graph these tests hold the code to, as counts of module-level imports: between
    packages, and between the supervisor's stages. `python -m tests.test_import_rules`."""
    modules = _all_modules()
    graph = _graph(modules)
    between, stages = Counter(), Counter()
    for m, ns in graph.items():
        for n in ns:
            a, b = _package_of(m), _package_of(n)
            if a != b:
                between[(a, b)] += 1
            sa, sb = _stage(m), _stage(n)
            if sa and sb and sa != sb:
                stages[(sa, sb)] += 1
    lines = [f"{len(modules)} modules; imports between packages (importer -> imported: count):"]
    lines += [f"  {a} -> {b}: {k}" for (a, b), k in sorted(between.items())]
    lines.append("between the supervisor's stages:")
    for a in STAGES:
        row = ", ".join(f"{b} {k}" for (x, b), k in sorted(stages.items()) if x == a)
        lines.append(f"  {a} -> {row or '-'}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(summary())
