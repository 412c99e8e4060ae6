"""Rollups (supervisor/store/rollups.py) and the chart's data (supervisor/store/chart.py) on real
SQLite and PostgreSQL: every chart, at every zoom, equals a reference computed from the raw
points in numpy; a single spike and a NaN survive every zoom; abandoned attempts are kept;
retention never thins rollups; the backfill writes what ingest writes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import sqlalchemy as sa

from thermowatch.monitors.contract import RunInfo, StepRecord
from thermowatch.supervisor.store import chart as chart_store
from thermowatch.supervisor.store import rollups, runs, thermometers
from thermowatch.supervisor.store.orm import ThermometerRollup

RUN = "r"
KEYS = ["attn_logit_max/blocks.0.attn", "attn_logit_max/blocks.1.attn", "loss"]
# (attempt, first step, last step): rolled back to 2500 after diverging, then to 6001 (off any bucket edge)
ATTEMPTS = [(0, 0, 2999), (1, 2500, 6999), (2, 6001, 9999)]
SPIKE, SPIKE_STEP, NAN_STEP = 1e6, 2900, 2950  # in attempt 0's abandoned part


def _value(attempt: int, step: int, j: int) -> float:
    if attempt == 0 and step == SPIKE_STEP and j == 0:
        return SPIKE
    if attempt == 0 and step == NAN_STEP and j == 1:
        return math.nan
    if attempt == 2 and step == 8000 and j == 2:
        return -math.inf
    return math.sin(step * 0.37 + j) * (1 + attempt) + j


def _ingest(db, batch: int = 97) -> None:
    with db.sessions.begin() as s:
        for a, _, _ in ATTEMPTS:
            runs.open_attempt(s, RunInfo(RUN, a, world_size=1))
    for a, lo, hi in ATTEMPTS:
        for b in range(lo, hi + 1, batch):  # 97: batches straddle every span edge
            recs = []
            for st in range(b, min(b + batch, hi + 1)):
                values = {k: _value(a, st, j) for j, k in enumerate(KEYS)}
                if st % 10 == 3:  # a ragged batch: one series skips some steps
                    del values[KEYS[1]]
                recs.append(StepRecord(step=st, values=values))
            with db.sessions.begin() as s:
                thermometers.append(s, RUN, a, recs)


def _reference(db, keys, lo, hi, width, bucket_steps, attempts="all"):
    """{(key, attempt, current): (step, min, max, last, count)} from the raw points: each
    attempt's points from the next attempt's first step on are abandoned; buckets aligned to
    bucket_steps within the window widened to whole `width` buckets; NaN propagates."""
    wlo, whi = (lo, hi) if width == 1 else (lo // width * width, (hi // width + 1) * width - 1)
    with db.sessions() as s:
        per = {k: thermometers.history_by_attempt(s, RUN, k) for k in keys}
    firsts = {a: int(st[0]) for a, (st, _) in per[keys[0]].items()}
    out = {}
    for k, by_attempt in per.items():
        for a, (st, v) in by_attempt.items():
            cut = min((f for b, f in firsts.items() if b > a), default=math.inf)
            for current in (True, False) if attempts == "all" else (True,):
                m = (st >= wlo) & (st <= whi) & ((st < cut) if current else (st >= cut))
                s_, v_ = st[m], v[m]
                if not len(s_):
                    continue
                g = s_ // bucket_steps
                starts = np.flatnonzero(np.r_[True, np.diff(g) != 0])
                ends = np.r_[starts[1:], len(g)] - 1
                out[(k, a, current)] = (g[starts] * bucket_steps, np.minimum.reduceat(v_, starts),
                                        np.maximum.reduceat(v_, starts), v_[ends], np.diff(np.r_[starts, len(g)]))
    return out


def _check(db, metric, lo=None, hi=None, buckets=1000, attempts="all"):
    with db.sessions() as s:
        data = chart_store.chart(s, RUN, metric, lo, hi, buckets, attempts)
    keys = [k for k in KEYS if k == metric or k.startswith(metric + "/")]
    width, bs = chart_store.resolution(data.step_lo, data.step_hi, buckets)
    assert data.bucket_steps == bs and bs % width == 0
    ref = _reference(db, keys, data.step_lo, data.step_hi, width, bs, attempts)
    got = {(x.key, x.attempt, x.current): x for x in data.series}
    assert list(got) == sorted(got, key=lambda t: (t[0], t[1], not t[2]))  # by key, attempt, live first
    assert set(got) == set(ref)
    for name, x in got.items():
        step, mn, mx, last, count = ref[name]
        assert len(x.step) <= buckets
        np.testing.assert_array_equal(x.step, step, err_msg=str(name))
        np.testing.assert_array_equal(x.min, mn, err_msg=str(name))
        np.testing.assert_array_equal(x.max, mx, err_msg=str(name))
        np.testing.assert_array_equal(x.last, last, err_msg=str(name))
        np.testing.assert_array_equal(x.count, count, err_msg=str(name))
    return data


@pytest.fixture(params=[256, 4], ids=["span256", "span4"])
def ingested(db, request, monkeypatch):
    # span4: 16-step spans at width 4, so a 10^4-step history exercises every width up to 4096
    monkeypatch.setattr(rollups, "SPAN_BUCKETS", request.param)
    if request.param == 4:  # and series read in groups (of 2 and 1), merged back in key order
        monkeypatch.setattr(chart_store, "READ_GROUP", 2)
    _ingest(db)
    return db


@pytest.mark.timeout(120)
def test_every_zoom_matches_the_raw_points(ingested):
    db = ingested
    with db.sessions() as s:
        widths = {w for (w,) in s.execute(sa.select(ThermometerRollup.width).distinct())}
    assert 4 in widths and 16 in widths  # ingest wrote rollups, more than one width
    for metric in ("attn_logit_max", "loss", KEYS[1]):
        for lo, hi in ((None, None), (1234, 5678), (2450, 2650), (6000, 6001)):
            for buckets in (10, 37, 1000, 5000):
                data = _check(db, metric, lo, hi, buckets)
                if data.step_hi - data.step_lo + 1 <= buckets:  # full zoom: every point, exactly
                    assert data.bucket_steps == 1
                    assert all((x.count == 1).all() for x in data.series)
    _check(db, "attn_logit_max", attempts="current", buckets=100)


def test_a_spike_and_a_nan_survive_every_zoom_in_the_abandoned_attempt(ingested):
    db = ingested
    for buckets in (10, 50, 200, 1000, 5000):
        for lo, hi in ((None, None), (0, 4000), (2800, 3100)):
            with db.sessions() as s:
                data = chart_store.chart(s, RUN, "attn_logit_max", lo, hi, buckets)
            gone = {(x.key, x.attempt): x for x in data.series if not x.current}
            want = {(KEYS[0], 0), (KEYS[1], 0)} | ({(KEYS[0], 1), (KEYS[1], 1)} if hi is None else set())
            assert set(gone) == want  # attempt 1 was abandoned from 6001 on
            spike = gone[(KEYS[0], 0)]
            assert np.nanmax(spike.max) == SPIKE
            hit = np.searchsorted(spike.step, SPIKE_STEP, side="right") - 1
            assert spike.max[hit] == SPIKE and spike.step[hit] <= SPIKE_STEP < spike.step[hit] + data.bucket_steps
            nan = gone[(KEYS[1], 0)]
            b = np.searchsorted(nan.step, NAN_STEP, side="right") - 1
            assert math.isnan(nan.min[b]) and math.isnan(nan.max[b])
            live = {x.attempt for x in data.series if x.current and x.key == KEYS[0]}
            assert live == {None: {0, 1, 2}, 4000: {0, 1}, 3100: {1}}[hi] and not any(np.nanmax(x.max) == SPIKE for x in data.series if x.current)


def _rollup_rows(db):
    with db.sessions() as s:
        return sorted(tuple(r) for r in s.execute(sa.select(ThermometerRollup.__table__)).all())


def test_retention_thins_raw_chunks_never_rollups(db):
    _ingest(db)
    before = _rollup_rows(db)
    def live_1(data):  # attempt 1 inside whole rolled-up spans (no raw tail, no cut nearby)
        return [x for x in data.series if x.attempt == 1]

    with db.sessions() as s:
        wide = chart_store.chart(s, RUN, "attn_logit_max", 3072, 5119, buckets=10)
    with db.sessions.begin() as s:
        assert thermometers.downsample(s, RUN, older_than_step=10_000, every=50) > 0
    assert _rollup_rows(db) == before
    with db.sessions() as s:
        after = chart_store.chart(s, RUN, "attn_logit_max", 3072, 5119, buckets=10)
        assert len(thermometers.history(s, RUN, KEYS[0])[0]) < 1000  # the raw points are thinned
    assert len(live_1(wide)) == 2
    for x, y in zip(live_1(wide), live_1(after), strict=True):
        np.testing.assert_array_equal(x.count, y.count)  # counts of the raw points, from the rollups
        np.testing.assert_array_equal(x.max, y.max)


def test_backfill_writes_what_ingest_wrote_and_charts_read_raw_meanwhile(db):
    _ingest(db)
    before = _rollup_rows(db)
    with db.sessions() as s:
        full = chart_store.chart(s, RUN, "attn_logit_max", buckets=37)
    with db.sessions.begin() as s:
        s.execute(sa.delete(ThermometerRollup.__table__))
    with db.sessions() as s:  # no rollups: the same chart from the raw chunks
        raw = chart_store.chart(s, RUN, "attn_logit_max", buckets=37)
    for x, y in zip(full.series, raw.series, strict=True):
        assert (x.key, x.attempt, x.current) == (y.key, y.attempt, y.current)
        for f in ("step", "min", "max", "last", "count"):
            np.testing.assert_array_equal(getattr(x, f), getattr(y, f))
    with db.sessions.begin() as s:
        assert rollups.backfill(s, RUN, steps_per_pass=1000) > 0
    assert _rollup_rows(db) == before


def test_resolution_reads_at_most_four_times_the_buckets():
    for lo, hi in ((0, 999_999), (123, 456_789), (0, 9), (5, 5)):
        for buckets in (10, 1000, 5000):
            width, bs = chart_store.resolution(lo, hi, buckets)
            n_read = hi // width - lo // width + 1
            assert n_read >= buckets or width == 1
            assert width == 1 or n_read <= 4 * buckets + 4
            assert hi // bs - lo // bs + 1 <= buckets and bs % width == 0


def test_0010_then_db_rollups_backfills_history_stored_before_it(empty_url, capsys):
    """Chunks stored at 0009 (no rollups table yet) chart the same before and after `thermowatch
    db rollups`, which writes the rows ingest would have; downgrade drops only the rollups."""
    from thermowatch.supervisor import db as dbmod
    from thermowatch.cli import main

    engine = dbmod.make_engine(empty_url)
    try:
        dbmod.upgrade(engine, "0009")
        sessions = dbmod.make_sessionmaker(engine)
        with sessions.begin() as s:  # the run row as 0009 had it (no created_by until 0011)
            s.execute(sa.text("INSERT INTO runs (run_id, config, created_at) VALUES (:r, '{}', CURRENT_TIMESTAMP)"),
                      {"r": RUN})
            ids = thermometers.series_ids(s, KEYS[:2])
            vals = np.sin(np.arange(5000) * 0.1)
            thermometers._insert_chunks(s, [  # as ingest wrote them before rollups existed
                (RUN, ids[k], 0, b, b + 49, 50, None, (vals[b:b + 50] + j).tobytes(), None)  # _COLS order
                for j, k in enumerate(KEYS[:2]) for b in range(0, 5000, 50)])
            thermometers._register(s, RUN, ids.values(), None)
        dbmod.upgrade(engine)
        with sessions() as s:
            before = chart_store.chart(s, RUN, "attn_logit_max", buckets=100)
        assert main(["db", "rollups", "--db", empty_url]) == 0
        assert f"{RUN}: " in capsys.readouterr().out
        with sessions() as s:
            after = chart_store.chart(s, RUN, "attn_logit_max", buckets=100)
            assert s.execute(sa.select(sa.func.count()).select_from(ThermometerRollup)).scalar() > 0
        for x, y in zip(before.series, after.series, strict=True):
            for f in ("step", "min", "max", "last", "count"):
                np.testing.assert_array_equal(getattr(x, f), getattr(y, f))
        dbmod.downgrade(engine, "0009")
        assert "thermometer_rollups" not in sa.inspect(engine).get_table_names()
        with sessions() as s:
            assert len(thermometers.history(s, RUN, KEYS[0])[0]) == 5000
    finally:
        engine.dispose()
