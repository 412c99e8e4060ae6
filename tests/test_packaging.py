"""One import name (issue 22): the wheel holds `thermowatch` and nothing else at the top level,
every package is listed in pyproject.toml, and the installed layout (packages inside
`thermowatch/`, no source checkout beside them) imports, migrates a database and runs the command."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"thermowatch": "thermowatch", "supervisor": "thermowatch.supervisor", "monitors": "thermowatch.monitors",
           "trainer": "thermowatch.trainer", "migrations": "thermowatch.migrations"}


def test_every_package_folder_is_in_the_wheel_list():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join([FOLDERS[init.relative_to(ROOT).parts[0]], *init.relative_to(ROOT).parts[1:-1]])
             for folder in FOLDERS for init in (ROOT / folder).rglob("__init__.py")}
    assert found == listed, f"missing from pyproject: {sorted(found - listed)}; listed but absent: {sorted(listed - found)}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    had_build = (ROOT / "build").exists()
    try:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                        str(out), str(ROOT)], check=True, cwd=out, timeout=300)
    finally:
        if not had_build:  # setuptools builds in the checkout: leave no second copy of the packages there
            shutil.rmtree(ROOT / "build", ignore_errors=True)
    (path,) = out.glob("thermowatch-*.whl")
    return path


def test_the_wheel_installs_only_thermowatch(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"thermowatch", wheel.name.split("-py")[0] + ".dist-info"}, tops
    assert "thermowatch/migrations/versions/0001_initial.py" in names
    assert "thermowatch/supervisor/serve/web/static/run.js" in names


def test_the_installed_layout_imports_migrates_and_runs(wheel, tmp_path):
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import sys, thermowatch, thermowatch.supervisor.db as db, thermowatch.trainer.controller\n"
        "assert list(thermowatch.__path__) == [sys.argv[1] + '/thermowatch'], thermowatch.__path__\n"
        "assert str(db.MIGRATIONS_DIR).startswith(sys.argv[1]), db.MIGRATIONS_DIR\n"
        "db.upgrade(db.make_engine('sqlite:///' + sys.argv[1] + '/t.db'))\n"
        "mods = {n: m for n, m in sys.modules.items() if n.split('.')[0] in "
        "('thermowatch', 'supervisor', 'monitors', 'trainer', 'migrations')}\n"
        "assert all(n.startswith('thermowatch') for n in mods), sorted(mods)\n"
        "assert all(getattr(m, '__file__', None) is None or m.__file__.startswith(sys.argv[1]) for m in mods.values())\n")
    # The checkout is not on the path: run from elsewhere, the unpacked wheel first.
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "-c", code, str(site)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run([sys.executable, "-m", "thermowatch", "--version"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.startswith("thermowatch "), r.stdout + r.stderr
