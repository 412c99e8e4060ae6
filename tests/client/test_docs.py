"""Public names are promises: every example in docs/any-trainer.md (a fenced python block after
an `<!-- example -->` line) runs as written, as a script of its own in an empty directory, with no
server configured (the embedded supervisor), and leaves what it says in the database."""

from __future__ import annotations

import math
import os
import re
import sqlite3
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "any-trainer.md"
EXAMPLES = re.findall(r"<!-- example -->\n```python\n(.*?)```", DOC.read_text(), re.S)
TORCHRUN = re.findall(r"<!-- example: torchrun -->\n```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_page_has_its_examples():
    assert len(EXAMPLES) == 5 and all("import thermowatch" in e for e in EXAMPLES)


def test_dir_lists_the_public_names_and_each_resolves():
    """Issue 35: dir(thermowatch) listed no public name (they are imported on first use)."""
    import thermowatch

    assert {"watch", "Run", "ThermometerConfig", "Ack", "StepRecord", "PreciseSkip"} <= set(thermowatch.__all__)
    assert set(thermowatch.__all__) <= set(dir(thermowatch))
    for name in thermowatch.__all__:
        assert getattr(thermowatch, name) is not None
    # every name the docs import from thermowatch is public
    used = set(re.findall(r"\bthermowatch\.([A-Za-z_]\w*)\b", DOC.read_text()))
    used |= {n.strip() for line in re.findall(r"from thermowatch import ([\w, ]+)", DOC.read_text()) for n in line.split(",")}
    modules = {"integrations", "supervisor", "monitors", "trainer", "protocol"}
    assert used - modules <= set(thermowatch.__all__), used - modules - set(thermowatch.__all__)


def test_every_thermometer_config_field_is_in_the_table_with_its_default():
    """Issue 35: ThermometerConfig's fields had no docs a user reads (only comments in its source)."""
    import dataclasses

    from thermowatch.monitors.thermometers import ThermometerConfig

    rows = dict(re.findall(r"^\| `(\w+)` \| (.*?) \|", DOC.read_text().split("## What the thermometers measure")[1],
                           re.M))
    fields = {f.name: f.default for f in dataclasses.fields(ThermometerConfig)}
    assert list(rows) == list(fields)
    for name, default in fields.items():
        if isinstance(default, (bool, int, str)) or default is None:  # a tuple's default is told in words
            assert rows[name] == f"`{default!r}`".replace("'", '"'), (name, rows[name])


def _run(code: str, cwd: Path, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    # As a user runs the script: no THERMOWATCH_ settings, and none of the torch.distributed
    # rendezvous variables an earlier test's in-process Trainer or process group left in this
    # worker's environment (one run failed with EADDRINUSE on the port they named).
    dist_env = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK"}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("THERMOWATCH_", "TORCHELASTIC_", "ACCELERATE_"))
           and k not in dist_env}
    env.update(XDG_CONFIG_HOME=str(cwd / "xdg"), PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    (cwd / "example.py").write_text(code)
    return subprocess.run([sys.executable, *launcher, "example.py"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.parametrize("i", range(len(EXAMPLES)))
def test_each_example_runs_as_written(i, tmp_path):
    r = _run(EXAMPLES[i], tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    db = sqlite3.connect(tmp_path / ".thermowatch" / "thermowatch.db")
    runs = dict(db.execute("SELECT run_id, MAX(step) FROM steps GROUP BY run_id").fetchall())
    if i == 0:
        assert "run my-run: step 40, attempt 1" in r.stdout, r.stdout
        assert runs == {"my-run": 40}
        ckpts = sorted(s for (s,) in db.execute("SELECT step FROM checkpoints WHERE run_id = 'my-run'"))
        assert ckpts == [10, 20, 30, 40] and sorted(p.name for p in (tmp_path / "ckpt").glob("*.pt")) == [
            "step_00000010.pt", "step_00000020.pt", "step_00000030.pt", "step_00000040.pt"]
        keys = {k for (k,) in db.execute("SELECT metric FROM series")}
        assert {"loss", "lr", "attn_logit_lse", "lr_multiplier"} <= keys, keys
    elif i == 1:  # LR set by hand, its forecast from lr_schedule; precise skip on (nothing to skip)
        assert "run by-hand: step 20, attempt 1" in r.stdout and "step 20 lr " in r.stdout, r.stdout
        assert runs == {"by-hand": 20}
        from sqlalchemy import create_engine
        from sqlalchemy.orm import Session

        from thermowatch.supervisor.store import thermometers as thermo_store

        with Session(create_engine(f"sqlite:///{tmp_path / '.thermowatch' / 'thermowatch.db'}")) as s:
            steps, peak = thermo_store.history(s, "by-hand", "lr_peak_ahead")
        # the forecast from lr_schedule: at each step, the largest LR the example's get_lr gives
        # from there on (the peak 1e-3 through the warm-up, then the cosine's own LR)
        lrs = [1e-3 * (it + 1) / 8 if it < 8 else 1e-3 * (0.1 + 0.45 * (1 + math.cos(math.pi * (it - 8) / 12)))
               for it in range(20)]
        assert steps.tolist() == list(range(1, 21))
        assert peak == pytest.approx(np.maximum.accumulate(np.array(lrs)[::-1])[::-1])
    elif i == 2:  # thermowatch.Run: its own checkpoints, thermometers and forecast
        assert "run own-loop: step 30, attempt 1" in r.stdout, r.stdout
        assert runs == {"own-loop": 30}
        ckpts = sorted(s for (s,) in db.execute("SELECT step FROM checkpoints WHERE run_id = 'own-loop'"))
        assert ckpts == [10, 20, 30] and len(list((tmp_path / "ckpt").glob("step_*.pt"))) == 3
        keys = {k for (k,) in db.execute("SELECT metric FROM series")}
        assert {"loss", "lr", "grad_norm", "lr_multiplier", "lr_peak_ahead"} <= keys, keys
        assert db.execute("SELECT finish_reason FROM attempts WHERE run_id = 'own-loop'").fetchone() == ("completed",)
    else:  # the Hugging Face Trainer and Lightning adapters: the same run, checkpoints and finish
        run = "hf-run" if i == 3 else "pl-run"
        assert f"run {run}: step 20, attempt 1" in r.stdout, r.stdout
        assert runs == {run: 20}
        ckpts = sorted(s for (s,) in db.execute("SELECT step FROM checkpoints WHERE run_id = ?", (run,)))
        assert ckpts == [10, 20], ckpts
        keys = {k for (k,) in db.execute("SELECT metric FROM series")}
        assert {"loss", "lr", "lr_multiplier"} <= keys, keys


def test_the_torchrun_example_runs_on_two_ranks(tmp_path):
    from tests.live_server import free_port

    assert len(TORCHRUN) == 1
    r = _run(TORCHRUN[0], tmp_path, ("-m", "torch.distributed.run", "--nproc_per_node", "2",
                                     "--master_addr", "127.0.0.1", "--master_port", str(free_port())))
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "run ddp-run: step 20, attempt 1" in r.stdout, r.stdout
    db = sqlite3.connect(tmp_path / ".thermowatch" / "thermowatch.db")
    assert dict(db.execute("SELECT run_id, MAX(step) FROM steps GROUP BY run_id").fetchall()) == {"ddp-run": 20}
    assert db.execute("SELECT count(*) FROM steps WHERE run_id = 'ddp-run'").fetchone()[0] == 20  # rank 0's only
    assert sorted(s for (s,) in db.execute("SELECT step FROM checkpoints WHERE run_id = 'ddp-run'")) == [10, 20]
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step_")) == [
        "step_00000010", "step_00000020"]
    assert db.execute("SELECT world_size FROM attempts WHERE run_id = 'ddp-run'").fetchone()[0] == 2


def test_every_thermowatch_name_the_readme_shows_exists():
    """The README's sketches elide the user's model (`...`), so they cannot run; the names they
    promise must still resolve, as the docs' runnable examples do."""
    import importlib

    text = (ROOT / "README.md").read_text()
    names = set(re.findall(r"\bthermowatch(?:\.\w+)+", text)) - {"thermowatch.service"}  # the systemd unit
    assert {"thermowatch.watch", "thermowatch.integrations.hf.ThermowatchCallback",
            "thermowatch.integrations.lightning.ThermowatchCallback"} <= names, names
    for name in sorted(names):
        parts = name.split(".")
        for cut in range(len(parts), 0, -1):  # the longest importable module, then attributes
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
                break
            except ImportError:
                continue
        for attr in parts[cut:]:
            assert hasattr(obj, attr), f"README names {name}, but {attr!r} is not there"
            obj = getattr(obj, attr)
