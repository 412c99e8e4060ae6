"""Ingest in-process (Ingestor) and over HTTP (the router), on real SQLite and PostgreSQL."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.testclient import TestClient

from thermowatch.monitors.contract import CheckpointInfo, ContractError, FinishReason, RunFinished, RunInfo, StepRecord
from thermowatch.supervisor.serve.api.ingest import make_router
from thermowatch.supervisor.ingest.ingestor import BatchTooLarge, HistoryConflict, IngestLimits, Ingestor, UnknownRun
from thermowatch.supervisor.store import audit, checkpoints, runs, thermometers
from thermowatch.supervisor.store import steps as steps_store
from tests.supervisor.auth_helpers import AUTH, bearer, guard, make_token

KEYS = ["loss", "attn_logit_max/blocks.0.attn", "act_max/blocks.0.mlp"]


def _recs(lo, hi, keys=KEYS):
    return [StepRecord(step=s, values={k: s + j / 10 for j, k in enumerate(keys)}, sample_lo=4 * s, sample_hi=4 * s + 4,
                       tokens=4096, wall_time=0.5, ranks={keys[-1]: s % 2}) for s in range(lo, hi)]


def _counts(db) -> tuple[int, int]:
    with db.sessions() as s:
        return (s.execute(sa.text("select count(*) from steps")).scalar(),
                s.execute(sa.text("select count(*) from thermometer_chunks")).scalar())


@pytest.fixture
def seen():
    return []


@pytest.fixture
def ingestor(db, seen):
    return Ingestor(db.sessions, on_records=lambda run, att, cols: seen.append((run, att, cols.steps.tolist())),
                    limits=IngestLimits(max_records=100, max_values=1000))


def test_write_then_read_back(db, ingestor, seen):
    ingestor.open_run(RunInfo("r", 0, world_size=2))
    assert ingestor.write("r", 0, _recs(0, 10)) == 30
    ingestor.write("r", 0, _recs(0, 10))  # retried batch: a no-op, and not judged again
    assert _counts(db) == (10, 3)
    assert seen == [("r", 0, list(range(10)))]
    with db.sessions() as s:
        steps, vals, ranks = thermometers.history_with_ranks(s, "r", KEYS[-1])
        np.testing.assert_array_equal(steps, np.arange(10))
        np.testing.assert_array_equal(ranks, np.arange(10) % 2)
        assert steps_store.sample_range(s, "r", 2, 3) == (8, 16)


def test_bad_input_stores_nothing(db, ingestor, seen):
    with pytest.raises(UnknownRun, match="unknown run 'r'"):
        ingestor.write("r", 0, _recs(0, 2))
    ingestor.open_run(RunInfo("r", 0, world_size=2))
    with pytest.raises(UnknownRun, match="no attempt 1"):
        ingestor.write("r", 1, _recs(0, 2))
    bad = _recs(0, 3)
    bad[2].values["loss"] = "high"
    with pytest.raises(ContractError, match="step 2: metric 'loss' must be a number"):
        ingestor.write("r", 0, bad)
    bad = _recs(0, 3)
    bad[1].step = -5
    with pytest.raises(ContractError, match="'step'"):
        ingestor.write("r", 0, bad)
    bad = _recs(0, 3)
    bad[0].sample_hi = 2**64
    with pytest.raises(ContractError, match="'sample_hi'"):
        ingestor.write("r", 0, bad)
    with pytest.raises(BatchTooLarge, match="101 records"):
        ingestor.write("r", 0, _recs(0, 101, keys=["loss"]))
    with pytest.raises(BatchTooLarge, match="values"):
        ingestor.write("r", 0, _recs(0, 20, keys=[f"k{i}" for i in range(60)]))
    with pytest.raises(ContractError, match="world_size"):
        ingestor.open_run(RunInfo("r2", 0, world_size=0))
    with pytest.raises(ContractError, match="healthy"):
        ingestor.checkpoint_saved("r", 0, CheckpointInfo(1, "/p", 1, healthy="yes"))
    assert _counts(db) == (0, 0) and seen == []


def test_one_transaction_per_batch(db, ingestor, monkeypatch):
    ingestor.open_run(RunInfo("r", 0, world_size=2))

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(thermometers, "append_columns", boom)  # fails after the steps rows were written
    with pytest.raises(RuntimeError):
        ingestor.write("r", 0, _recs(0, 5))
    monkeypatch.undo()
    assert _counts(db) == (0, 0)
    ingestor.write("r", 0, _recs(0, 5))
    assert _counts(db) == (5, 3)


def test_on_records_failure_does_not_undo_the_batch(db):
    def broken(*a):
        raise ZeroDivisionError

    ing = Ingestor(db.sessions, on_records=broken)
    ing.open_run(RunInfo("r", 0, world_size=1))
    ing.write("r", 0, _recs(0, 3))
    assert _counts(db) == (3, 3)


def test_checkpoint_saved(db, ingestor):
    ingestor.open_run(RunInfo("r", 0, world_size=2))
    ingestor.checkpoint_saved("r", 0, CheckpointInfo(100, "/ck/100", 400, True, {"skip_ranges": []}))
    ingestor.checkpoint_saved("r", 0, CheckpointInfo(100, "/ck/100", 400, True))
    with db.sessions() as s:
        assert [(c.step, c.path, c.healthy) for c in checkpoints.checkpoints(s, "r")] == [(100, "/ck/100", True)]


# --- HTTP ------------------------------------------------------------------------------------------


@pytest.fixture
def client(ingestor, db):
    app = FastAPI()
    app.include_router(make_router(ingestor, guard=guard(db.sessions), max_body_bytes=20_000))
    trainer = make_token(db.sessions, "trainer", "ingest")
    with TestClient(app, raise_server_exceptions=False, headers=bearer(trainer)) as c:
        yield c


RUN = {"run_id": "r", "attempt": 0, "world_size": 2, "hosts": {"0": "n0"}, "config": {"lr": 1e-3}}
STEPS = "/api/runs/r/attempts/0/steps"


def test_http_round_trip_with_nan_literals(db, client, seen):
    assert client.post("/api/runs", json=RUN).status_code == 201
    recs = [StepRecord(step=i, values={"loss": v}) for i, v in enumerate([1.0, math.nan, math.inf, -math.inf])]
    body = json.dumps({"records": [r.to_json() for r in recs]})  # Python's json: NaN, Infinity
    assert "NaN" in body and "-Infinity" in body
    r = client.post(STEPS, content=body)
    assert r.status_code == 200 and r.json() == {"ok": True, "records": 4, "values": 4}
    r = client.post(STEPS, content=json.dumps({"records": [{"step": 4, "loss": None}]}))
    assert r.status_code == 200
    with db.sessions() as s:
        _, vals = thermometers.history(s, "r", "loss")
    assert vals[0] == 1.0 and math.isnan(vals[1]) and vals[2] == math.inf and vals[3] == -math.inf and math.isnan(vals[4])
    ck = {"step": 3, "path": "/ck/3", "sample_cursor": 12, "healthy": True}
    assert client.post("/api/runs/r/attempts/0/checkpoints", json=ck).status_code == 201
    assert seen[0][2] == [0, 1, 2, 3]


@pytest.mark.parametrize(
    "path,body,status,needle",
    [
        (STEPS, {"records": [{"step": 1, "loss": 1.0}]}, 404, "unknown run 'r'"),
        ("/api/runs/r/attempts/0/checkpoints", {"step": 1, "path": "/p", "sample_cursor": 0, "healthy": True}, 404, "unknown run"),
        ("/api/runs", {"run_id": "r", "attempt": "zero", "world_size": 2}, 422, "'attempt'"),
        ("/api/runs", {"attempt": 0, "world_size": 2}, 422, "'run_id'"),
        ("/api/runs", [1, 2], 422, "JSON object"),
    ],
)
def test_http_errors_before_open(db, client, path, body, status, needle):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"]


@pytest.mark.parametrize(
    "body,status,needle",
    [
        (b'{"records": [{"step": 1, "loss": "x"}]}', 422, "metric 'loss' must be a number"),
        (b'{"records": [{"step": -1, "loss": 1}]}', 422, "'step'"),
        (b'{"records": [{"step": 1, "tokens": "many"}]}', 422, "records[0]"),
        (b'{"records": [{"step": 1, "ranks": {"loss": "r0"}}]}', 422, "records[0]"),
        (b'{"records": [{"step": 1, "ranks": [1]}]}', 422, "'ranks'"),
        (b'{"records": [{"step": 1, "ranks": false}]}', 422, "'ranks'"),  # was taken for {} (issue 21)
        (b'{"records": [{"step": 1, "wall_time": 1.8e308}]}', 422, "within +-1e+15"),  # finite, no clock
        (b'{"records": [{"step": 1, "wall_time": -1.0000001e15}]}', 422, "within +-1e+15"),
        (b'{"records": {"step": 1}}', 422, '{"records": [...]}'),
        (b'{"records": [{"step": 1, "loss": 1', 400, "not valid JSON"),
        (b"\xff\xfe", 400, "not valid JSON"),
        (b'{"records": [' + b'{"step": 1, "loss": 1.0},' * 2000 + b'{"step": 2}]}', 413, "exceeds the limit"),
        (json.dumps({"records": [{"step": i, "loss": 1.0} for i in range(101)]}).encode(), 413, "101 records"),
    ],
)
def test_http_bad_batches_are_4xx_and_store_nothing(db, client, body, status, needle):
    assert client.post("/api/runs", json=RUN).status_code == 201
    r = client.post(STEPS, content=body)
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"]
    assert _counts(db) == (0, 0)
    assert client.post(STEPS, json={"records": [{"step": 1, "loss": 1.0}]}).status_code == 200  # still up
    r = client.post(STEPS, json={"records": [{"step": 2, "wall_time": 1e15, "ranks": None}]})  # the bound is inclusive
    assert r.status_code == 200, r.text


def test_http_chunked_oversized_body_and_bad_attempt(db, client):
    assert client.post("/api/runs", json=RUN).status_code == 201

    def chunks():  # no Content-Length: the limit is enforced while streaming
        yield b'{"records": ['
        for _ in range(1000):
            yield b'{"step": 1, "loss": 1.0},'
        yield b'{"step": 2}]}'

    r = client.post(STEPS, content=chunks())
    assert r.status_code == 413 and "exceeds the limit" in r.json()["detail"]
    r = client.post("/api/runs/r/attempts/first/steps", json={"records": []})
    assert r.status_code == 422 and r.json()["detail"] == "attempt must be a non-negative integer of at most 2**31-1, got 'first'"
    assert _counts(db) == (0, 0)


def test_http_token(ingestor, db):
    app = FastAPI()
    app.include_router(make_router(ingestor, guard=guard(db.sessions)))
    reader = make_token(db.sessions, "reader", "read")
    with TestClient(app) as c:
        assert c.post("/api/runs", json=RUN).status_code == 401
        assert c.post("/api/runs", json=RUN, headers={"authorization": "Bearer nope"}).status_code == 401
        r = c.post("/api/runs", json=RUN, headers=bearer(reader))
        assert r.status_code == 403 and "`ingest` scope" in r.json()["detail"]
        with db.sessions() as s:
            assert s.execute(sa.text("select count(*) from runs")).scalar() == 0
        assert c.post("/api/runs", json=RUN, headers=AUTH).status_code == 201


def test_values_the_database_would_choke_on_are_4xx(db, client):
    assert client.post("/api/runs", json=RUN).status_code == 201
    for body, needle in [
        (b'{"records": [{"step": 1, "loss": 1' + b"0" * 400 + b"}]}", "records[0]"),  # int beyond float64
        (json.dumps({"records": [{"step": 1, ("m" * 101): 1.0}]}).encode(), "at most 100"),
        (json.dumps({"records": [{"step": 1, "act_max/" + "x" * 301: 1.0}]}).encode(), "module"),
        (json.dumps({"records": [{"step": 1, "/blocks.0": 1.0}]}).encode(), "non-empty metric"),
        (json.dumps({"records": [{"step": 1, "loss": 1.0, "ranks": {"loss": 2**40}}]}).encode(), "ranks['loss']"),
        (json.dumps({"records": [{"step": 2**63, "loss": 1.0}]}).encode(), "'step'"),
    ]:
        r = client.post(STEPS, content=body)
        assert r.status_code == 422, (needle, r.text)
        assert needle in r.json()["detail"]
    assert _counts(db) == (0, 0)


def test_in_process_int_too_large_for_float(db, ingestor):
    ingestor.open_run(RunInfo("r", 0, world_size=1))
    with pytest.raises(ContractError, match="too large"):
        ingestor.write("r", 0, [StepRecord(step=1, values={"loss": 10**400})])
    assert _counts(db) == (0, 0)


def test_stored_history_is_immutable(db, ingestor, seen):
    """A re-send that overlaps stored steps: identical points are dropped (only the new steps are
    stored and judged); any difference is refused naming step and series, and nothing of that
    batch is stored. The same on SQLite and PostgreSQL (PostgreSQL used to read back the new value)."""
    ingestor.open_run(RunInfo("r", 0, world_size=1))
    ingestor.write("r", 0, _recs(0, 10))
    ingestor.write("r", 0, _recs(5, 15))  # re-batched overlap: 5..9 identical, 10..14 new
    assert seen == [("r", 0, list(range(10))), ("r", 0, list(range(10, 15)))]
    changed = _recs(6, 20)
    changed[0].values["loss"] = 99.0
    with pytest.raises(HistoryConflict, match=r"step 6, series 'loss': stored 6\.0, this write says 99\.0"):
        ingestor.write("r", 0, changed)
    extra = _recs(14, 16)
    extra[0].values["grad_norm"] = 1.0  # a point added to a stored step changes history too
    with pytest.raises(HistoryConflict, match="step 14, series 'grad_norm': stored nothing"):
        ingestor.write("r", 0, extra)
    moved = _recs(3, 4)
    moved[0].sample_lo += 1
    with pytest.raises(HistoryConflict, match="step 3 is already stored with samples"):
        ingestor.write("r", 0, moved)
    nan = [StepRecord(step=20, values={"loss": math.nan}, sample_lo=80, sample_hi=84)]
    ingestor.write("r", 0, nan)
    ingestor.write("r", 0, nan)  # NaN equals NaN here: a stored NaN re-sent is identical
    with db.sessions() as s:
        steps, vals = thermometers.history(s, "r", "loss")
    np.testing.assert_array_equal(steps, list(range(15)) + [20])
    np.testing.assert_array_equal(vals[:15], np.arange(15.0))
    assert math.isnan(vals[-1])
    assert [r[2] for r in seen] == [list(range(10)), list(range(10, 15)), [20]]
    ingestor.open_run(RunInfo("r", 1, world_size=1, start_step=5))
    ingestor.write("r", 1, changed)  # a retrained step under a new attempt is new history
    with db.sessions() as s:
        assert thermometers.history(s, "r", "loss")[1][6] == 99.0


def test_http_conflicting_resend_is_409(db, client):
    assert client.post("/api/runs", json={"run_id": "r", "attempt": 0, "world_size": 1}).status_code in (200, 201)
    body = {"records": [r.to_json() for r in _recs(0, 3)]}
    assert client.post("/api/runs/r/attempts/0/steps", json=body).status_code < 300
    assert client.post("/api/runs/r/attempts/0/steps", json=body).status_code < 300  # identical: no-op
    body["records"][1]["loss"] = -1.0
    r = client.post("/api/runs/r/attempts/0/steps", json=body)
    assert r.status_code == 409 and "step 1, series 'loss'" in r.text
    with db.sessions() as s:
        np.testing.assert_array_equal(thermometers.history(s, "r", "loss")[1], [0.0, 1.0, 2.0])


def test_batch_around_a_stored_step_is_not_a_resend(db, ingestor):
    """Found by tests/supervisor/serve/test_fuzz.py: a batch of steps 3 and 10 after step 5 was stored
    asked the store for steps 3..10, found 5, re-sent nothing, and took min() of nothing (a 500)."""
    ingestor.open_run(RunInfo("r", 0, world_size=1))
    ingestor.write("r", 0, _recs(5, 6))
    assert ingestor.write("r", 0, _recs(3, 4) + _recs(10, 11)) == 6
    assert _counts(db)[0] == 3


def test_a_deleted_checkpoints_reason_is_bounded_as_documented():
    """The OpenAPI says reason <= 10,000 characters (issue 21: a longer one was stored and cut)."""
    from thermowatch.supervisor.ingest.ingestor import MAX_DELETED_REASON, deleted_from_json

    assert deleted_from_json({"steps": [3], "reason": "x" * MAX_DELETED_REASON}) == ([3], "x" * 200)
    with pytest.raises(ContractError, match="reason"):
        deleted_from_json({"steps": [3], "reason": "x" * (MAX_DELETED_REASON + 1)})


# --- an attempt says it finished (issue 22, item 9) -------------------------------------------------

FINISHED = "/api/runs/r/attempts/0/finished"


def test_http_finished_is_idempotent_and_once(db, client):
    """200 and stored with its NaN loss; the same report again is 200; a different one 409 and
    the first stays; unknown run or attempt 404; a bad body 422; the body is bounded."""
    body = '{"step": 7, "final_loss": NaN, "reason": "closed"}'  # Python's json writes a NaN loss so
    assert client.post(FINISHED, content=body).status_code == 404  # before the run is opened
    assert client.post("/api/runs", json=RUN).status_code == 201
    assert client.post("/api/runs/r/attempts/1/finished", content=body).status_code == 404
    r = client.post(FINISHED, content=body)
    assert r.status_code == 200 and r.json() == {"ok": True}
    r = client.post(FINISHED, content=body)
    assert r.status_code == 200, r.text  # a re-send (a retry, a replayed spool)
    r = client.post(FINISHED, json={"step": 7, "final_loss": 2.5, "reason": "closed"})
    assert r.status_code == 409 and "already finished at step 7" in r.json()["detail"]
    for bad, needle in [({"step": -1, "final_loss": 1.0, "reason": "closed"}, "'step'"),
                        ({"step": 1, "final_loss": "low", "reason": "closed"}, "'final_loss'"),
                        ({"step": 1, "final_loss": 1.0, "reason": "done"}, "'reason'"),
                        ({"step": 1, "final_loss": 1.0}, "'reason'"), ([7], "JSON object")]:
        r = client.post(FINISHED, json=bad)
        assert r.status_code == 422 and needle in r.json()["detail"], (bad, r.text)
    route = client.app.openapi()["paths"]["/api/runs/{run_id}/attempts/{attempt}/finished"]["post"]
    assert route["x-max-body-bytes"] == 4096  # supervisor.serve.body's middleware refuses more with 413
    with db.sessions() as s:
        (att,) = runs.attempts(s, "r")
        got = att.finished
        assert att.finished_at is not None and (got.step, got.reason.value) == (7, "closed")
        assert math.isnan(got.final_loss)  # kept on both databases (SQLite stores NaN as text)
        events = [e.event for e in audit.events(s, "r", "run_finished")]
    assert events == ["run_finished"]  # the re-send is no new event


def test_finish_run_in_process(db, ingestor):
    ingestor.open_run(RunInfo("r", 0, world_size=1))
    with pytest.raises(UnknownRun):
        ingestor.finish_run("r", 3, RunFinished(1, None, FinishReason.COMPLETED))
    ingestor.finish_run("r", 0, RunFinished(10, -math.inf, FinishReason.COMPLETED))
    ingestor.finish_run("r", 0, RunFinished(10, -math.inf, "completed"))
    with pytest.raises(HistoryConflict):
        ingestor.finish_run("r", 0, RunFinished(10, -math.inf, "stopped"))
    with db.sessions() as s:
        assert runs.latest_attempt(s, "r").finished == RunFinished(10, -math.inf, FinishReason.COMPLETED)
