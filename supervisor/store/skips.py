"""The skip ledger: absolute sample ranges [lo, hi) every restart of a run passes over."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from thermowatch.monitors.contract import SampleRange, ledger_digest, merge_ranges
from thermowatch.supervisor.store.orm import SkipRange


def add_skip_range(session: Session, run_id: str, lo: int, hi: int, action_id: int | None = None) -> int:
    SampleRange(lo, hi)  # the contract's rules (ContractError names the bound)
    row = SkipRange(run_id=run_id, lo=lo, hi=hi, action_id=action_id)
    session.add(row)
    session.flush()
    return row.id


def skip_ranges(session: Session, run_id: str) -> list[tuple[int, int]]:
    """The run's skip ranges, sorted, overlapping and touching ranges merged."""
    rows = session.execute(select(SkipRange.lo, SkipRange.hi).where(SkipRange.run_id == run_id)).all()
    return [(r.lo, r.hi) for r in merge_ranges(rows)]


def digest(session: Session, run_id: str) -> str:
    """contract.ledger_digest of the run's ledger: what the trainer's records must carry."""
    return ledger_digest(skip_ranges(session, run_id))
