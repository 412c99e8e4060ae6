"""Aggregate reads for `/metrics` and `/healthz` (supervisor.metrics, supervisor.health).

Each function is one GROUP BY query returning plain tuples: a scrape every 15 s must cost the
same for a run with 10 incidents as for one with 10,000, and never build an ORM object per row.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import func, select, text
from sqlalchemy.orm import Session

from supervisor.store.orm import Action, Alert, Attempt, Incident, JudgeMark


@dataclass(frozen=True, slots=True)
class RunGauges:
    run_id: str
    attempts: int  # attempts opened (the newest is attempts - 1)
    last_step: int | None  # newest judged step of the newest attempt that has one
    last_record_at: dt.datetime | None  # when the daemon last judged a batch of the run (its own clock)
    open_incidents: int


def run_gauges(session: Session, run_id: str | None = None) -> list[RunGauges]:
    """One row per run (or only `run_id`'s) from the small tables alone. The last step is the
    judge's marker (store.judged: one row per attempt, trailing the stored steps by the judge's
    backlog, milliseconds when healthy), not MAX() over the steps table: that read every step of
    every run, 1.2 s a scrape at 10^6 steps x 2 runs on SQLite."""
    def only(q, col):
        return q if run_id is None else q.where(col == run_id)

    attempts = dict(session.execute(only(select(Attempt.run_id, func.count()), Attempt.run_id)
                                    .group_by(Attempt.run_id)).all())
    newest: dict[str, tuple[int, int]] = {}  # run -> (its newest marked attempt, that attempt's marker)
    seen: dict[str, dt.datetime] = {}
    for r, attempt, through, at in session.execute(
            only(select(JudgeMark.run_id, JudgeMark.attempt, JudgeMark.through_step, JudgeMark.updated_at),
                 JudgeMark.run_id)).all():
        if r not in newest or attempt > newest[r][0]:
            newest[r] = (attempt, int(through))
        at = _utc(at)
        if at is not None and (r not in seen or at > seen[r]):
            seen[r] = at
    incidents = dict(session.execute(only(select(Incident.run_id, func.count()), Incident.run_id)
                                     .where(Incident.state == "open").group_by(Incident.run_id)).all())
    return [RunGauges(r, int(n), newest[r][1] if r in newest else None, seen.get(r), int(incidents.get(r, 0)))
            for r, n in sorted(attempts.items())]


def actions_by_state(session: Session) -> list[tuple[str, str, str, int]]:
    """(run_id, kind, state, count) over every action ever written."""
    rows = session.execute(select(Action.run_id, Action.kind, Action.state, func.count())
                           .group_by(Action.run_id, Action.kind, Action.state)).all()
    return [(r, k, s, int(n)) for r, k, s, n in rows]


def alerts_by_state(session: Session) -> list[tuple[str, str, int, dt.datetime | None]]:
    """(channel, state, count, oldest created_at) of the alert outbox."""
    rows = session.execute(select(Alert.channel, Alert.state, func.count(), func.min(Alert.created_at))
                           .group_by(Alert.channel, Alert.state)).all()
    return [(c, s, int(n), _utc(oldest)) for c, s, n, oldest in rows]


def ping(session: Session) -> None:
    """`SELECT 1`: the database answers (the caller bounds how long it may take)."""
    session.execute(text("SELECT 1")).scalar()


def _utc(value: dt.datetime | None) -> dt.datetime | None:
    # MAX() over a UTCDateTime column comes back as the driver's raw value on SQLite (a naive
    # string or datetime): aggregates skip the column type's result processor.
    if value is None:
        return None
    if isinstance(value, str):
        value = dt.datetime.fromisoformat(value)
    return value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)
