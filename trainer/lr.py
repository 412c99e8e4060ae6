"""Learning rate as a pure function of the step: base schedule x the product of LR changes.

Nothing here is stateful, so a resumed or rolled-back run gets exactly the LR it had (or was
told to have) at every step; the list of `LRChange`s rides in every checkpoint manifest, like
the skip ledger (DESIGN.md, "Rollback semantics": "The LR change is a multiplier on the
schedule, recorded with the step it starts at").

Steps are 1-based: step k is the k-th optimizer update; a checkpoint at step s holds the state
after s updates, and resuming from it trains step s + 1 next.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Iterable, Mapping, Sequence

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
            return self.base_lr * step / self.warmup_steps
        if self.kind == "constant":
            return self.base_lr
        span = max(1, self.total_steps - self.warmup_steps)
        frac = min(1.0, (step - self.warmup_steps) / span)
        if self.kind == "cosine":
            shape = 0.5 * (1.0 + math.cos(math.pi * frac))
        else:
            shape = 1.0 - frac
        return self.base_lr * (self.min_ratio + (1.0 - self.min_ratio) * shape)


@dataclass(frozen=True)
class LRChange:
    """Multiply the schedule by `multiplier` from `start_step` on, for `steps` steps (None =
    for the rest of the run). `rewarmup_steps` ramps the change in linearly from 0: after a
    rollback the optimizer moments are those of the checkpoint, and OPT-175B's logbook restarts
    with a short warmup rather than jumping straight back to the full LR."""

    start_step: int
    multiplier: float
    steps: int | None = None
    rewarmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.start_step < 1:
            raise ValueError(f"LRChange.start_step must be >= 1 (steps are 1-based), got {self.start_step}")
        if not (self.multiplier >= 0 and math.isfinite(self.multiplier)):
            raise ValueError(f"LRChange.multiplier must be a finite float >= 0, got {self.multiplier!r}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"LRChange.steps must be >= 1 or None (permanent), got {self.steps}")
        if self.rewarmup_steps < 0:
            raise ValueError(f"LRChange.rewarmup_steps must be >= 0, got {self.rewarmup_steps}")

    def factor(self, step: int) -> float:
        k = step - self.start_step
        if k < 0 or (self.steps is not None and k >= self.steps):
            return 1.0
        if k < self.rewarmup_steps:
            return self.multiplier * (k + 1) / self.rewarmup_steps
        return self.multiplier

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "LRChange":
        steps = obj.get("steps")
        return cls(
            start_step=int(obj["start_step"]),
            multiplier=float(obj["multiplier"]),
            steps=None if steps is None else int(steps),
            rewarmup_steps=int(obj.get("rewarmup_steps", 0)),
        )


def lr_at(step: int, schedule: LRSchedule, changes: Iterable[LRChange] = ()) -> float:
    """The LR for (1-based) `step`: the schedule times every change active at that step."""
    lr = schedule.at(step)
    for change in changes:
        lr *= change.factor(step)
    return lr


def changes_to_json(changes: Sequence[LRChange]) -> list[dict[str, Any]]:
    return [c.to_json() for c in changes]


def changes_from_json(obj: Any) -> list[LRChange]:
    if not obj:
        return []
    if not isinstance(obj, (list, tuple)):
        raise ValueError(f"LR changes must be a JSON list of objects, got {type(obj).__name__}")
    return [LRChange.from_json(o) for o in obj]


def change_from_args(args: Mapping[str, Any], start_step: int) -> LRChange | None:
    """The LR change a ROLLBACK / SET_LR command asks for (contract.CommandKind), or None when
    it names no `lr_multiplier`. `lr_steps` None = permanent."""
    mult = args.get("lr_multiplier")
    if mult is None:
        return None
    steps = args.get("lr_steps")
    return LRChange(
        start_step=start_step,
        multiplier=float(mult),
        steps=None if steps is None else int(steps),
        rewarmup_steps=int(args.get("rewarmup_steps") or 0),
    )
