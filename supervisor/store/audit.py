"""The audit trail: who did what to which run, and why."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from thermowatch.monitors.commands import json_safe
from thermowatch.supervisor.store.orm import AuditEntry


@dataclass(slots=True)
class AuditRow:
    id: int
    at: dt.datetime
    run_id: str | None
    actor: str
    event: str
    detail: dict[str, Any] = field(default_factory=dict)


def audit(session: Session, run_id: str | None, actor: str, event: str, detail: dict[str, Any] | None = None) -> int:
    row = AuditEntry(run_id=run_id, actor=actor, event=event, detail=json_safe(detail or {}))
    session.add(row)
    session.flush()
    return row.id


# A run's rows newest first in the order of ix_audit_run_id_at (run_id, at), id breaking ties: a
# backward range of the index read for `limit` rows. By id alone the database sorted every row
# of the run first, one per attempt opened: 10^4 on a run of 10^4 attempts (issue 34).
_NEWEST = (AuditEntry.at.desc(), AuditEntry.id.desc())


def audit_log(session: Session, run_id: str | None = None, limit: int = 500) -> list[AuditRow]:
    q = select(AuditEntry)
    if run_id is not None:
        q = q.where(AuditEntry.run_id == run_id).order_by(*_NEWEST)
    else:
        q = q.order_by(AuditEntry.id.desc())
    rows = session.execute(q.limit(limit)).scalars()
    return [AuditRow(r.id, r.at, r.run_id, r.actor, r.event, dict(r.detail or {})) for r in rows]


def events(session: Session, run_id: str, event: str, limit: int = 1000) -> list[AuditRow]:
    """The run's audit rows of one kind of event, newest first."""
    q = (select(AuditEntry).where(AuditEntry.run_id == run_id, AuditEntry.event == event)
         .order_by(*_NEWEST).limit(limit))
    return [AuditRow(r.id, r.at, r.run_id, r.actor, r.event, dict(r.detail or {})) for r in session.execute(q).scalars()]
