"""LR changes the trainer acknowledged: an absolute multiplier on the schedule from start_step,
for `steps` steps (None: for good), ramped in over `rewarmup_steps`. Listed in the order the
trainer applied them (`seq`, its list position; rows from before it was recorded: by id), because
a newer change replaces the older ones (contract.multiplier_at)."""

from __future__ import annotations

from dataclasses import dataclass

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from thermowatch.monitors.contract import LRChange, multiplier_at
from thermowatch.supervisor.store.orm import LrChange


@dataclass(slots=True)
class LrChangeRow:
    id: int
    run_id: str
    multiplier: float
    start_step: int
    steps: int | None
    action_id: int | None
    rewarmup_steps: int = 0
    seq: int | None = None

    def change(self) -> LRChange:
        return LRChange(self.start_step, self.multiplier, self.steps, self.rewarmup_steps)


def add_lr_change(session: Session, run_id: str, multiplier: float, start_step: int, steps: int | None = None,
                  action_id: int | None = None, *, rewarmup_steps: int = 0, seq: int | None = None) -> int:
    change = LRChange(start_step, multiplier, steps, rewarmup_steps)  # the contract's rules (ContractError)
    row = LrChange(run_id=run_id, multiplier=change.multiplier, start_step=change.start_step, steps=change.steps,
                   rewarmup_steps=change.rewarmup_steps, seq=seq, action_id=action_id)
    session.add(row)
    session.flush()
    return row.id


def lr_changes(session: Session, run_id: str) -> list[LrChangeRow]:
    """In the order the trainer applied them (newest last)."""
    rows = session.execute(select(LrChange).where(LrChange.run_id == run_id)
                           .order_by(func.coalesce(LrChange.seq, -1), LrChange.id)).scalars()
    return [LrChangeRow(r.id, r.run_id, r.multiplier, r.start_step, r.steps, r.action_id, r.rewarmup_steps or 0, r.seq)
            for r in rows]


def changes(session: Session, run_id: str) -> list[LRChange]:
    return [r.change() for r in lr_changes(session, run_id)]


def multiplier_in_force(session: Session, run_id: str, step: int) -> float:
    """The multiplier the supervisor believes the trainer uses at `step` (1-based)."""
    return multiplier_at(step, changes(session, run_id))
