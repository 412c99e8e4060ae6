"""A checkpoint write that fails (issue 13, the fault matrix): the checkpoint volume is a real
tmpfs that fills up (ENOSPC on the ranks' writes), then turns read-only (EROFS on the driver's
staging dir), then is given room again. The run must train on through it, the supervisor must
page once when the saves start failing and say when they succeed again, and afterwards every
step is stored once and the checkpoints on disk are whole.

Needs root (mount); this project's machines and CI run as root."""

from __future__ import annotations

import io
import logging
import subprocess

import numpy as np
import pytest

from tests.trainer.conftest import init_local_ray, tiny_config

pytestmark = pytest.mark.slow


def _mount(*args: str) -> None:
    done = subprocess.run(["mount", *args], capture_output=True, text=True)
    assert done.returncode == 0, f"mount {' '.join(args)} failed (this test needs root): {done.stderr}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("db", ["postgres"], indirect=True)
def test_a_full_then_read_only_checkpoint_volume_pages_and_the_run_trains_through(db, tmp_path, caplog):
    from thermowatch.monitors.contract import CHECKPOINT_FAILURES, LOSS, Signal
    from thermowatch.supervisor.app.config import SupervisorConfig
    from thermowatch.supervisor.notify.console import ConsoleNotifier
    from thermowatch.supervisor.app.service import Supervisor
    from thermowatch.supervisor.store import findings as findings_store
    from thermowatch.supervisor.store import thermometers as thermo_store
    from thermowatch.supervisor.store.orm import Step
    from thermowatch.trainer.checkpoint import STAGING_SUFFIX
    from thermowatch.trainer.controller import RunController

    run, steps = "ckptfault", 12
    vol = tmp_path / "ckpt"
    vol.mkdir()
    # One checkpoint of this model is ~1.7 MB: the first fits, the second does not.
    _mount("-t", "tmpfs", "-o", "size=2560k", "tmpfs", str(vol))
    try:
        init_local_ray()
        cfg = tiny_config(tmp_path, run_id=run, steps=steps, optim={"warmup_steps": 2}, step_timeout_s=60.0,
                          checkpoint={"every": 2, "keep_last": 2, "keep_every": 0, "keep_behind": 0})
        alerts = io.StringIO()
        sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url), notifier=ConsoleNotifier(alerts))

        def on_step(rec, attempt):
            if rec.step == 5:
                _mount("-o", "remount,ro", str(vol))  # the next save cannot even create its staging dir
            if rec.step == 7:
                _mount("-o", "remount,rw,size=64m", str(vol))  # room again

        caplog.set_level(logging.ERROR, logger="thermowatch.trainer.controller")
        ctl = RunController(cfg, sup, sup, progress=on_step)
        try:
            result = ctl.run()
            with sup.sessions() as s:
                rows = s.query(Step.attempt, Step.step).filter(Step.run_id == run).all()
                live, _ = thermo_store.history(s, run, LOSS)
                fsteps, fvals = thermo_store.history(s, run, CHECKPOINT_FAILURES)
                paged = [f.finding for f in findings_store.findings(s, run) if f.finding.signal is Signal.CHECKPOINT_FAILED]
        finally:
            sup.close()
        on_disk = sorted(p.name for p in (vol / run).iterdir() if p.name.startswith("step_"))
        newest = ctl.store.latest_valid()
    finally:
        subprocess.run(["umount", "-l", str(vol)], capture_output=True)

    # Trained through: one attempt, no restart, every step stored once.
    assert result.final_step == steps and result.restarts == 0 and result.attempts == [0]
    assert len(rows) == len(set(rows)) and live.tolist() == list(range(1, steps + 1))
    # The two failures were the real ones: the ranks' writes on the full volume (torch.save's
    # ENOSPC reads "unexpected pos ..." or "file write failed"; the ranks raise CheckpointSaveError
    # together), and the driver's mkdir on the read-only one.
    errors = "\n".join(r.getMessage() for r in caplog.records)
    assert "checkpoint at step 4 failed (1 in a row): CheckpointSaveError" in errors, errors
    assert "checkpoint at step 6 failed (2 in a row)" in errors and "Read-only file system" in errors, errors
    # Every record while failing says how many in a row; the first after a good save says 0.
    assert fsteps.tolist() == [5, 6, 7, 8, 9] and fvals.tolist() == [1, 1, 2, 2, 0]
    # Paged once (a critical finding and an alert), and told when it was over.
    assert [(f.onset_step, f.evidence["consecutive_failures"]) for f in paged] == [(5, 1)]
    text = alerts.getvalue()
    assert text.count("checkpoint saves are failing") == 1 and text.count("checkpoints are saved again") == 1, text
    # The failed saves left nothing half-written; the checkpoints kept are whole and loadable.
    assert not any(name.endswith(STAGING_SUFFIX) for name in on_disk), on_disk
    assert on_disk == ["step_00000010", "step_00000012"] and newest is not None and newest.step == steps
    assert np.isfinite(live).all()
