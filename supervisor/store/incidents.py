"""Incidents: findings grouped by (run, signal, module) while open."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from thermowatch.supervisor.store.orm import Incident, utcnow

STATES = ("open", "resolved")


@dataclass(slots=True)
class IncidentRow:
    id: int
    run_id: str
    signal: str
    module: str
    severity: str
    onset_step: int
    detect_step: int
    state: str
    opened_at: dt.datetime
    closed_at: dt.datetime | None
    resolution: str
    episode_id: int | None = None

    @property
    def episode(self) -> int:
        """The id of the first incident of its divergence episode (its own when it is the first)."""
        return self.episode_id if self.episode_id is not None else self.id


def _row(i: Incident) -> IncidentRow:
    return IncidentRow(i.id, i.run_id, i.signal, i.module, i.severity, i.onset_step, i.detect_step,
                       i.state, i.opened_at, i.closed_at, i.resolution, i.episode_id)


# A divergence episode (issue 37: one divergence tripped nine detector/module pairs, nine Slack
# threads): incidents of one run whose steps [onset, detection] lie within this many steps of
# each other, in any attempt (a rollback re-trains the same steps), opened within EPISODE_S of
# the newest. Their alerts share the first one's thread.
EPISODE_GAP_STEPS = 50
EPISODE_S = 6 * 3600.0


def episode_of(session: Session, run_id: str, onset_step: int, detect_step: int,
               now: dt.datetime | None = None) -> int | None:
    """The episode a new incident over steps [onset_step, detect_step] joins: the first incident
    of the run's newest incident within EPISODE_GAP_STEPS of those steps, opened in the last
    EPISODE_S; None when there is none (it starts an episode of its own)."""
    since = (now or utcnow()) - dt.timedelta(seconds=EPISODE_S)
    near = session.execute(
        select(Incident.id, Incident.episode_id).where(
            Incident.run_id == run_id, Incident.opened_at >= since,
            Incident.detect_step >= onset_step - EPISODE_GAP_STEPS,
            Incident.onset_step <= detect_step + EPISODE_GAP_STEPS)
        .order_by(Incident.id.desc()).limit(1)).first()
    if near is None:
        return None
    return near.episode_id if near.episode_id is not None else near.id


def start_episode(session: Session, incident_id: int) -> None:
    """`incident_id` leads its episode from now on (an alert that needs a human: a message of its
    own); incidents opened after it join it (episode_of reads the newest)."""
    session.execute(update(Incident).where(Incident.id == incident_id).values(episode_id=None))


def episode(session: Session, incident_id: int) -> int | None:
    """The first incident of `incident_id`'s episode (itself when it is the first; None: no such incident)."""
    row = session.execute(select(Incident.id, Incident.episode_id).where(Incident.id == incident_id)).first()
    if row is None:
        return None
    return row.episode_id if row.episode_id is not None else row.id


def open_incident(session: Session, run_id: str, signal: str, module: str, onset_step: int, detect_step: int,
                  severity: str = "warn") -> int:
    """Id of the open incident for (run, signal, module), opening one if there is none."""
    found = find_open(session, run_id, signal, module)
    if found is not None:
        return found.id
    inc = Incident(run_id=run_id, signal=signal, module=module, severity=severity,
                   onset_step=onset_step, detect_step=detect_step, state="open",
                   episode_id=episode_of(session, run_id, onset_step, detect_step))
    session.add(inc)
    session.flush()
    return inc.id


def find_open(session: Session, run_id: str, signal: str, module: str) -> IncidentRow | None:
    i = session.execute(
        select(Incident).where(Incident.run_id == run_id, Incident.signal == signal, Incident.module == module,
                               Incident.state == "open").order_by(Incident.id).limit(1)
    ).scalar()
    return _row(i) if i is not None else None


def open_incidents(session: Session, run_id: str | None = None) -> list[IncidentRow]:
    q = select(Incident).where(Incident.state == "open")
    if run_id is not None:
        q = q.where(Incident.run_id == run_id)
    return [_row(i) for i in session.execute(q.order_by(Incident.id)).scalars()]


def get_incident(session: Session, incident_id: int) -> IncidentRow | None:
    i = session.get(Incident, incident_id)
    return _row(i) if i is not None else None


def incidents(session: Session, run_id: str) -> list[IncidentRow]:
    return [_row(i) for i in session.execute(select(Incident).where(Incident.run_id == run_id).order_by(Incident.id)).scalars()]


def resolve_incident(session: Session, incident_id: int, resolution: str = "") -> bool:
    """Close an open incident; False if it was not open."""
    res = session.execute(
        update(Incident).where(Incident.id == incident_id, Incident.state == "open")
        .values(state="resolved", closed_at=utcnow(), resolution=resolution)
    )
    return res.rowcount == 1


def opened_since(session: Session, run_id: str, signal: str, module: str,
                 since: dt.datetime) -> list[tuple[int, dt.datetime]]:
    """(id, opened_at) of the run's incidents of (signal, module) opened at or after `since`,
    oldest first: how often one signal has fired lately (flap damping, supervisor.notify.flap)."""
    q = (select(Incident.id, Incident.opened_at)
         .where(Incident.run_id == run_id, Incident.signal == signal, Incident.module == module,
                Incident.opened_at >= since)
         .order_by(Incident.id))
    return [(int(i), at) for i, at in session.execute(q)]
