"""Peer baselines for the divergence benchmark: the spike rules other trainers ship, behind the
same interface as our detectors (`update(step, value) -> Finding | None`, `reset`,
`state_dict`/`load_state_dict`) plus a `PeerBank.observe(record)` that routes keys like
DetectorBank does. They are re-implemented from the upstream source, not imported.

- OLMo-core `StabilityMonitorCallback` (allenai/OLMo-core,
  src/olmo_core/train/callbacks/stability_monitor.py): value > mean + 6 * std (population std)
  of the previous 128 values, only once 128 are there, never when std < 1e-10; loss and grad
  norm. Upstream only counts spikes (a SpikeScore metric); here each spike is a finding.
- LLM Foundry `KillLossSpike` (mosaicml/llm-foundry, llmfoundry/callbacks/kill_loss_spike_callback.py):
  once a full window of 100 losses exists, loss >= 2 x the window mean for more than
  `patience` = 4 consecutive steps is a spike; or, from step 2*window on, at least half of the
  window above `loss_cap` = 10 is "persistently high". Outliers enter the window too.
- Megatron-LM `RerunStateMachine.is_unexpectedly_large` (NVIDIA/Megatron-LM,
  megatron/core/rerun_state_machine.py), used with threshold 10 for "Spiky loss": |loss| >=
  10 x the max |loss| of the first 100 finite values; NaN/Inf ignored.

Ours differs by design: they have no onset search (onset_step = the step their rule points at),
no log space, and no attention thermometers. To be comparable on "first alarm" they are
edge-triggered: a finding when the rule turns true, not on every step it stays true.
"""

from __future__ import annotations

import math
from collections import deque
from typing import Any, Callable, Iterable

import numpy as np

from thermowatch.monitors.contract import GRAD_NORM, LOSS, Finding, Severity, Signal, StepRecord, split_key


class _Peer:
    """Edge-triggered finding plumbing shared by the three rules."""

    name = "peer"

    def __init__(self, key: str) -> None:
        self.key = key
        self.metric, self.module = split_key(key)
        self.signal = Signal.GRAD_SPIKE if self.metric == GRAD_NORM else Signal.LOSS_SPIKE
        self.active = False
        self.last_step: int | None = None

    def update(self, step: int, value: float, wall_time: float | None = None) -> Finding | None:
        if self.last_step is not None and step <= self.last_step:
            self.reset(step)
        self.last_step = step
        hit = self._judge(step, float(value))
        if hit is None:
            self.active = False
            return None
        fire = not self.active
        self.active = True
        if not fire:
            return None
        onset, evidence = hit
        evidence["rule"] = self.name
        return Finding(signal=self.signal, module=self.module, severity=Severity.CRITICAL,
                       onset_step=onset, detect_step=step, metric=self.key, evidence=evidence)

    def _judge(self, step: int, value: float) -> tuple[int, dict[str, Any]] | None:  # pragma: no cover
        raise NotImplementedError

    def reset(self, first_step: int | None = None) -> None:
        # Upstream keeps no step-indexed state, so a rollback clears the window entirely.
        self.active = False
        self.last_step = None


class OlmoCoreSpike(_Peer):
    name = "olmo_core"

    def __init__(self, key: str, window: int = 128, threshold_std: float = 6.0) -> None:
        super().__init__(key)
        self.window, self.threshold_std = window, threshold_std
        self.history: deque[float] = deque(maxlen=window)

    def _judge(self, step: int, value: float) -> tuple[int, dict[str, Any]] | None:
        hit = None
        if len(self.history) == self.window:
            arr = np.asarray(self.history)
            mean, std = float(arr.mean()), float(arr.std())
            if std >= 1e-10 and value > mean + self.threshold_std * std:
                hit = (step, {"value": value, "baseline": mean, "threshold": mean + self.threshold_std * std})
        self.history.append(value)
        return hit

    def reset(self, first_step: int | None = None) -> None:
        super().reset(first_step)
        self.history.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"history": [v if math.isfinite(v) else str(v) for v in self.history], "active": self.active}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.history = deque((float(v) for v in d["history"]), maxlen=self.window)
        self.active = bool(d["active"])


class FoundryKillLossSpike(_Peer):
    name = "llm_foundry"

    def __init__(self, key: str = LOSS, window: int = 100, outlier_multiplier: float = 2.0,
                 patience: int = 4, loss_cap: float = 10.0) -> None:
        super().__init__(key)
        self.window, self.mult, self.patience, self.loss_cap = window, outlier_multiplier, patience, loss_cap
        self.history: deque[float] = deque(maxlen=window)
        self.outliers = 0
        self.first_outlier = -1
        self.n = 0  # steps seen (upstream uses the trainer's batch counter)

    def _judge(self, step: int, value: float) -> tuple[int, dict[str, Any]] | None:
        hit = None
        if len(self.history) == self.window:
            avg = float(np.mean(self.history))
            if value >= avg * self.mult:
                if self.outliers == 0:
                    self.first_outlier = step
                self.outliers += 1
                if self.outliers > self.patience:
                    hit = (self.first_outlier, {"value": value, "baseline": avg, "threshold": avg * self.mult})
            else:
                self.outliers = 0
                high = sum(1 for v in self.history if v > self.loss_cap)
                if self.n >= 2 * self.window and high >= self.window / 2:
                    hit = (step, {"value": value, "threshold": self.loss_cap, "high_losses": high})
        self.history.append(value)
        self.n += 1
        return hit

    def reset(self, first_step: int | None = None) -> None:
        super().reset(first_step)
        self.history.clear()
        self.outliers, self.first_outlier, self.n = 0, -1, 0

    def state_dict(self) -> dict[str, Any]:
        return {"history": [v if math.isfinite(v) else str(v) for v in self.history], "active": self.active,
                "outliers": self.outliers, "first_outlier": self.first_outlier, "n": self.n}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.history = deque((float(v) for v in d["history"]), maxlen=self.window)
        self.active, self.outliers = bool(d["active"]), int(d["outliers"])
        self.first_outlier, self.n = int(d["first_outlier"]), int(d["n"])


class MegatronSpikyLoss(_Peer):
    name = "megatron_lm"

    def __init__(self, key: str = LOSS, threshold: float = 10.0, num_samples: int = 100) -> None:
        super().__init__(key)
        self.threshold, self.num_samples = threshold, num_samples
        self.count, self.max_value = 0, 0.0

    def _judge(self, step: int, value: float) -> tuple[int, dict[str, Any]] | None:
        mag = abs(value)
        if not math.isfinite(mag):
            return None  # upstream: "NaNs and Infs should be checked separately"
        if self.count < self.num_samples:
            self.count += 1
            self.max_value = max(self.max_value, mag)
            return None
        if mag >= self.max_value * self.threshold:
            return step, {"value": value, "baseline": self.max_value, "threshold": self.max_value * self.threshold}
        return None

    def reset(self, first_step: int | None = None) -> None:
        # Upstream keeps the sampled max across restarts (it is checkpointed); so do we.
        super().reset(first_step)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "max_value": self.max_value, "active": self.active}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.count, self.max_value, self.active = int(d["count"]), float(d["max_value"]), bool(d["active"])


PEERS: dict[str, tuple[Callable[[str], _Peer], frozenset[str]]] = {
    "olmo_core": (OlmoCoreSpike, frozenset({LOSS, GRAD_NORM})),
    "llm_foundry": (FoundryKillLossSpike, frozenset({LOSS})),
    "megatron_lm": (MegatronSpikyLoss, frozenset({LOSS})),
}


class PeerBank:
    """One peer rule over a record stream: `PeerBank("olmo_core").observe(record)`.
    Only the scalar keys (`loss`, `grad_norm`) are judged, as upstream does."""

    def __init__(self, name: str) -> None:
        if name not in PEERS:
            raise ValueError(f"unknown peer baseline {name!r}; choose one of {sorted(PEERS)}")
        self.name = name
        self._build, self._metrics = PEERS[name]
        self.series: dict[str, _Peer] = {}

    def observe(self, record: StepRecord) -> list[Finding]:
        out = []
        for key, value in record.values.items():
            if key not in self._metrics:  # scalar keys only: "grad_norm", not "grad_norm/<module>"
                continue
            det = self.series.get(key)
            if det is None:
                det = self.series[key] = self._build(key)
            f = det.update(record.step, value)
            if f is not None:
                out.append(f)
        return out

    def observe_many(self, records: Iterable[StepRecord]) -> list[Finding]:
        return [f for r in records for f in self.observe(r)]

    def reset(self, first_step: int | None = None) -> None:
        for det in self.series.values():
            det.reset(first_step)

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "series": {k: d.state_dict() for k, d in self.series.items()}}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.series = {}
        for key, state in d["series"].items():
            det = self.series[key] = self._build(key)
            det.load_state_dict(state)
