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

import json
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from thermowatch.monitors.contract import Outcome, Severity, Signal

from .arrays import as_rows
from .base import at_least_each, positive
from .series import Found, SeriesBank, Single
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
        at_least_each(self, confirm_min=1, warmup=0, clear_steps=1, history=8, onset_lookback=8)


class DegradationBank(SeriesBank):
    """Judged row by row in Python: the trend fit is sequential per series, and only `loss`
    takes this route (one row per run)."""

    signal = Signal.LOSS_DEGRADATION

    def __init__(self, config: DegradationConfig | None = None, witnesses: Witnesses | None = None) -> None:
        self.config = config or DegradationConfig()
        self.witnesses = witnesses  # for the step's LR: the trend starts after the LR warm-up
        self.trends: list[LossTrend] = []
        self.worst: list[float] = []  # smallest excess over the current run of behind points (log ratio)
        super().__init__(self.config.history, self.config.clear_steps)

    def _describe(self, row: int, key: str) -> None:
        super()._describe(row, key)
        self.trends.append(LossTrend(self.config.trend))
        self.worst.append(0.0)

    def _update(self, rows: np.ndarray, step: int, values: np.ndarray) -> Found:
        c, R = self.config, self.rows
        out: Found = []
        for i, (row, value) in enumerate(zip(rows.tolist(), values.tolist())):
            got = self.trends[row].update(step, value, self.witnesses.lr if self.witnesses is not None else None)
            if not math.isfinite(value) or value <= 0.0:
                continue
            one = as_rows([row])
            R.append(one, step, np.array([math.log(value)]))
            R.seen[row] += 1
            if got is None or R.seen[row] <= c.warmup:
                continue
            excess, margin = got
            behind = excess > margin
            R.observe(one, np.array([not behind]))
            R.count_exceed(one, step, np.array([behind]))
            run = int(R.run[row])
            self.worst[row] = min(self.worst[row], excess) if run > 1 else excess
            confirm = max(c.confirm_min, int(c.confirm_fraction * int(R.seen[row])))
            if run < confirm:
                continue
            critical = self.worst[row] >= math.log1p(c.critical_margin)
            severity = Severity.CRITICAL if critical else Severity.WARN
            outcome = Outcome.ACT if critical else Outcome.ALERT
            fired = self._fire(row, severity, None, outcome)
            if fired is None:
                continue
            evidence: dict[str, Any] = {
                "value": value, "above_trend": math.expm1(excess), "margin": math.expm1(margin),
                "min_above_trend": math.expm1(self.worst[row]), "points_behind": run, "confirm": confirm,
                "onset_method": "first_behind",
            }
            out.append((i, self._finding(row, severity, fired[0], step, evidence, outcome)))
        return out

    def reset_rows(self, rows: np.ndarray, first_step: int | None) -> None:
        super().reset_rows(rows, first_step)
        for row in rows.tolist():
            self.trends[row].reset(first_step)
            self.worst[row] = 0.0

    def parts(self, prefix: str, dirty_only: bool = False) -> dict[str, bytes]:
        extra = {"trends": [t.state_dict() for t in self.trends], "worst": self.worst}
        return {**super().parts(prefix, dirty_only), f"{prefix}.trends": json.dumps(extra).encode()}

    def load(self, prefix: str, parts: dict[str, bytes]) -> None:
        self.trends, self.worst = [], []
        super().load(prefix, parts)
        extra = json.loads(parts[f"{prefix}.trends"])
        for t, d in zip(self.trends, extra["trends"]):
            t.load_state_dict(d)
        self.worst = [float(w) for w in extra["worst"]]


class DegradationDetector(Single):
    def __init__(self, key: str = "loss", config: DegradationConfig | None = None,
                 witnesses: Witnesses | None = None) -> None:
        super().__init__(DegradationBank(config, witnesses), key)
