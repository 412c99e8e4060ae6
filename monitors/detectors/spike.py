"""Robust rolling spike test shared by loss_spike.py and grad_spike.py.

A point y (after the detector's transform: identity for loss, log for grad norm) is past the
threshold when y - median(window) > max(z * 1.4826 * MAD(window), min_excess(median)).
Median/MAD instead of mean/std: a spike inside the window does not raise the bar for the next
one (OLMo-core's mean + 6 sigma does, see baselines.py). One-sided: falling loss is progress.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from monitors.contract import Finding, Severity

from .base import SeriesBase, at_least, positive, robust_stats


@dataclass
class SpikeConfig:
    window: int = 128  # trailing points for median/MAD (OLMo-core's window is 128 steps too)
    z: float = 6.0  # robust z; 6 as OLMo-core, but on MAD so one outlier does not mask the next
    confirm: int = 2  # consecutive points: a lone bad batch is common and usually harmless
    warmup: int = 100  # points before any finding: early training falls and jumps fast
    clear_steps: int = 5  # in-band points before the same series may raise again
    history: int = 128  # points kept: the baseline window and the onset search
    # Points searched back for the onset: enough baseline before a change caught within
    # ~20-40 points, short enough that slow healthy curvature is not read as the break.
    onset_lookback: int = 96

    def __post_init__(self) -> None:
        positive("z", self.z)
        at_least("window", self.window, 8)
        at_least("confirm", self.confirm, 1)
        at_least("warmup", self.warmup, 0)
        at_least("clear_steps", self.clear_steps, 1)
        at_least("history", self.history, self.window)
        at_least("onset_lookback", self.onset_lookback, 8)
        if self.onset_lookback > self.history:
            raise ValueError(f"onset_lookback ({self.onset_lookback}) must not exceed history ({self.history})")


class SpikeDetector(SeriesBase):
    """Subclasses set `signal` and define `transform`, `min_excess`, `is_critical`."""

    config: SpikeConfig

    def __init__(self, key: str, config: SpikeConfig) -> None:
        self.config = config
        super().__init__(key, config.history, config.clear_steps)

    def transform(self, value: float) -> float | None:  # pragma: no cover - abstract
        raise NotImplementedError

    def min_excess(self, median: float) -> float:  # pragma: no cover - abstract
        raise NotImplementedError

    def is_critical(self, y: float, median: float) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self, y: float) -> float:
        """Back to the metric's own units for evidence."""
        return y

    def _update(self, step: int, value: float) -> Finding | None:
        c = self.config
        if not math.isfinite(value):
            return None  # non_finite.py owns NaN/Inf; keep them out of the median
        y = self.transform(value)
        if y is None:
            return None
        base = self.history.tail(c.window)  # the window *before* this point
        self.history.append(step, y)
        self.seen += 1
        if self.seen <= c.warmup or base.size < c.window // 4:
            return None
        med, sigma = robust_stats(base)
        thr = max(c.z * sigma, self.min_excess(med))
        excess = y - med
        self.latch.observe(excess <= thr / 2)
        self._count_exceed(step, excess > thr)
        if self.run < c.confirm:
            return None
        severity = Severity.CRITICAL if self.is_critical(y, med) else Severity.WARN
        if not self.latch.should_fire(severity):
            return None
        onset, method = (self.latch.onset_step, "latched") if self.latch.active else self._onset(c.onset_lookback)
        self.latch.fire(severity, onset)
        return self._finding(severity, onset, step, self._evidence(value, med, thr, method))

    def _evidence(self, value: float, med: float, thr: float, method: str) -> dict[str, Any]:
        return {
            "value": value,
            "baseline": self.describe(med),
            "threshold": self.describe(med + thr),
            "robust_z": self.config.z,
            "recent": [self.describe(v) for v in self.history.tail(8)],
            "onset_method": method,
        }
