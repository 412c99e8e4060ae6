"""Findings: what detectors saw, attached to an incident. Stored once per key (judged once)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Iterable

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from thermowatch.monitors.contract import Finding
from thermowatch.monitors.commands import json_safe
from thermowatch.supervisor.store.orm import FindingRow


@dataclass(slots=True)
class StoredFinding:
    id: int
    run_id: str
    incident_id: int | None
    finding: Finding
    created_at: dt.datetime | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def stored_key(finding: Finding, attempt: int | None) -> str | None:
    """The row key: the attempt, because a re-trained step in a new attempt may legitimately
    find the same thing again; None (no de-duplication) when the attempt is unknown."""
    return None if attempt is None else f"{attempt}|{finding.key}"


def incident_attempts(session: Session, run_id: str, incident_ids: Iterable[int]) -> dict[int, int]:
    """incident id -> the attempt its first finding was judged on (read from the row key, whose
    format stored_key owns); incidents whose findings have no attempt are left out."""
    out: dict[int, int] = {}
    ids = sorted(set(incident_ids))
    if not ids:
        return out
    rows = session.execute(select(FindingRow.incident_id, FindingRow.key).where(
        FindingRow.run_id == run_id, FindingRow.incident_id.in_(ids), FindingRow.key.is_not(None))
        .order_by(FindingRow.id))
    for incident_id, key in rows:
        head = key.partition("|")[0]
        if head.isdigit():
            out.setdefault(incident_id, int(head))
    return out


def find_key(session: Session, run_id: str, key: str) -> FindingRow | None:
    return session.execute(select(FindingRow).where(FindingRow.run_id == run_id, FindingRow.key == key)).scalar()


def add_finding(session: Session, run_id: str, finding: Finding, incident_id: int | None = None,
                attempt: int | None = None) -> tuple[int, bool]:
    """(row id, True) for a new finding; (id of the stored one, False) when this finding of this
    attempt is already stored (a batch delivered twice), which is left as it was."""
    key = stored_key(finding, attempt)
    if key is not None:
        old = find_key(session, run_id, key)
        if old is not None:
            return old.id, False
    row = FindingRow(run_id=run_id, incident_id=incident_id, signal=finding.signal.value, module=finding.module,
                     metric=finding.metric, severity=finding.severity.value, outcome=finding.outcome.value,
                     onset_step=finding.onset_step, detect_step=finding.detect_step,
                     evidence=json_safe(finding.evidence), key=key)
    try:
        with session.begin_nested():  # a racing writer with the same key: keep theirs
            session.add(row)
            session.flush()
    except IntegrityError:
        old = find_key(session, run_id, key) if key is not None else None
        if old is None:
            raise
        return old.id, False
    return row.id, True


def findings(session: Session, run_id: str, incident_id: int | None = None) -> list[StoredFinding]:
    q = select(FindingRow).where(FindingRow.run_id == run_id)
    if incident_id is not None:
        q = q.where(FindingRow.incident_id == incident_id)
    return [_stored(r) for r in session.execute(q.order_by(FindingRow.id)).scalars()]


def findings_on(session: Session, run_id: str, metrics: Iterable[str], step_lo: int | None = None,
                step_hi: int | None = None, limit: int = 500) -> list[StoredFinding]:
    """The run's findings about these metric keys detected in [step_lo, step_hi] (None: open
    end), earliest detection first, at most `limit`: the thresholds a chart draws
    (supervisor/charts/png.py). Served by the (run_id, detect_step) index."""
    q = select(FindingRow).where(FindingRow.run_id == run_id, FindingRow.metric.in_(sorted(set(metrics))))
    if step_lo is not None:
        q = q.where(FindingRow.detect_step >= step_lo)
    if step_hi is not None:
        q = q.where(FindingRow.detect_step <= step_hi)
    rows = session.execute(q.order_by(FindingRow.detect_step, FindingRow.id).limit(limit)).scalars()
    return [_stored(r) for r in rows]


def _stored(r: FindingRow) -> StoredFinding:
    f = Finding.from_json({"signal": r.signal, "module": r.module, "severity": r.severity, "onset_step": r.onset_step,
                           "detect_step": r.detect_step, "metric": r.metric, "evidence": r.evidence,
                           "outcome": r.outcome})
    return StoredFinding(r.id, r.run_id, r.incident_id, f, r.created_at)
