"""Gradient-norm spike (keys `grad_norm`, `grad_norm/<module>`), judged in log space.

Grad norms are positive and move multiplicatively (a spike is "10x", not "+3"), and their
spread scales with their level, so median/MAD of log(norm) gives one threshold that works from
the noisy start of training to its quiet end. Zero norms (frozen modules) carry no information
and are skipped. The global norm is pre-clipping (DESIGN.md), so clipping does not hide spikes.
The per-module norm is the max over ranks (contract.reduction): a spike on one rank shows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from thermowatch.monitors.contract import Signal

import numpy as np

from .series import Single, logs
from .spike import SpikeBank, SpikeConfig


@dataclass
class GradSpikeConfig(SpikeConfig):
    # A doubling is the smallest excess that counts: grad norms routinely wander +-50 %.
    min_ratio: float = 2.0
    # 10x the baseline norm: updates are an order of magnitude off, CRITICAL.
    critical_ratio: float = 10.0

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("min_ratio", "critical_ratio"):
            if not getattr(self, name) > 1.0:
                raise ValueError(f"{name} must be > 1 (a ratio over baseline), got {getattr(self, name)!r}")


class GradSpikeBank(SpikeBank):
    signal = Signal.GRAD_SPIKE
    config: GradSpikeConfig

    def __init__(self, config: GradSpikeConfig | None = None) -> None:
        super().__init__(config or GradSpikeConfig())

    def transform(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ok = np.isfinite(values) & (values > 0.0)
        return ok, logs(values[ok])

    def min_excess(self, median: np.ndarray) -> np.ndarray:
        return np.full(median.shape, math.log(self.config.min_ratio))

    def min_excess_lo(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        return self.min_excess(lo)

    def is_critical(self, y: float, median: float) -> bool:
        return y - median >= math.log(self.config.critical_ratio)

    def describe(self, y: float) -> float:
        return math.exp(y)


class GradSpikeDetector(Single):
    def __init__(self, key: str = "grad_norm", config: GradSpikeConfig | None = None) -> None:
        super().__init__(GradSpikeBank(config), key)
