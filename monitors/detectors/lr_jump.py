"""LR jump (keys `lr`, `loss`, `lr_peak_ahead`): a raise of the recorded LR that the schedule did
not plan, followed by a loss that is still behind its pre-raise trend a window later (issue 24).

An operator's edit or a run resumed with another config can raise the LR mid-run. When the
damage is sudden, the loss-spike detector sees it; when it is gradual (the loss rises 0.25+
nats over a hundred steps, under the spike bar and within 8 % of its own moving trend), only
the LR change explains it. A raise is not harm by itself: a run raised x4 mid-run can lose
~0.2 nats for ~50 steps and then end better than every run at the old LR. So the raise is
evidence, and the verdict waits:

- Unplanned: the LR rose at least `jump_ratio`-fold in one step and past what the schedule had
  forecast the step before (`lr_peak_ahead`: the largest LR it will still train at). Without
  a forecast, a raise that follows `settle` steps of a flat or falling LR (a warm-up's steps
  are not jumps: they follow rises).
- The pre-raise trend: log(loss) against log(step), fitted over the last `fit` smoothed points
  before the raise (witness.LossTrend's model), frozen there, so the raise's own effect can
  never become its baseline.
- The verdict, from `window` steps after the raise: when the last `confirm` smoothed points all
  stand above that trend by more than `margin` (and 3 x the fit's residual spread), the finding
  fires, CRITICAL with outcome act: the policy sets the LR back to what it was before the raise.
  Still on trend (or better) by `window + patience` steps: the raise cost nothing lasting, it
  is left alone, and the detector waits for the next raise.

Why a window of 100 steps: the transient cost of a beneficial raise lasts ~50 steps (the
held-out x4 run), so 100 leaves it twice that to recover, and the 20-point confirmation needs
the loss behind for the whole of steps 80-100 after the raise, not one noisy stretch. A raise
whose damage is fast is the spike detectors' (they act within a few steps); this one answers
the slow case, where acting 100 steps late still saves the rest of the run.

Pure, bounded, restartable (state_dict / load_state_dict); a rollback to before the raise
(reset) forgets it, and the re-trained steps meet the same raise again if it is in the schedule.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from thermowatch.monitors.contract import LOSS, LR, LR_PEAK_AHEAD, Finding, Outcome, Severity, Signal

from .base import at_least_each, positive
from .witness import line_fit


@dataclass
class LrJumpConfig:
    # A raise counts from x1.5 in one step: an operator's "a bit more" is already a decision
    # worth checking; a schedule's own step-to-step change is far smaller after warm-up.
    jump_ratio: float = 1.5
    window: int = 100  # steps after the raise before any verdict (module docstring)
    confirm: int = 20  # smoothed points in a row behind the pre-raise trend, ending at the verdict
    patience: int = 100  # steps after the window still judged; then the raise is left alone
    margin: float = 0.08  # behind = smoothed loss above the trend by more than 8 % (LossTrend's margin)
    fit: int = 64  # smoothed points before the raise that the trend is fitted on (at least half needed)
    smooth: int = 10  # trailing mean of the loss: one noisy batch is not a trend
    settle: int = 20  # without a forecast: steps of a flat or falling LR before a raise is a jump

    def __post_init__(self) -> None:
        if not self.jump_ratio > 1.0:
            raise ValueError(f"jump_ratio must be > 1 (a ratio of LRs), got {self.jump_ratio!r}")
        positive("margin", self.margin)
        at_least_each(self, window=1, confirm=1, patience=0, fit=8, smooth=1, settle=0)
        if self.confirm > self.window:
            raise ValueError(f"confirm ({self.confirm}) must be <= window ({self.window})")


class LrJumpDetector:
    """Record-level, like stall: `observe(step, get)` with `get(key) -> value or None`."""

    signal = Signal.LR_JUMP

    def __init__(self, config: LrJumpConfig | None = None) -> None:
        self.config = config or LrJumpConfig()
        c = self.config
        self.raw: deque[tuple[int, float]] = deque(maxlen=c.smooth)
        self.points: deque[tuple[int, float]] = deque(maxlen=c.fit)  # (step, log smoothed loss)
        self.prev_lr: float | None = None
        self.prev_peak: float | None = None
        self.flat = 0  # steps since the LR last rose
        self.jump: dict[str, Any] | None = None  # the raise being judged
        self.behind = 0  # smoothed points in a row behind the frozen trend

    def observe(self, step: int, get: Callable[[str], float | None]) -> Finding | None:
        c = self.config
        lr, loss, peak = get(LR), get(LOSS), get(LR_PEAK_AHEAD)
        lr = lr if lr is not None and math.isfinite(lr) and lr > 0 else None
        peak = peak if peak is not None and math.isfinite(peak) and peak > 0 else None
        found = None
        if lr is not None and self.prev_lr is not None:
            ratio = lr / self.prev_lr
            planned = (self.prev_peak is not None and lr <= self.prev_peak * (1 + 1e-6)) or (
                self.prev_peak is None and self.flat < c.settle)
            if ratio >= c.jump_ratio and not planned:
                self._arm(step, self.prev_lr, lr)
            self.flat = 0 if ratio > 1 + 1e-9 else self.flat + 1
        if loss is not None and math.isfinite(loss) and loss > 0:
            self.raw.append((step, loss))
            smoothed = math.log(sum(v for _, v in self.raw) / len(self.raw))
            if self.jump is None:
                self.points.append((step, smoothed))
            else:
                found = self._judge(step, smoothed)
        if lr is not None:
            self.prev_lr = lr
            self.prev_peak = peak
        return found

    def _arm(self, step: int, before: float, after: float) -> None:
        c = self.config
        pts = list(self.points)
        if len(pts) < c.fit // 2:
            self.jump = None  # too little history before the raise to know its trend
            return
        xs = np.log(np.maximum(np.array([s for s, _ in pts], float), 1.0))
        ys = np.array([v for _, v in pts])
        xm, ym, slope, resid = line_fit(xs, ys)
        # The trend's slope may only fall or stay flat: a loss fitted as still rising before the
        # raise would excuse any rise after it.
        slope = min(slope, 0.0)
        self.jump = {"step": step, "lr_before": before, "lr_after": after, "xm": float(xm), "ym": float(ym),
                     "slope": slope,
                     "margin": max(math.log1p(c.margin), 3.0 * float(resid.std())), "worst": math.inf,
                     "planned_peak": self.prev_peak}
        self.behind = 0

    def _judge(self, step: int, smoothed: float) -> Finding | None:
        c, j = self.config, self.jump
        since = step - j["step"]
        if since < 0:  # steps from before the raise again (an unannounced rewind)
            self.jump = None
            return None
        pred = j["ym"] + j["slope"] * (math.log(max(step, 1)) - j["xm"])
        excess = smoothed - pred
        if since <= c.smooth:  # the trailing mean still holds steps from before the raise
            return None
        if excess > j["margin"]:
            self.behind += 1
            j["worst"] = min(j["worst"], excess)
        else:
            self.behind, j["worst"] = 0, math.inf
        if since < c.window:
            return None
        if self.behind >= c.confirm:
            self.jump = None
            return Finding(
                signal=Signal.LR_JUMP, module="", severity=Severity.CRITICAL, onset_step=j["step"],
                detect_step=step, metric=LR, outcome=Outcome.ACT,
                evidence={"value": math.expm1(excess), "lr_before": j["lr_before"], "lr_after": j["lr_after"], "ratio": j["lr_after"] / j["lr_before"],
                          "jump_step": j["step"], "planned_peak": j["planned_peak"], "above_trend": math.expm1(excess),
                          "min_above_trend": math.expm1(j["worst"]), "margin": math.expm1(j["margin"]),
                          "points_behind": self.behind, "window": c.window, "onset_method": "lr_jump"})
        if since >= c.window + c.patience:
            self.jump = None  # on trend again: the raise's cost was transient
            self.points.clear()
        return None

    def reset(self, first_step: int | None = None) -> None:
        """A rollback to `first_step`: a raise at or after it will be trained again (or not)."""
        if first_step is None:
            self.__init__(self.config)
            return
        keep = lambda d: deque(((s, v) for s, v in d if s < first_step), maxlen=d.maxlen)  # noqa: E731
        self.raw, self.points = keep(self.raw), keep(self.points)
        if self.jump is not None and self.jump["step"] >= first_step:
            self.jump = None
        elif self.jump is not None:
            self.behind = 0
        self.prev_lr = self.prev_peak = None
        self.flat = 0

    def state_dict(self) -> dict[str, Any]:
        return {"raw": list(self.raw), "points": list(self.points), "prev_lr": self.prev_lr,
                "prev_peak": self.prev_peak, "flat": self.flat, "behind": self.behind,
                "jump": None if self.jump is None else {k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                                        for k, v in self.jump.items()}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.__init__(self.config)
        self.raw.extend((int(s), float(v)) for s, v in d.get("raw", []))
        self.points.extend((int(s), float(v)) for s, v in d.get("points", []))
        self.prev_lr, self.prev_peak = d.get("prev_lr"), d.get("prev_peak")
        self.flat, self.behind = int(d.get("flat", 0)), int(d.get("behind", 0))
        jump = d.get("jump")
        if jump is not None:
            jump["worst"] = math.inf if jump.get("worst") is None else jump["worst"]
        self.jump = jump
