"""Runs and their attempts (each launch or relaunch of a run is one attempt), and the runs list.

The list is read in newest-first pages (`runs_page`), never whole: an ingest token made 10^5
runs and reading them all took 26-67 s (issue 21, item 4). A page and every run's summary on it
are one statement whose cost follows the page, not the number of runs: a keyset range on
ix_runs_created_at_run_id, and per run index seeks for its attempts, open incidents and last step.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Collection, Iterator

from sqlalchemy import Select, bindparam, func, select, tuple_
from sqlalchemy.orm import Session, aliased, sessionmaker

from thermowatch.monitors.contract import FinishReason, RunFinished, RunInfo
from thermowatch.supervisor.store._sql import insert_ignore
from thermowatch.supervisor.store.orm import Action, Attempt, Incident, JudgeMark, Run, Step


@dataclass(slots=True)
class RunRow:
    run_id: str
    config: dict[str, Any]
    created_at: dt.datetime


@dataclass(slots=True)
class AttemptRow:
    run_id: str
    attempt: int
    started_at: dt.datetime
    world_size: int
    start_step: int
    hosts: dict[int, str] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    finished_at: dt.datetime | None = None
    finished: RunFinished | None = None  # what the attempt said when it ended (None: not yet, or never)


def create_run(session: Session, run_id: str, config: dict[str, Any] | None = None, created_by: str = "") -> bool:
    """Create the run if it does not exist; True when this call created it (idempotent: a
    relaunch keeps the first config and creator; of two concurrent creations one gets True)."""
    # RETURNING, not rowcount: rowcount reads -1 on PostgreSQL (psycopg) for it.
    res = session.execute(insert_ignore(session, Run.__table__).returning(Run.run_id),
                          {"run_id": run_id, "config": config or {}, "created_by": created_by})
    return res.first() is not None


def open_attempt(session: Session, info: RunInfo, created_by: str = "") -> bool:
    """Record a run's (re)start; creates the run on its first attempt. Idempotent per attempt.
    True when this call created the run (the run-creation quota counts those, supervisor.ingest.quota)."""
    created = create_run(session, info.run_id, info.config, created_by)
    session.execute(
        insert_ignore(session, Attempt.__table__),
        [
            {
                "run_id": info.run_id,
                "attempt": info.attempt,
                "world_size": info.world_size,
                "start_step": info.start_step,
                "hosts": {str(k): v for k, v in info.hosts.items()},
                "config": info.config,
                "opened_by": created_by,
            }
        ],
    )
    return created


def get_run(session: Session, run_id: str) -> RunRow | None:
    r = session.get(Run, run_id)
    return RunRow(r.run_id, dict(r.config), r.created_at) if r is not None else None


def created_by(session: Session, run_id: str) -> str | None:
    """The actor that opened the run (a token's name; '' when unknown), or None: no such run."""
    return session.execute(select(Run.created_by).where(Run.run_id == run_id)).scalar()


def attempt_config(session: Session, run_id: str, attempt: int) -> dict[str, Any] | None:
    """The config an attempt was opened with, or None: no such attempt."""
    return session.execute(select(Attempt.config).where(Attempt.run_id == run_id,
                                                        Attempt.attempt == attempt)).scalar()


def run_exists(session: Session, run_id: str) -> bool:
    return session.execute(select(Run.run_id).where(Run.run_id == run_id)).first() is not None


# --- the list -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RunKey:
    """A run's place in the newest-first list: created_at, then run_id (both descending)."""

    created_at: dt.datetime
    run_id: str


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One line of the runs list (GET /api/runs, the index page, `thermowatch runs`)."""

    run_id: str
    created_at: dt.datetime
    last_step: int | None  # the newest step of the newest attempt that reported any
    attempt: int | None  # the run's attempt (newest_attempt); None before the first
    attempts: int  # attempts opened
    open_incidents: int

    @property
    def key(self) -> RunKey:
        return RunKey(self.created_at, self.run_id)


def _summaries():
    """SELECT of every run's summary. Each figure is a correlated scalar subquery that the
    indexes answer with a seek or a short range (attempts' primary key, ix_incidents_run_id_state,
    ix_steps_run_id_attempt_step), evaluated only for the rows the page returns."""
    newer = aliased(Step)
    newest_stepped = (select(func.max(newer.attempt)).where(newer.run_id == Run.run_id)
                      .correlate(Run).scalar_subquery())
    last_step = (select(func.max(Step.step)).where(Step.run_id == Run.run_id, Step.attempt == newest_stepped)
                 .correlate(Run).scalar_subquery())
    newest = _newest_attempt(Run.run_id).correlate(Run).scalar_subquery()
    opened = select(func.count()).select_from(Attempt).where(Attempt.run_id == Run.run_id).correlate(Run).scalar_subquery()
    open_incidents = (select(func.count()).select_from(Incident)
                      .where(Incident.run_id == Run.run_id, Incident.state == "open").correlate(Run).scalar_subquery())
    return select(Run.run_id, Run.created_at, last_step, newest, opened, open_incidents)


def _summary(row) -> RunSummary:
    run_id, created_at, last_step, newest, opened, open_incidents = row
    return RunSummary(run_id, created_at, None if last_step is None else int(last_step),
                      None if newest is None else int(newest), int(opened or 0), int(open_incidents or 0))


def runs_page(session: Session, limit: int, after: RunKey | None = None) -> tuple[list[RunSummary], RunKey | None]:
    """Up to `limit` runs, newest first, starting after `after` (None: the newest), with their
    summaries; and the key to pass as `after` for the next page (None after the last page).
    One statement, whatever the number of runs."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    q = _summaries()
    if after is not None:
        # Row-value comparison: both databases read it as a range on (created_at, run_id).
        q = q.where(tuple_(Run.created_at, Run.run_id) < tuple_(
            bindparam("after_created_at", after.created_at, type_=Run.__table__.c.created_at.type),
            bindparam("after_run_id", after.run_id, type_=Run.__table__.c.run_id.type)))
    rows = session.execute(q.order_by(Run.created_at.desc(), Run.run_id.desc()).limit(limit + 1)).all()
    page = [_summary(r) for r in rows[:limit]]
    return page, (page[-1].key if len(rows) > limit else None)


def each_page(sessions: sessionmaker, size: int = 1000) -> Iterator[list[RunSummary]]:
    """Every run, newest first, a page at a time, each page read in a short session of its own:
    a pass over 10^5 runs (the periodic jobs, `thermowatch db rollups`) neither holds every row
    in memory nor keeps one read transaction open (SQLite's WAL checkpoints wait for those)."""
    after: RunKey | None = None
    while True:
        with sessions() as s:
            page, after = runs_page(s, size, after)
        if page:
            yield page
        if after is None:
            return


def newest_run_ids(session: Session, n: int) -> list[str]:
    """The `n` newest runs' ids, newest first (a 404's hint)."""
    q = select(Run.run_id).order_by(Run.created_at.desc(), Run.run_id.desc()).limit(n)
    return list(session.execute(q).scalars())


# The daily digest's window, and what `/metrics` calls an active run (store.metrics.active_runs).
ACTIVE_WINDOW = dt.timedelta(days=1)


def news_since(since: dt.datetime) -> list[Select]:
    """SELECTs of (run_id, at) for everything new since `since`: the run created, an attempt
    started, steps judged (the judge's marker moved), an incident opened, an action written."""
    return [select(Run.run_id, Run.created_at.label("at")).where(Run.created_at >= since),
            select(Attempt.run_id, Attempt.started_at).where(Attempt.started_at >= since),
            select(JudgeMark.run_id, JudgeMark.updated_at).where(JudgeMark.updated_at >= since),
            select(Incident.run_id, Incident.opened_at).where(Incident.opened_at >= since),
            select(Action.run_id, Action.created_at).where(Action.created_at >= since)]


def active_since(session: Session, since: dt.datetime) -> list[str]:
    """Runs with anything new since `since` (news_since), sorted. The daily digest covers these,
    not every run ever made."""
    first, *rest = news_since(since)
    q = select(first.union_all(*rest).subquery().c.run_id).distinct()
    return sorted(session.execute(q).scalars())


def nth_newest_created_by(session: Session, created_by: str, since: dt.datetime, n: int) -> dt.datetime | None:
    """When `created_by` created its n-th newest run (1: the newest) among those created at or
    after `since`; None when it created fewer than n. Reads at most n entries of
    ix_runs_created_by_created_at, however many runs it made (supervisor.ingest.quota)."""
    q = (select(Run.created_at).where(Run.created_by == created_by, Run.created_at >= since)
         .order_by(Run.created_at.desc()).offset(n - 1).limit(1))
    return session.execute(q).scalar()


def nth_newest_attempt(session: Session, since: dt.datetime, n: int, *, run_id: str | None = None,
                       opened_by: str | None = None) -> dt.datetime | None:
    """When the n-th newest new attempt (attempt > 0: a restart, not a run's first launch) of this
    run, or opened by this actor, started, among those started at or after `since`; None when there
    are fewer than n. Reads at most n entries of an index (0014), however many attempts there are."""
    q = select(Attempt.started_at).where(Attempt.started_at >= since, Attempt.attempt > 0)
    q = q.where(Attempt.run_id == run_id) if run_id is not None else q.where(Attempt.opened_by == opened_by)
    return session.execute(q.order_by(Attempt.started_at.desc()).offset(n - 1).limit(1)).scalar()


def _attempt_row(a: Attempt) -> AttemptRow:
    return AttemptRow(
        a.run_id, a.attempt, a.started_at, a.world_size, a.start_step,
        {int(k): v for k, v in (a.hosts or {}).items()}, dict(a.config or {}), a.finished_at, _finished(a),
    )


def _finished(a: Attempt) -> RunFinished | None:
    if a.finish_reason is None:
        return None
    return RunFinished(step=a.final_step, final_loss=a.final_loss, reason=FinishReason(a.finish_reason))


def finish_attempt(session: Session, run_id: str, attempt: int, finished: RunFinished) -> RunFinished | None:
    """Record that the attempt finished, unless it already did: returns the report stored before
    (the caller compares: the same is a re-send, a different one is refused, an attempt finishes
    once), or None when this one is recorded now. Raises LookupError for an attempt never opened.
    The row is locked, so of two reports sent at once one stores and the other compares."""
    a = session.execute(select(Attempt).where(Attempt.run_id == run_id, Attempt.attempt == attempt)
                        .with_for_update()).scalar()
    if a is None:
        raise LookupError(f"run {run_id!r} has no attempt {attempt}")
    stored = _finished(a)
    if stored is None:
        a.finished_at, a.final_step, a.final_loss = dt.datetime.now(dt.timezone.utc), finished.step, finished.final_loss
        a.finish_reason = finished.reason.value
    return stored


def attempts(session: Session, run_id: str) -> list[AttemptRow]:
    """Every attempt, oldest first: for code that must see them all (a replay, the story's tests).
    A read that answers a person or a client pages them instead (attempts_page): one token opened
    10^4 attempts of a run, and listing them all took its page 3.4-9.4 s (issue 34)."""
    rows = session.execute(select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.attempt)).scalars()
    return [_attempt_row(a) for a in rows]


def attempts_page(session: Session, run_id: str, limit: int,
                  before: int | None = None) -> tuple[list[AttemptRow], int | None]:
    """Up to `limit` attempts numbered below `before` (None: the newest), newest first; and the
    `before` of the next, older page (None after the last). A keyset range on the attempts'
    primary key (run_id, attempt): the same cost at 10 attempts as at 10^4."""
    if limit < 1:
        raise ValueError(f"limit must be >= 1, got {limit}")
    q = select(Attempt).where(Attempt.run_id == run_id)
    if before is not None:
        q = q.where(Attempt.attempt < before)
    rows = list(session.execute(q.order_by(Attempt.attempt.desc()).limit(limit + 1)).scalars())
    page = [_attempt_row(a) for a in rows[:limit]]
    return page, (page[-1].attempt if len(rows) > limit else None)


def _newest_attempt(run_id: Any) -> Select:
    """SELECT of the run's attempt: its newest attempt's number as the trainer numbers it (from 1
    for thermowatch.watch and the bundled trainer; whatever a client sent), a seek on the
    attempts' primary key. The one definition behind every place that shows "the run's attempt"
    (`thermowatch status` and `runs`, GET /api/runs and /api/runs/{run}, the runs and run pages):
    status used to show the count less one and the list the largest number plus one, which
    disagreed by two for a trainer numbering from 1 (issue 35)."""
    return select(func.max(Attempt.attempt)).where(Attempt.run_id == run_id)


def newest_attempt(session: Session, run_id: str) -> int | None:
    """The run's attempt (see _newest_attempt); None before its first."""
    n = session.execute(_newest_attempt(run_id)).scalar()
    return None if n is None else int(n)


def attempt_count(session: Session, run_id: str) -> int:
    """Attempts opened: a count over the primary key's range for the run, in the database."""
    return int(session.execute(select(func.count()).select_from(Attempt).where(Attempt.run_id == run_id)).scalar())


def attempt_exists(session: Session, run_id: str, attempt: int) -> bool:
    q = select(Attempt.attempt).where(Attempt.run_id == run_id, Attempt.attempt == attempt)
    return session.execute(q).first() is not None


def newest_finishes(session: Session, run_ids: Collection[str]) -> dict[str, RunFinished | None]:
    """Each run's newest attempt's finish report (None while it has not finished), for a page of
    runs in one statement on the attempts' primary key (the runs index)."""
    ids = sorted(set(run_ids))
    if not ids:
        return {}
    newest = (select(Attempt.run_id, func.max(Attempt.attempt).label("n")).where(Attempt.run_id.in_(ids))
              .group_by(Attempt.run_id).subquery())
    rows = session.execute(select(Attempt).join(newest, (Attempt.run_id == newest.c.run_id)
                                                & (Attempt.attempt == newest.c.n))).scalars()
    return {a.run_id: _finished(a) for a in rows}


def ended_runs(session: Session, run_ids: Collection[str]) -> set[str]:
    """Those of `run_ids` whose newest attempt has said it finished (completed, stopped, closed):
    one query for the lot, for the stall check's sweep over every run it watches."""
    if not run_ids:
        return set()
    newest = (select(Attempt.run_id, func.max(Attempt.attempt).label("attempt"))
              .where(Attempt.run_id.in_(list(run_ids))).group_by(Attempt.run_id).subquery())
    q = (select(Attempt.run_id).join(newest, (Attempt.run_id == newest.c.run_id) & (Attempt.attempt == newest.c.attempt))
         .where(Attempt.finish_reason.is_not(None)))
    return set(session.execute(q).scalars())


def latest_attempt(session: Session, run_id: str) -> AttemptRow | None:
    """The run's newest attempt, the one numbered newest_attempt (None before its first)."""
    a = session.execute(
        select(Attempt).where(Attempt.run_id == run_id).order_by(Attempt.attempt.desc()).limit(1)
    ).scalar()
    return _attempt_row(a) if a is not None else None
