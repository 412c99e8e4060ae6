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

from monitors.contract import LR, LR_MULTIPLIER, Finding, Outcome, RunInfo, Severity, Signal
from supervisor.config import SupervisorConfig
from supervisor.notify.console import ConsoleNotifier
from supervisor.service import Supervisor
from supervisor.store import actions as actions_store
from supervisor.store import checkpoints as ckpt_store
from supervisor.store import findings as findings_store
from supervisor.store import lr_changes as lr_store
from supervisor.store import thermometers as thermo_store

os.environ.setdefault("DS_ACCELERATOR", "cpu")

RUN = "seam"
POLICY = {"rollback_margin_steps": 2, "recurrence_window_steps": 100, "lr_multiplier": 0.5,
          "min_lr_multiplier": 0.1, "cooldown_steps": 0, "cooldown_s": 0.0, "max_interventions": 50,
          "recurrence_rollback": False}


def tiny(tmp_path, **over):
    from tests.trainer.conftest import tiny_config

    return tiny_config(tmp_path, run_id=RUN, world_size=1, cpus_per_rank=1,
                       checkpoint={"every": 4, "keep_last": 2, "keep_every": 0},
                       model={"n_layer": 1, "d_model": 32, "n_head": 2},
                       data={"max_bytes": 1 << 18, "seq_len": 32, "global_batch": 4}, **over)


def spike(step: int) -> Finding:
    return Finding(Signal.LOSS_SPIKE, "", Severity.CRITICAL, onset_step=step - 1, detect_step=step, metric="loss",
                   outcome=Outcome.ACT)


def test_trained_lr_equals_recorded_multiplier_across_two_cuts_and_a_rollback(db, tmp_path):
    from trainer.controller import RunController
    from trainer.local import InProcessGang

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
            acts = sorted(actions_store.actions(s, RUN), key=lambda a: a.id)
            changes = lr_store.lr_changes(s, RUN)
            steps, lrs = thermo_store.history(s, RUN, LR)
            _, mults = thermo_store.history(s, RUN, LR_MULTIPLIER)
            recorded = np.array([lr_store.multiplier_in_force(s, RUN, int(k)) for k in steps])
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
        assert (last["checkpoint_step"], last["step"], last["lr_multiplier"]) == (16, 17, 0.25)
        assert mismatches == []
        assert listed == ctl.store.steps()  # the supervisor's list is the trainer's disk
    finally:
        sup.close()
