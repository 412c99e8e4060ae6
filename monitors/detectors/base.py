"""Shared pieces of the streaming detectors: the seam Protocols, a bounded step/value history,
a severity latch, robust window statistics and a strict-JSON helper for evidence.

Every detector is pure (no clock, no I/O), O(1) amortised per point (bounded buffers only) and
restartable: `state_dict()` returns strict JSON (no NaN, so it fits PostgreSQL JSONB) and
`load_state_dict()` restores it exactly, so findings after a supervisor restart are the same
as if it had never stopped. The detectors keep their series as rows of arrays (arrays.py,
series.py); History remains for the loss trend, a single sequential series.
"""

from __future__ import annotations

import math
from collections import deque
from itertools import islice
from typing import Any, Protocol, runtime_checkable

import numpy as np

from thermowatch.monitors.contract import Finding, Outcome, Severity

_RANK = {Severity.INFO: 0, Severity.WARN: 1, Severity.CRITICAL: 2}

# 1.4826 * MAD estimates the standard deviation of Gaussian noise (consistency constant).
MAD_TO_SIGMA = 1.4826


@runtime_checkable
class SeriesDetector(Protocol):
    """One instance judges one metric key (one series)."""

    def update(self, step: int, value: float, wall_time: float | None = None) -> Finding | None: ...

    def reset(self, first_step: int | None = None) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, d: dict[str, Any]) -> None: ...


def severity_rank(s: Severity) -> int:
    return _RANK[s]


class History:
    """Bounded (step, value) buffer. Appends are O(1); `rewind` drops points from a rolled-back
    stretch so repeated steps after a rollback do not sit next to their first run."""

    def __init__(self, maxlen: int) -> None:
        self.maxlen = maxlen
        self.steps: deque[int] = deque(maxlen=maxlen)
        self.values: deque[float] = deque(maxlen=maxlen)

    def __len__(self) -> int:
        return len(self.values)

    def append(self, step: int, value: float) -> None:
        self.steps.append(int(step))
        self.values.append(float(value))

    def tail(self, n: int, skip_last: int = 0) -> np.ndarray:
        """The `n` values before the last `skip_last` ones (fewer if the buffer is short)."""
        vals = self.values
        end = len(vals) - skip_last
        start = max(0, end - n)
        if end <= 0:
            return np.empty(0)
        # deques do not slice; islice walks at most `maxlen` items, a bounded cost.
        return np.fromiter(islice(vals, start, end), dtype=np.float64, count=end - start)

    def tail_steps(self, n: int) -> np.ndarray:
        end = len(self.steps)
        start = max(0, end - n)
        return np.fromiter(islice(self.steps, start, end), dtype=np.float64, count=end - start)

    def rewind(self, first_step: int | None) -> int:
        """Drop points at or after `first_step` (all with None); returns how many were dropped."""
        n = len(self.steps)
        if first_step is None:
            self.steps.clear()
            self.values.clear()
            return n
        while self.steps and self.steps[-1] >= first_step:
            self.steps.pop()
            self.values.pop()
        return n - len(self.steps)

    def state_dict(self) -> dict[str, Any]:
        return {"steps": list(self.steps), "values": list(self.values)}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.steps = deque((int(s) for s in d["steps"]), maxlen=self.maxlen)
        self.values = deque((float(v) for v in d["values"]), maxlen=self.maxlen)


class Latch:
    """Raise a finding once per excursion. Re-raise only to escalate, in severity (WARN ->
    CRITICAL) or in outcome (watch -> alert -> act: a growth that gains a witness of harm);
    clear after `clear_steps` consecutive points back inside the baseline band (that rule runs
    across all series at once: arrays.Rows.observe; a Latch is materialised only for a row that
    may fire)."""

    def __init__(self, clear_steps: int) -> None:
        self.clear_steps = clear_steps
        self.severity: Severity | None = None
        self.outcome: Outcome | None = None
        self.onset_step = -1
        self._clear_run = 0

    @property
    def active(self) -> bool:
        return self.severity is not None

    def should_fire(self, severity: Severity, outcome: Outcome | None = None) -> bool:
        if self.severity is None:
            return True
        if outcome is not None and self.outcome is not None and outcome.rank > self.outcome.rank:
            return True
        return severity_rank(severity) > severity_rank(self.severity) and (
            outcome is None or self.outcome is None or outcome.rank >= self.outcome.rank)

    def fire(self, severity: Severity, onset_step: int, outcome: Outcome | None = None) -> None:
        if self.severity is None:
            self.onset_step = onset_step  # an escalation keeps the first onset
        if self.severity is None or severity_rank(severity) > severity_rank(self.severity):
            self.severity = severity
        if outcome is not None and (self.outcome is None or outcome.rank > self.outcome.rank):
            self.outcome = outcome
        self._clear_run = 0

    def reset(self) -> None:
        self.severity = None
        self.outcome = None
        self.onset_step = -1
        self._clear_run = 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "severity": self.severity.value if self.severity else None,
            "outcome": self.outcome.value if self.outcome else None,
            "onset_step": self.onset_step,
            "clear_run": self._clear_run,
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.severity = Severity(d["severity"]) if d["severity"] else None
        self.outcome = Outcome(d["outcome"]) if d.get("outcome") else None
        self.onset_step = int(d["onset_step"])
        self._clear_run = int(d["clear_run"])



def positive(name: str, value: float) -> None:
    """Config validation helper: the message names the field and the fix."""
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


def at_least(name: str, value: int, lo: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise ValueError(f"{name} must be an integer >= {lo}, got {value!r}")


def at_least_each(cfg: object, **lows: int) -> None:
    """at_least for each named field of `cfg`, in the order given: a config's counts in one table."""
    for name, lo in lows.items():
        at_least(name, getattr(cfg, name), lo)
