"""Alerts sent (or attempted) to humans: Slack, console."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from supervisor.store.orm import Alert


@dataclass(slots=True)
class AlertRow:
    id: int
    run_id: str | None
    channel: str
    text: str
    sent_at: dt.datetime
    ok: bool
    error: str


def record_alert(session: Session, run_id: str | None, channel: str, text: str, ok: bool, error: str = "") -> int:
    row = Alert(run_id=run_id, channel=channel, text=text, ok=ok, error=error)
    session.add(row)
    session.flush()
    return row.id


def alerts(session: Session, run_id: str | None = None, limit: int = 200) -> list[AlertRow]:
    q = select(Alert)
    if run_id is not None:
        q = q.where(Alert.run_id == run_id)
    rows = session.execute(q.order_by(Alert.id.desc()).limit(limit)).scalars()
    return [AlertRow(r.id, r.run_id, r.channel, r.text, r.sent_at, r.ok, r.error) for r in rows]
