"""Thermometer storage: per-series chunks of packed arrays.

Layout, chosen by measurement (`python bench/ingest.py --layouts`: raw drivers, 2,000 steps x
1,000 series in batches of 50 steps, this shared 2-core machine while it was quiet; at load ~10 every
figure is 2-4x worse, same order), write values/s | read one series (2,000 points) ms:

    layout                                     SQLite              PostgreSQL (COPY)
    narrow rows (run, series, step, attempt)   0.21 M/s |  3.9 ms  0.41 M/s | 10.3 ms
    wide per-step rows (all series, one blob)  28 M/s   | 12.4 ms  13 M/s   | 56 ms
    per-series chunks (this module)            8.2 M/s  |  0.6 ms  4.9 M/s  |  0.8 ms

Narrow rows cannot reach 500k values/s even through the raw driver, and a 10^6-step history
is 10^6 rows to read. Wide rows write fastest but reading one metric drags every metric of
every step along (x1000 the bytes; seconds at 10^6 steps). Chunks keyed
(run, series, attempt, first_step) write 1 row per series per batch and read 20k rows for a
10^6-step history.

One chunk = one series' points from one ingest batch: int64 `steps` (NULL when they are
first_step..last_step without gaps), float64 `values` (NaN and +-Inf survive bit-exact: they
are raw IEEE bytes, not SQL floats), int32 `ranks` or NULL. downsample(..., every=1) compacts
old chunks into 4096-point ones (80x fewer rows to read) without dropping a point.
Ranks ride as a parallel array in the same chunk rather than as a separate per-rank series:
the rank belongs to the exact point it explains (outlier-rank detection reads both together),
and chunks without ranks pay nothing (NULL).

Idempotency: a retried batch produces the same chunk keys and is dropped by ON CONFLICT DO
NOTHING; a replay that re-batches overlapping steps differently is deduplicated at read time
(one point per step; for the same step a later attempt wins, as a rollback re-trains steps).
history_by_attempt() keeps every attempt's points instead, so a chart can still show the
diverged trajectory that a rollback abandoned.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
from sqlalchemy import and_, delete, func, select
from sqlalchemy.orm import Session

from thermowatch.monitors.columns import StepColumns
from thermowatch.monitors.contract import ContractError, Reduce, StepRecord, metric_key, reduction, split_key
from thermowatch.supervisor.limits import LimitExceeded
from thermowatch.supervisor.store import rollups
from thermowatch.supervisor.store.steps_blob import decode_steps as _decode_steps
from thermowatch.supervisor.store._sql import insert_ignore
from thermowatch.supervisor.store.orm import RunSeries, Series, Step, ThermometerChunk

_CHUNK = ThermometerChunk.__table__
MERGED_CHUNK_POINTS = 4096  # downsample() rewrites old points into chunks of this many
_IN_CHUNK = 10_000  # names per IN (...) lookup


@dataclass(slots=True)
class SeriesCache:
    """Series ids and (run, series) registrations known to be committed, so a steady stream of
    batches does no dictionary lookups in SQL. Store functions only read `ids`/`registered` and
    write what they created into `new_ids`/`new_registered`; the caller merges those after its
    commit (a rolled-back id must never be cached). Use one view() per transaction."""

    ids: dict[str, int] = field(default_factory=dict)
    registered: set[tuple[str, int]] = field(default_factory=set)
    new_ids: dict[str, int] = field(default_factory=dict)
    new_registered: set[tuple[str, int]] = field(default_factory=set)

    def view(self) -> "SeriesCache":
        return SeriesCache(self.ids, self.registered)

    def merge(self, view: "SeriesCache") -> None:
        self.ids.update(view.new_ids)
        self.registered.update(view.new_registered)


def _steps_blob(steps: np.ndarray) -> bytes | None:
    """NULL for a contiguous run of steps (the common case: first_step..last_step), else int64s.
    Halves what a history read moves."""
    if len(steps) and steps[-1] - steps[0] == len(steps) - 1:
        return None
    return steps.tobytes()


def series_ids(session: Session, keys: Iterable[str], cache: SeriesCache | None = None) -> dict[str, int]:
    """Ids for metric keys, creating missing series rows."""
    keys = list(keys)
    known = cache.ids if cache is not None else {}
    out = {k: known[k] for k in keys if k in known}
    missing = [k for k in keys if k not in out]
    if missing:
        pairs = [split_key(k) for k in missing]
        session.execute(insert_ignore(session, Series.__table__), [{"metric": m, "module": mod} for m, mod in pairs])
        metrics = sorted({m for m, _ in pairs})
        rows = []
        for i in range(0, len(metrics), _IN_CHUNK):  # SQLite binds at most 32,766 variables per statement
            rows += session.execute(
                select(Series.metric, Series.module, Series.id).where(Series.metric.in_(metrics[i:i + _IN_CHUNK]))
            ).all()
        want = set(missing)
        for metric, module, sid in rows:
            key = metric_key(metric, module)
            if key in want:
                out[key] = sid
        if cache is not None:
            cache.new_ids.update((k, out[k]) for k in missing)
    return out


def check_series_budget(session: Session, run_id: str, keys: Iterable[str], cache: SeriesCache, limit: int) -> None:
    """Refuse a batch that would give the run more than `limit` distinct series
    (supervisor.limits.Limits.max_series_per_run), before anything of it is written. Free when
    every key is a series the cache knows the run has (every batch but a run's first few); else
    one read of the run's series names."""
    ids, registered = cache.ids, cache.registered
    unknown = [k for k in keys if k not in ids or (run_id, ids[k]) not in registered]
    if not unknown:
        return
    have = {metric_key(m, mod) for m, mod in session.execute(
        select(Series.metric, Series.module).join(RunSeries, RunSeries.series_id == Series.id)
        .where(RunSeries.run_id == run_id)).all()}
    new = sum(1 for k in unknown if k not in have)
    if len(have) + new > limit:
        raise LimitExceeded(f"run {run_id!r} has {len(have)} series and this batch adds {new}: a run may hold at most "
                            f"{limit} distinct series (limits.max_series_per_run); nothing of the batch was stored")


def append(
    session: Session, run_id: str, attempt: int, records: Sequence[StepRecord], cache: SeriesCache | None = None
) -> int:
    """Store a batch of records' values; returns how many values it carried. Never commits."""
    if not records:
        return 0
    try:
        cols = StepColumns.from_records(records)
    except OverflowError:  # an int beyond float64; the caller's transaction rolls back
        raise ContractError("a metric value is an integer too large for a float64") from None
    return append_columns(session, run_id, attempt, cols, cache)


def append_columns(session: Session, run_id: str, attempt: int, cols: StepColumns,
                   cache: SeriesCache | None = None) -> int:
    """Store a batch given as columns (monitors.columns: one array per series already, as the
    chunks want them). Returns how many values it carried. Never commits."""
    if not len(cols) or not cols.keys:  # steps without a metric: their rows are in `steps`, no chunk
        return 0
    steps, vals, present, ranks, keys = cols.steps, cols.values, cols.present, cols.ranks, cols.keys
    # One point per step: sort the batch and drop repeated steps (first one wins).
    _, first = np.unique(steps, return_index=True)
    if len(first) != len(steps) or np.any(np.diff(steps) < 0):
        steps, vals = steps[first], vals[first]
        present = present[first] if present is not None else None
        ranks = ranks[first] if ranks is not None else None

    ids = series_ids(session, keys, cache)
    vt = np.ascontiguousarray(vals.T)
    rt = np.ascontiguousarray(ranks.T) if ranks is not None else None
    has_rank = (rt >= 0).any(axis=1).tolist() if rt is not None else [False] * len(keys)
    steps_blob = _steps_blob(steps)
    sids = [ids[k] for k in keys]
    if present is None or present.all():
        # The common case: every step carries every key; the row tuples are built by zip in C.
        lo, hi, n = int(steps[0]), int(steps[-1]), len(steps)
        value_blobs = [v.tobytes() for v in vt]
        rank_blobs = [rt[j].tobytes() if has_rank[j] else None for j in range(len(keys))] if rt is not None \
            else [None] * len(keys)
        rows = [(run_id, sid, attempt, lo, hi, n, steps_blob, v, r) for sid, v, r in zip(sids, value_blobs, rank_blobs)]
    else:
        rows = []
        pt = np.ascontiguousarray(present.T)
        for j in range(len(keys)):
            m = pt[j]
            s = steps[m]
            if len(s) == 0:
                continue
            rows.append((run_id, sids[j], attempt, int(s[0]), int(s[-1]), len(s), _steps_blob(s), vt[j][m].tobytes(),
                         rt[j][m].tobytes() if has_rank[j] else None))
    _insert_chunks(session, rows)
    _register(session, run_id, ids.values(), cache)
    rollups.on_append(session, run_id, attempt, list(ids.values()), int(steps[0]), int(steps[-1]))
    return int(vals.size if present is None else present.sum())


_COLS = ("run_id", "series_id", "attempt", "first_step", "last_step", "n", "steps", "values", "ranks")
_PG_TYPES = ("text", "int4", "int4", "int8", "int8", "int4", "bytea", "bytea", "bytea")
_COL_LIST = ", ".join(f'"{c}"' for c in _COLS)


def stored_points(session: Session, run_id: str, attempt: int, step_lo: int, step_hi: int,
                  ranks: dict[str, dict[int, int]] | None = None) -> dict[str, dict[int, float]]:
    """Every series' stored points of one attempt in [step_lo, step_hi]: key -> {step: value};
    with `ranks`, also fills key -> {step: rank} for points that name one. For comparing a
    re-sent batch and for the judge's catch-up (rare and bounded: not the ingest hot path)."""
    c = ThermometerChunk
    stmt = (select(Series.metric, Series.module, c.first_step, c.n, c.steps, c.values, c.ranks)
            .join(Series, Series.id == c.series_id)
            .where(c.run_id == run_id, c.attempt == attempt, c.last_step >= step_lo, c.first_step <= step_hi))
    out: dict[str, dict[int, float]] = {}
    for metric, module, first, n, blob, vals, rk in _fetch(session, stmt):
        steps = _decode_steps(np.array([first], np.int64), np.array([n], np.int64), [blob])
        keep = (steps >= step_lo) & (steps <= step_hi)
        key = metric_key(metric, module)
        kept = steps[keep].tolist()
        out.setdefault(key, {}).update(zip(kept, np.frombuffer(vals, np.float64)[keep].tolist()))
        if ranks is not None and rk is not None:
            r = np.frombuffer(rk, np.int32)[keep]
            ranks.setdefault(key, {}).update((s_, int(v)) for s_, v in zip(kept, r.tolist()) if v >= 0)
    return out


def records_after(session: Session, run_id: str, attempt: int, after_step: int, limit: int) -> list[StepRecord]:
    """Up to `limit` stored steps of one attempt after `after_step`, rebuilt as StepRecords (the
    judge's catch-up after a crash between commit and judgement)."""
    rows = session.execute(
        select(Step.step, Step.sample_lo, Step.sample_hi, Step.tokens, Step.wall_time)
        .where(Step.run_id == run_id, Step.attempt == attempt, Step.step > after_step)
        .order_by(Step.step).limit(limit)).all()
    if not rows:
        return []
    ranks: dict[str, dict[int, int]] = {}
    points = stored_points(session, run_id, attempt, rows[0][0], rows[-1][0], ranks)
    return [StepRecord(step=st, values={k: p[st] for k, p in points.items() if st in p}, sample_lo=lo,
                       sample_hi=hi, tokens=tok, wall_time=wt,
                       ranks={k: r[st] for k, r in ranks.items() if st in r})
            for st, lo, hi, tok, wt in rows]


def _insert_chunks(session: Session, rows: list[tuple]) -> None:
    """INSERT ... ON CONFLICT DO NOTHING of chunk rows (tuples in _COLS order), through the
    session's own connection and transaction but straight to the driver: SQLAlchemy's
    executemany builds and processes a parameter dict per row (~0.6 ms per 1000-series batch,
    as much as SQLite's insert itself). On PostgreSQL: binary COPY into a temp table, then one
    INSERT ... SELECT, instead of one pipelined INSERT per row; measured ~1.5-2x faster."""
    if not rows:
        return
    conn = session.connection()
    if conn.dialect.name != "postgresql":
        cur = conn.connection.driver_connection.cursor()
        cur.executemany(f"INSERT INTO thermometer_chunks ({_COL_LIST}) VALUES ({', '.join('?' * len(_COLS))}) "
                        "ON CONFLICT DO NOTHING", rows)
        return
    cur = conn.connection.driver_connection.cursor()
    # Temp table per connection, emptied by each commit; unlogged, so the copy costs no WAL.
    cur.execute(f"CREATE TEMP TABLE IF NOT EXISTS _chunk_in AS SELECT {_COL_LIST} FROM thermometer_chunks WITH NO DATA")
    cur.execute("TRUNCATE _chunk_in")
    with cur.copy(f"COPY _chunk_in ({_COL_LIST}) FROM STDIN (FORMAT BINARY)") as cp:
        cp.set_types(list(_PG_TYPES))
        for r in rows:
            cp.write_row(r)
    cur.execute(f"INSERT INTO thermometer_chunks ({_COL_LIST}) SELECT {_COL_LIST} FROM _chunk_in ON CONFLICT DO NOTHING")


def _register(session: Session, run_id: str, sids: Iterable[int], cache: SeriesCache | None) -> None:
    done = cache.registered if cache is not None else set()
    new = [{"run_id": run_id, "series_id": s} for s in sids if (run_id, s) not in done]
    if new:
        session.execute(insert_ignore(session, RunSeries.__table__), new)
        if cache is not None:
            cache.new_registered.update((run_id, r["series_id"]) for r in new)


def _series_id(session: Session, key: str) -> int | None:
    metric, module = split_key(key)
    return session.execute(select(Series.id).where(Series.metric == metric, Series.module == module)).scalar()


def _points(session: Session, run_id: str, key: str, step_lo: int | None, step_hi: int | None, with_ranks: bool):
    """Every stored point of one series inside the window, every attempt, in chunk order
    (attempt, first_step), not deduplicated: (attempts, steps, values, ranks or None, keep), where
    `keep` masks the points inside [step_lo, step_hi] (chunks straddle the bounds). None if none."""
    sid = _series_id(session, key)
    if sid is None:
        return None
    c = ThermometerChunk
    cond = [c.run_id == run_id, c.series_id == sid]
    if step_lo is not None:
        cond.append(c.last_step >= step_lo)
    if step_hi is not None:
        cond.append(c.first_step <= step_hi)
    cols = [c.attempt, c.first_step, c.n, c.steps, c.values] + ([c.ranks] if with_ranks else [])
    rows = _fetch(session, select(*cols).where(and_(*cond)).order_by(c.attempt, c.first_step))
    if not rows:
        return None
    ns = np.array([r[2] for r in rows], np.int64)
    attempts = np.repeat(np.array([r[0] for r in rows], np.int64), ns)
    steps = _decode_steps(np.array([r[1] for r in rows], np.int64), ns, [r[3] for r in rows])
    values = np.frombuffer(b"".join(r[4] for r in rows), np.float64)
    ranks = (
        np.concatenate([np.frombuffer(r[5], np.int32) if r[5] is not None else np.full(r[2], -1, np.int32) for r in rows])
        if with_ranks
        else None
    )
    keep = np.ones(len(steps), bool)
    if step_lo is not None:
        keep &= steps >= step_lo
    if step_hi is not None:
        keep &= steps <= step_hi
    return attempts, steps, values, ranks, keep


def _read(session: Session, run_id: str, key: str, step_lo: int | None, step_hi: int | None, with_ranks: bool):
    empty = (np.empty(0, np.int64), np.empty(0, np.float64), np.empty(0, np.int32))
    pts = _points(session, run_id, key, step_lo, step_hi, with_ranks)
    if pts is None:
        return empty
    attempts, steps, values, ranks, keep = pts
    # Sort by (step, attempt) and keep the last point of each step: the latest attempt wins.
    order = np.lexsort((attempts, steps))
    order = order[keep[order]]
    s = steps[order]
    last = np.ones(len(s), bool)
    last[:-1] = s[1:] != s[:-1]
    order = order[last]
    return steps[order].copy(), values[order].copy(), (ranks[order].copy() if with_ranks else None)


def _fetch(session: Session, stmt) -> list[tuple]:
    """Rows of a chunk query straight from the driver cursor (20k rows for a 10^6-step series;
    SQLAlchemy's per-row result processing would be a third of the read). On PostgreSQL in
    binary format: bytea as text is hex, twice the bytes and the parsing (measured 2x)."""
    conn = session.connection()
    compiled = stmt.compile(dialect=conn.dialect)
    params = compiled.params
    if compiled.positiontup:  # sqlite3: qmark placeholders
        params = [params[k] for k in compiled.positiontup]
    cur = conn.connection.driver_connection.cursor()
    if conn.dialect.name == "postgresql":
        cur.execute(str(compiled), params, binary=True)
    else:
        cur.execute(str(compiled), params)
    return cur.fetchall()


def history(
    session: Session, run_id: str, key: str, step_lo: int | None = None, step_hi: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(steps int64, values float64) of one metric key, ascending, bounds inclusive."""
    steps, values, _ = _read(session, run_id, key, step_lo, step_hi, False)
    return steps, values


def history_with_ranks(
    session: Session, run_id: str, key: str, step_lo: int | None = None, step_hi: int | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Like history(), plus the rank that held each extreme (-1 where none was reported)."""
    return _read(session, run_id, key, step_lo, step_hi, True)


def history_by_attempt(
    session: Session, run_id: str, key: str, step_lo: int | None = None, step_hi: int | None = None
) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """{attempt: (steps int64, values float64)} of one metric key, each attempt's own points
    (ascending, bounds inclusive), attempts ascending. Unlike history(), a step that a rollback
    re-trained keeps every attempt's value: the abandoned trajectory is what explains the
    rollback. Within one attempt a re-batched replay's duplicates are dropped as history() does."""
    pts = _points(session, run_id, key, step_lo, step_hi, False)
    if pts is None:
        return {}
    attempts, steps, values, _, keep = pts
    # Sort by (attempt, step) and keep the last point of each (attempt, step): the sort is
    # stable, so among duplicates the later chunk wins, the same point history() would keep.
    order = np.lexsort((steps, attempts))
    order = order[keep[order]]
    if not len(order):  # chunks overlap the window but none of their points is in it
        return {}
    a, s = attempts[order], steps[order]
    last = np.ones(len(s), bool)
    last[:-1] = (s[1:] != s[:-1]) | (a[1:] != a[:-1])
    order = order[last]
    a = attempts[order]
    bounds = np.flatnonzero(np.r_[True, a[1:] != a[:-1], True])
    return {
        int(a[lo]): (steps[order[lo:hi]], values[order[lo:hi]])  # fancy indexing: fresh arrays
        for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist())
    }


def split_superseded(
    by_attempt: dict[int, tuple[np.ndarray, np.ndarray]],
) -> tuple[tuple[np.ndarray, np.ndarray], dict[int, tuple[np.ndarray, np.ndarray]]]:
    """history_by_attempt() -> (current, superseded). `current` is what history() returns (for
    each step the newest attempt's point); `superseded` holds, per older attempt, the points a
    newer attempt re-trained (the steps where a newer attempt has a point), omitting attempts
    with none. One pass per attempt, numpy within it."""
    if not by_attempt:
        return (np.empty(0, np.int64), np.empty(0, np.float64)), {}
    if len(by_attempt) == 1:
        return next(iter(by_attempt.values())), {}
    cur_s, cur_v, superseded = [], [], {}
    newer = np.empty(0, np.int64)  # sorted steps of every attempt newer than the one at hand
    for attempt in sorted(by_attempt, reverse=True):
        steps, values = by_attempt[attempt]
        gone = np.isin(steps, newer, assume_unique=True)
        if gone.any():
            superseded[attempt] = (steps[gone], values[gone])
        cur_s.append(steps[~gone])
        cur_v.append(values[~gone])
        newer = np.union1d(newer, steps)
    s, v = np.concatenate(cur_s), np.concatenate(cur_v)
    order = np.argsort(s, kind="stable")
    return (s[order], v[order]), dict(sorted(superseded.items()))


def latest_step(session: Session, run_id: str) -> int | None:
    """Newest step of the run's newest attempt that reported any step (None before the first)."""
    newest = select(func.max(Step.attempt)).where(Step.run_id == run_id).scalar_subquery()
    return session.execute(select(func.max(Step.step)).where(Step.run_id == run_id, Step.attempt == newest)).scalar()


def latest_values(session: Session, run_id: str, keys: Iterable[str], window: int = 512) -> dict[str, float]:
    """The newest stored value of each key, looked for in the last `window` steps of the run (a
    figure read every k-th step has one there); keys without one are left out."""
    last = latest_step(session, run_id)
    if last is None:
        return {}
    out = {}
    for key in keys:
        steps, values = history(session, run_id, key, max(0, last - window), None)
        if len(values):
            out[key] = float(values[-1])
    return out


def series_keys(session: Session, run_id: str) -> list[str]:
    """Metric keys the run has reported, sorted."""
    rows = session.execute(
        select(Series.metric, Series.module).join(RunSeries, RunSeries.series_id == Series.id).where(RunSeries.run_id == run_id)
    ).all()
    return sorted(metric_key(m, mod) for m, mod in rows)


def _thin(steps: np.ndarray, values: np.ndarray, ranks: np.ndarray, every: int, how: Reduce) -> np.ndarray:
    """Indices of the points to keep: one per window of `every` steps. Max-reduced metrics keep
    the window's max, min-reduced its min, others the window's first point; a non-finite point
    always wins its window, so a spike survives thinning."""
    window = steps // every
    if how is Reduce.MAX:
        score = values
    elif how is Reduce.MIN:
        score = -values
    else:
        score = -steps.astype(np.float64)
    score = np.where(np.isfinite(values), score, np.inf)  # a NaN/Inf point is what a window keeps
    order = np.lexsort((score, window))
    w = window[order]
    last = np.ones(len(w), bool)
    last[:-1] = w[1:] != w[:-1]
    return np.sort(order[last])


def downsample(session: Session, run_id: str, older_than_step: int, every: int) -> int:
    """Thin every series of the run to one point per `every` steps for steps < older_than_step
    and repack those points into large chunks. Returns the number of points removed.
    Idempotent: a second call with the same arguments changes nothing."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    removed = 0
    c = ThermometerChunk
    sids = session.execute(
        select(RunSeries.series_id, Series.metric, Series.module)
        .join(Series, Series.id == RunSeries.series_id)
        .where(RunSeries.run_id == run_id)
    ).all()
    for sid, metric, module in sids:
        how = reduction(metric_key(metric, module))
        rows = session.execute(
            select(c.attempt, c.first_step, c.n, c.steps, c.values, c.ranks)
            .where(c.run_id == run_id, c.series_id == sid, c.last_step < older_than_step)
            .order_by(c.attempt, c.first_step)
        ).all()
        by_attempt: dict[int, list] = {}
        for r in rows:
            by_attempt.setdefault(r[0], []).append(r)
        for attempt, chunk_rows in by_attempt.items():
            steps = _decode_steps(np.array([r[1] for r in chunk_rows], np.int64),
                                  np.array([r[2] for r in chunk_rows], np.int64), [r[3] for r in chunk_rows])
            values = np.concatenate([np.frombuffer(r[4], np.float64) for r in chunk_rows])
            ranks = np.concatenate(
                [np.frombuffer(r[5], np.int32) if r[5] is not None else np.full(r[2], -1, np.int32) for r in chunk_rows]
            )
            # duplicates from re-batched replays go first
            _, uniq = np.unique(steps, return_index=True)
            steps, values, ranks = steps[uniq], values[uniq], ranks[uniq]
            keep = _thin(steps, values, ranks, every, how)
            n_chunks = -(-len(keep) // MERGED_CHUNK_POINTS)
            if len(keep) == sum(r[2] for r in chunk_rows) and n_chunks == len(chunk_rows):
                continue  # already thinned and packed
            removed += sum(r[2] for r in chunk_rows) - len(keep)
            session.execute(  # exactly the chunks read above (same transaction)
                delete(_CHUNK).where(
                    c.run_id == run_id, c.series_id == sid, c.attempt == attempt, c.last_step < older_than_step
                )
            )
            s, v, rk = steps[keep], values[keep], ranks[keep]
            out = []
            for i in range(0, len(s), MERGED_CHUNK_POINTS):
                sl = slice(i, i + MERGED_CHUNK_POINTS)
                out.append({
                    "run_id": run_id, "series_id": sid, "attempt": attempt,
                    "first_step": int(s[sl][0]), "last_step": int(s[sl][-1]), "n": len(s[sl]),
                    "steps": _steps_blob(s[sl]), "values": v[sl].tobytes(),
                    "ranks": rk[sl].tobytes() if (rk[sl] >= 0).any() else None,
                })
            if out:
                session.execute(_CHUNK.insert(), out)
    return removed
