"""Activations approaching the dtype's largest finite value (keys `act_max/*`, `act_min/*`).

|act| > fraction * finfo(dtype).max. Default fraction 0.5: one doubling away from Inf, and a
doubling is exactly what a residual add of two similar-size tensors or one more step of
runaway growth does. For fp16 (65504) this is the real overflow risk; for bf16 (3.39e38, the
fp32 exponent range) activations practically never get there, which is why YaLM moved to bf16,
and the detector then mostly guards against values that are already absurd. The act_max key is
reduced by max and act_min by min across ranks (contract.reduction), so one rank suffices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from thermowatch.monitors.contract import Severity, Signal

from .base import at_least
from .series import Found, SeriesBank, Single, slogs

# torch.finfo(dtype).max, written out so the detectors import without torch.
DTYPE_MAX = {
    "bf16": 3.3895313892515355e38,
    "fp16": 65504.0,
    "fp32": 3.4028234663852886e38,
    "fp8_e4m3": 448.0,
    "fp8_e5m2": 57344.0,
}


@dataclass
class ActOverflowConfig:
    dtype: str = "bf16"  # the trainer's compute dtype (DESIGN.md: bf16 with DeepSpeed)
    fraction: float = 0.5  # one doubling from Inf (module docstring)
    critical_fraction: float = 0.9  # within ~10 % of Inf: the next step may overflow
    clear_steps: int = 5  # points back under the line before it may raise again
    history: int = 128  # points kept: the baseline window and the onset search
    # Points searched back for the onset: enough baseline before a change caught within
    # ~20-40 points, short enough that slow healthy curvature is not read as the break.
    onset_lookback: int = 96

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_MAX:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_MAX)}, got {self.dtype!r}")
        if not 0.0 < self.fraction <= self.critical_fraction <= 1.0:
            raise ValueError(
                f"need 0 < fraction <= critical_fraction <= 1, got {self.fraction!r}, {self.critical_fraction!r}"
            )
        at_least("clear_steps", self.clear_steps, 1)
        at_least("history", self.history, 8)
        at_least("onset_lookback", self.onset_lookback, 8)
        if self.onset_lookback > self.history:
            raise ValueError(f"onset_lookback ({self.onset_lookback}) must not exceed history ({self.history})")

    @property
    def limit(self) -> float:
        return DTYPE_MAX[self.dtype]


class ActOverflowBank(SeriesBank):
    signal = Signal.ACT_OVERFLOW

    def __init__(self, config: ActOverflowConfig | None = None) -> None:
        self.config = config or ActOverflowConfig()
        super().__init__(self.config.history, self.config.clear_steps)

    def _bulk(self, steps: np.ndarray, rows: np.ndarray, values: np.ndarray):
        c = self.config
        mag = np.abs(values)
        at = self._quiet_candidates(rows, (np.isfinite(values) & (mag <= c.fraction * c.limit)).all(axis=0))
        m = mag[:, at]
        return at, slogs(m.ravel()).reshape(m.shape)

    def _update(self, rows: np.ndarray, step: int, values: np.ndarray) -> Found:
        c, R = self.config, self.rows
        idx = np.flatnonzero(np.isfinite(values))  # non_finite.py reports Inf
        rows, vals = rows[idx], values[idx]
        mag = np.abs(vals)
        R.append(rows, step, slogs(mag))
        R.seen[rows] += 1
        warn_at, crit_at = c.fraction * c.limit, c.critical_fraction * c.limit
        R.observe(rows, mag <= warn_at)
        R.count_exceed(rows, step, mag > warn_at)
        out: Found = []
        for j in np.flatnonzero(mag > warn_at):
            row, m = int(rows[j]), float(mag[j])
            severity = Severity.CRITICAL if m > crit_at else Severity.WARN
            fired = self._fire(row, severity, c.onset_lookback)
            if fired is None:
                continue
            evidence = {"value": float(vals[j]), "threshold": warn_at, "dtype": c.dtype, "dtype_max": c.limit,
                        "fraction_of_max": m / c.limit, "onset_method": fired[1]}
            out.append((int(idx[j]), self._finding(row, severity, fired[0], step, evidence)))
        return out


class ActOverflowDetector(Single):
    def __init__(self, key: str, config: ActOverflowConfig | None = None) -> None:
        super().__init__(ActOverflowBank(config), key)
