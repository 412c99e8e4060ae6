"""supervisor.serve.daemon.Daemon, the routers' view of the Supervisor: every router and page
function takes `sup: Daemon`, uses only what Daemon lists (and Daemon lists nothing they do not
use), and the real Supervisor is one."""

from __future__ import annotations

import ast
import inspect
import io

from thermowatch.supervisor.act.executor import Executor
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.serve.daemon import Daemon
from tests.supervisor import ROOT

SERVE = ROOT / "supervisor" / "serve"
ROUTERS = sorted([*(SERVE / "api").glob("*.py"), *(SERVE / "web").glob("*.py")])
MEMBERS = set(Daemon.__annotations__) | {n for n, v in vars(Daemon).items() if callable(v) and not n.startswith("_")}


def _uses(paths) -> tuple[set[str], set[str], list[str]]:
    """(attributes read off `sup`, methods called on `sup.executor`, `sup` parameters not typed Daemon)."""
    used, executor, untyped = set(), set(), []
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "sup":
                used.add(node.attr)
            elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                  and isinstance(node.value.value, ast.Name) and node.value.value.id == "sup"
                  and node.value.attr == "executor"):
                executor.add(node.attr)
            elif isinstance(node, ast.arg) and node.arg == "sup" and ast.unparse(node.annotation or ast.Constant(None)) != "Daemon":
                untyped.append(f"{path.parent.name}/{path.name}:{node.lineno}")
    return used, executor, untyped


def test_the_routers_take_a_daemon_and_use_exactly_what_it_lists():
    used, executor, untyped = _uses(ROUTERS)
    assert untyped == [], "type these `sup` parameters as supervisor.serve.daemon.Daemon"
    assert used == MEMBERS, "add what a router uses to Daemon, and drop what none does"
    assert executor and all(callable(getattr(Executor, m, None)) for m in executor), executor


def test_the_scan_sees_an_untyped_sup_and_a_new_attribute(tmp_path):
    (tmp_path / "r.py").write_text("def make_router(sup, *, guard):\n    return sup.judge.backlog\n")
    used, _, untyped = _uses([tmp_path / "r.py"])
    assert used == {"judge"} and untyped == [f"{tmp_path.name}/r.py:1"]


def test_the_supervisor_is_a_daemon(tmp_path):
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "data"), notifier=ConsoleNotifier(io.StringIO()))
    try:
        assert isinstance(sup, Daemon)
        for name in ("poll", "ack"):
            want = list(inspect.signature(getattr(Daemon, name)).parameters)[1:]
            assert list(inspect.signature(getattr(sup, name)).parameters)[: len(want)] == want, name
    finally:
        sup.close()
