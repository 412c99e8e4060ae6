"""A blow-up that builds (issue 24, item 3): the loss and the global gradient norm rising together
against their own recent past, for a few steps in a row.

The loss-spike detector waits for one point 6 robust sigmas out and acts only at 1.5x its median
(loss_spike.py), which is right for a bad batch and late for a divergence that builds over 20-50
steps: on a noisy high-LR run the loss climbs 3.1 -> 3.9 -> 4.9 with no single point far enough out,
and the spike acts 20-80 steps in (bench/divergence.py, qkln-blowup). A building blow-up is not
one point but a *mean* that moved, and the gradient norm moves with it:

    loss      the mean of the last `recent` losses >= the median of the `baseline` losses before
              them + max(z x their robust spread / sqrt(recent), min_rel_rise x that median)
    gradient  the median of the last `recent` gradient norms >= grad_ratio x the baseline median

both at `confirm` steps in a row: CRITICAL, outcome act. The standard error of a mean of 8 is a
third of one point's spread, so the bar sits ~1.4 robust sigmas of one point above the baseline,
met only by a sustained rise; the gradient norm has to agree, which a noisy stretch of data
alone (the loss up, the gradient norm not) and a slow healthy drift do not give. The onset is the
first step of the recent window when the rise was first seen: the rollback reaches back before
it.

Settings (the grid of bench/divergence.py, 68 real runs): recent 8, baseline 64, z 4, rise >= 3%,
gradient x1.5, 3 steps. No healthy run of the grid meets them, the x4 operator raise whose cost
is transient included; z 3 / x1.3 / 2 steps fires on two runs the ground truth calls healthy. A
trainer that does not send `grad_norm` gets nothing from this detector.

Record-level, like lr_jump.py and stall: `observe(step, get)`; one per run; reset by a rollback.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from thermowatch.monitors.contract import GRAD_NORM, LOSS, Finding, Outcome, Severity, Signal

from .base import MAD_TO_SIGMA, at_least, positive



@dataclass
class CoRiseConfig:
    recent: int = 8
    baseline: int = 64
    z: float = 4.0
    min_rel_rise: float = 0.03
    grad_ratio: float = 1.5
    confirm: int = 3
    warmup: int = 100  # points before any finding: the first steps fall and jump fast
    clear_steps: int = 10  # steps without the condition before it may fire again
    # Points kept: a rollback that goes back up to `history - recent - baseline` steps still
    # has a full window before its checkpoint, so the re-trained steps are judged at once.
    history: int = 192

    def __post_init__(self) -> None:
        for name in ("z", "min_rel_rise"):
            positive(name, getattr(self, name))
        if not self.grad_ratio > 1.0:
            raise ValueError(f"grad_ratio must be > 1, got {self.grad_ratio!r}")
        at_least("recent", self.recent, 2)
        at_least("baseline", self.baseline, 8)
        at_least("confirm", self.confirm, 1)
        at_least("warmup", self.warmup, self.recent + self.baseline)
        at_least("clear_steps", self.clear_steps, 1)
        at_least("history", self.history, self.recent + self.baseline)


def _stats(c: CoRiseConfig, loss: np.ndarray, grad: np.ndarray) -> list[np.ndarray]:
    """Per window (one row each: `baseline` points, then `recent`): the recent mean loss, the
    baseline median, the bar the mean must clear above it, the robust spread, and the recent and
    baseline medians of gradient norm. Only + - x / and order statistics: a transcendental (log)
    differs in its last bit between numpy's SIMD loop and libm, and the batch path must give
    exactly the findings of one step at a time on every CPU."""
    base, rec = loss[:, : c.baseline], loss[:, c.baseline:]
    med = np.median(base, axis=1)
    spread = MAD_TO_SIGMA * np.median(np.abs(base - med[:, None]), axis=1)
    bar = np.maximum(c.z * spread / math.sqrt(c.recent), c.min_rel_rise * np.abs(med))
    return [rec.mean(axis=1), med, bar, spread, np.median(grad[:, c.baseline:], axis=1),
            np.median(grad[:, : c.baseline], axis=1)]


class CoRiseDetector:
    """Record-level: `observe(step, get)` with `get(key) -> value or None`."""

    signal = Signal.LOSS_GRAD_RISE

    def __init__(self, config: CoRiseConfig | None = None) -> None:
        self.config = config or CoRiseConfig()
        c = self.config
        # (step, loss, gradient norm), the newest `recent + baseline` finite points
        self.points: deque[tuple[int, float, float]] = deque(maxlen=c.history)
        self.n = c.recent + c.baseline  # the window judged: the newest n points
        self.seen = 0
        self.run = 0  # steps in a row with both rising
        self.first = -1  # the first step of that run of steps
        self.latched = False
        self.quiet = 0  # steps in a row without the condition, while latched
        self._pre: tuple[np.ndarray, list[np.ndarray], int] | None = None  # a batch's statistics (prepare)

    def prepare(self, steps: np.ndarray, loss: np.ndarray, grad: np.ndarray) -> None:
        """A batch's windows at once (DetectorBank._observe_columns): the statistics of every step
        of the batch from one sliding-window pass, read back by `observe` step by step. The same
        arithmetic as one step at a time (`_stats`), so the same findings."""
        self._pre = None
        c, n = self.config, self.n
        ok = np.isfinite(loss) & np.isfinite(grad) & (grad > 0)
        if not ok.any():
            return
        hist = np.array(self._tail(n - 1), dtype=np.float64).reshape(-1, 3)
        l = np.concatenate([hist[:, 1], loss[ok]])
        g = np.concatenate([hist[:, 2], grad[ok]])
        if len(l) < n:
            return
        stats = _stats(c, sliding_window_view(l, n), sliding_window_view(g, n))
        # Window j ends at point j + n - 1; with at most n - 1 points before the batch, the first
        # window already ends inside it, at batch point n - 1 - len(hist).
        self._pre = (steps[ok][n - 1 - len(hist):], stats, 0)

    def _tail(self, k: int) -> list[tuple[int, float, float]]:
        return list(itertools.islice(self.points, max(0, len(self.points) - k), None))

    def end_batch(self) -> None:
        self._pre = None

    def _prepared(self, step: int) -> tuple[float, ...] | None:
        if self._pre is None:
            return None
        steps, stats, i = self._pre
        if i < len(steps) and steps[i] == step:
            self._pre = (steps, stats, i + 1)
            return tuple(float(a[i]) for a in stats)
        self._pre = None  # out of step with the batch: compute directly from here on
        return None

    def observe(self, step: int, get: Callable[[str], float | None]) -> Finding | None:
        loss, grad = get(LOSS), get(GRAD_NORM)
        if loss is None or grad is None or not (math.isfinite(loss) and math.isfinite(grad) and grad > 0):
            return None  # non_finite.py owns NaN/Inf; a trainer without grad_norm gets nothing here
        c = self.config
        self.points.append((step, float(loss), float(grad)))
        self.seen += 1
        full = len(self.points) >= self.n
        pre = self._prepared(step) if full else None
        if self.seen < c.warmup or not full:
            return None
        if pre is None:
            arr = np.array(self._tail(self.n), dtype=np.float64)
            pre = tuple(float(a[0]) for a in _stats(c, arr[None, :, 1], arr[None, :, 2]))
        mean, med, bar, spread, g_rec, g_base = pre
        rising = mean - med >= bar and g_rec >= c.grad_ratio * g_base
        if self.latched:
            self.quiet = 0 if rising else self.quiet + 1
            if self.quiet >= c.clear_steps:
                self.latched, self.run = False, 0
            return None
        if not rising:
            self.run = 0
            return None
        if self.run == 0:
            self.first = self.points[-c.recent][0]
        self.run += 1
        if self.run < c.confirm:
            return None
        self.latched, self.quiet = True, 0
        return Finding(
            signal=Signal.LOSS_GRAD_RISE, module="", severity=Severity.CRITICAL, onset_step=self.first,
            detect_step=step, metric=LOSS, outcome=Outcome.ACT,
            evidence={"value": mean, "baseline": med, "threshold": med + bar, "robust_sigma": spread,
                      "rise": mean / med - 1.0 if med else math.inf,
                      "grad_norm_recent": g_rec, "grad_norm_baseline": g_base, "grad_ratio": g_rec / g_base, "recent": c.recent, "baseline_points": c.baseline,
                      "steps_in_a_row": self.run, "onset_method": "co_rise"})

    def reset(self, first_step: int | None = None) -> None:
        """A rollback to `first_step`: the points at or after it will be trained again."""
        if first_step is None:
            self.__init__(self.config)
            return
        kept = [p for p in self.points if p[0] < first_step]
        self.seen = max(0, self.seen - (len(self.points) - len(kept)))
        self.points = deque(kept, maxlen=self.points.maxlen)
        self.run, self.first, self.latched, self.quiet = 0, -1, False, 0

    def state_dict(self) -> dict[str, Any]:
        return {"grad_points": [list(p) for p in self.points], "seen": self.seen, "run": self.run, "first": self.first,
                "latched": self.latched, "quiet": self.quiet}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.__init__(self.config)
        # "grad_points": (step, loss, gradient norm). State saved before held log norms under
        # "points"; it is not read back, and the detector warms up again.
        self.points.extend((int(s), float(v), float(g)) for s, v, g in d.get("grad_points", []))
        self.seen, self.run, self.first = int(d.get("seen", 0)), int(d.get("run", 0)), int(d.get("first", -1))
        self.latched, self.quiet = bool(d.get("latched", False)), int(d.get("quiet", 0))
