"""The skip ledger: absolute sample ranges [lo, hi) every restart of a run passes over."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from supervisor.store.orm import SkipRange


def add_skip_range(session: Session, run_id: str, lo: int, hi: int, action_id: int | None = None) -> int:
    if not 0 <= lo < hi:
        raise ValueError(f"skip range must satisfy 0 <= lo < hi, got [{lo}, {hi})")
    row = SkipRange(run_id=run_id, lo=lo, hi=hi, action_id=action_id)
    session.add(row)
    session.flush()
    return row.id


def skip_ranges(session: Session, run_id: str) -> list[tuple[int, int]]:
    """The run's skip ranges, sorted, overlapping and touching ranges merged."""
    rows = session.execute(select(SkipRange.lo, SkipRange.hi).where(SkipRange.run_id == run_id).order_by(SkipRange.lo)).all()
    merged: list[list[int]] = []
    for lo, hi in rows:
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi) for lo, hi in merged]
