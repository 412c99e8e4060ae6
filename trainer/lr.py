"""Learning rate as a pure function of the step: base schedule x the multiplier in force.

Nothing here is stateful, so a resumed or rolled-back run gets exactly the LR it had (or was
told to have) at every step; the list of `LRChange`s rides in every checkpoint manifest, like
the skip ledger (DESIGN.md, "Rollback semantics": "The LR change is a multiplier on the
schedule, recorded with the step it starts at"). The multiplier is absolute: the newest change
covering a step replaces the older ones (contract.multiplier_at, the supervisor's function too),
so a second cut to 0.25 trains at x0.25, not 0.5 x 0.25.

Steps are 1-based: step k is the k-th optimizer update; a checkpoint at step s holds the state
after s updates, and resuming from it trains step s + 1 next.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from thermowatch.monitors.contract import ContractError, LRChange, multiplier_at

__all__ = ["LRSchedule", "LRChange", "lr_at", "multiplier_at", "changes_to_json", "changes_from_json"]

SCHEDULES = ("cosine", "constant", "linear")


@dataclass(frozen=True)
class LRSchedule:
    """Linear warmup to `base_lr`, then cosine (or linear) decay to `min_ratio * base_lr` at
    `total_steps`, or constant. The GPT-3 / Chinchilla recipe."""

    base_lr: float
    total_steps: int
    warmup_steps: int = 0
    kind: str = "cosine"
    min_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not (self.base_lr > 0 and math.isfinite(self.base_lr)):
            raise ValueError(f"LRSchedule.base_lr must be a positive finite float, got {self.base_lr!r}")
        if self.total_steps < 1:
            raise ValueError(f"LRSchedule.total_steps must be >= 1, got {self.total_steps}")
        if not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(
                f"LRSchedule.warmup_steps={self.warmup_steps} must be in [0, total_steps={self.total_steps}]"
            )
        if self.kind not in SCHEDULES:
            raise ValueError(f"LRSchedule.kind={self.kind!r} is not one of {SCHEDULES}")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"LRSchedule.min_ratio must be in [0, 1], got {self.min_ratio!r}")

    def at(self, step: int) -> float:
        if step < 1:
            raise ValueError(f"steps are 1-based; got step {step}")
        if step <= self.warmup_steps:
            # The fraction first: 1e-2 * 57 / 57 is 0.010000000000000002, above the peak it climbs
            # to (peak_from says base_lr); step / warmup_steps is exactly 1.0 at the top, below it before.
            return self.base_lr * (step / self.warmup_steps)
        if self.kind == "constant":
            return self.base_lr
        span = max(1, self.total_steps - self.warmup_steps)
        frac = min(1.0, (step - self.warmup_steps) / span)
        if self.kind == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * frac))
        else:
            shape = 1.0 - frac
        return self.base_lr * (self.min_ratio + (1.0 - self.min_ratio) * shape)

    def peak_from(self, step: int) -> float:
        """The largest LR of the schedule at `step` or later: the peak while the warm-up still
        climbs, then the LR of `step` itself (cosine, linear and constant never rise again).
        Sent with every step as `lr_peak_ahead` (times the multiplier in force)."""
        if step < 1:
            raise ValueError(f"steps are 1-based; got step {step}")
        return self.base_lr if step <= self.warmup_steps else self.at(step)


def lr_at(step: int, schedule: LRSchedule, changes: Sequence[LRChange] = ()) -> float:
    """The LR for (1-based) `step`: the schedule times the multiplier in force at that step."""
    return schedule.at(step) * multiplier_at(step, changes)


def changes_to_json(changes: Sequence[LRChange]) -> list[dict[str, Any]]:
    return [c.to_json() for c in changes]


def changes_from_json(obj: Any) -> list[LRChange]:
    if not obj:
        return []
    if not isinstance(obj, (list, tuple)):
        raise ContractError(f"LR changes must be a JSON list of objects, got {type(obj).__name__}")
    return [LRChange.from_json(o) for o in obj]
