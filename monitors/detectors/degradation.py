"""Loss degradation (key `loss`): the run falls behind its own expected curve, with or without
any attention signal.

qk-LayerNorm bounds the attention logits, so a qk-LN model at too high an LR degrades with no
logit growth at all (issue 8: three qk-LN runs at LR 1e-1 that nothing caught). The expected
curve is the run's own: log(loss) against log(step) fitted over a trailing window that grows
with the run (witness.LossTrend). Behind = the smoothed loss above the trend by more than its
margin, for `confirm` points in a row.

It alerts (outcome alert); a long stretch well behind is CRITICAL with outcome act, which the
policy only acts on when `loss_degradation` is in its rollback_signals (off by default: a
rollback replays the same LR, and a slow-down is a human's call).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from monitors.contract import Finding, Outcome, Severity, Signal

from .base import SeriesBase, at_least, positive
from .witness import LossTrend, WitnessConfig, Witnesses


def _trend() -> WitnessConfig:
    # The fit ends 48 points back, past the 30-point confirmation: a departure must not pull
    # its own trend up before it is confirmed.
    return WitnessConfig(trend_gap=48)


@dataclass
class DegradationConfig:
    trend: WitnessConfig = field(default_factory=_trend)
    # Points in a row behind the trend: `confirm_min`, or a fraction of the points seen (0: off;
    # keep confirm below trend.trend_gap, or the fit absorbs the departure first).
    confirm_min: int = 30
    confirm_fraction: float = 0.0
    # Points before any finding: the first steps fall fast under a warming-up LR, no trend yet.
    warmup: int = 100
    # 15 % above the trend for the whole confirmation: CRITICAL (outcome act, gated by policy).
    critical_margin: float = 0.15
    clear_steps: int = 20  # points back on the trend before it may raise again
    history: int = 128
    onset_lookback: int = 96

    def __post_init__(self) -> None:
        if isinstance(self.trend, dict):
            self.trend = WitnessConfig(**self.trend)
        positive("critical_margin", self.critical_margin)
        if not 0.0 <= self.confirm_fraction < 1.0:
            raise ValueError(f"confirm_fraction must be in [0, 1), got {self.confirm_fraction!r}")
        at_least("confirm_min", self.confirm_min, 1)
        at_least("warmup", self.warmup, 0)
        at_least("clear_steps", self.clear_steps, 1)
        at_least("history", self.history, 8)
        at_least("onset_lookback", self.onset_lookback, 8)


class DegradationDetector(SeriesBase):
    signal = Signal.LOSS_DEGRADATION

    def __init__(self, key: str = "loss", config: DegradationConfig | None = None,
                 witnesses: Witnesses | None = None) -> None:
        self.config = config or DegradationConfig()
        self.witnesses = witnesses  # for the step's LR: the trend starts after the LR warm-up
        super().__init__(key, self.config.history, self.config.clear_steps)
        self.trend = LossTrend(self.config.trend)
        self.worst = 0.0  # smallest excess over the current run of behind points (log ratio)

    def _update(self, step: int, value: float) -> Finding | None:
        c = self.config
        got = self.trend.update(step, value, self.witnesses.lr if self.witnesses is not None else None)
        if not math.isfinite(value) or value <= 0.0:
            return None
        self.history.append(step, math.log(value))
        self.seen += 1
        if got is None or self.seen <= c.warmup:
            return None
        excess, margin = got
        behind = excess > margin
        self.latch.observe(not behind)
        self._count_exceed(step, behind)
        self.worst = min(self.worst, excess) if self.run > 1 else excess
        confirm = max(c.confirm_min, int(c.confirm_fraction * self.seen))
        if self.run < confirm:
            return None
        critical = self.worst >= math.log1p(c.critical_margin)
        severity = Severity.CRITICAL if critical else Severity.WARN
        outcome = Outcome.ACT if critical else Outcome.ALERT
        if not self.latch.should_fire(severity, outcome):
            return None
        onset = self.latch.onset_step if self.latch.active else self.first_exceed
        self.latch.fire(severity, onset, outcome)
        evidence: dict[str, Any] = {
            "value": value, "above_trend": math.expm1(excess), "margin": math.expm1(margin),
            "min_above_trend": math.expm1(self.worst), "points_behind": self.run, "confirm": confirm,
            "onset_method": "first_behind",
        }
        return self._finding(severity, onset, step, evidence, outcome)

    def reset(self, to_step: int | None = None) -> None:
        super().reset(to_step)
        self.trend.reset(to_step)
        self.worst = 0.0

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "trend": self.trend.state_dict(), "worst": self.worst}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        super().load_state_dict(d)
        self.trend.load_state_dict(d["trend"])
        self.worst = float(d["worst"])
