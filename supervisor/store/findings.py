"""Findings: what detectors saw, attached to an incident."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from monitors.contract import Finding
from supervisor.store._sql import jsonable
from supervisor.store.orm import FindingRow


@dataclass(slots=True)
class StoredFinding:
    id: int
    run_id: str
    incident_id: int | None
    finding: Finding
    created_at: dt.datetime | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def add_finding(session: Session, run_id: str, finding: Finding, incident_id: int | None = None) -> int:
    row = FindingRow(run_id=run_id, incident_id=incident_id, signal=finding.signal.value, module=finding.module,
                     metric=finding.metric, severity=finding.severity.value, onset_step=finding.onset_step,
                     detect_step=finding.detect_step, evidence=jsonable(finding.evidence))
    session.add(row)
    session.flush()
    return row.id


def findings(session: Session, run_id: str, incident_id: int | None = None) -> list[StoredFinding]:
    q = select(FindingRow).where(FindingRow.run_id == run_id)
    if incident_id is not None:
        q = q.where(FindingRow.incident_id == incident_id)
    out = []
    for r in session.execute(q.order_by(FindingRow.id)).scalars():
        f = Finding.from_json({"signal": r.signal, "module": r.module, "severity": r.severity, "onset_step": r.onset_step,
                               "detect_step": r.detect_step, "metric": r.metric, "evidence": r.evidence})
        out.append(StoredFinding(r.id, r.run_id, r.incident_id, f, r.created_at))
    return out
