"""Robust rolling spike test shared by loss_spike.py and grad_spike.py.

A point y (after the detector's transform: identity for loss, log for grad norm) is past the
threshold when y - median(window) > max(z * 1.4826 * MAD(window), min_excess(median)).
Median/MAD instead of mean/std: a spike inside the window does not raise the bar for the next
one (OLMo-core's mean + 6 sigma does, see baselines.py). One-sided: falling loss is progress.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from thermowatch.monitors.contract import Severity

from .base import at_least, positive
from .arrays import block_max
from .series import Found, SeriesBank, quiet_excursions, robust_rows


@dataclass
class SpikeConfig:
    window: int = 128  # trailing points for median/MAD (OLMo-core's window is 128 steps too)
    z: float = 6.0  # robust z; 6 as OLMo-core, but on MAD so one outlier does not mask the next
    confirm: int = 2  # consecutive points: a lone bad batch is common and usually harmless
    # Steps of a series' age before any finding: early training falls and jumps fast. Counted in
    # steps, as the reason is: a per-layer norm read every 16th step is past it at step ~100 too
    # (its window then asks for min_points points), not at its 100th reading (issue 36).
    warmup: int = 100
    clear_steps: int = 5  # in-band points before the same series may raise again
    history: int = 128  # points kept: the baseline window and the onset search
    # Points searched back for the onset: enough baseline before a change caught within
    # ~20-40 points, short enough that slow healthy curvature is not read as the break.
    onset_lookback: int = 96
    # Points of the window a point is judged against, at least (or a quarter of the window, if
    # less). A rollback keeps only what the history held before its target: 100 steps back (the
    # policy's margin) leaves 28 of the 128, and the re-trained path is where the rest of a bad stretch comes (issue 35: 13 poisoned
    # steps trained unjudged right after a rollback, with 26 points left under a floor of 32).
    min_points: int = 16

    def __post_init__(self) -> None:
        positive("z", self.z)
        at_least("window", self.window, 8)
        at_least("confirm", self.confirm, 1)
        at_least("warmup", self.warmup, 0)
        at_least("clear_steps", self.clear_steps, 1)
        at_least("history", self.history, self.window)
        at_least("onset_lookback", self.onset_lookback, 8)
        at_least("min_points", self.min_points, 8)
        if self.onset_lookback > self.history:
            raise ValueError(f"onset_lookback ({self.onset_lookback}) must not exceed history ({self.history})")


class SpikeBank(SeriesBank):
    """Subclasses set `signal` and define `transform`, `min_excess`, `is_critical`."""

    config: SpikeConfig

    def __init__(self, config: SpikeConfig) -> None:
        self.config = config
        super().__init__(config.history, config.clear_steps)

    def transform(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # pragma: no cover - abstract
        """(mask of the values judged, their transform); NaN/Inf are never judged."""
        raise NotImplementedError

    def min_excess(self, median: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def min_excess_lo(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:  # pragma: no cover - abstract
        """A lower bound of min_excess(m) for every m in [lo, hi]."""
        raise NotImplementedError

    def is_critical(self, y: float, median: float) -> bool:  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self, y: float) -> float:
        """Back to the metric's own units for evidence."""
        return y

    def bulk_points_of(self) -> int:
        return self.config.window  # _bulk: a full window before the batch's first point

    def batch_values(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ok, ys = self.transform(values.ravel())
        full = np.full(values.size, np.nan)
        full[ok] = ys
        every = ok.reshape(values.shape).all(axis=0)
        return every, full.reshape(values.shape)[:, every]

    def _bulk(self, steps: np.ndarray, rows: np.ndarray, values: np.ndarray):
        c, R = self.config, self.rows
        every, ys = self.batch_values(values)
        K, cols = len(steps), np.flatnonzero(every)  # ys holds the columns of `every`
        # In warm-up at every step of the batch (_update's `live` is False): the ring only fills.
        age = np.maximum(R.seen[rows] + K, R.age(rows, int(steps[-1]), int(steps[0])))
        warm = np.flatnonzero(every & (R.lsev[rows] < 0) & (age <= c.warmup))
        at = self._quiet_candidates(rows, every, points=c.window, warmup=c.warmup, first_step=int(steps[0]))
        if at.size:
            y = ys[:, np.searchsorted(cols, at)]
            yt = np.ascontiguousarray(y.T)
            x = np.concatenate([R.ordered(rows[at]), yt], axis=1)
            # _update: the point y_t against the window of `window` points before it.
            quiet = quiet_excursions(x, R.H - c.window, c.window, K, c.z, yt, block_max(yt, 0, 1, K),
                                     self.min_excess, self.min_excess_lo)
            at, y = at[quiet], y[:, quiet]
        else:
            y = ys[:, :0]
        if not warm.size:
            return at, y
        return (np.concatenate([at, warm]), np.concatenate([y, ys[:, np.searchsorted(cols, warm)]], axis=1),
                np.r_[np.zeros(at.size, bool), np.ones(warm.size, bool)])

    def _update(self, rows: np.ndarray, step: int, values: np.ndarray) -> Found:
        c, R = self.config, self.rows
        ok, ys = self.transform(values)  # non_finite.py owns NaN/Inf; keep them out of the median
        idx = np.flatnonzero(ok)
        rows, vals = rows[idx], values[idx]
        # The window *before* this point, for the rows past warm-up with enough of it. Warm-up is
        # the series' age: its points, or the steps since its oldest one where they are more (a
        # series read every few steps, issue 36).
        age = np.maximum(R.seen[rows] + 1, R.age(rows, step, step))
        live = (age > c.warmup) & (R.sizes(rows, c.window) >= min(c.min_points, c.window // 4))
        lrows = rows[live]
        med, sigma = robust_rows(R, lrows, c.window)
        R.append(rows, step, ys)
        R.seen[rows] += 1
        y = ys[live]
        thr = np.maximum(c.z * sigma, self.min_excess(med))
        excess = y - med
        R.observe(lrows, excess <= thr / 2)
        R.count_exceed(lrows, step, excess > thr)
        out: Found = []
        at = np.flatnonzero(live)
        for j in np.flatnonzero(R.run[lrows] >= c.confirm):
            row, yj, mj = int(lrows[j]), float(y[j]), float(med[j])
            severity = Severity.CRITICAL if self.is_critical(yj, mj) else Severity.WARN
            fired = self._fire(row, severity, c.onset_lookback)
            if fired is not None:
                ev = self._evidence(row, float(vals[at[j]]), mj, float(thr[j]), fired[1])
                out.append((int(idx[at[j]]), self._finding(row, severity, fired[0], step, ev)))
        return out

    def _evidence(self, row: int, value: float, med: float, thr: float, method: str) -> dict[str, Any]:
        return {
            "value": value,
            "baseline": self.describe(med),
            "threshold": self.describe(med + thr),
            "robust_z": self.config.z,
            "recent": [self.describe(v) for v in self.recent(row)],
            "onset_method": method,
        }
