"""Thermometer storage on real SQLite and PostgreSQL: round trips, NaN/Inf, idempotency,
attempts, ranks, ragged batches, retention."""

from __future__ import annotations

import math

import numpy as np
import pytest
import sqlalchemy as sa

from thermowatch.monitors.contract import RunInfo, StepRecord
from thermowatch.supervisor.store import runs, thermometers
from thermowatch.supervisor.store.orm import ThermometerChunk


def _open(db, run_id="r", attempts=(0,)):
    with db.sessions.begin() as s:
        for a in attempts:
            runs.open_attempt(s, RunInfo(run_id, a, world_size=2))


def _recs(steps, keys, fn=lambda step, j: step + j / 1000, ranks=None):
    return [StepRecord(step=st, values={k: fn(st, j) for j, k in enumerate(keys)}, ranks=dict(ranks or {})) for st in steps]


def _append(db, recs, run_id="r", attempt=0):
    with db.sessions.begin() as s:
        return thermometers.append(s, run_id, attempt, recs)


def _chunks(db) -> int:
    with db.sessions() as s:
        return s.execute(sa.select(sa.func.count()).select_from(ThermometerChunk)).scalar()


KEYS = ["loss", "grad_norm", "attn_logit_max/blocks.0.attn", "act_min/blocks.1.mlp"]


def test_round_trip_and_step_range(db):
    _open(db)
    assert _append(db, _recs(range(0, 50), KEYS)) == 50 * len(KEYS)
    _append(db, _recs(range(50, 100), KEYS))
    with db.sessions() as s:
        steps, vals = thermometers.history(s, "r", "attn_logit_max/blocks.0.attn")
        assert steps.dtype == np.int64 and vals.dtype == np.float64
        np.testing.assert_array_equal(steps, np.arange(100))
        np.testing.assert_array_equal(vals, np.arange(100) + 2 / 1000)
        steps, vals = thermometers.history(s, "r", "loss", step_lo=45, step_hi=55)
        np.testing.assert_array_equal(steps, np.arange(45, 56))
        assert thermometers.history(s, "r", "no_such_metric")[0].size == 0
        assert thermometers.history(s, "other-run", "loss")[0].size == 0
        assert thermometers.series_keys(s, "r") == sorted(KEYS)


def test_nan_and_inf_are_stored_bit_exact(db):
    _open(db)
    special = [math.nan, math.inf, -math.inf, 0.0, -0.0, 1e308, 5e-324]
    recs = [StepRecord(step=i, values={"loss": v}) for i, v in enumerate(special)]
    _append(db, recs)
    with db.sessions() as s:
        _, vals = thermometers.history(s, "r", "loss")
    assert vals.tobytes() == np.array(special).tobytes()


def test_retried_batch_stores_nothing_twice(db):
    _open(db)
    batch = _recs(range(10), KEYS)
    _append(db, batch)
    n = _chunks(db)
    _append(db, batch)  # the sink retried after a lost response
    assert _chunks(db) == n == len(KEYS)
    # a replay that cuts the same steps into different batches: duplicates are dropped on read
    _append(db, _recs(range(5, 15), KEYS))
    with db.sessions() as s:
        steps, vals = thermometers.history(s, "r", "loss")
    np.testing.assert_array_equal(steps, np.arange(15))
    np.testing.assert_array_equal(vals, np.arange(15.0))


def test_later_attempt_wins_for_the_same_step(db):
    _open(db, attempts=(0, 1))
    _append(db, _recs(range(0, 100), ["loss"], fn=lambda st, j: 1.0), attempt=0)
    # rollback to step 60: attempt 1 re-trains 60..79
    _append(db, _recs(range(60, 80), ["loss"], fn=lambda st, j: 2.0), attempt=1)
    with db.sessions() as s:
        steps, vals = thermometers.history(s, "r", "loss")
        np.testing.assert_array_equal(steps, np.arange(100))
        assert (vals[60:80] == 2.0).all() and (vals[:60] == 1.0).all() and (vals[80:] == 1.0).all()
        steps, vals = thermometers.history(s, "r", "loss", 70, 90)
        np.testing.assert_array_equal(steps, np.arange(70, 91))
        assert (vals[:10] == 2.0).all() and (vals[10:] == 1.0).all()


def test_history_by_attempt_keeps_the_superseded_trajectory(db):
    _open(db, attempts=(0, 1, 2))
    # attempt 0 diverges from step 50 on; a rollback to 40 re-trains 40..60 in attempt 1
    _append(db, _recs(range(40), ["loss"], fn=lambda st, j: 1.0), attempt=0)
    _append(db, _recs(range(40, 61), ["loss"], fn=lambda st, j: 1.0 if st < 50 else 10.0 ** (st - 49)), attempt=0)
    _append(db, _recs(range(40, 61), ["loss"], fn=lambda st, j: 2.0), attempt=1)
    _append(db, _recs(range(45, 55), ["loss"], fn=lambda st, j: 2.0), attempt=1)  # a re-batched replay
    _append(db, _recs(range(55, 58), ["loss"], fn=lambda st, j: 3.0), attempt=2)  # a second rollback
    _append(db, _recs(range(3), ["lr"]), attempt=0)  # another series: not mixed in
    with db.sessions() as s:
        by = thermometers.history_by_attempt(s, "r", "loss")
        assert list(by) == [0, 1, 2]
        np.testing.assert_array_equal(by[0][0], np.arange(61))
        assert by[0][0].dtype == np.int64 and by[0][1].dtype == np.float64
        assert by[0][1][60] == 1e11 and (by[0][1][50:] > 1).all() and (by[0][1][:50] == 1.0).all()
        np.testing.assert_array_equal(by[1][0], np.arange(40, 61))  # the replay's duplicates are dropped
        assert (by[1][1] == 2.0).all()
        np.testing.assert_array_equal(by[2][0], [55, 56, 57])
        # history() is unchanged: the newest attempt wins each step
        steps, vals = thermometers.history(s, "r", "loss")
        np.testing.assert_array_equal(steps, np.arange(61))
        assert (vals[:40] == 1.0).all() and (vals[40:55] == 2.0).all() and (vals[55:58] == 3.0).all()
        assert (vals[58:] == 2.0).all()
        # split_superseded: current == history(), the rest per attempt
        (cs, cv), sup = thermometers.split_superseded(by)
        np.testing.assert_array_equal(cs, steps)
        np.testing.assert_array_equal(cv, vals)
        assert list(sup) == [0, 1]
        np.testing.assert_array_equal(sup[0][0], np.arange(40, 61))
        np.testing.assert_array_equal(sup[0][1], by[0][1][40:])
        np.testing.assert_array_equal(sup[1][0], [55, 56, 57])
        # a window cuts every attempt alike
        win = thermometers.history_by_attempt(s, "r", "loss", 50, 56)
        np.testing.assert_array_equal(win[0][0], np.arange(50, 57))
        np.testing.assert_array_equal(win[0][1], 10.0 ** np.arange(1, 8))
        np.testing.assert_array_equal(win[1][0], np.arange(50, 57))
        np.testing.assert_array_equal(win[2][0], [55, 56])
        assert thermometers.history_by_attempt(s, "r", "loss", 100, 200) == {}
        assert thermometers.history_by_attempt(s, "r", "no_such_metric") == {}
        assert list(thermometers.history_by_attempt(s, "r", "lr")) == [0]
        (cs, _), sup = thermometers.split_superseded({})
        assert cs.size == 0 and sup == {}


def test_ranks_are_kept_per_point(db):
    _open(db)
    key = "attn_logit_max/blocks.0.attn"
    recs = _recs(range(4), [key, "loss"])
    recs[2].ranks[key] = 7
    _append(db, recs)
    with db.sessions() as s:
        steps, _, ranks = thermometers.history_with_ranks(s, "r", key)
        np.testing.assert_array_equal(ranks, [-1, -1, 7, -1])
        _, _, ranks = thermometers.history_with_ranks(s, "r", "loss")
        np.testing.assert_array_equal(ranks, [-1] * 4)


def test_ragged_batch_keeps_absent_apart_from_nan(db):
    _open(db)
    recs = [
        StepRecord(step=0, values={"loss": 1.0}),
        StepRecord(step=1, values={"loss": math.nan, "z/head": 3.0}),
        StepRecord(step=2, values={"z/head": 4.0, "loss": 2.0}),
    ]
    assert _append(db, recs) == 5
    with db.sessions() as s:
        steps, vals = thermometers.history(s, "r", "z/head")
        np.testing.assert_array_equal(steps, [1, 2])
        np.testing.assert_array_equal(vals, [3.0, 4.0])
        steps, vals = thermometers.history(s, "r", "loss")
        np.testing.assert_array_equal(steps, [0, 1, 2])
        assert vals[0] == 1.0 and math.isnan(vals[1]) and vals[2] == 2.0


def test_unsorted_batch_with_repeated_step(db):
    _open(db)
    recs = [StepRecord(step=s, values={"loss": float(s)}) for s in (3, 1, 2, 1)]
    _append(db, recs)
    with db.sessions() as s:
        steps, vals = thermometers.history(s, "r", "loss")
    np.testing.assert_array_equal(steps, [1, 2, 3])
    np.testing.assert_array_equal(vals, [1.0, 2.0, 3.0])


def test_latest_step_follows_the_newest_attempt(db):
    from thermowatch.supervisor.store import steps as steps_store

    _open(db, attempts=(0, 1))
    with db.sessions.begin() as s:
        assert thermometers.latest_step(s, "r") is None
        steps_store.record_steps(s, "r", 0, _recs(range(100), ["loss"]))
        assert thermometers.latest_step(s, "r") == 99
        steps_store.record_steps(s, "r", 1, _recs(range(60, 70), ["loss"]))
        assert thermometers.latest_step(s, "r") == 69


def test_downsample_keeps_spikes_and_is_idempotent(db):
    _open(db)
    keys = ["attn_logit_max/blocks.0.attn", "act_min/blocks.0.mlp", "lr"]
    flat = lambda st, j: 1.0  # noqa: E731
    for lo in range(0, 1000, 50):
        recs = _recs(range(lo, lo + 50), keys, fn=flat)
        if lo == 300:
            recs[7].values[keys[0]] = 99.0  # step 307: a spike in a max-reduced metric
            recs[8].values[keys[1]] = -99.0  # step 308: a dip in a min-reduced metric
            recs[9].values["lr"] = math.nan  # step 309
        _append(db, recs)
    with db.sessions.begin() as s:
        removed = thermometers.downsample(s, "r", older_than_step=800, every=10)
    assert removed == 3 * (800 - 80)
    with db.sessions() as s:
        steps, vals = thermometers.history(s, "r", keys[0])
        assert len(steps) == 80 + 200 and 307 in steps and vals[steps == 307][0] == 99.0
        np.testing.assert_array_equal(steps[80:], np.arange(800, 1000))
        steps, vals = thermometers.history(s, "r", keys[1])
        assert vals[steps == 308][0] == -99.0
        steps, vals = thermometers.history(s, "r", "lr")
        assert 309 in steps and math.isnan(vals[steps == 309][0])  # non-finite always survives
        assert 0 in steps and 10 in steps and 1 not in steps
    n = _chunks(db)
    with db.sessions.begin() as s:
        assert thermometers.downsample(s, "r", older_than_step=800, every=10) == 0
    assert _chunks(db) == n
    with pytest.raises(ValueError, match="every"):
        with db.sessions.begin() as s:
            thermometers.downsample(s, "r", 800, 0)


def test_series_dictionary_is_shared_between_runs(db):
    _open(db, run_id="a")
    _open(db, run_id="b")
    _append(db, _recs(range(3), ["loss"]), run_id="a")
    _append(db, _recs(range(3), ["loss", "lr"], fn=lambda st, j: -1.0), run_id="b")
    with db.sessions() as s:
        assert thermometers.series_keys(s, "a") == ["loss"]
        assert thermometers.series_keys(s, "b") == ["loss", "lr"]
        np.testing.assert_array_equal(thermometers.history(s, "a", "loss")[1], [0.0, 1.0, 2.0])
        np.testing.assert_array_equal(thermometers.history(s, "b", "loss")[1], [-1.0] * 3)
        assert s.execute(sa.text("select count(*) from series")).scalar() == 2


def test_gappy_steps_and_compaction_keep_every_point(db):
    _open(db, attempts=(0, 1))
    for lo in range(0, 3000, 100):  # logged every 2nd step: chunks carry explicit steps
        _append(db, _recs(range(lo, lo + 100, 2), ["loss"]))
    _append(db, _recs(range(3000, 3050), ["loss"]))  # contiguous: steps stored as NULL
    _append(db, _recs(range(1000, 1010), ["loss"], fn=lambda st, j: -1.0), attempt=1)
    with db.sessions() as s:
        before = thermometers.history(s, "r", "loss")
    assert _chunks(db) == 32
    with db.sessions.begin() as s:
        assert thermometers.downsample(s, "r", older_than_step=10**9, every=1) == 0  # compaction only
    assert _chunks(db) == 2  # one per attempt
    with db.sessions() as s:
        after = thermometers.history(s, "r", "loss")
        np.testing.assert_array_equal(before[0], after[0])
        np.testing.assert_array_equal(before[1], after[1])
        assert after[1][after[0] == 1004][0] == -1.0 and after[1][after[0] == 1010][0] == 1010.0
        steps, _ = thermometers.history(s, "r", "loss", 2990, 3005)
        np.testing.assert_array_equal(steps, [2990, 2992, 2994, 2996, 2998, 3000, 3001, 3002, 3003, 3004, 3005])
