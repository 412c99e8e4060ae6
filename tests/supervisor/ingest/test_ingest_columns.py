"""The steps batch as columns (monitors.columns, issue 10): what the HttpSink sends. The same
checks, immutability and judged-once rules as the per-step JSON form, on SQLite and PostgreSQL."""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from thermowatch.monitors.columns import COLUMNS_CONTENT_TYPE, StepColumns, as_records
from thermowatch.monitors.contract import RunInfo, StepRecord
from thermowatch.supervisor.serve.api.ingest import make_router
from thermowatch.supervisor.ingest.ingestor import HistoryConflict, IngestLimits, Ingestor
from thermowatch.supervisor.store import thermometers
from thermowatch.supervisor.store import steps as steps_store
from tests.supervisor.auth_helpers import bearer, guard, make_token
from tests.supervisor.ingest.test_ingest import KEYS, RUN, STEPS, _counts, _recs

COLS = {"content-type": COLUMNS_CONTENT_TYPE}
# NaN with a payload, both infinities and a negative zero: raw IEEE bytes must survive.
ODD = np.array([0x7FF8_0000_DEAD_BEEF, 0x7FF0_0000_0000_0000, 0xFFF0_0000_0000_0000, 1 << 63], np.uint64).view(np.float64)


@pytest.fixture
def seen():
    return []


@pytest.fixture
def ingestor(db, seen):
    # The judge gets the columns as stored (no dict per step on the request's thread); the tests
    # read them back as records (as_records), the form they were sent in.
    return Ingestor(db.sessions, on_records=lambda run, att, batch: seen.append((run, att, as_records(batch), type(batch))),
                    limits=IngestLimits(max_records=100, max_values=1000, max_keys_per_step=50))


@pytest.fixture
def client(ingestor, db):
    app = FastAPI()
    app.include_router(make_router(ingestor, guard=guard(db.sessions), max_body_bytes=200_000))
    with TestClient(app, raise_server_exceptions=False, headers=bearer(make_token(db.sessions, "t", "ingest"))) as c:
        assert c.post("/api/runs", json=RUN).status_code == 201
        yield c


def _body(recs) -> bytes:
    return StepColumns.from_records(recs).encode()


def test_columns_round_trip_bit_exact(db, client, seen):
    recs = _recs(0, 4)
    for r, v in zip(recs, ODD):
        r.values["loss"] = float(v)
    recs[2].values.pop(KEYS[1])  # a step without one key: the present mask
    recs[3].ledger_digest = "ab" * 8
    r = client.post(STEPS, content=_body(recs), headers=COLS)
    assert r.status_code == 200, r.text
    assert r.json() == {"ok": True, "records": 4, "values": 11}
    with db.sessions() as s:
        steps, vals = thermometers.history(s, "r", "loss")
        assert vals.view(np.uint64).tolist() == ODD.view(np.uint64).tolist()
        st, _, ranks = thermometers.history_with_ranks(s, "r", KEYS[-1])
        assert ranks.tolist() == [0, 1, 0, 1]
        assert thermometers.history(s, "r", KEYS[1])[0].tolist() == [0, 1, 3]
        assert steps_store.sample_range(s, "r", 1, 2) == (4, 12)
    assert seen[0][3] is StepColumns  # the judge gets the columns as stored, no dict per step
    judged = seen[0][2]  # and they read back exactly as the records that were sent
    assert [j.step for j in judged] == [0, 1, 2, 3] and KEYS[1] not in judged[2].values
    assert judged[3].ledger_digest == "ab" * 8 and judged[1].ranks == {KEYS[-1]: 1}
    assert math.isnan(judged[0].values["loss"]) and judged[3].values["loss"] == 0.0
    assert math.copysign(1, judged[3].values["loss"]) == -1


def test_identical_resend_is_not_judged_again_and_a_change_is_409(db, client, seen):
    assert client.post(STEPS, content=_body(_recs(0, 10)), headers=COLS).status_code == 200
    r = client.post(STEPS, content=_body(_recs(5, 15)), headers=COLS)  # 5..9 identical, 10..14 new
    assert r.status_code == 200
    assert [[x.step for x in b[2]] for b in seen] == [list(range(10)), list(range(10, 15))]
    changed = _recs(6, 20)
    changed[0].values["loss"] = 99.0
    r = client.post(STEPS, content=_body(changed), headers=COLS)
    assert r.status_code == 409 and "step 6, series 'loss': stored 6.0, this write says 99.0" in r.text
    # The JSON form of what is stored is an identical re-send too: both forms store one history.
    assert client.post(STEPS, json={"records": [x.to_json() for x in _recs(0, 3)]}).status_code == 200
    assert len(seen) == 2 and _counts(db) == (15, 3 * 2)


def _raw(header: dict, arrays: bytes) -> bytes:
    h = json.dumps(header).encode()
    return b"TWC1" + struct.pack("<I", len(h)) + h + arrays


def _arrays(n: int, k: int, step=0, lo=0, wall=1.0) -> bytes:
    ints = np.array([[step] * n, [lo] * n, [lo] * n, [0] * n], np.int64).tobytes()
    return ints + np.full(n, wall).tobytes() + np.ones(n * k).tobytes()


@pytest.mark.parametrize("body,status,needle", [
    (b"nope", 422, "starts with b'TWC1'"),
    (b"TWC1" + struct.pack("<I", 1 << 30), 422, "does not fit"),
    (b"TWC1" + struct.pack("<I", 2) + b"{]", 422, "header is not valid JSON"),
    (_raw({"steps": 1, "keys": ["loss"]}, _arrays(1, 1)[:-1]), 422, "needs"),
    (_raw({"steps": -1, "keys": ["loss"]}, b""), 422, "'steps' must be a non-negative integer"),
    (_raw({"steps": 1, "keys": ["loss", "loss"]}, _arrays(1, 2)), 422, "listed twice"),
    (_raw({"steps": 1, "keys": [1]}, _arrays(1, 1)), 422, "'keys' must be a list"),
    (_raw({"steps": 1, "keys": ["loss"], "ranked": [3]}, _arrays(1, 1)), 422, "'ranked'"),
    (_raw({"steps": 1, "keys": ["step"]}, _arrays(1, 1)), 422, "field of the step record"),
    (_raw({"steps": 1, "keys": ["m" * 101]}, _arrays(1, 1)), 422, "at most 100"),
    (_raw({"steps": 1, "keys": ["loss"]}, _arrays(1, 1, step=-3)), 422, "'step' must be a non-negative"),
    (_raw({"steps": 1, "keys": ["loss"]}, _arrays(1, 1, lo=-2)), 422, "'sample_lo'"),
    (_raw({"steps": 1, "keys": ["loss"]}, _arrays(1, 1, wall=math.nan)), 422, "'wall_time' must be a finite"),
    (_raw({"steps": 1, "keys": ["loss"], "ledger_digest": ["x" * 65]}, _arrays(1, 1)), 422, "'ledger_digest'"),
    (_raw({"steps": 1, "keys": ["loss"], "ranked": [0]}, _arrays(1, 1) + np.int32(-7).tobytes()), 422,
     "ranks['loss'] must be a rank"),
    (_raw({"steps": 101, "keys": ["loss"]}, _arrays(101, 1)), 413, "101 records"),
    (_raw({"steps": 1, "keys": [f"k{i}" for i in range(51)]}, _arrays(1, 51)), 413, "51 metric keys"),
    (_raw({"steps": 30, "keys": [f"k{i}" for i in range(40)]}, _arrays(30, 40)), 413, "1200 values"),
])
def test_bad_columns_are_4xx_naming_the_field_and_store_nothing(db, client, body, status, needle):
    r = client.post(STEPS, content=body, headers=COLS)
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"]
    assert _counts(db) == (0, 0)
    assert client.post(STEPS, content=_body(_recs(0, 2)), headers=COLS).status_code == 200  # still up


def test_in_process_write_columns_equals_write(db, ingestor):
    """The two forms store the same chunks, byte for byte (the store is one format)."""
    ingestor.open_run(RunInfo("a", 0, 1))
    ingestor.open_run(RunInfo("b", 0, 1))
    recs = _recs(0, 7)
    recs[4].values.pop("loss")
    assert ingestor.write("a", 0, recs) == ingestor.write_columns("b", 0, StepColumns.from_records(recs)) == 20
    with db.sessions() as s:
        for key in KEYS:
            a, b = thermometers.history_with_ranks(s, "a", key), thermometers.history_with_ranks(s, "b", key)
            for x, y in zip(a, b):
                np.testing.assert_array_equal(x, y)


def test_columns_codec_survives_what_records_carry():
    recs = [StepRecord(step=s, values={"loss": float(s), "act_max/x": -0.0}, sample_lo=s, sample_hi=s + 1, tokens=9,
                       wall_time=0.25 * s, ranks={"act_max/x": 7} if s == 1 else {}) for s in range(3)]
    back = StepColumns.decode(StepColumns.from_records(recs).encode()).to_records()
    assert [r.to_json() for r in back] == [r.to_json() for r in recs]
    assert StepColumns.decode(StepColumns.from_records([]).encode()).to_records() == []


def test_openapi_documents_both_bodies(client):
    body = client.get("/openapi.json").json()["paths"][STEPS.replace("r/attempts/0", "{run_id}/attempts/{attempt}")]
    content = body["post"]["requestBody"]["content"]
    assert set(content) == {"application/json", COLUMNS_CONTENT_TYPE}
    assert "TWC1" in content[COLUMNS_CONTENT_TYPE]["schema"]["description"]
