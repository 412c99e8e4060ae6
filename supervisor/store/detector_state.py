"""Each run's detector state, so a restarted supervisor judges the next step against the same
baseline it had before it died (DESIGN.md, "A supervisor restart resumes from the DB").

Stored as text, not JSON: detector buffers hold NaN/Inf (data, never errors), which
PostgreSQL's json type refuses; Python's json writes and reads them as literals.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from sqlalchemy import ForeignKey, String, Text, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column

from supervisor.store.orm import Base, utcnow


class DetectorState(Base):
    __tablename__ = "detector_state"
    run_id: Mapped[str] = mapped_column(String(200), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True)
    state: Mapped[str] = mapped_column(Text)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


def save(session: Session, run_id: str, state: dict[str, Any]) -> None:
    text = json.dumps(state, separators=(",", ":"))
    res = session.execute(update(DetectorState).where(DetectorState.run_id == run_id)
                          .values(state=text, updated_at=utcnow()))
    if res.rowcount == 0:
        session.add(DetectorState(run_id=run_id, state=text))
        session.flush()


def load(session: Session, run_id: str) -> dict[str, Any] | None:
    text = session.execute(select(DetectorState.state).where(DetectorState.run_id == run_id)).scalar()
    return json.loads(text) if text else None
