"""A chart's data: every series of a metric (or a family of per-module series) in a step
window, as at most `buckets` min/max/last/count buckets per series, read from the rollups
(store/rollups.py). The JSON contract is supervisor/serve/api/chart.py's; the PNGs
(supervisor/charts/png.py) draw the same data.

Reads: series in groups of READ_GROUP, one query per stored width per group (the rows of every
series and attempt of the group at once), so memory stays bounded at 100+ layers.

Resolution: the coarsest stored width that still gives >= `buckets` buckets in the window (so
at most 4 x `buckets` are read per series), merged into `bucket_steps`-wide buckets (a multiple
of that width, aligned to step 0) so that at most `buckets` remain. A window of at most
`buckets` steps reads the raw chunks: bucket_steps 1, every point, min = max = last. Coarser
buckets are aligned to their width, so the first and last may reach up to bucket_steps - 1
steps outside the window (a partial bucket would need a finer read for each edge).

Attempts: a rollback re-trains steps; the older attempt's points at steps the newer one
re-trained (from the newer attempt's first step on) were abandoned. Each attempt is drawn as up
to two series with the same key and attempt: its live part (`current` true) and its abandoned
part (`current` false, drawn faded), so the live path reads as one line across attempts. The
bucket that straddles the cut is re-read raw (at most width points per series), so neither side
holds the other's points; above STRADDLE_RAW_MAX steps per bucket it is counted as abandoned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session, aliased

from thermowatch.monitors.contract import metric_key
from thermowatch.supervisor.errors import NotFound, UserError
from thermowatch.supervisor.store import rollups
from thermowatch.supervisor.store.orm import RunSeries, Series, ThermometerChunk

MIN_BUCKETS, MAX_BUCKETS, DEFAULT_BUCKETS = 10, 5000, 1000
# Series read together: one query per width per group. 25 keeps a 100-layer chart's transient
# arrays near 20 MB (one group of 100 held ~70 MB: bench/plot.py, the daemon's peak RSS).
READ_GROUP = 25
STRADDLE_RAW_MAX = 4096  # re-read a cut's straddling bucket raw up to this width (series x width points)


@dataclass(slots=True)
class ChartSeries:
    key: str
    module: str | None  # None for a scalar series (loss)
    attempt: int
    current: bool  # False: points a later attempt re-trained (abandoned by a rollback)
    step: np.ndarray  # int64, first step of each bucket holding data, ascending
    min: np.ndarray
    max: np.ndarray
    last: np.ndarray
    count: np.ndarray  # int64


@dataclass(slots=True)
class ChartData:
    run_id: str
    metric: str
    step_lo: int
    step_hi: int
    bucket_steps: int
    series: list[ChartSeries]


def family(session: Session, run_id: str, metric: str) -> dict[int, str]:
    """{series id: key} for `metric` as a full key or a family prefix; NotFound naming the known
    families when the run has neither."""
    rows = session.execute(select(Series.id, Series.metric, Series.module)
                           .join(RunSeries, RunSeries.series_id == Series.id).where(RunSeries.run_id == run_id)).all()
    keys = {sid: metric_key(m, mod) for sid, m, mod in rows}
    out = {sid: k for sid, k in keys.items() if k == metric or k.startswith(metric + "/")}
    if not out:
        fams = sorted({k.split("/", 1)[0] for k in keys.values()})
        known = f"known families: {', '.join(fams)}" if fams else "it has reported no thermometers yet"
        raise NotFound(f"run {run_id!r} has no series {metric!r}; {known}")
    return out


def attempt_ranges(session: Session, run_id: str, sid: int) -> list[tuple[int, int, int]]:
    """(attempt, first step, last step) of one series, by attempt, for the attempts that hold
    any of its points. The attempts are found by a skip scan of the chunks' primary key (a seek
    each for the next attempt that holds a chunk), then two seeks each (its first chunk, its last
    chunk's end): the cost follows the attempts holding points, not the attempts opened (a seek
    per opened attempt, 10^4 of them, was half a chart's read; issue 34)."""
    c, nxt = ThermometerChunk, aliased(ThermometerChunk)
    held = (select(func.min(c.attempt).label("attempt")).where(c.run_id == run_id, c.series_id == sid)
            .cte("held", recursive=True))
    following = (select(func.min(nxt.attempt)).where(nxt.run_id == run_id, nxt.series_id == sid,
                                                     nxt.attempt > held.c.attempt).scalar_subquery())
    held = held.union_all(select(following).where(held.c.attempt.is_not(None)))

    def edge(first: bool):
        col = c.last_step if not first else c.first_step
        return (select(col).where(c.run_id == run_id, c.series_id == sid, c.attempt == held.c.attempt)
                .order_by(c.first_step if first else c.first_step.desc()).limit(1).scalar_subquery())

    rows = session.execute(select(held.c.attempt, edge(True), edge(False)).where(held.c.attempt.is_not(None))
                           .order_by(held.c.attempt)).all()
    return [(int(a), int(lo), int(hi)) for a, lo, hi in rows]


def resolution(lo: int, hi: int, buckets: int) -> tuple[int, int]:
    """(stored width to read, bucket_steps): the coarsest width with >= `buckets` buckets in
    [lo, hi], then the smallest multiple of it that leaves <= `buckets` aligned buckets."""
    def count(w: int) -> int:
        return hi // w - lo // w + 1

    width = max((w for w in rollups.WIDTHS if count(w) >= buckets), default=1)
    m = max(1, math.ceil((hi - lo + 1) / (width * buckets)))
    while count(width * m) > buckets:
        m += 1
    return width, width * m


def chart(session: Session, run_id: str, metric: str, step_lo: int | None = None, step_hi: int | None = None,
          buckets: int = DEFAULT_BUCKETS, attempts: str = "all") -> ChartData:
    if not MIN_BUCKETS <= buckets <= MAX_BUCKETS:
        raise UserError(f"buckets={buckets} is out of range; use {MIN_BUCKETS}..{MAX_BUCKETS}")
    if attempts not in ("all", "current"):
        raise UserError(f"attempts={attempts!r}: use all or current")
    keys = family(session, run_id, metric)
    if step_lo is not None and step_hi is not None and step_lo > step_hi:
        return ChartData(run_id, metric, step_lo, step_hi, 1, [])  # an empty window holds no points
    sids = sorted(keys)
    ranges = attempt_ranges(session, run_id, sids[0])
    lo = step_lo if step_lo is not None else min((r[1] for r in ranges), default=0)
    hi = step_hi if step_hi is not None else max((r[2] for r in ranges), default=lo)
    hi = max(hi, lo)  # a window opened only on one side past the data
    width, bucket_steps = resolution(lo, hi, buckets)
    cuts = _cuts(ranges)
    series: list[ChartSeries] = []
    for i in range(0, len(sids), READ_GROUP):  # bounds the daemon's memory per request
        series += _group(session, run_id, keys, sids[i:i + READ_GROUP], [a for a, _, _ in ranges], cuts,
                         width, bucket_steps, lo, hi, attempts)
    series.sort(key=lambda x: (x.key, x.attempt, not x.current))  # by key, then attempt, live part first
    return ChartData(run_id, metric, lo, hi, bucket_steps, series)


def _cuts(ranges: list[tuple[int, int, int]]) -> dict[int, int | None]:
    """{attempt: first step any later attempt trained} (None for the newest): an attempt's points
    from there on were re-trained. One backward pass (a min over the later attempts for each was
    quadratic: 10^6 steps of Python at 10^3 attempts holding points, issue 34)."""
    out: dict[int, int | None] = {}
    later: int | None = None
    for a, first, _ in reversed(ranges):  # ranges ascend by attempt
        out[a] = later
        later = first if later is None else min(later, first)
    return out


class _ByAttempt:
    """{attempt: value}, looked up for an array of attempt numbers (`missing` where there is
    none) by a search in the sorted attempts. Never an array indexed by attempt: an attempt
    number is any int32 a client sent, and one of 2^31 - 1 made a chart request allocate 16 GB
    and hang the daemon's worker (schemathesis found it)."""

    def __init__(self, values: dict[int, int | None], missing: int) -> None:
        got = sorted((a, v) for a, v in values.items() if v is not None)
        self.ids = np.array([a for a, _ in got], np.int64)
        self.vals = np.array([v for _, v in got], np.int64)
        self.missing = missing

    def __getitem__(self, attempts: np.ndarray) -> np.ndarray:
        attempts = np.asarray(attempts, np.int64)
        if not len(self.ids):
            return np.full(attempts.shape, self.missing, np.int64)
        i = np.minimum(np.searchsorted(self.ids, attempts), len(self.ids) - 1)
        return np.where(self.ids[i] == attempts, self.vals[i], self.missing)


def _group(session, run_id, keys, sids, attempt_ids, cuts, width, bucket_steps, lo, hi, attempts) -> list[ChartSeries]:
    data = rollups.read(session, run_id, sids, attempt_ids, width, lo, hi)
    piece_w = np.full(len(data), width, np.int64)
    if width == 1:
        keep = (data.step >= lo) & (data.step <= hi)  # exact window at full zoom
        data, piece_w = data.take(keep), piece_w[keep]
    else:
        data, piece_w = _split_straddles(session, run_id, sids, width, lo, hi, cuts, data, piece_w)
    cut_of = _ByAttempt(cuts, np.iinfo(np.int64).max)
    abandoned = (data.step + piece_w - 1 >= cut_of[data.attempt]) if len(data) else np.zeros(0, bool)
    if attempts == "current":
        data, abandoned = data.take(~abandoned), abandoned[~abandoned]
    merged = data.reduce(bucket_steps, extra_key=abandoned.astype(np.int64))
    gone = _abandoned_of(merged, bucket_steps, data, abandoned)
    return _series(keys, merged, gone)


def _split_straddles(session, run_id, sids, width, lo, hi, cuts, data, piece_w):
    """Re-read raw the bucket that holds each cut (when it is not on a bucket edge), so its live
    and abandoned points land on their own sides."""
    windows = {a: c // width * width for a, c in cuts.items()
               if c is not None and c % width and lo // width * width <= c <= hi + width and width <= STRADDLE_RAW_MAX}
    if not windows:
        return data, piece_w
    floors = rollups.chunk_floors(session, run_id, sids, windows)
    raw = rollups.raw_points(session, run_id, sids, [(a, floors[a], b + width - 1) for a, b in windows.items()])
    bucket_of = _ByAttempt(windows, -1)

    def in_window(b):
        start = bucket_of[b.attempt]
        return (start >= 0) & (b.step >= start) & (b.step < start + width)

    drop = in_window(data)
    raw = raw.take(in_window(raw) & (raw.step >= lo // width * width) & (raw.step <= (hi // width + 1) * width - 1))
    # the kept buckets in order, each cut's raw points where its bucket was: one gather per column
    kept = np.flatnonzero(~drop)
    key_s = np.r_[data.series_id[kept], raw.series_id]
    key_a = np.r_[data.attempt[kept], raw.attempt]
    key_t = np.r_[data.step[kept], raw.step]
    order = np.lexsort((key_t, key_a, key_s))
    del key_s, key_a, key_t
    idx = np.r_[kept, len(data) + np.arange(len(raw))][order]
    ws = np.r_[piece_w, np.ones(len(raw), np.int64)][idx]
    return rollups.Buckets.concat([data, raw], idx), ws


def _abandoned_of(merged, bucket_steps, data, abandoned) -> np.ndarray:
    """Which merged buckets came from abandoned pieces: reduce() keeps group order, so recompute
    the group key the same way (first piece of each group)."""
    if not len(data):
        return np.zeros(0, bool)
    b = data.step // bucket_steps
    change = (np.diff(b) != 0) | (np.diff(data.series_id) != 0) | (np.diff(data.attempt) != 0) | (np.diff(abandoned) != 0)
    return abandoned[np.flatnonzero(np.r_[True, change])]


def _series(keys: dict[int, str], b: rollups.Buckets, gone: np.ndarray) -> list[ChartSeries]:
    if not len(b):
        return []
    starts = np.flatnonzero(np.r_[True, (np.diff(b.series_id) != 0) | (np.diff(b.attempt) != 0) | (np.diff(gone) != 0)])
    ends = np.r_[starts[1:], len(b)]
    out = []
    for i, j in zip(starts.tolist(), ends.tolist()):
        key = keys[int(b.series_id[i])]
        module = key.split("/", 1)[1] if "/" in key else None
        out.append(ChartSeries(key, module, int(b.attempt[i]), not bool(gone[i]), b.step[i:j], b.min[i:j],
                               b.max[i:j], b.last[i:j], b.count[i:j]))
    return out
