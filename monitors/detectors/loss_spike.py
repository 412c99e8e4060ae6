"""Loss spike (key `loss`): the training loss jumps above its rolling median.

PaLM saw ~20 such spikes and restarted ~100 steps before each; the onset (onset.py) is what
lets the policy pick that restart point. The loss is a mean over ranks (contract.reduction),
so a spike on one data-parallel shard shows diluted by 1/world_size: a bad batch on one rank
is still visible, just smaller.
"""

from __future__ import annotations

from dataclasses import dataclass

from thermowatch.monitors.contract import Signal

import numpy as np

from .base import positive
from .series import Single
from .spike import SpikeBank, SpikeConfig


@dataclass
class LossSpikeConfig(SpikeConfig):
    # 5 % of the loss level as the smallest excess that counts: late in training the MAD of the
    # loss can be ~0.01, and a 6-sigma bar on that would call ordinary batch noise a spike.
    min_rel_excess: float = 0.05
    # 1.5x the baseline loss is a divergence in progress, not a blip: CRITICAL.
    critical_ratio: float = 1.5

    def __post_init__(self) -> None:
        super().__post_init__()
        positive("min_rel_excess", self.min_rel_excess)
        if not self.critical_ratio > 1.0:
            raise ValueError(f"critical_ratio must be > 1, got {self.critical_ratio!r}")


class LossSpikeBank(SpikeBank):
    signal = Signal.LOSS_SPIKE
    config: LossSpikeConfig

    def __init__(self, config: LossSpikeConfig | None = None) -> None:
        super().__init__(config or LossSpikeConfig())

    def transform(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        ok = np.isfinite(values)
        return ok, values[ok]

    def min_excess(self, median: np.ndarray) -> np.ndarray:
        return self.config.min_rel_excess * np.abs(median)

    def min_excess_lo(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        # |m| over [lo, hi] is smallest at 0 when the interval holds it, else at its nearer end.
        least = np.where((lo <= 0.0) & (hi >= 0.0), 0.0, np.minimum(np.abs(lo), np.abs(hi)))
        return self.config.min_rel_excess * least

    def is_critical(self, y: float, median: float) -> bool:
        return median > 0 and y >= self.config.critical_ratio * median


class LossSpikeDetector(Single):
    def __init__(self, key: str = "loss", config: LossSpikeConfig | None = None) -> None:
        super().__init__(LossSpikeBank(config), key)
