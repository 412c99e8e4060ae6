"""GET /api/runs/{run_id}/chart against its contract (whichever implementation serves it), on real
SQLite and PostgreSQL, over the seeded run of test_runs_api (a blow-up in attempt 0 at steps
180-219, rolled back to 100 and re-trained in attempt 1 to step 260)."""

from __future__ import annotations

import math

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from thermowatch.supervisor.serve.api import install_error_handlers
from thermowatch.supervisor.serve.api import chart as chart_api
from tests.supervisor.auth_helpers import AUTH, guard
from tests.supervisor.serve.test_runs_api import RUN, Sup, seed


@pytest.fixture
def client(db):
    seed(db)
    app = FastAPI()
    install_error_handlers(app)  # the store's NotFound -> 404, as the daemon's app
    app.include_router(chart_api.make_router(Sup(db.sessions), guard=guard(db.sessions)))
    with TestClient(app, headers=AUTH) as c:
        yield c


def _get(c, **params):
    r = c.get(f"/api/runs/{RUN}/chart", params=params)
    assert r.status_code == 200, r.text
    return r.json()


def test_family_live_and_abandoned_exact_at_full_zoom(client):
    ch = _get(client, metric="attn_logit_max", step_lo=150, step_hi=230, buckets=100)
    assert (ch["step_lo"], ch["step_hi"], ch["bucket_steps"]) == (150, 230, 1)
    assert [(s["key"], s["attempt"]) for s in ch["series"]] == sorted((s["key"], s["attempt"]) for s in ch["series"])
    b2 = [s for s in ch["series"] if s["module"] == "blocks.2.attn"]
    live = sorted((st, v) for s in b2 if s["current"] for st, v in zip(s["step"], s["last"]))
    assert [st for st, _ in live] == list(range(150, 231))  # one live point per step
    assert all(v < 20 for _, v in live)  # the re-trained attempt 1, not the blow-up
    gone = next(s for s in b2 if not s["current"])
    assert gone["attempt"] == 0 and gone["step"] == list(range(150, 220))
    assert gone["max"][-1] == pytest.approx(10.0 * 1.2 ** 39)  # the abandoned spike is kept
    assert gone["min"] == gone["max"] == gone["last"] and set(gone["count"]) == {1}


def test_buckets_bound_the_points_and_keep_extremes(client):
    ch = _get(client, metric="attn_logit_max/blocks.2.attn", buckets=10)
    assert ch["bucket_steps"] >= 26 and ch["step_lo"] == 0 and ch["step_hi"] == 260
    for s in ch["series"]:
        assert s["module"] == "blocks.2.attn" and len(s["step"]) <= 10
        assert s["step"] == sorted(s["step"]) and sum(s["count"]) > 0
    peak = max(v for s in ch["series"] for v in s["max"])
    assert peak == pytest.approx(10.0 * 1.2 ** 39)
    assert all(s["current"] for s in _get(client, metric="attn_logit_max/blocks.2.attn", buckets=10,
                                           attempts="current")["series"])


def test_nonfinite_values_are_strings(client):
    ch = _get(client, metric="loss", step_lo=205, step_hi=215)
    assert ch["series"][0]["module"] is None
    gone = next(s for s in ch["series"] if not s["current"])
    i = gone["step"].index(210)
    assert gone["last"][i] == "NaN" and math.isnan(float(gone["last"][i]))


def test_an_empty_window_is_empty_data(client):
    """step_lo > step_hi is an empty window (issue 21: what the OpenAPI allows, the API takes)."""
    ch = _get(client, metric="loss", step_lo=9, step_hi=3)
    assert (ch["step_lo"], ch["step_hi"]) == (9, 3) and ch["series"] == []


@pytest.mark.parametrize("params,status,word", [
    ({"metric": "attn_logit_mx"}, 404, "attn_logit_max"),
    ({"metric": "loss", "buckets": 5}, 422, "buckets"),
    ({"metric": "loss", "attempts": "some"}, 422, "attempts"),
])
def test_bad_input(client, params, status, word):
    r = client.get(f"/api/runs/{RUN}/chart", params=params)
    assert r.status_code == status and word in r.text, r.text
    r = client.get("/api/runs/nope/chart", params={"metric": "loss"})
    assert r.status_code == 404 and "nope" in r.text
