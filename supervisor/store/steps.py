"""Per-step bookkeeping: which absolute samples each step consumed (for skip ranges)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from sqlalchemy import func, insert, select
from sqlalchemy.orm import Session

from thermowatch.monitors.columns import StepColumns
from thermowatch.monitors.contract import StepRecord
from thermowatch.supervisor.store.orm import Step


def record_steps(session: Session, run_id: str, attempt: int, records: Sequence[StepRecord]) -> None:
    """One row per step (tests and replays that store records directly)."""
    if records:
        record_step_columns(session, run_id, attempt, StepColumns.from_records(records))


def record_step_columns(session: Session, run_id: str, attempt: int, cols: StepColumns) -> None:
    """One row per step, inserted plainly: a step already stored for this attempt is a unique
    violation, never silently skipped, so the database decides who stored it first (ingest
    compares a re-sent step with what is stored before it gets here: supervisor.ingest.ingestor)."""
    if len(cols):
        session.execute(insert(Step.__table__), [
            {"run_id": run_id, "attempt": attempt, "step": st, "sample_lo": lo, "sample_hi": hi, "tokens": tok,
             "wall_time": wt}
            for st, lo, hi, tok, wt in zip(cols.steps.tolist(), cols.sample_lo.tolist(), cols.sample_hi.tolist(),
                                           cols.tokens.tolist(), cols.wall_time.tolist())])


class StoredStep(NamedTuple):
    sample_lo: int
    sample_hi: int
    tokens: int
    wall_time: float


def stored(session: Session, run_id: str, attempt: int, step_lo: int, step_hi: int) -> dict[int, StoredStep]:
    """Steps of this attempt already stored in [step_lo, step_hi]. One indexed range read per
    batch; empty unless the batch is a re-send."""
    rows = session.execute(
        select(Step.step, Step.sample_lo, Step.sample_hi, Step.tokens, Step.wall_time)
        .where(Step.run_id == run_id, Step.attempt == attempt, Step.step >= step_lo, Step.step <= step_hi)
    ).all()
    return {step: StoredStep(lo, hi, tok, wt) for step, lo, hi, tok, wt in rows}


def sample_range(session: Session, run_id: str, step_lo: int, step_hi: int) -> tuple[int, int] | None:
    """Half-open absolute sample range [lo, hi) consumed by steps step_lo..step_hi (inclusive),
    as the newest attempt that trained each step saw it. None if no step there reported samples."""
    rows = session.execute(
        select(Step.step, Step.attempt, Step.sample_lo, Step.sample_hi)
        .where(Step.run_id == run_id, Step.step >= step_lo, Step.step <= step_hi, Step.sample_lo >= 0)
        .order_by(Step.step, Step.attempt)
    ).all()
    if not rows:
        return None
    newest = {step: (lo, hi) for step, _, lo, hi in rows}  # ordered by attempt: the last one wins
    return min(lo for lo, _ in newest.values()), max(hi for _, hi in newest.values())


def step_wall_times(session: Session, run_id: str, attempt: int, step_lo: int = 0) -> list[tuple[int, float]]:
    rows = session.execute(
        select(Step.step, Step.wall_time)
        .where(Step.run_id == run_id, Step.attempt == attempt, Step.step >= step_lo)
        .order_by(Step.step)
    ).all()
    return [(s, w) for s, w in rows]


def steps_of_samples(session: Session, run_id: str, sample_lo: int, sample_hi: int) -> tuple[int, int] | None:
    """The first and last step (any attempt) that consumed a sample of [sample_lo, sample_hi): where
    a skip range sits on the step axis. None when no stored step overlaps it."""
    lo, hi = session.execute(
        select(func.min(Step.step), func.max(Step.step))
        .where(Step.run_id == run_id, Step.sample_hi > sample_lo, Step.sample_lo < sample_hi)
    ).one()
    return None if lo is None else (int(lo), int(hi))


def last_step(session: Session, run_id: str, attempt: int) -> int | None:
    """The last step the attempt stored: one seek on ix_steps_run_id_attempt_step. (A GROUP BY over
    the run's steps reads all of them: the run page calls this on every refresh, at 10^6 steps.)"""
    q = select(func.max(Step.step)).where(Step.run_id == run_id, Step.attempt == attempt)
    found = session.execute(q).scalar()
    return None if found is None else int(found)


def furthest_step(session: Session, run_id: str) -> int | None:
    """The highest step any attempt of the run stored: one seek on the steps' primary key
    (run_id, step, attempt), however many attempts the run has."""
    found = session.execute(select(func.max(Step.step)).where(Step.run_id == run_id)).scalar()
    return None if found is None else int(found)


def live_wall_times(session: Session, run_id: str, step_lo: int | None, step_hi: int | None,
                    points: int) -> tuple[list[int], list[float]]:
    """(steps, wall times) of the run's live path (each step's newest attempt) at up to `points`
    steps spread evenly over [step_lo, step_hi] (default: the whole run): what the page needs to
    put its charts on a wall-clock axis. One IN query on the steps' primary key, whatever the run's
    length; steps a gap skipped, or without a wall time, are left out."""
    if step_hi is None:  # the furthest step of any attempt: one seek (a seek per attempt took 3.5-9 s at
        step_hi = furthest_step(session, run_id)  # 10^4 attempts, issue 34)
        if step_hi is None:
            return [], []
    step_lo = 0 if step_lo is None else step_lo
    if step_hi < step_lo:
        return [], []
    grid = np.unique(np.linspace(step_lo, step_hi, max(2, points)).round().astype(np.int64)).tolist()
    newest: dict[int, tuple[int, float]] = {}
    for step, attempt, wall in session.execute(select(Step.step, Step.attempt, Step.wall_time)
                                               .where(Step.run_id == run_id, Step.step.in_(grid))).all():
        if wall is not None and math.isfinite(wall) and wall > 0 and (step not in newest or attempt > newest[step][0]):
            newest[step] = (attempt, float(wall))
    steps = sorted(newest)
    return steps, [newest[st][1] for st in steps]
