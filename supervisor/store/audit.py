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


def audit_log(session: Session, run_id: str | None = None, limit: int = 500) -> list[AuditRow]:
    q = select(AuditEntry)
    if run_id is not None:
        q = q.where(AuditEntry.run_id == run_id)
    rows = session.execute(q.order_by(AuditEntry.id.desc()).limit(limit)).scalars()
    return [AuditRow(r.id, r.at, r.run_id, r.actor, r.event, dict(r.detail or {})) for r in rows]


def events(session: Session, run_id: str, event: str, limit: int = 1000) -> list[AuditRow]:
    """The run's audit rows of one kind of event, newest first."""
    q = (select(AuditEntry).where(AuditEntry.run_id == run_id, AuditEntry.event == event)
         .order_by(AuditEntry.id.desc()).limit(limit))
    return [AuditRow(r.id, r.at, r.run_id, r.actor, r.event, dict(r.detail or {})) for r in session.execute(q).scalars()]
