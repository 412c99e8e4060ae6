"""Each run's detector state, so a restarted supervisor judges the next step against the same
baseline it had before it died (DESIGN.md, "A supervisor restart resumes from the DB").

Stored as named parts, one row each (issue 10 item 4): the bank's counters and latches per
detector type, its ring buffers in column chunks, and a small JSON `meta`. A save writes the
parts that changed since the last one (`save_parts`, an upsert), so a 1,000-series run does not
rewrite megabytes every few seconds; a bank that starts fresh replaces every part
(`replace_parts`), so no part of an older state outlives it.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
from typing import Any

from sqlalchemy import ForeignKey, LargeBinary, String, delete, select, update
from sqlalchemy.orm import Mapped, Session, mapped_column

from thermowatch.supervisor.store.orm import Base, utcnow


class DetectorStatePart(Base):
    __tablename__ = "detector_state_parts"
    run_id: Mapped[str] = mapped_column(String(200), ForeignKey("runs.run_id", ondelete="CASCADE"), primary_key=True)
    part: Mapped[str] = mapped_column(String(200), primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)
    updated_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


def save_parts(session: Session, run_id: str, parts: dict[str, bytes]) -> int:
    """Upsert these parts, leave the others; returns the bytes written."""
    now = utcnow()
    have = set(session.execute(select(DetectorStatePart.part).where(DetectorStatePart.run_id == run_id)).scalars())
    rows = [{"run_id": run_id, "part": k, "data": v, "updated_at": now} for k, v in parts.items()]
    fresh = [r for r in rows if r["part"] not in have]
    old = [r for r in rows if r["part"] in have]
    if old:  # one executemany by primary key, not a statement per part
        session.execute(update(DetectorStatePart), old)
    if fresh:
        session.execute(DetectorStatePart.__table__.insert(), fresh)
    return sum(len(v) for v in parts.values())


def replace_parts(session: Session, run_id: str, parts: dict[str, bytes]) -> int:
    session.execute(delete(DetectorStatePart).where(DetectorStatePart.run_id == run_id))
    return save_parts(session, run_id, parts)


def load_parts(session: Session, run_id: str) -> dict[str, bytes]:
    rows = session.execute(select(DetectorStatePart.part, DetectorStatePart.data)
                           .where(DetectorStatePart.run_id == run_id))
    return {part: bytes(data) for part, data in rows}


def save(session: Session, run_id: str, state: dict[str, Any]) -> None:
    """A whole state as DetectorBank.state_dict() gives it (strict JSON: base64 parts beside the
    meta fields); replaces every part."""
    parts = {k: base64.b64decode(v) for k, v in state.get("parts", {}).items()}
    parts.setdefault("meta", json.dumps({k: v for k, v in state.items() if k != "parts"}).encode())
    replace_parts(session, run_id, parts)


def load(session: Session, run_id: str) -> dict[str, Any] | None:
    """The state as DetectorBank.load_state_dict() takes it: the meta fields and the parts."""
    parts = load_parts(session, run_id)
    if not parts:
        return None
    meta = json.loads(parts["meta"]) if "meta" in parts else {}
    return {**meta, "parts": {k: base64.b64encode(v).decode() for k, v in parts.items()}}
