"""DESIGN.md's import rule, enforced: `monitors` depends on torch (and numpy) only; `trainer` may
import `monitors`, never `supervisor`; `supervisor` imports `monitors` but never `trainer`,
except in the composition modules that launch training (`thermowatch train`, `thermowatch
demo`). Every import counts, including those inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# The modules that put a supervisor and a trainer together in one process (train, demo).
COMPOSITION = {"supervisor/launch.py", "supervisor/demo.py"}
FORBIDDEN = {"monitors": {"trainer", "supervisor"}, "trainer": {"supervisor"}, "supervisor": {"trainer"}}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            # `from supervisor import jobs` imports the module supervisor.jobs
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_packages_import_only_what_design_allows():
    bad = []
    for package, forbidden in FORBIDDEN.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in COMPOSITION:
                continue
            for line, name in _imports(path):
                if name.split(".")[0] in forbidden:
                    bad.append(f"{rel}:{line} imports {name}")
    assert bad == [], "imports against DESIGN.md's rule:\n" + "\n".join(bad)


def test_the_rule_sees_function_level_imports():
    # The checker must catch the form the composition modules use, or it proves nothing.
    names = [n for _, n in _imports(ROOT / "supervisor/launch.py")]
    assert "trainer.controller" in names


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def test_no_import_cycles_inside_the_supervisor():
    """A cycle (jobs <-> service was one, hidden behind TYPE_CHECKING and a function-level import)
    means two modules are one concept split in two files, or a missing seam."""
    paths = {_module(p): p for p in (ROOT / "supervisor").rglob("*.py")}
    graph = {m: {n for _, n in _imports(p) if n in paths and n != m} for m, p in paths.items()}
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
