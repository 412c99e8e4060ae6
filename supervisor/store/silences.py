"""Silences: a run's signal silenced until a time (issue 37). Its alerts stop paging (they still go
to the channels as warnings, saying so) and its findings still act by policy; "*" silences every
signal of the run. Each one is audited when set and when ended early."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from thermowatch.supervisor.errors import NotFound
from thermowatch.supervisor.store.orm import Silence, utcnow

EVERY = "*"  # every signal of the run


@dataclass(frozen=True, slots=True)
class SilenceRow:
    id: int
    run_id: str
    signal: str
    until: dt.datetime
    who: str
    reason: str
    created_at: dt.datetime
    ended_at: dt.datetime | None

    def to_json(self) -> dict:
        return {"id": self.id, "run_id": self.run_id, "signal": self.signal, "until": self.until.isoformat(),
                "who": self.who, "reason": self.reason, "created_at": self.created_at.isoformat(),
                "ended_at": self.ended_at.isoformat() if self.ended_at else None}


def _row(r: Silence) -> SilenceRow:
    return SilenceRow(r.id, r.run_id, r.signal, r.until, r.who, r.reason, r.created_at, r.ended_at)


def create(session: Session, run_id: str, signal: str, until: dt.datetime, who: str, reason: str) -> int:
    row = Silence(run_id=run_id, signal=signal, until=until, who=who, reason=reason)
    session.add(row)
    session.flush()
    return row.id


def active(session: Session, run_id: str, now: dt.datetime | None = None) -> list[SilenceRow]:
    """The run's silences in force at `now`, newest first."""
    now = now or utcnow()
    q = (select(Silence).where(Silence.run_id == run_id, Silence.until > now, Silence.ended_at.is_(None))
         .order_by(Silence.id.desc()))
    return [_row(r) for r in session.execute(q).scalars()]


def silencing(session: Session, run_id: str, signal: str, now: dt.datetime | None = None) -> SilenceRow | None:
    """The silence in force for `signal` of the run (its own or "*"), or None."""
    now = now or utcnow()
    q = (select(Silence).where(Silence.run_id == run_id, Silence.until > now, Silence.ended_at.is_(None),
                               or_(Silence.signal == signal, Silence.signal == EVERY))
         .order_by(Silence.until.desc()).limit(1))
    r = session.execute(q).scalar()
    return _row(r) if r is not None else None


def listed(session: Session, run_id: str, limit: int = 100) -> list[SilenceRow]:
    """The run's silences, in force or not, newest first."""
    q = select(Silence).where(Silence.run_id == run_id).order_by(Silence.id.desc()).limit(limit)
    return [_row(r) for r in session.execute(q).scalars()]


def end(session: Session, silence_id: int) -> SilenceRow:
    """End a silence now (NotFound when there is none with that id)."""
    r = session.get(Silence, silence_id)
    if r is None:
        raise NotFound(f"no silence {silence_id}")
    if r.ended_at is None and r.until > utcnow():
        r.ended_at = utcnow()
        session.flush()
    return _row(r)


def get(session: Session, silence_id: int) -> SilenceRow | None:
    r = session.get(Silence, silence_id)
    return _row(r) if r is not None else None
