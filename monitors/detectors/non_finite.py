"""Non-finite values (any key): NaN or +-Inf in a thermometer.

In loss or grad norm it means the optimizer step is poisoned (or, with an fp16 loss scaler,
skipped): CRITICAL and outcome act at once, no warm-up, no confirmation. Other metrics
(tokens_per_s, update_ratio ...) are WARN with outcome watch: stored and drawn, nobody paged.
NaN in an `unmeasured_nan` metric means "not measured at this step" (the update ratio is
sampled every few steps) and is not a finding; +-Inf there still is. In other metrics it is WARN unless the
metric is in `critical_metrics` (an Inf activation in bf16 is an overflow, not noise).
The onset is searched over the finite values buffered before the first NaN: a loss that
climbed for 30 steps before turning NaN is rolled back to where the climb began.
Values are reduced across ranks by max/min/mean and all three propagate NaN, so one bad rank
is enough to show here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from monitors.contract import ACT_MAX, ACT_MIN, ATTN_LOGIT_LSE, ATTN_LOGIT_MAX, GRAD_NORM, LOSS, UPDATE_RATIO, Z
from monitors.contract import Finding, Outcome, Severity, Signal

from .base import SeriesBase, at_least, slog


@dataclass
class NonFiniteConfig:
    # Metric names (key before "/") whose NaN/Inf means the run is broken right now.
    critical_metrics: tuple[str, ...] = (LOSS, GRAD_NORM, ATTN_LOGIT_MAX, ATTN_LOGIT_LSE, ACT_MAX, ACT_MIN, Z)
    # Metrics whose NaN means "not sampled at this step" (monitors/thermometers/update.py).
    unmeasured_nan: tuple[str, ...] = (UPDATE_RATIO,)
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


class NonFiniteDetector(SeriesBase):
    signal = Signal.NON_FINITE

    def __init__(self, key: str, config: NonFiniteConfig | None = None) -> None:
        self.config = config or NonFiniteConfig()
        super().__init__(key, self.config.history, self.config.clear_steps)
        critical = self.metric in self.config.critical_metrics
        self.severity = Severity.CRITICAL if critical else Severity.WARN
        self.outcome = Outcome.ACT if critical else Outcome.WATCH
        self.skip_nan = self.metric in self.config.unmeasured_nan

    def _update(self, step: int, value: float) -> Finding | None:
        if self.skip_nan and math.isnan(value):
            return None
        finite = math.isfinite(value)
        self.latch.observe(finite)
        if finite:
            self.history.append(step, slog(value))  # signed log: act_min is negative
            self.seen += 1
            self.run, self.first_exceed = 0, -1
            return None
        self._count_exceed(step, True)
        if self.latch.active:
            return None
        onset, method = self._onset(self.config.onset_lookback)
        self.latch.fire(self.severity, onset)
        last = [math.copysign(math.expm1(abs(v)), v) for v in self.history.tail(8)]
        evidence = {"value": value, "last_finite": last, "onset_method": method}
        return self._finding(self.severity, onset, step, evidence, self.outcome)
