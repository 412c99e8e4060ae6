"""The LR the user's schedule gives, now and ahead, for thermowatch.watch: `schedule_lr` reads the
optimizer's LR now; `lr_forecast` is the schedule's largest LR from each step on (the record's
lr_peak_ahead: the attention detectors' witness of harm still to come, monitors/detectors/witness.py),
made once at the start and after each rollback, never per step."""

from __future__ import annotations

import copy
import logging
import math
import warnings
from typing import Any, Callable

import numpy as np
import torch

log = logging.getLogger(__name__)

FORECAST_HORIZON = 200_000  # steps of the schedule dry-run for lr_peak_ahead (one pass, at start)


def schedule_lr(optimizer: torch.optim.Optimizer) -> float:
    """The first parameter group's LR as the schedule set it (a tensor LR read once)."""
    lr = optimizer.param_groups[0]["lr"]
    return float(lr) if not isinstance(lr, torch.Tensor) else float(lr.detach().cpu())


def lr_forecast(optimizer: torch.optim.Optimizer, scheduler: Any, lr_schedule: Callable[[int], float] | None,
                step: int, total: int) -> np.ndarray:
    """peak[k] = the largest LR from step step+k+1 on, from `lr_schedule(step)` when given (a loop
    that sets its LR by hand, as nanoGPT's get_lr does), else a dry run of a copy of `scheduler` on a
    stand-in optimizer (never the user's). Empty when it cannot be made (said once in the log)."""
    n = min(total - step, FORECAST_HORIZON)
    if lr_schedule is not None and n > 0:
        try:
            lrs = np.array([float(lr_schedule(step + 1 + i)) for i in range(n)])
        except Exception as exc:  # noqa: BLE001 - the user's function: no forecast, say so once
            log.warning("thermowatch: lr_schedule failed (%s); the LR forecast is off", exc)
            return np.zeros(0)
        return np.maximum.accumulate(lrs[::-1])[::-1]
    now = schedule_lr(optimizer)
    if scheduler is None or n <= 0:
        return np.full(max(n, 0), now)
    try:
        stand_in = torch.optim.SGD([torch.zeros(1)], lr=now)
        stand_in.param_groups = [{**{k: copy.deepcopy(v) for k, v in g.items() if k != "params"},
                                  "params": [torch.zeros(1)]} for g in optimizer.param_groups]
        # Every reference to the user's optimizer (SequentialLR's children too) becomes the stand-in.
        sched = copy.deepcopy(scheduler, memo={id(optimizer): stand_in})
        lrs = np.empty(n)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for i in range(n):
                lrs[i] = float(stand_in.param_groups[0]["lr"])
                sched.step()
    except Exception as exc:  # noqa: BLE001 - a scheduler we cannot copy: no forecast, say so once
        log.warning("thermowatch: cannot dry-run %s for lr_peak_ahead (%s); the LR forecast is off",
                    type(scheduler).__name__, exc)
        return np.zeros(0)
    return np.maximum.accumulate(lrs[::-1])[::-1]


class Forecast:
    """The schedule's peak LR ahead for one attempt: made at its first step, read per step."""

    def __init__(self) -> None:
        self.base, self.peak = 0, np.zeros(0)

    def make(self, optimizer: torch.optim.Optimizer, scheduler: Any, lr_schedule: Callable[[int], float] | None,
             step: int, total: int) -> None:
        self.base, self.peak = step, lr_forecast(optimizer, scheduler, lr_schedule, step, total)

    def at(self, step: int) -> float:
        """The largest LR from `step` on (NaN past the forecast, or with none)."""
        k = step - 1 - self.base
        return float(self.peak[k]) if 0 <= k < len(self.peak) else math.nan
