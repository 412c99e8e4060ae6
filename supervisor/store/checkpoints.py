"""Checkpoints the run controller saved, with their health at save time."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from thermowatch.monitors.contract import CheckpointInfo
from thermowatch.supervisor.store._sql import insert_ignore
from thermowatch.supervisor.store.orm import Checkpoint


@dataclass(slots=True)
class CheckpointRow:
    id: int
    run_id: str
    attempt: int
    step: int
    path: str
    sample_cursor: int
    healthy: bool
    manifest: dict[str, Any] = field(default_factory=dict)
    created_at: dt.datetime | None = None
    deleted: bool = False


def record_checkpoint(session: Session, run_id: str, attempt: int, ckpt: CheckpointInfo) -> None:
    """Idempotent on (run, attempt, step): a retried report stores nothing new. An older
    attempt's checkpoint at the same path was replaced on disk by this one: it is gone."""
    session.execute(
        update(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.step == ckpt.step,
                                 Checkpoint.attempt < attempt, Checkpoint.path == ckpt.path).values(deleted=True))
    session.execute(
        insert_ignore(session, Checkpoint.__table__),
        [
            {
                "run_id": run_id, "attempt": attempt, "step": ckpt.step, "path": ckpt.path,
                "sample_cursor": ckpt.sample_cursor, "healthy": bool(ckpt.healthy), "manifest": ckpt.manifest,
            }
        ],
    )


def mark_deleted(session: Session, run_id: str, steps: list[int]) -> int:
    """The trainer deleted these checkpoint steps (every attempt's row at that step shares the
    step's directory). Returns how many rows changed."""
    if not steps:
        return 0
    res = session.execute(update(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.step.in_(list(steps)),
                                                   Checkpoint.deleted.is_(False)).values(deleted=True))
    return res.rowcount


def _row(c: Checkpoint) -> CheckpointRow:
    return CheckpointRow(c.id, c.run_id, c.attempt, c.step, c.path, c.sample_cursor, c.healthy,
                         dict(c.manifest or {}), c.created_at, c.deleted)


def checkpoints(session: Session, run_id: str, *, include_deleted: bool = False) -> list[CheckpointRow]:
    """The run's checkpoints by step (then attempt), oldest first."""
    q = select(Checkpoint).where(Checkpoint.run_id == run_id)
    if not include_deleted:
        q = q.where(Checkpoint.deleted.is_(False))
    return [_row(c) for c in session.execute(q.order_by(Checkpoint.step, Checkpoint.attempt)).scalars()]


def newest_healthy_before(session: Session, run_id: str, step: int) -> CheckpointRow | None:
    """Rollback target: the newest healthy, not deleted checkpoint strictly before `step`."""
    c = session.execute(
        select(Checkpoint)
        .where(Checkpoint.run_id == run_id, Checkpoint.step < step, Checkpoint.healthy.is_(True),
               Checkpoint.deleted.is_(False))
        .order_by(Checkpoint.step.desc(), Checkpoint.attempt.desc())
        .limit(1)
    ).scalar()
    return _row(c) if c is not None else None


def distrust_from(session: Session, run_id: str, step: int) -> int:
    """Mark every healthy checkpoint of the run at or after `step` unhealthy (saved during a
    divergence, or on a trajectory a rollback abandoned); returns how many changed."""
    res = session.execute(update(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.step >= step,
                                                   Checkpoint.healthy.is_(True)).values(healthy=False))
    return res.rowcount


def distrust_step(session: Session, run_id: str, step: int) -> int:
    """Mark the run's live checkpoint(s) at exactly `step` unhealthy: its weights went non-finite
    right after a rollback loaded it (policy._bad_load). Returns how many changed."""
    res = session.execute(update(Checkpoint).where(Checkpoint.run_id == run_id, Checkpoint.step == step,
                                                   Checkpoint.deleted.is_(False),
                                                   Checkpoint.healthy.is_(True)).values(healthy=False))
    return res.rowcount


def mark_checkpoint(session: Session, checkpoint_id: int, *, healthy: bool | None = None, deleted: bool | None = None) -> None:
    values = {k: v for k, v in (("healthy", healthy), ("deleted", deleted)) if v is not None}
    if values:
        session.execute(update(Checkpoint).where(Checkpoint.id == checkpoint_id).values(**values))


@dataclass(frozen=True, slots=True)
class CheckpointPath:
    """What the checkpoint scan needs of a checkpoint (supervisor.app.jobs): no manifest."""

    id: int
    run_id: str
    step: int
    path: str
    healthy: bool


def live_checkpoints(session: Session, after_id: int = 0, limit: int = 1000) -> list[CheckpointPath]:
    """Checkpoints not marked deleted, of every run, by id after `after_id`: the scan pages
    through them, so it costs what there are checkpoints, not runs (issue 21, item 4)."""
    q = (select(Checkpoint.id, Checkpoint.run_id, Checkpoint.step, Checkpoint.path, Checkpoint.healthy)
         .where(Checkpoint.id > after_id, Checkpoint.deleted.is_(False)).order_by(Checkpoint.id).limit(limit))
    return [CheckpointPath(*row) for row in session.execute(q).all()]
