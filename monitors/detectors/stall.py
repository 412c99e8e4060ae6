"""Stall: no step has arrived for longer than `timeout_s` of wall-clock time.

Pure like the others: the caller passes the clock. `update(step, value, wall_time)` records
progress (any step, also a repeated one after a rollback: the run is alive); `check(now)` asks
"has it been too long?". A hung NCCL collective or a dead node shows up as silence, not as a
bad value, so this is the only detector that can see it. Latched until the next step arrives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from thermowatch.monitors.contract import Finding, Outcome, Severity, Signal

from thermowatch.monitors.commands import json_safe

from .base import positive


@dataclass
class StallConfig:
    # 10 minutes: longer than a step plus a checkpoint save at the embedded scale, well before
    # the collective timeouts (tens of minutes) after which NCCL aborts the job on its own.
    timeout_s: float = 600.0
    # Three timeouts of silence: nobody is coming back without help, CRITICAL.
    critical_factor: float = 3.0

    def __post_init__(self) -> None:
        positive("timeout_s", self.timeout_s)
        if not self.critical_factor >= 1.0:
            raise ValueError(f"critical_factor must be >= 1, got {self.critical_factor!r}")


class StallDetector:
    signal = Signal.STALL

    def __init__(self, config: StallConfig | None = None) -> None:
        self.config = config or StallConfig()
        self.last_step = -1
        self.last_time: float | None = None
        self.severity: Severity | None = None  # latched severity for the current silence

    def update(self, step: int, value: float = math.nan, wall_time: float | None = None) -> Finding | None:
        """A step arrived at `wall_time` (seconds, any epoch). Without a time it is ignored."""
        if wall_time is None or not math.isfinite(wall_time) or wall_time <= 0:
            return None
        self.last_step = int(step)
        if self.last_time is None or wall_time >= self.last_time:
            self.last_time = float(wall_time)
        self.severity = None
        return None

    def check(self, now: float) -> Finding | None:
        if self.last_time is None:
            return None
        silent = now - self.last_time
        c = self.config
        if silent <= c.timeout_s:
            return None
        severity = Severity.CRITICAL if silent > c.critical_factor * c.timeout_s else Severity.WARN
        if self.severity is not None and (self.severity == severity or severity == Severity.WARN):
            return None
        self.severity = severity
        evidence: dict[str, Any] = {"last_step": self.last_step, "last_wall_time": self.last_time,
                                    "now": now, "silent_s": silent, "threshold_s": c.timeout_s}
        # Alert (and page, by the policy's page_signals): a stall is not in the weights.
        return Finding(signal=self.signal, module="", severity=severity, onset_step=self.last_step,
                       detect_step=self.last_step, metric="step", evidence=json_safe(evidence),
                       outcome=Outcome.ALERT)

    def reset(self, first_step: int | None = None) -> None:
        """After a rollback the restart takes time; the silence clock starts at the next step."""
        self.last_time = None
        self.severity = None

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step, "last_time": self.last_time,
                "severity": self.severity.value if self.severity else None}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.last_step = int(d["last_step"])
        self.last_time = None if d["last_time"] is None else float(d["last_time"])
        self.severity = Severity(d["severity"]) if d["severity"] else None
