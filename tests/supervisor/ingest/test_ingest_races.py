"""Stored history is immutable under concurrency (issue 21): the database decides, not a
read-then-write in Python. Two overlapping batches of one attempt with different values, sent at
once from two threads through one Ingestor (as the daemon's threadpool runs them), on real SQLite
and PostgreSQL: exactly one is stored whole, the other is refused with 409, and what is read back
is the winner's values and nothing of the loser's. Before: 19/40 trials on SQLite and 34/40 on
PostgreSQL accepted both, and reads returned the second batch's values.

Also the silent drops of issue 21 item 7, and the body that answered 500 on PostgreSQL (item 3).
"""

from __future__ import annotations

import threading

import numpy as np
import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.testclient import TestClient

from thermowatch.monitors.columns import COLUMNS_CONTENT_TYPE, StepColumns
from thermowatch.monitors.contract import ContractError, RunInfo, StepRecord
from thermowatch.supervisor.serve.api.ingest import make_router
from thermowatch.supervisor.ingest.ingestor import HistoryConflict, Ingestor
from thermowatch.supervisor.store import thermometers
from tests.supervisor.auth_helpers import AUTH, guard

TRIALS = 20


def _batch(lo: int, hi: int, base: float) -> list[StepRecord]:
    return [StepRecord(step=s, values={"loss": base + s, "grad_norm": base - s}, sample_lo=s, sample_hi=s + 1,
                       tokens=64, wall_time=0.5) for s in range(lo, hi)]


def _race(ing: Ingestor, run: str, batches: list, columns: bool) -> list:
    """Each batch from its own thread, released together; each thread's outcome."""
    gate = threading.Barrier(len(batches))
    out: list = [None] * len(batches)

    def send(i: int) -> None:
        gate.wait()
        try:
            if columns:
                ing.write_columns(run, 0, StepColumns.from_records(batches[i]))
            else:
                ing.write(run, 0, batches[i])
            out[i] = "ok"
        except HistoryConflict as exc:
            out[i] = exc

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return out


@pytest.mark.parametrize("columns", [True, False], ids=["columns", "json-records"])
def test_overlapping_batches_at_once_one_wins_whole(db, columns):
    ing = Ingestor(db.sessions)
    twice = 0
    for t in range(TRIALS):
        run = f"race-{t}"
        ing.open_run(RunInfo(run, 0, world_size=1))
        a, b = _batch(0, 20, 1000.0), _batch(10, 30, 2000.0)
        out = _race(ing, run, [a, b], columns)
        twice += out == ["ok", "ok"]
        assert sorted(map(str, out)).count("ok") == 1, out  # one stored, the other refused
        winner = a if out[0] == "ok" else b
        with db.sessions() as s:
            steps, loss = thermometers.history(s, run, "loss")
        assert steps.tolist() == [r.step for r in winner]  # nothing of the loser's batch
        np.testing.assert_array_equal(loss, [r.values["loss"] for r in winner])
    assert twice == 0


def test_identical_batches_at_once_are_stored_once(db):
    ing = Ingestor(db.sessions)
    for t in range(5):
        run = f"same-{t}"
        ing.open_run(RunInfo(run, 0, world_size=1))
        out = _race(ing, run, [_batch(0, 20, 1.0), _batch(0, 20, 1.0)], columns=True)
        assert out == ["ok", "ok"]  # a retry of the same batch: nothing new, no error
        with db.sessions() as s:
            steps, _ = thermometers.history(s, run, "loss")
            n = s.execute(sa.text("select count(*) from steps where run_id = :r"), {"r": run}).scalar()
        assert steps.tolist() == list(range(20)) and n == 20


@pytest.fixture
def client(db):
    ing = Ingestor(db.sessions)
    ing.open_run(RunInfo("r", 0, world_size=1))
    app = FastAPI()
    app.include_router(make_router(ing, guard=guard(db.sessions)))
    with TestClient(app, headers=AUTH) as c:
        yield c


def _steps(c: TestClient, body=None, **kw):
    return c.post("/api/runs/r/attempts/0/steps", json=body, **kw)


def test_a_step_twice_in_one_batch_is_422_and_nothing_is_stored(db, client):
    r = _steps(client, {"records": [{"step": 1, "loss": 1.0}, {"step": 2, "loss": 2.0}, {"step": 1, "loss": 9.0}]})
    assert r.status_code == 422 and "step 1 appears 2 times" in r.json()["detail"]
    cols = StepColumns.from_records([StepRecord(step=s, values={"loss": 1.0}) for s in (5, 5)])
    r = client.post("/api/runs/r/attempts/0/steps", content=cols.encode(), headers={"content-type": COLUMNS_CONTENT_TYPE})
    assert r.status_code == 422 and "step 5 appears 2 times" in r.json()["detail"]
    with db.sessions() as s:
        assert thermometers.history(s, "r", "loss")[0].tolist() == []


@pytest.mark.parametrize("field,value", [("wall_time", 0.75), ("tokens", 65)])
def test_a_resend_differing_only_in_wall_time_or_tokens_is_409(client, field, value):
    rec = {"step": 3, "loss": 1.0, "wall_time": 0.5, "tokens": 64}
    assert _steps(client, {"records": [rec]}).status_code == 200
    assert _steps(client, {"records": [rec]}).status_code == 200  # the same re-sent: nothing new
    r = _steps(client, {"records": [{**rec, field: value}]})
    assert r.status_code == 409 and field in r.json()["detail"]


def test_steps_without_a_metric_are_stored_on_both_databases_and_the_next_batch_goes_on(db, client):
    """`{"records":[{"step":1023}]}` answered 500 on PostgreSQL (`series_id IN ()`), and the
    trainer's sink retried it forever; a columns batch of `keys: []` too."""
    assert _steps(client, {"records": [{"step": 1023}]}).status_code == 200
    empty = StepColumns.from_records([StepRecord(step=1024, values={}, sample_lo=8, sample_hi=9)])
    assert empty.keys == []
    r = client.post("/api/runs/r/attempts/0/steps", content=empty.encode(), headers={"content-type": COLUMNS_CONTENT_TYPE})
    assert r.status_code == 200, r.text
    assert _steps(client, {"records": [{"step": 1025, "loss": 1.5}]}).status_code == 200
    with db.sessions() as s:
        assert s.execute(sa.text("select count(*) from steps where run_id = 'r'")).scalar() == 3
        assert thermometers.history(s, "r", "loss")[0].tolist() == [1025]
    # stored history: a step with no metric re-sent with one is a conflict like any other change
    assert _steps(client, {"records": [{"step": 1023, "loss": 1.0}]}).status_code == 409


@pytest.mark.parametrize("run_id", [".", ".."])
def test_dot_run_ids_are_refused(db, run_id):
    ing = Ingestor(db.sessions)
    with pytest.raises(ContractError, match="relative path segment"):
        ing.open_run(RunInfo(run_id, 0, world_size=1))
