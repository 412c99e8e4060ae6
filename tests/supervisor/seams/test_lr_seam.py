"""The seam issue 9 found untested: policy + executor + a real RunController (a tiny GPT, one
rank in-process: trainer.local.InProcessGang, real DeepSpeed on gloo) through the embedded
Supervisor, on SQLite and PostgreSQL. The LR the trainer trains with must equal what the
database records, across a rollback, two automatic LR cuts (0.5 then 0.25: absolute, not
0.125) and a manual rollback.

The findings are handed to the responder directly (the policy's input); detectors are tested
on real divergences elsewhere. Everything after the finding is the real path."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest

from thermowatch.monitors.contract import LR, LR_MULTIPLIER, Finding, Outcome, RunInfo, Severity, Signal
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import checkpoints as ckpt_store
from thermowatch.supervisor.store import findings as findings_store
from thermowatch.supervisor.store import lr_changes as lr_store
from thermowatch.supervisor.store import thermometers as thermo_store

os.environ.setdefault("DS_ACCELERATOR", "cpu")

RUN = "seam"
POLICY = {"rollback_margin_steps": 2, "recurrence_window_steps": 100, "lr_factor": 0.5,
          "min_lr_multiplier": 0.1, "cooldown_steps": 0, "cooldown_s": 0.0, "max_interventions": 50,
          "recurrence_rollback": False}


def tiny(tmp_path, **over):
    from tests.trainer.conftest import tiny_config

    return tiny_config(tmp_path, run_id=RUN, world_size=1, cpus_per_rank=1,
                       checkpoint={"every": 4, "keep_last": 2, "keep_every": 0},
                       model={"n_layer": 1, "d_model": 32, "n_head": 2},
                       data={"max_bytes": 1 << 18, "seq_len": 32, "global_batch": 4}, **over)


def _lr_record(s):
    """What the database says about the run's LR: its actions, LR changes, the LR each stored
    step trained at, and the multiplier the database has in force at each of those steps."""
    acts = sorted(actions_store.actions(s, RUN), key=lambda a: a.id)
    steps, lrs = thermo_store.history(s, RUN, LR)
    recorded = np.array([lr_store.multiplier_in_force(s, RUN, int(k)) for k in steps])
    return acts, lr_store.lr_changes(s, RUN), steps, lrs, recorded


def spike(step: int) -> Finding:
    return Finding(Signal.LOSS_SPIKE, "", Severity.CRITICAL, onset_step=step - 1, detect_step=step, metric="loss",
                   outcome=Outcome.ACT)


def test_trained_lr_equals_recorded_multiplier_across_two_cuts_and_a_rollback(db, tmp_path):
    from thermowatch.trainer.controller import RunController
    from thermowatch.trainer.local import InProcessGang

    cfg = tiny(tmp_path, steps=22)
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, policy=dict(POLICY)),
                     notifier=ConsoleNotifier(io.StringIO()))
    plan = {(0, 10): "spike", (1, 10): "spike", (1, 14): "spike", (1, 18): "manual"}

    def on_step(rec, attempt):
        what = plan.pop((attempt, rec.step), None)
        if what == "spike":
            sup.responder.handle(RUN, spike(rec.step))
        elif what == "manual":
            sup.executor.submit(RUN, "rollback", {"to_step": 16}, "alice", "replay from 16")

    ctl = RunController(cfg, sup, sup, progress=on_step, gang_factory=InProcessGang)
    try:
        result = ctl.run()
        assert not plan, f"steps never reached: {plan}"
        schedule = cfg.lr_schedule()
        with sup.sessions() as s:
            acts, changes, steps, lrs, recorded = _lr_record(s)
            _, mults = thermo_store.history(s, RUN, LR_MULTIPLIER)
            mismatches = [f for f in findings_store.findings(s, RUN) if f.finding.signal is Signal.STATE_MISMATCH]
            listed = sorted({c.step for c in ckpt_store.checkpoints(s, RUN)})
        assert [(a.kind, a.state) for a in acts] == [("rollback", "done"), ("set_lr", "done"), ("set_lr", "done"),
                                                     ("rollback", "done")]
        # The second cut is absolute: x0.25, recorded and trained.
        assert [c.multiplier for c in changes] == [0.5, 0.25]
        assert [c.start_step for c in changes] == [11, 15]
        # Every step the run kept: trained LR == schedule x the multiplier the DB says was in force.
        want = np.array([schedule.at(int(k)) for k in steps]) * recorded
        np.testing.assert_allclose(lrs, want, rtol=1e-6)
        np.testing.assert_allclose(mults, recorded, rtol=1e-12)
        assert recorded[-1] == 0.25 and result.final_step == 22
        # What the acks say happened: the manual rollback loaded checkpoint 16 and trains at x0.25.
        last = acts[-1].result
        assert (last["checkpoint_step"], last["first_step"], last["lr_multiplier"]) == (16, 17, 0.25)
        assert mismatches == []
        assert listed == ctl.store.steps()  # the supervisor's list is the trainer's disk
    finally:
        sup.close()


def test_the_lr_forecast_lowers_the_lr_the_trainer_trains_at(db, tmp_path):
    """Issue 8's forecast across the seam, nothing handed over by hand: the real trainer sends
    `lr_peak_ahead` with every step, the default detector bank judges the records as the daemon
    does, the policy lowers the LR in place (no rollback: nothing is damaged yet), the executor
    sends it, and the trainer trains at it. The ceiling is lowered to the tiny model's own logit
    scale so that the crossing falls inside its 10-step warm-up (5x the LR still to come)."""
    from thermowatch.monitors.contract import LR_PEAK_AHEAD
    from thermowatch.trainer.controller import RunController
    from thermowatch.trainer.local import InProcessGang

    cfg = tiny(tmp_path, steps=24, optim={"lr": 3e-2, "warmup_steps": 20})
    detectors = {"attn": {"ceiling": 1.0, "act_level": 0.5, "min_growth": 1e-9}}
    policy = {k: v for k, v in POLICY.items() if k != "recurrence_rollback"}
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, policy=policy, detectors=detectors),
                     notifier=ConsoleNotifier(io.StringIO()))
    ctl = RunController(cfg, sup, sup, gang_factory=InProcessGang)
    try:
        result = ctl.run()
        sup.judge.wait()
        schedule = cfg.lr_schedule()
        with sup.sessions() as s:
            acts, changes, steps, lrs, recorded = _lr_record(s)
            _, ahead = thermo_store.history(s, RUN, LR_PEAK_AHEAD)
            found = [f.finding for f in findings_store.findings(s, RUN)]
        assert result.final_step == 24
        acting = [f for f in found if f.outcome is Outcome.ACT]
        assert acting and acting[0].signal is Signal.ATTN_LOGIT_CEILING
        assert set(acting[0].evidence["witnesses"]) == {"lr_forecast"}
        assert acting[0].detect_step <= 10  # inside the warm-up, with >= 2x the LR to come
        # One action: the LR lowered in place, done; no rollback.
        assert [(a.kind, a.state) for a in acts] == [("set_lr", "done")]
        assert [c.multiplier for c in changes] == [0.5] and changes[0].start_step > acting[0].detect_step
        # The trainer trained at what the database says, and its forecast followed the cut.
        np.testing.assert_allclose(lrs, np.array([schedule.at(int(k)) for k in steps]) * recorded, rtol=1e-6)
        np.testing.assert_allclose(ahead, np.array([schedule.peak_from(int(k)) for k in steps]) * recorded, rtol=1e-6)
        assert recorded[-1] == 0.5
    finally:
        sup.close()
