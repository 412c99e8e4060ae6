"""Thermometer rollups: min/max/last/count per bucket at coarser widths, so a chart of a
10^6-step, 100-layer history reads a few thousand buckets per series instead of 10^8 points
(issue 12: read raw, such a chart takes 48-90 s and 3.4 GB).

Widths 4, 16, 64, ... 262144 steps (x4 apart). A chart asks for `buckets` buckets and reads the
coarsest width that still gives at least that many in its window, so it reads between
`buckets` and 4 x `buckets` per series (x4 apart is the price: x8 would read up to 8,000 at the
default 1000, x64 up to 64,000; each extra level costs one more row per series every 4x its
span, i.e. nothing). 262144 is the top: a 10^7-step window at the smallest `buckets` (10)
still reads only a few hundred buckets.

Storage: one row per (run, series, attempt, width, span) holding the buckets of one aligned span
of SPAN_BUCKETS (256) buckets as packed arrays, like the raw chunks (store/thermometers.py): a
10^6-step series is 16 rows at width 256. A span is written once, in the ingest transaction
of the batch that completes it (its step passes the span's end): width 4 from the raw chunks of
that span (1,024 points per series), each coarser width from the 4 rows of the width below, so
the ingest pays one indexed read and one small insert per series every 1,024 steps, amortised
(no per-point work in Python, no row per bucket). Rows are upserts: a backfill or a re-sent
batch rewrites the same span with the same content.

What is not rolled up yet (the open span at the head of each attempt, an abandoned attempt's
last partial span, history stored before this table existed) is read from the next finer
width and finally from raw chunks (`read`): a chart is correct before any rollup exists, only
slower. `thermowatch db rollups` backfills old histories.

NaN: min and max propagate it (np.minimum), so a bucket with a NaN reads NaN at every zoom:
a non-finite value is the one point a divergence watchdog must never average away. The price:
a finite spike sharing a bucket with a NaN shows only at a zoom where they part. +-Inf
survive as ordinary extremes. Retention (thermometers.downsample) thins raw chunks only.

Known limit: a batch that arrives after its span was rolled up (out of order, not something the
sink does: it delivers a run's batches in order) leaves that span stale until a backfill.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Sequence

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session

from thermowatch.supervisor.store.orm import ThermometerChunk, ThermometerRollup
from thermowatch.supervisor.store.steps_blob import decode_steps

WIDTHS = (4, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)
SPAN_BUCKETS = 256  # buckets per stored row: a span is width * 256 steps
_ROLLUP = ThermometerRollup.__table__


def span_steps(width: int) -> int:
    return width * SPAN_BUCKETS


@dataclass(slots=True)
class Buckets:
    """Parallel arrays, sorted by (series_id, attempt, step): `step` is each bucket's first
    step (a multiple of the width); a raw point is a bucket of width 1 (min = max = last)."""

    series_id: np.ndarray  # int64
    attempt: np.ndarray  # int64
    step: np.ndarray  # int64
    min: np.ndarray  # float64
    max: np.ndarray
    last: np.ndarray
    count: np.ndarray  # int64

    @staticmethod
    def empty() -> "Buckets":
        i, f = np.empty(0, np.int64), np.empty(0, np.float64)
        return Buckets(i, i, i, f, f, f, i)

    def __len__(self) -> int:
        return len(self.step)

    def take(self, idx) -> "Buckets":
        memo: dict[int, np.ndarray] = {}  # raw points share one array for min, max and last: copy it once
        for a in self._arrays():
            if id(a) not in memo:
                memo[id(a)] = a[idx]
        return Buckets(*(memo[id(a)] for a in self._arrays()))

    def _arrays(self):
        return (self.series_id, self.attempt, self.step, self.min, self.max, self.last, self.count)

    @staticmethod
    def concat(parts: Sequence["Buckets"], order: np.ndarray | None = None) -> "Buckets":
        """The parts one after another, or gathered in `order` (indices into that) one column
        at a time, so a big merge holds the parts, one column and the result, not two copies."""
        parts = [p for p in parts if len(p)]
        if not parts:
            return Buckets.empty()
        if len(parts) == 1 and order is None:
            return parts[0]
        cols = []
        for i in range(7):
            col = np.concatenate([p._arrays()[i] for p in parts]) if len(parts) > 1 else parts[0]._arrays()[i]
            cols.append(col[order] if order is not None else col)
        return Buckets(*cols)

    @staticmethod
    def merge_sorted(parts: Sequence["Buckets"]) -> "Buckets":
        """concat(parts).sorted() for parts that are each sorted and, per (series, attempt), hold
        ascending step ranges in list order (coarse widths first, then finer, then raw): a
        stable O(n) sort on (series, attempt) alone; the full sort if that assumption fails."""
        parts = [p for p in parts if len(p)]
        if len(parts) <= 1:
            return parts[0] if parts else Buckets.empty()
        pair = np.concatenate([p.series_id * 2**20 + p.attempt for p in parts])
        order = np.argsort(pair, kind="stable")
        out = Buckets.concat(parts, order)
        same = (out.series_id[1:] == out.series_id[:-1]) & (out.attempt[1:] == out.attempt[:-1])
        return out.sorted() if (same & (out.step[1:] <= out.step[:-1])).any() else out

    def sorted(self) -> "Buckets":
        """Sorted by (series, attempt, step); stable, so among equal keys the input order stays."""
        return self.take(np.lexsort((self.step, self.attempt, self.series_id)))

    def reduce(self, width: int, extra_key: np.ndarray | None = None) -> "Buckets":
        """Merge into buckets of `width` steps (input sorted by series, attempt, step; `extra_key`
        splits groups further, e.g. live vs abandoned). O(n) numpy reduceat."""
        if not len(self):
            return self
        b = self.step // width
        change = (np.diff(b) != 0) | (np.diff(self.series_id) != 0) | (np.diff(self.attempt) != 0)
        if extra_key is not None:
            change |= np.diff(extra_key) != 0
        if change.all() and not (self.step % width).any():
            return self  # already whole buckets of this width: nothing to merge, no copy
        starts = np.flatnonzero(np.r_[True, change])
        ends = np.r_[starts[1:], len(b)] - 1
        return Buckets(self.series_id[starts], self.attempt[starts], b[starts] * width,
                       np.minimum.reduceat(self.min, starts), np.maximum.reduceat(self.max, starts),
                       self.last[ends], np.add.reduceat(self.count, starts))


# --- reading -----------------------------------------------------------------------------------


Range = tuple[int, int, int]  # (attempt, least first_step, greatest first_step): one index range


# A statement's limits: SQLite refuses a compound SELECT of more than 500 terms and more than
# 32,766 bound values. A run of 10^4 attempts (issue 34) asked for a branch per attempt: a 500.
MAX_BRANCHES, MAX_PARAMS = 400, 30_000


@lru_cache(maxsize=256)
def _sql(dialect: str, table: str, cols: tuple[str, ...], by_width: bool, n_sids: int, shape: tuple[int, ...]) -> str:
    """SELECT cols FROM table WHERE run_id, [width,] series_id IN (...) and one index range per
    branch (a UNION ALL of them: both planners turn an OR of ranges into a scan), a branch being
    the attempts (`shape`: how many in each) that share one range of first_step. Written out
    and cached by shape: compiling the SQLAlchemy statement (IN list rendered, one branch per
    attempt) took ~6 ms a query, a third of a 100-layer chart's read (24 queries; bench/plot.py)."""
    mark = "%s" if dialect == "postgresql" else "?"
    head = (f"SELECT {', '.join(f'{chr(34)}{c}{chr(34)}' for c in cols)} FROM {table} WHERE run_id = {mark}"
            + (f" AND width = {mark}" if by_width else "")
            + f" AND series_id IN ({', '.join([mark] * n_sids)})")

    def branch(n: int) -> str:
        attempt = f"attempt = {mark}" if n == 1 else f"attempt IN ({', '.join([mark] * n)})"
        return f"{head} AND {attempt} AND first_step >= {mark} AND first_step <= {mark}"

    return " UNION ALL ".join(branch(n) for n in shape)


def _statements(ranges: Sequence[Range], n_head: int) -> list[list[tuple[list[int], int, int]]]:
    """The ranges as statements of branches: the attempts that share (least, greatest first_step)
    are one branch (attempt IN ...), as the uncovered attempts of a many-attempt run all do; each
    statement within MAX_BRANCHES and MAX_PARAMS, so their number follows the distinct ranges
    (and the attempts only past MAX_PARAMS of them), not one per attempt."""
    by: dict[tuple[int, int], list[int]] = {}
    for a, lo, hi in ranges:
        by.setdefault((int(lo), int(hi)), []).append(int(a))
    per = max(1, MAX_PARAMS - n_head - 2)  # attempts a branch may carry
    branches = [(sorted(atts)[i:i + per], lo, hi) for (lo, hi), atts in by.items() for i in range(0, len(atts), per)]
    out: list[list[tuple[list[int], int, int]]] = [[]]
    used = 0
    for b in branches:
        cost = n_head + len(b[0]) + 2
        if out[-1] and (len(out[-1]) >= MAX_BRANCHES or used + cost > MAX_PARAMS):
            out.append([])
            used = 0
        out[-1].append(b)
        used += cost
    return out


def _fetch_ranges(session: Session, table, cols: tuple[str, ...], run_id: str, width: int | None,
                  sids: Sequence[int], ranges: Sequence[Range]) -> list[tuple]:
    """Rows of `table` in the given index ranges, straight from the driver cursor (as
    thermometers._fetch: binary on PostgreSQL), sorted by (series, attempt, first_step), the
    first three columns."""
    if not ranges:
        return []
    conn = session.connection()
    dialect = conn.dialect.name
    sids = [int(x) for x in sids]
    head = [run_id] + ([width] if width is not None else []) + sids
    rows: list[tuple] = []
    for branches in _statements(ranges, len(head)):
        params = [p for atts, lo, hi in branches for p in (*head, *atts, lo, hi)]
        sql = _sql(dialect, table.name, cols, width is not None, len(sids), tuple(len(atts) for atts, _, _ in branches))
        cur = conn.connection.driver_connection.cursor()
        if dialect == "postgresql":
            cur.execute(sql, params, binary=True)
        else:
            cur.execute(sql, params)
        rows += cur.fetchall()
    rows.sort(key=lambda r: (r[0], r[1], r[2]))  # per row (chunk), not per point
    return rows


_CHUNK_COLS = ("series_id", "attempt", "first_step", "n", "steps", "values")
_ROLLUP_COLS = ("series_id", "attempt", "first_step", "n", "buckets", "stats")


def raw_points(session: Session, run_id: str, sids: Sequence[int], ranges: Sequence[Range]) -> Buckets:
    """Raw points of the chunks whose first step lies in `ranges`, as width-1 buckets, one per
    (series, attempt, step) (a re-batched replay's duplicate keeps the later chunk's point, as
    thermometers.history_by_attempt does)."""
    rows = _fetch_ranges(session, ThermometerChunk.__table__, _CHUNK_COLS, run_id, None, sids, ranges)
    if not rows:
        return Buckets.empty()
    ns = np.array([r[3] for r in rows], np.int64)
    sid = np.repeat(np.array([r[0] for r in rows], np.int64), ns)
    att = np.repeat(np.array([r[1] for r in rows], np.int64), ns)
    steps = decode_steps(np.array([r[2] for r in rows], np.int64), ns, [r[4] for r in rows])
    vals = np.frombuffer(b"".join(r[5] for r in rows), np.float64)
    same = (sid[1:] == sid[:-1]) & (att[1:] == att[:-1])
    if not (same & (steps[1:] <= steps[:-1])).any():  # the common case: chunks in order, no overlap
        return Buckets(sid, att, steps, vals, vals, vals, np.ones(len(vals), np.int64))
    order = np.lexsort((steps, att, sid))  # stable: the later chunk of a duplicate comes last
    sid, att, steps, vals = sid[order], att[order], steps[order], vals[order]
    last = np.r_[(steps[1:] != steps[:-1]) | (att[1:] != att[:-1]) | (sid[1:] != sid[:-1]), True]
    sid, att, steps, vals = sid[last], att[last], steps[last], vals[last]
    return Buckets(sid, att, steps, vals, vals, vals, np.ones(len(vals), np.int64))


def _rollup_rows(session: Session, run_id: str, sids: Sequence[int], width: int,
                 ranges: Sequence[Range]) -> tuple[Buckets, np.ndarray]:
    """Stored rows of one width whose span starts in `ranges`, as buckets, plus each bucket's
    span end + 1 (its row's coverage)."""
    rows = _fetch_ranges(session, _ROLLUP, _ROLLUP_COLS, run_id, width, sids, ranges)
    if not rows:
        return Buckets.empty(), np.empty(0, np.int64)
    ns = np.array([x[3] for x in rows], np.int64)
    stats = [np.frombuffer(x[5], np.float64).reshape(4, -1) for x in rows]
    mn, mx, last, cnt = (np.concatenate([s[i] for s in stats]) for i in range(4))
    out = Buckets(np.repeat(np.array([x[0] for x in rows], np.int64), ns),
                  np.repeat(np.array([x[1] for x in rows], np.int64), ns),
                  np.frombuffer(b"".join(x[4] for x in rows), np.int64), mn, mx, last, cnt.astype(np.int64))
    covered = np.repeat(np.array([x[2] for x in rows], np.int64) + span_steps(width), ns)
    return out, covered


def read(session: Session, run_id: str, sids: Sequence[int], attempts: Sequence[int], width: int,
         lo: int, hi: int) -> Buckets:
    """Buckets of `width` steps (1 or one of WIDTHS) of the given attempts in [lo, hi] widened to
    whole buckets, sorted by (series, attempt, step). One query per width from `width` down to
    the raw chunks, each reading only what the coarser ones did not cover (per series and
    attempt). Every condition is an index range on (run, series, attempt[, width], first_step)."""
    if width != 1 and width not in WIDTHS:
        raise ValueError(f"width must be 1 or one of {WIDTHS}, got {width}")
    lo, hi = lo // width * width, (hi // width + 1) * width - 1
    pieces: list[Buckets] = []
    got = covered = None
    need: dict[tuple[int, int], int] = {}  # (series, attempt) -> first step not yet covered
    r, c = ThermometerRollup, ThermometerChunk
    for w in (x for x in reversed(WIDTHS) if x <= width):
        # a span holding step x starts after x - span (spans are aligned)
        starts = {a: st - span_steps(w) + 1 for a, st in _needs(need, sids, attempts, lo).items()}
        got, covered = _rollup_rows(session, run_id, sids, w, _ranges(starts, hi))
        if len(got):
            keep = (got.step >= _need_of(need, got, lo)) & (got.step <= hi)
            if not keep.all():
                got, covered = got.take(keep), covered[keep]
            _advance(need, got, covered)
            pieces.append(got.reduce(width))  # small for finer widths; no copy at `width` itself
    starts = chunk_floors(session, run_id, sids, _needs(need, sids, attempts, lo))
    raw = raw_points(session, run_id, sids, _ranges(starts, hi))
    if len(raw):
        pieces.append(raw.take((raw.step >= _need_of(need, raw, lo)) & (raw.step <= hi)).reduce(width))
    del got, covered, raw
    out = Buckets.merge_sorted(pieces)
    del pieces
    return out.reduce(width)  # where two widths met inside one bucket (width > 1024); else no copy


def _needs(need: dict[tuple[int, int], int], sids: Sequence[int], attempts: Sequence[int], lo: int) -> dict[int, int]:
    """Per attempt, the least step any of its series still needs (lo where a series has no
    coarser row at all). One pass over what is covered, not a lookup per series per attempt."""
    wanted = set(sids)
    covered: dict[int, int] = {}  # attempt -> its series with a coarser row
    least: dict[int, int] = {}
    for (sid, a), st in need.items():
        if sid in wanted:
            covered[a] = covered.get(a, 0) + 1
            least[a] = min(least.get(a, st), st)
    return {a: max(lo, least[a]) if covered.get(a) == len(wanted) else lo for a in attempts}


def _ranges(starts: dict[int, int], hi: int) -> list[Range]:
    """attempt = a AND first_step BETWEEN start_a AND hi: one index range per attempt."""
    return [(a, st, hi) for a, st in starts.items()]


def chunk_floor(session: Session, run_id: str, sids: Sequence[int], attempt: int, step: int) -> int:
    """The least first step among the chunks that may hold `step` or later: per series the last
    chunk starting at or before `step` (one index seek each), so a read from `step` on is an
    index range however long the chunks are (retention merges old points into long ones)."""
    from sqlalchemy import func

    from thermowatch.supervisor.store.orm import RunSeries

    c = ThermometerChunk
    floor = (select(func.max(c.first_step))
             .where(c.run_id == run_id, c.series_id == RunSeries.series_id, c.attempt == attempt, c.first_step <= step)
             .scalar_subquery())
    got = [x for (x,) in session.execute(select(floor).where(RunSeries.run_id == run_id, RunSeries.series_id.in_(list(sids))))
           if x is not None]
    return min(got, default=step)


def chunk_floors(session: Session, run_id: str, sids: Sequence[int], steps: dict[int, int]) -> dict[int, int]:
    """chunk_floor of many attempts at once, {attempt: step} -> {attempt: floor}: the (attempt,
    step) pairs go in as a VALUES list and the seeks (per series and pair) run in the database,
    one statement per FLOOR_PAIRS pairs. A query per attempt sent 10^3 for a chart of a run with
    10^3 attempts holding points (issue 34)."""
    if not steps:
        return {}
    conn = session.connection()
    dialect = conn.dialect.name
    sids = [int(x) for x in sids]
    pairs = [(int(a), int(st)) for a, st in steps.items()]
    out = dict(steps)
    for i in range(0, len(pairs), FLOOR_PAIRS):
        part = pairs[i:i + FLOOR_PAIRS]
        cur = conn.connection.driver_connection.cursor()
        cur.execute(_floors_sql(dialect, len(sids), len(part)), [x for p in part for x in p] + [run_id, run_id] + sids)
        for a, f in cur.fetchall():
            if f is not None:
                out[int(a)] = int(f)
    return out


FLOOR_PAIRS = 5000  # (attempt, step) pairs a statement: 10^4 bound values, within SQLite's 32,766


def _floors_sql(dialect: str, n_sids: int, n_pairs: int) -> str:
    """Per wanted (attempt, step): the least over the series of the last chunk starting at or
    before the step (one seek on the chunks' primary key per series and pair)."""
    mark = "%s" if dialect == "postgresql" else "?"
    wanted = ", ".join([f"({mark}, {mark})"] * n_pairs)
    return (f"WITH wanted(attempt, step) AS (VALUES {wanted}) "
            "SELECT attempt, min(floor) FROM (SELECT w.attempt AS attempt, "
            "(SELECT max(c.first_step) FROM thermometer_chunks c WHERE c.run_id = "
            f"{mark} AND c.series_id = rs.series_id AND c.attempt = w.attempt AND c.first_step <= w.step) AS floor "
            f"FROM wanted w JOIN run_series rs ON rs.run_id = {mark} "
            f"WHERE rs.series_id IN ({', '.join([mark] * n_sids)})) x GROUP BY attempt")


def _need_of(need: dict[tuple[int, int], int], b: Buckets, lo: int) -> np.ndarray:
    """Per bucket: the first step its (series, attempt) still needs (lo when nothing covered it)."""
    if not need:
        return np.full(len(b), lo, np.int64)
    keys = np.array(list(need), np.int64).reshape(-1, 2)
    vals = np.array(list(need.values()), np.int64)
    code = keys[:, 0] * 2**20 + keys[:, 1]  # attempts < 2^20 (limits.max_attempts is far below)
    order = np.argsort(code)
    code, vals = code[order], vals[order]
    q = b.series_id * 2**20 + b.attempt
    pos = np.clip(np.searchsorted(code, q), 0, len(code) - 1)
    return np.where(code[pos] == q, vals[pos], lo)


def _advance(need: dict[tuple[int, int], int], b: Buckets, covered: np.ndarray) -> None:
    """After reading a width: each (series, attempt) needs steps from its furthest covered span on."""
    if not len(b):
        return
    key = b.series_id * 2**20 + b.attempt
    uniq, inv = np.unique(key, return_inverse=True)
    top = np.full(len(uniq), np.iinfo(np.int64).min)
    np.maximum.at(top, inv, covered)
    for k, t in zip(uniq.tolist(), top.tolist()):
        pair = (k >> 20, k & (2**20 - 1))
        need[pair] = max(need.get(pair, t), t)


# --- writing -----------------------------------------------------------------------------------


def _upsert(session: Session, rows: list[dict]) -> None:
    if not rows:
        return
    if session.get_bind().dialect.name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    else:
        from sqlalchemy.dialects.sqlite import insert
    stmt = insert(_ROLLUP)
    stmt = stmt.on_conflict_do_update(
        index_elements=["run_id", "series_id", "attempt", "width", "first_step"],
        set_={"n": stmt.excluded.n, "buckets": stmt.excluded.buckets, "stats": stmt.excluded.stats})
    session.execute(stmt, rows)


def _rows(run_id: str, width: int, b: Buckets) -> list[dict]:
    """One row per (series, attempt, span) of buckets already reduced to `width`."""
    if not len(b):
        return []
    span = b.step // span_steps(width)
    starts = np.flatnonzero(np.r_[True, (np.diff(span) != 0) | (np.diff(b.series_id) != 0) | (np.diff(b.attempt) != 0)])
    ends = np.r_[starts[1:], len(span)]
    stats = np.stack([b.min, b.max, b.last, b.count.astype(np.float64)])
    return [{"run_id": run_id, "series_id": int(b.series_id[i]), "attempt": int(b.attempt[i]), "width": width,
             "first_step": int(span[i]) * span_steps(width), "n": int(j - i),
             "buckets": b.step[i:j].tobytes(), "stats": np.ascontiguousarray(stats[:, i:j]).tobytes()}
            for i, j in zip(starts.tolist(), ends.tolist())]


def _roll_up(session: Session, run_id: str, attempt: int, sids: list[int], lo: int, hi: int) -> int:
    """Write, for every width, the spans of one attempt whose end + 1 lies in [lo, hi] (each
    width from the rows of the width below, the finest from raw chunks). Rows written."""
    written, src_w = 0, 1
    for w in WIDTHS:
        s = span_steps(w)
        # spans whose last step (k+1)*s - 1 is in [lo - 1, hi]: this batch holds it or starts
        # right after it (a span is rolled up once its attempt has reached its end)
        k0, k1 = max(0, -(-lo // s) - 1), (hi + 1) // s - 1
        if k1 < k0:
            break  # coarser spans end on a subset of these ends: none complete either
        a, z = k0 * s, (k1 + 1) * s - 1
        if src_w == 1:
            floor = chunk_floor(session, run_id, sids, attempt, a)
            src = raw_points(session, run_id, sids, [(attempt, floor, z)])
            src = src.take((src.step >= a) & (src.step <= z))
        else:
            src, _ = _rollup_rows(session, run_id, sids, src_w, [(attempt, a, z)])  # sorted: by (series, attempt, span)
        rows = _rows(run_id, w, src.reduce(w))
        _upsert(session, rows)
        written += len(rows)
        src_w = w
    return written


def on_append(session: Session, run_id: str, attempt: int, sids: Sequence[int], lo: int, hi: int) -> int:
    """The ingest hook (thermometers.append, after the batch's chunks are inserted): a batch of
    steps lo..hi completes the spans whose last step is in [lo - 1, hi]. Most batches complete none and cost two
    integer divisions; the rest one raw read of 1,024 steps and a few small rows per series."""
    s = span_steps(WIDTHS[0])
    if (hi + 1) // s < max(1, -(-lo // s)):
        return 0
    return _roll_up(session, run_id, attempt, list(sids), lo, hi)


def backfill(session: Session, run_id: str, *, steps_per_pass: int = 65536) -> int:
    """Roll up every stored attempt of a run (histories ingested before rollups existed, or a
    span left stale), as if its steps arrived again in batches of `steps_per_pass` (memory:
    series x steps_per_pass points). Never commits; returns the rows written."""
    from sqlalchemy import func

    from thermowatch.supervisor.store.orm import RunSeries

    c = ThermometerChunk
    sids = [x for (x,) in session.execute(select(RunSeries.series_id).where(RunSeries.run_id == run_id))]
    ranges = session.execute(select(c.attempt, func.min(c.first_step), func.max(c.last_step))
                             .where(c.run_id == run_id).group_by(c.attempt).order_by(c.attempt)).all()
    written = 0
    for attempt, lo, hi in ranges:
        for a in range(lo, hi + 1, steps_per_pass):
            written += on_append(session, run_id, attempt, sids, a, min(a + steps_per_pass - 1, hi))
    return written
