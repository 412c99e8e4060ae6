"""LR changes: a multiplier on the schedule from start_step for `steps` steps (None: for good)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from supervisor.store.orm import LrChange


@dataclass(slots=True)
class LrChangeRow:
    id: int
    run_id: str
    multiplier: float
    start_step: int
    steps: int | None
    action_id: int | None


def add_lr_change(session: Session, run_id: str, multiplier: float, start_step: int, steps: int | None = None,
                  action_id: int | None = None) -> int:
    if not multiplier > 0:
        raise ValueError(f"LR multiplier must be > 0, got {multiplier}")
    row = LrChange(run_id=run_id, multiplier=multiplier, start_step=start_step, steps=steps, action_id=action_id)
    session.add(row)
    session.flush()
    return row.id


def lr_changes(session: Session, run_id: str) -> list[LrChangeRow]:
    rows = session.execute(select(LrChange).where(LrChange.run_id == run_id).order_by(LrChange.start_step, LrChange.id)).scalars()
    return [LrChangeRow(r.id, r.run_id, r.multiplier, r.start_step, r.steps, r.action_id) for r in rows]
