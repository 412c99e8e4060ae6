"""The chart endpoints (supervisor/serve/api/chart.py) and `thermowatch plot` on real SQLite and
PostgreSQL: the JSON contract, full-zoom exactness, abandoned attempts, non-finite values as
strings, 404/422 with their messages, the PNG (with an onset line) over real HTTP."""

from __future__ import annotations

import io
import math
from dataclasses import dataclass, field

import numpy as np
import pytest
from sqlalchemy.orm import sessionmaker

from thermowatch.monitors.contract import RunInfo, StepRecord
from thermowatch.supervisor.serve.api import chart as chart_api
from thermowatch.cli import main
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.store import runs, thermometers
from tests.supervisor.api_client import router_client
from tests.supervisor.auth_helpers import ADMIN_TOKEN

RUN = "chart-run"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass
class Sup:
    sessions: sessionmaker
    cfg: SupervisorConfig = field(default_factory=SupervisorConfig)


def _recs(lo, hi, attempt):
    out = []
    for s in range(lo, hi):
        v = {"loss": 3.0 - s / 1000, "attn_logit_max/blocks.0.attn": 10.0 + s / 100,
             "attn_logit_max/blocks.1.attn": 11.0 + s / 100 + attempt}
        out.append(StepRecord(step=s, values=v))
    if attempt == 0:
        out[-10].values["attn_logit_max/blocks.1.attn"] = math.inf
        out[-5].values["loss"] = math.nan
    return out


@pytest.fixture
def seeded(db):
    """Attempt 0 diverged by step 2200 (Inf logit, NaN loss), rolled back to 1900; attempt 1
    re-trained 1900..2999."""
    with db.sessions.begin() as s:
        runs.open_attempt(s, RunInfo(RUN, 0, world_size=1))
        runs.open_attempt(s, RunInfo(RUN, 1, world_size=1))
    for a, lo, hi in ((0, 0, 2200), (1, 1900, 3000)):
        for b in range(lo, hi, 100):
            with db.sessions.begin() as s:
                thermometers.append(s, RUN, a, _recs(b, min(b + 100, hi), a))
    return db


@pytest.fixture
def client(seeded):
    with router_client(chart_api, Sup(seeded.sessions)) as c:
        yield c


def _num(xs):
    return np.array([float(x) for x in xs])  # "NaN"/"Infinity" read back as Python's float() does


def test_full_zoom_is_every_point_exactly(client, seeded):
    r = client.get(f"/api/runs/{RUN}/chart", params={"metric": "attn_logit_max/blocks.1.attn",
                                                      "step_lo": 2150, "step_hi": 2250, "buckets": 500})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) == {"run_id", "metric", "step_lo", "step_hi", "bucket_steps", "series"}
    assert (body["run_id"], body["step_lo"], body["step_hi"], body["bucket_steps"]) == (RUN, 2150, 2250, 1)
    assert [(x["key"], x["attempt"], x["current"]) for x in body["series"]] == [
        ("attn_logit_max/blocks.1.attn", 0, False), ("attn_logit_max/blocks.1.attn", 1, True)]
    with seeded.sessions() as s:
        by_attempt = thermometers.history_by_attempt(s, RUN, "attn_logit_max/blocks.1.attn", 2150, 2250)
    for x in body["series"]:
        assert set(x) == {"key", "module", "attempt", "current", "step", "min", "max", "last", "count"}
        assert x["module"] == "blocks.1.attn"
        steps, values = by_attempt[x["attempt"]]
        assert x["step"] == steps.tolist() and x["count"] == [1] * len(steps)
        for f in ("min", "max", "last"):
            np.testing.assert_array_equal(_num(x[f]), values)
    assert "Infinity" in body["series"][0]["max"]  # JSON has no Infinity: the string


def test_whole_run_keeps_abandoned_attempts_and_current_drops_them(client):
    body = client.get(f"/api/runs/{RUN}/chart", params={"metric": "attn_logit_max", "buckets": 100}).json()
    assert (body["step_lo"], body["step_hi"]) == (0, 2999) and body["bucket_steps"] > 1
    got = [(x["key"], x["attempt"], x["current"]) for x in body["series"]]
    assert got == [(k, a, c) for k in ("attn_logit_max/blocks.0.attn", "attn_logit_max/blocks.1.attn")
                   for a, c in ((0, True), (0, False), (1, True))]
    for x in body["series"]:
        assert len(x["step"]) <= 100 and x["step"] == sorted(x["step"])
    gone = next(x for x in body["series"] if x["key"].endswith("1.attn") and not x["current"])
    assert sum(gone["count"]) == 300 and max(_num(gone["max"])) == math.inf  # steps 1900..2199 of attempt 0
    live = [x for x in body["series"] if x["current"] and x["key"].endswith("1.attn")]
    assert sum(sum(x["count"]) for x in live) == 3000  # one live point per step across the attempts
    cur = client.get(f"/api/runs/{RUN}/chart", params={"metric": "loss", "attempts": "current"}).json()
    assert [x["current"] for x in cur["series"]] == [True, True] and cur["series"][0]["module"] is None


def test_an_attempt_numbered_near_int32_max_charts_without_an_array_that_large(db):
    """Attempt numbers are any int32 a client sends. The chart's per-attempt lookups were arrays
    indexed by attempt: attempts 0 and 2^31 - 2 (rolled back over) made one request allocate
    16 GB and hang the daemon's worker (schemathesis found it). Now a search in the attempts."""
    big = 2**31 - 2
    with db.sessions.begin() as s:
        runs.open_attempt(s, RunInfo(RUN, 0, world_size=1))
        runs.open_attempt(s, RunInfo(RUN, big, world_size=1))
    with db.sessions.begin() as s:
        thermometers.append(s, RUN, 0, _recs(0, 300, 1))
        thermometers.append(s, RUN, big, _recs(150, 400, 1))
    with router_client(chart_api, Sup(db.sessions)) as c:
        for params in ({"buckets": 1000}, {"buckets": 10}, {"step_lo": 140, "step_hi": 160, "buckets": 500}):
            r = c.get(f"/api/runs/{RUN}/chart", params={"metric": "loss", **params})
            assert r.status_code == 200, r.text
            body = r.json()
            got = {(x["attempt"], x["current"]): sum(x["count"]) for x in body["series"]}
            lo, hi = params.get("step_lo", 0), params.get("step_hi", 399)
            # attempt 0's steps from 150 on were re-trained by attempt 2^31-2: abandoned, not current
            assert got.get((0, True), 0) == len(range(lo, min(hi, 149) + 1)), (params, got)
            assert got.get((0, False), 0) == len(range(max(lo, 150), min(hi, 299) + 1)), (params, got)
            assert got[(big, True)] == len(range(max(lo, 150), hi + 1)), (params, got)


def test_times_are_the_live_paths_wall_clock(db):
    """GET .../times (the page's wall-clock axis): each step's newest attempt's time, sampled
    evenly; a rolled-back stretch reads the re-training's times, not the abandoned ones."""
    from thermowatch.supervisor.store import steps as steps_store

    run = "clock"
    with db.sessions.begin() as s:
        runs.open_attempt(s, RunInfo(run, 0, world_size=1))
        runs.open_attempt(s, RunInfo(run, 1, world_size=1, start_step=100))
        for attempt, lo, hi, t0 in ((0, 0, 200, 1000.0), (1, 100, 300, 5000.0)):
            recs = [StepRecord(step=st, values={"loss": 1.0}, wall_time=t0 + st) for st in range(lo, hi)]
            steps_store.record_steps(s, run, attempt, recs)
    with router_client(chart_api, Sup(db.sessions)) as c:
        whole = c.get(f"/api/runs/{run}/times", params={"points": 300}).json()
        few = c.get(f"/api/runs/{run}/times", params={"points": 10, "step_lo": 50, "step_hi": 150}).json()
        assert c.get(f"/api/runs/{run}/times", params={"points": 1}).status_code == 422
        assert c.get("/api/runs/nope/times").status_code == 404
    got = dict(zip(whole["step"], whole["wall_time"]))
    assert whole["step"] == list(range(300))
    assert got[50] == 1050.0 and got[99] == 1099.0 and got[150] == 5150.0 and got[299] == 5299.0
    assert len(few["step"]) == 10 and few["step"][0] == 50 and few["step"][-1] == 150
    assert all(w == (1000.0 if st < 100 else 5000.0) + st for st, w in zip(few["step"], few["wall_time"]))


def test_a_hundred_layer_chart_for_a_phone_is_under_a_megabyte(db):
    """Issue 23: a 100-series chart was 6.9 MB of JSON. At a phone's 390 buckets, with only the
    array the page draws (fields=max), 100 layers x 2,000 steps: under 1 MB, and the same
    maxima as the full response."""
    run = "hundred"
    with db.sessions.begin() as s:
        runs.open_attempt(s, RunInfo(run, 0, world_size=1))
    rng = np.random.default_rng(0)
    for lo in range(0, 2000, 500):
        recs = [StepRecord(step=st, values={f"act_max/blocks.{i}.mlp": float(rng.lognormal(2.0, 0.5)) for i in range(100)})
                for st in range(lo, lo + 500)]
        with db.sessions.begin() as s:
            thermometers.append(s, run, 0, recs)
    with router_client(chart_api, Sup(db.sessions)) as c:
        params = {"metric": "act_max", "buckets": 390}
        full = c.get(f"/api/runs/{run}/chart", params=params)
        thin = c.get(f"/api/runs/{run}/chart", params={**params, "fields": "max"})
        assert c.get(f"/api/runs/{run}/chart", params={**params, "fields": "max,mean"}).status_code == 422
    assert len(thin.json()["series"]) == 100
    assert len(thin.content) < 1_000_000 < len(full.content), (len(thin.content), len(full.content))
    for a, b in zip(full.json()["series"], thin.json()["series"]):
        assert set(b) == {"key", "module", "attempt", "current", "step", "max"}
        assert a["step"] == b["step"] and a["max"] == b["max"]


@pytest.mark.parametrize("path, params, status, words", [
    ("/api/runs/nope/chart", {"metric": "loss"}, 404, ["nope"]),
    (f"/api/runs/{RUN}/chart", {"metric": "attn_logit"}, 404, ["attn_logit", "attn_logit_max", "loss"]),
    (f"/api/runs/{RUN}/chart", {"metric": "loss", "buckets": 9}, 422, ["buckets"]),
    (f"/api/runs/{RUN}/chart", {"metric": "loss", "buckets": 5001}, 422, ["buckets"]),
    (f"/api/runs/{RUN}/chart", {"metric": "loss", "attempts": "some"}, 422, ["attempts"]),
    (f"/api/runs/{RUN}/chart", {"metric": "loss", "step_lo": -1}, 422, ["step_lo"]),
    (f"/api/runs/{RUN}/chart", {}, 422, ["metric"]),
    (f"/api/runs/{RUN}/chart.png", {"metric": "nope"}, 404, ["nope", "attn_logit_max"]),
    (f"/api/runs/{RUN}/chart.png", {"metric": "nope", "step_lo": 9, "step_hi": 1}, 404, ["nope"]),
])
def test_bad_requests_name_the_problem(client, path, params, status, words):
    r = client.get(path, params=params)
    assert r.status_code == status, r.text
    for w in words:
        assert w in r.text


def test_an_empty_window_is_empty_data_not_an_error(client):
    """step_lo > step_hi matches no step: 200 with no series (issue 21: the OpenAPI cannot say
    step_lo <= step_hi, so a schema-valid request must not be refused for it)."""
    body = client.get(f"/api/runs/{RUN}/chart", params={"metric": "attn_logit_max", "step_lo": 210,
                                                        "step_hi": 200}).json()
    assert (body["step_lo"], body["step_hi"], body["series"]) == (210, 200, [])
    png = client.get(f"/api/runs/{RUN}/chart.png", params={"metric": "loss", "step_lo": 9, "step_hi": 1})
    assert png.status_code == 200 and png.content[:8] == PNG_SIGNATURE


def _pixels(png: bytes) -> np.ndarray:
    from matplotlib.image import imread

    return imread(io.BytesIO(png), format="png")


def test_png_draws_the_chart_and_the_onset(client):
    params = {"metric": "attn_logit_max", "step_lo": 1500, "step_hi": 2500}
    plain = client.get(f"/api/runs/{RUN}/chart.png", params=params)
    assert plain.status_code == 200 and plain.headers["content-type"] == "image/png"
    assert plain.content[:8] == PNG_SIGNATURE
    marked = client.get(f"/api/runs/{RUN}/chart.png", params={**params, "onset": 2100}).content
    a, b = _pixels(plain.content), _pixels(marked)
    assert a.shape == b.shape and (np.abs(a - b).sum(axis=-1) > 0.1).sum() > 200  # the onset line


def test_thermowatch_plot_writes_the_png_over_http(seeded, tmp_path, capsys):
    from thermowatch.supervisor.serve.server import build_app
    from thermowatch.supervisor.app.service import Supervisor
    from tests.live_server import running

    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "d", db_url=seeded.url, api_token=ADMIN_TOKEN),
                     judge_inline=False)
    try:
        with running(build_app(sup)) as url:
            flags = ["--server", url, "--token", ADMIN_TOKEN]
            out = tmp_path / "f.png"
            assert main(["plot", RUN, "attn_logit_max", "-o", str(out), "--step-lo", "1000", "--onset", "2100",
                         *flags]) == 0
            assert out.read_bytes()[:8] == PNG_SIGNATURE and _pixels(out.read_bytes()).shape[1] == 1100
            assert main(["plot", RUN, "attn_logt", "-o", str(out), *flags]) == 2
            assert "attn_logt" in capsys.readouterr().err
            assert main(["plot", RUN, "loss", "-o", str(tmp_path / "no" / "f.png"), *flags]) == 2
    finally:
        sup.close()


def test_many_layers_draw_the_hottest_as_lines_over_a_band_of_all():
    from thermowatch.supervisor.store.chart import ChartData, ChartSeries
    from thermowatch.supervisor.charts.png import MAX_LINES, to_chart
    from thermowatch.supervisor.charts.plots import render

    st = np.arange(0, 1000, 10)

    def ser(metric, i, lo, hi, attempt=0, current=True):
        return ChartSeries(f"{metric}/blocks.{i}", f"blocks.{i}", attempt, current, st, np.full(len(st), lo),
                           np.full(len(st), hi), np.full(len(st), hi), np.ones(len(st), np.int64))

    layers = [ser("attn_logit_max", i, 1.0 + i / 100, 2.0 + i / 100) for i in range(12)]
    layers[3].max[40] = math.nan  # a NaN and an abandoned spike in low layers: both must be drawn
    layers.append(ser("attn_logit_max", 2, 1.0, 1e4, attempt=0, current=False))
    chart = to_chart(ChartData("r", "attn_logit_max", 0, 999, 10, layers))
    names = [label for label, _, _ in chart.series]
    assert len(names) == MAX_LINES and {"blocks.2", "blocks.3", "blocks.11"} <= set(names)
    assert "blocks.0" not in names and chart.band is not None
    label, bs, lo, hi = chart.band
    assert "12" in label and bs.tolist() == st.tolist() and hi.max() == 1e4 and lo.min() == 1.0
    mins = [ser("act_min", i, -1.0 - (i == 5) * 100, 0.0) for i in range(12)]  # ranked by their lowest value
    assert "blocks.5" in [label for label, _, _ in to_chart(ChartData("r", "act_min", 0, 999, 10, mins)).series]
    assert render(chart)[:8] == PNG_SIGNATURE


def test_no_figure_outlives_its_png(client):
    """A matplotlib figure is a web of reference cycles: left to the collector's own schedule, a
    daemon kept every chart's figure for a while (RSS +5.5 MB per 100-series PNG, 168 -> 209 MB
    over 15). Each render now frees its figure before it returns."""
    import gc

    from matplotlib.figure import Figure

    def figures() -> int:
        return sum(type(o) is Figure for o in gc.get_objects())  # type(), not isinstance: no __class__ lookups

    client.get(f"/api/runs/{RUN}/chart.png", params={"metric": "loss"})  # imports, caches
    gc.collect()
    before = figures()
    for _ in range(3):
        r = client.get(f"/api/runs/{RUN}/chart.png", params={"metric": "attn_logit_max"})
        assert r.status_code == 200 and r.content[:8] == b"\x89PNG\r\n\x1a\n"
        assert figures() == before  # no collection of our own in between: render freed it
