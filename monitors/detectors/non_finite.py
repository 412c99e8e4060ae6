"""Non-finite values (any key): NaN or +-Inf in a thermometer.

In loss or grad norm it means the optimizer step is poisoned (or, with an fp16 loss scaler,
skipped): CRITICAL and outcome act at once, no warm-up, no confirmation. Other metrics
(tokens_per_s, update_ratio ...) are WARN with outcome watch: stored and drawn, nobody paged.
NaN in an `unmeasured_nan` metric means "not measured at this step" (the update ratio and the
attention entropy are sampled every few steps) and is not a finding; +-Inf there still is. In other metrics it is WARN unless the
metric is in `critical_metrics` (an Inf activation in bf16 is an overflow, not noise).
The onset is searched over the finite values buffered before the first NaN: a loss that
climbed for 30 steps before turning NaN is rolled back to where the climb began.
Values are reduced across ranks by max/min/mean and all three propagate NaN, so one bad rank
is enough to show here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from thermowatch.monitors.contract import (ACT_MAX, ACT_MIN, ATTN_ENTROPY_MIN, ATTN_LOGIT_LSE, ATTN_LOGIT_MAX, GRAD_NORM,
                                           LOSS, UPDATE_RATIO, Z)
import numpy as np

from thermowatch.monitors.contract import Outcome, Severity, Signal

from .base import at_least
from .series import Found, SeriesBank, Single, slogs


@dataclass
class NonFiniteConfig:
    # Metric names (key before "/") whose NaN/Inf means the run is broken right now.
    critical_metrics: tuple[str, ...] = (LOSS, GRAD_NORM, ATTN_LOGIT_MAX, ATTN_LOGIT_LSE, ACT_MAX, ACT_MIN, Z)
    # Metrics whose NaN means "not sampled at this step": the update ratio and the attention
    # entropy are read every few steps (ThermometerConfig.update_every, attn_entropy_every).
    unmeasured_nan: tuple[str, ...] = (UPDATE_RATIO, ATTN_ENTROPY_MIN)
    # Finite points before the latch clears: with an fp16 loss scaler Inf grad norms come and
    # go every few steps, one finding per burst is enough.
    clear_steps: int = 10
    # Finite points kept for the onset search.
    history: int = 128
    # Points searched back for the onset: enough baseline before a change caught within
    # ~20-40 points, short enough that slow healthy curvature is not read as the break.
    onset_lookback: int = 96

    def __post_init__(self) -> None:
        self.critical_metrics = tuple(self.critical_metrics)
        self.unmeasured_nan = tuple(self.unmeasured_nan)
        at_least("clear_steps", self.clear_steps, 1)
        at_least("history", self.history, 8)
        at_least("onset_lookback", self.onset_lookback, 8)
        if self.onset_lookback > self.history:
            raise ValueError(f"onset_lookback ({self.onset_lookback}) must not exceed history ({self.history})")


class NonFiniteBank(SeriesBank):
    signal = Signal.NON_FINITE

    def __init__(self, config: NonFiniteConfig | None = None) -> None:
        self.config = config or NonFiniteConfig()
        self.critical: list[bool] = []
        self.skip_nan: list[bool] = []
        super().__init__(self.config.history, self.config.clear_steps)

    def _describe(self, row: int, key: str) -> None:
        super()._describe(row, key)
        self.critical.append(self.metric[row] in self.config.critical_metrics)
        self.skip_nan.append(self.metric[row] in self.config.unmeasured_nan)

    def load(self, prefix: str, parts: dict[str, bytes]) -> None:
        self.critical, self.skip_nan = [], []
        super().load(prefix, parts)

    def _bulk(self, steps: np.ndarray, rows: np.ndarray, values: np.ndarray):
        at = self._quiet_candidates(rows, np.isfinite(values).all(axis=0))
        v = values[:, at]
        return at, slogs(v.ravel()).reshape(v.shape)

    def _update(self, rows: np.ndarray, step: int, values: np.ndarray) -> Found:
        R = self.rows
        idx = np.flatnonzero(~(np.asarray(self.skip_nan, bool)[rows] & np.isnan(values)))
        rows, vals = rows[idx], values[idx]
        finite = np.isfinite(vals)
        R.observe(rows, finite)
        good = rows[finite]
        R.append(good, step, slogs(vals[finite]))  # signed log: act_min is negative
        R.seen[good] += 1
        R.count_exceed(rows, step, ~finite)
        out: Found = []
        for j in np.flatnonzero(~finite):
            row = int(rows[j])
            if R.lsev[row] >= 0:
                continue  # one finding per burst
            critical = self.critical[row]
            severity = Severity.CRITICAL if critical else Severity.WARN
            fired = self._fire(row, severity, self.config.onset_lookback)
            last = [math.copysign(math.expm1(abs(v)), v) for v in self.recent(row)]
            evidence = {"value": float(vals[j]), "last_finite": last, "onset_method": fired[1]}
            outcome = Outcome.ACT if critical else Outcome.WATCH
            out.append((int(idx[j]), self._finding(row, severity, fired[0], step, evidence, outcome)))
        return out


class NonFiniteDetector(Single):
    def __init__(self, key: str, config: NonFiniteConfig | None = None) -> None:
        super().__init__(NonFiniteBank(config), key)
        self.severity = Severity.CRITICAL if self.bank.critical[0] else Severity.WARN
