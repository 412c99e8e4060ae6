"""The schedule's forecast (`lr_peak_ahead`) for any loop (issue 22 item 4, issue 24 item 4): from a
dry run of the user's torch scheduler, or from `lr_schedule` for a loop that sets its LR by hand
(nanoGPT's get_lr). Without it the attention ladder waits for a witness of harm (BENCHMARKS.md:
lead 0.37x of a fixed ceiling's against 1.00x with it)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import thermowatch
from tests.client.user_loop import DATA, train_step, user_batch, user_model
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.store import thermometers as thermo_store

STEPS, WARMUP, PEAK = 12, 8, 1e-3


def get_lr(it: int) -> float:  # nanoGPT's shape: linear warm-up, then cosine to a tenth
    if it < WARMUP:
        return PEAK * (it + 1) / WARMUP
    return 0.1 * PEAK + 0.45 * PEAK * (1 + math.cos(math.pi * (it - WARMUP) / (STEPS - WARMUP)))


def _series(tmp_path, name: str, **kw) -> tuple[np.ndarray, np.ndarray]:
    model = user_model()
    opt = torch.optim.AdamW(model.parameters(), lr=PEAK)
    sched = kw.pop("sched", None)
    cfg = SupervisorConfig(data_dir=tmp_path / "sup", db_url=f"sqlite:///{tmp_path}/db.sqlite")
    tw = thermowatch.watch(model, opt, run=name, steps=STEPS, global_batch=4, checkpoint_dir=tmp_path / name,
                           supervisor_config=cfg, scheduler=sched(opt) if sched else None, **kw)
    for step in tw.steps():
        if sched is None:
            for g in opt.param_groups:  # the loop sets its own LR, as nanoGPT does
                g["lr"] = get_lr(step - 1)
        tw.record(train_step(model, opt, *user_batch(DATA, tw.batch_ids(step))))
        if tw.scheduler is not None:
            tw.scheduler.step()
    tw.run.flush()
    with tw.run.supervisor.sessions() as s:
        steps, peak = thermo_store.history(s, name, "lr_peak_ahead")
        _, lr = thermo_store.history(s, name, "lr")
    tw.close()
    return peak, lr


def test_the_forecast_from_a_scheduler_and_from_a_hand_set_lr(tmp_path):
    want = np.maximum.accumulate(np.array([get_lr(i) for i in range(STEPS)])[::-1])[::-1]
    peak, lr = _series(tmp_path, "sched", sched=lambda opt: torch.optim.lr_scheduler.LambdaLR(
        opt, lambda i: get_lr(i) / PEAK))
    assert peak == pytest.approx(want) and lr == pytest.approx([get_lr(i) for i in range(STEPS)])
    peak, lr = _series(tmp_path, "by-hand", lr_schedule=lambda step: get_lr(step - 1))
    assert peak == pytest.approx(want) and lr == pytest.approx([get_lr(i) for i in range(STEPS)])
    # No scheduler and no lr_schedule: the LR the optimizer was built with, held (a constant LR)
    peak, _ = _series(tmp_path, "none")
    assert peak == pytest.approx([PEAK] * STEPS)
    with pytest.raises(ValueError, match="lr_schedule must be a function"):
        thermowatch.watch(user_model(), torch.optim.SGD(user_model().parameters(), lr=0.1), run="x", steps=2,
                          global_batch=4, checkpoint_dir=tmp_path / "x", lr_schedule=0.1)
