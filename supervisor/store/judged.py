"""The judge's durable marker: the newest step of each attempt the detectors have judged.

Written after a batch is judged; read at start-up (and after the judge's in-memory queue
overflowed) to find steps that were committed but never judged. See supervisor.judge.judge.
"""

from __future__ import annotations

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from thermowatch.supervisor.store._sql import insert_ignore
from thermowatch.supervisor.store.orm import Attempt, JudgeMark, Step, utcnow


def mark(session: Session, run_id: str, attempt: int, step: int, exists: bool = False) -> None:
    """Record that every step of (run, attempt) up to `step` is judged (never moves back).
    `exists`: the caller knows the row is there (it read or wrote it), so one statement will do."""
    if not exists:
        session.execute(insert_ignore(session, JudgeMark.__table__).values(
            run_id=run_id, attempt=attempt, through_step=step, updated_at=utcnow()))
    session.execute(update(JudgeMark)
                    .where(JudgeMark.run_id == run_id, JudgeMark.attempt == attempt, JudgeMark.through_step < step)
                    .values(through_step=step, updated_at=utcnow()))


def through(session: Session, run_id: str, attempt: int) -> int:
    """The newest judged step of (run, attempt); -1 if none."""
    v = session.execute(select(JudgeMark.through_step)
                        .where(JudgeMark.run_id == run_id, JudgeMark.attempt == attempt)).scalar()
    return -1 if v is None else int(v)


def behind(session: Session) -> list[tuple[str, int, int]]:
    """(run_id, attempt, through_step) for each run's newest attempt with stored steps beyond its
    marker. Older attempts are never judged (their late records are stored only)."""
    newest = (select(Attempt.run_id, func.max(Attempt.attempt).label("attempt"))
              .group_by(Attempt.run_id).subquery())
    top = (select(Step.run_id, Step.attempt, func.max(Step.step).label("top"))
           .join(newest, (newest.c.run_id == Step.run_id) & (newest.c.attempt == Step.attempt))
           .group_by(Step.run_id, Step.attempt).subquery())
    rows = session.execute(
        select(top.c.run_id, top.c.attempt, func.coalesce(JudgeMark.through_step, -1), top.c.top)
        .outerjoin(JudgeMark, (JudgeMark.run_id == top.c.run_id) & (JudgeMark.attempt == top.c.attempt))
    ).all()
    return [(r, int(a), int(t)) for r, a, t, last in rows if last > t]
