"""Runs and their attempts (each launch or relaunch of a run is one attempt)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from monitors.contract import RunInfo
from supervisor.store._sql import insert_ignore
from supervisor.store.orm import Attempt, Run


@dataclass(slots=True)
class RunRow:
    run_id: str
    config: dict[str, Any]
    created_at: dt.datetime


@dataclass(slots=True)
class AttemptRow:
    run_id: str
    attempt: int
    started_at: dt.datetime
    world_size: int
    start_step: int
    hosts: dict[int, str] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)


def create_run(session: Session, run_id: str, config: dict[str, Any] | None = None) -> None:
    """Create the run if it does not exist (idempotent: a relaunch keeps the first config)."""
    session.execute(insert_ignore(session, Run.__table__), [{"run_id": run_id, "config": config or {}}])


def open_attempt(session: Session, info: RunInfo) -> None:
    """Record a run's (re)start; creates the run on its first attempt. Idempotent per attempt."""
    create_run(session, info.run_id, info.config)
    session.execute(
        insert_ignore(session, Attempt.__table__),
        [
            {
                "run_id": info.run_id,
                "attempt": info.attempt,
                "world_size": info.world_size,
                "start_step": info.start_step,
                "hosts": {str(k): v for k, v in info.hosts.items()},
                "config": info.config,
            }
        ],
    )


def get_run(session: Session, run_id: str) -> RunRow | None:
    r = session.get(Run, run_id)
    return RunRow(r.run_id, dict(r.config), r.created_at) if r is not None else None


def run_exists(session: Session, run_id: str) -> bool:
    return session.execute(select(Run.run_id).where(Run.run_id == run_id)).first() is not None


def list_runs(session: Session) -> list[RunRow]:
    rows = session.execute(select(Run).order_by(Run.created_at)).scalars().all()
    return [RunRow(r.run_id, dict(r.config), r.created_at) for r in rows]


def _attempt_row(a: Attempt) -> AttemptRow:
    return AttemptRow(
        a.run_id, a.attempt, a.started_at, a.world_size, a.start_step,
        {int(k): v for k, v in (a.hosts or {}).items()}, dict(a.config or {}),
    )


def attempts(session: Session, run_id: str) -> list[AttemptRow]:
    rows = session.execute(select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.attempt)).scalars()
    return [_attempt_row(a) for a in rows]


def attempt_exists(session: Session, run_id: str, attempt: int) -> bool:
    q = select(Attempt.attempt).where(Attempt.run_id == run_id, Attempt.attempt == attempt)
    return session.execute(q).first() is not None


def latest_attempt(session: Session, run_id: str) -> AttemptRow | None:
    a = session.execute(
        select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.attempt.desc()).limit(1)
    ).scalar()
    return _attempt_row(a) if a is not None else None
