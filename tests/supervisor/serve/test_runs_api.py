"""The read API (supervisor.serve.api.runs) on real SQLite and PostgreSQL, seeded through the store."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np
import pytest
from sqlalchemy.orm import sessionmaker

from thermowatch.monitors.contract import CheckpointInfo, Finding, RunInfo, Severity, Signal, StepRecord
from thermowatch.supervisor.serve.api import runs as runs_api
from thermowatch.supervisor.store import views
from thermowatch.supervisor.store.views import envelope
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.service import Progress
from thermowatch.supervisor.store import actions, audit, checkpoints, findings, incidents, lr_changes, runs, skips, thermometers
from thermowatch.supervisor.store import steps as steps_store
from tests.supervisor.api_client import router_client

RUN = "gpt-350m"
LAYERS = 3


@dataclass
class Sup:
    sessions: sessionmaker
    cfg: SupervisorConfig = field(default_factory=SupervisorConfig)  # detectors.stall for /status
    progress: Progress = field(default_factory=Progress)  # the newest loss per run (the runs index)


@dataclass
class Seeded:
    incident: int
    rollback: int
    set_lr: int
    evil_run: str
    evil_incident: int


def _records(lo: int, hi: int, scale: float = 1.0) -> list[StepRecord]:
    out = []
    for s in range(lo, hi):
        v = {"loss": 3.0 - s / 1000 * scale, "lr": 3e-4, "grad_norm": 0.5 + s / 1000}
        for layer in range(LAYERS):
            v[f"attn_logit_max/blocks.{layer}.attn"] = 10.0 + layer + s / 100
            v[f"act_max/blocks.{layer}.mlp"] = 5.0 + layer
        out.append(StepRecord(step=s, values=v, sample_lo=8 * s, sample_hi=8 * s + 8))
    return out


def seed(db) -> Seeded:
    """A run that blew up in attempt 0 (attention logits of block 2, then a NaN loss), was rolled
    back to step 100 with a skip and a lower LR, and re-trained to step 260 in attempt 1. Plus a
    run whose id and strings are hostile HTML."""
    with db.sessions.begin() as s:
        runs.open_attempt(s, RunInfo(RUN, 0, world_size=2, config={"model": "350m"}))
        recs = _records(0, 220)
        for r in recs:
            if r.step >= 180:  # the blow-up
                r.values["attn_logit_max/blocks.2.attn"] = 10.0 * 1.2 ** (r.step - 180)
        recs[210].values["loss"] = math.nan
        recs[211].values["grad_norm"] = math.inf
        recs[212].values["act_max/blocks.0.mlp"] = -math.inf
        thermometers.append(s, RUN, 0, recs)
        steps_store.record_steps(s, RUN, 0, recs)
        checkpoints.record_checkpoint(s, RUN, 0, CheckpointInfo(100, "/ckpt/100", 800, True))
        checkpoints.record_checkpoint(s, RUN, 0, CheckpointInfo(200, "/ckpt/200", 1600, False))
        inc = incidents.open_incident(s, RUN, "attn_logit_growth", "blocks.2.attn", 185, 205, severity="critical")
        findings.add_finding(s, RUN, Finding(Signal.ATTN_LOGIT_GROWTH, "blocks.2.attn", Severity.CRITICAL, 185, 205,
                                             metric="attn_logit_max/blocks.2.attn",
                                             evidence={"slope": 0.18, "ratio": math.inf}), inc)
        findings.add_finding(s, RUN, Finding(Signal.NON_FINITE, "", Severity.CRITICAL, 210, 210, metric="loss"), inc)
        rb = actions.enqueue_action(s, RUN, "rollback", {"to_step": 100, "skip_ranges": [[1440, 1648]],
                                                         "lr_multiplier": 0.5, "lr_steps": 200},
                                    "attn logits of blocks.2.attn grew 18%/step", "auto", "policy", incident_id=inc)
        audit.audit(s, RUN, "policy", "enqueued", {"action_id": rb, "kind": "rollback"})
        actions.set_action_state(s, rb, "sent")
        actions.set_action_state(s, rb, "acked", ack_step=100)
        skips.add_skip_range(s, RUN, 1440, 1648, action_id=rb)
        lr_changes.add_lr_change(s, RUN, 0.5, 100, 200, action_id=rb)
        actions.set_action_state(s, rb, "done")
        incidents.resolve_incident(s, inc, "rollback done at step 100")
        audit.audit(s, RUN, "trainer", "done", {"action_id": rb, "step": 100})
        lr = actions.enqueue_action(s, RUN, "set_lr", {"lr_multiplier": 0.25}, "still hot", "manual", "alice")
        runs.open_attempt(s, RunInfo(RUN, 1, world_size=2, start_step=100))
        retrained = _records(100, 261, scale=2.0)
        thermometers.append(s, RUN, 1, retrained)
        steps_store.record_steps(s, RUN, 1, retrained)

        evil = "<img src=x onerror=alert('run')>&\"x"
        runs.open_attempt(s, RunInfo(evil, 0, world_size=1))
        thermometers.append(s, evil, 0, [StepRecord(step=i, values={"loss": 1.0}) for i in range(5)])
        evil_inc = incidents.open_incident(s, evil, "loss_spike", "<img src=x onerror=alert(1)>", 2, 3)
        actions.enqueue_action(s, evil, "pause", {}, "<b>bold</b> reason", "manual", "mallory<script>")
    return Seeded(inc, rb, lr, evil, evil_inc)


@pytest.fixture
def seeded(db):
    return seed(db)


@pytest.fixture
def client(db):
    with router_client(runs_api, Sup(db.sessions)) as c:
        yield c


def _num(v):
    """The API's encoding of non-finite floats, read back the way Python and JS read them."""
    return float(v)


def test_runs_list(client, seeded):
    body = client.get("/api/runs").json()
    by_id = {r["run_id"]: r for r in body["runs"]}
    assert by_id[RUN]["last_step"] == 260  # the newest attempt's newest step
    assert (by_id[RUN]["attempt"], by_id[RUN]["attempts"]) == (1, 2)  # attempts 0 and 1
    assert by_id[RUN]["open_incidents"] == 0  # resolved by the rollback
    assert by_id[seeded.evil_run]["open_incidents"] == 1


def test_run_detail(client, seeded):
    body = client.get(f"/api/runs/{RUN}").json()
    assert [a["attempt"] for a in body["attempts"]] == [0, 1]
    assert body["attempts"][1]["start_step"] == 100
    assert [(c["step"], c["healthy"]) for c in body["checkpoints"]] == [(100, True), (200, False)]
    assert body["skip_ranges"] == [[1440, 1648]]
    assert [(c["multiplier"], c["start_step"], c["steps"]) for c in body["lr_changes"]] == [(0.5, 100, 200)]
    assert body["config"] == {"model": "350m"}


def test_series_keys(client, seeded):
    keys = client.get(f"/api/runs/{RUN}/series").json()["keys"]
    assert "loss" in keys and "attn_logit_max/blocks.2.attn" in keys
    assert len(keys) == 3 + 2 * LAYERS


def test_history_values_and_nonfinite(client, seeded):
    body = client.get(f"/api/runs/{RUN}/history", params={"key": "loss", "step_lo": 205, "step_hi": 215}).json()
    assert body["steps"] == list(range(205, 216))
    # steps 205..215 were re-trained in attempt 1 (the latest attempt wins): no NaN there any more
    assert body["values"][0] == pytest.approx(3.0 - 205 / 1000 * 2.0)
    # attempt 0's NaN/Inf are still in the series it alone wrote
    g = client.get(f"/api/runs/{RUN}/history", params={"key": "grad_norm", "step_lo": 0, "step_hi": 99}).json()
    assert len(g["steps"]) == 100 and g["values"][10] == pytest.approx(0.51)


def test_history_of_every_attempt_keeps_the_abandoned_spike(client, seeded):
    key = "attn_logit_max/blocks.2.attn"
    params = {"key": key, "step_lo": 150, "step_hi": 230}
    newest = client.get(f"/api/runs/{RUN}/history", params=params).json()
    assert set(newest) == {"run_id", "key", "points", "downsampled", "steps", "values"}  # unchanged without attempts
    assert max(newest["values"]) < 20  # the newest attempt re-trained 100..260: no spike left
    body = client.get(f"/api/runs/{RUN}/history", params={**params, "attempts": "all"}).json()
    assert (body["run_id"], body["key"]) == (RUN, key) and set(body["attempts"]) == {"0", "1"}
    a0, a1 = body["attempts"]["0"], body["attempts"]["1"]
    assert a0["steps"] == list(range(150, 220)) and a1["steps"] == list(range(150, 231))
    assert a0["values"][-1] == pytest.approx(10.0 * 1.2 ** 39)  # the spike that caused the rollback
    assert a0["values"][:30] == pytest.approx([10.0 + 2 + s / 100 for s in range(150, 180)])
    assert a1["values"][219 - 150] == pytest.approx(12 + 219 / 100)
    assert (a0["points"], a0["downsampled"], a1["points"]) == (70, False, 81)
    # NaN/Inf encoding per attempt: attempt 0's NaN loss at 210, gone from the newest history
    loss = client.get(f"/api/runs/{RUN}/history", params={"key": "loss", "attempts": "all", "step_lo": 205}).json()
    assert loss["attempts"]["0"]["values"][210 - 205] == "NaN"
    assert "NaN" not in loss["attempts"]["1"]["values"]
    # max_points applies per attempt, and each attempt keeps its own extremes
    small = client.get(f"/api/runs/{RUN}/history", params={"key": key, "attempts": "all", "max_points": 10}).json()
    s0, s1 = small["attempts"]["0"], small["attempts"]["1"]
    assert s0["downsampled"] and s1["downsampled"] and len(s0["steps"]) <= 10 and len(s1["steps"]) <= 10
    assert (s0["points"], s1["points"]) == (220, 161)
    assert max(s0["values"]) == pytest.approx(10.0 * 1.2 ** 39) and 219 in s0["steps"]
    assert max(s1["values"]) == pytest.approx(12 + 260 / 100)
    # a window no attempt reaches: no attempts, not an error
    empty = client.get(f"/api/runs/{RUN}/history", params={"key": key, "attempts": "all", "step_lo": 5000}).json()
    assert empty["attempts"] == {}
    # an empty window (step_lo > step_hi) inside the run's chunks: no points, not an error (it
    # raised IndexError with attempts=all: chunks found, none of their points kept)
    for extra in ({}, {"attempts": "all"}):
        r = client.get(f"/api/runs/{RUN}/history", params={"key": key, "step_lo": 200, "step_hi": 150, **extra})
        assert r.status_code == 200, r.text
        assert r.json().get("attempts", {}) == {} and r.json().get("steps", []) == []
    r = client.get(f"/api/runs/{RUN}/history", params={"key": key, "attempts": "newest"})
    assert r.status_code == 422 and "attempts" in str(r.json()["detail"])


def test_history_encodes_nan_and_inf_as_strings(db, client, seeded):
    with db.sessions.begin() as s:
        runs.open_attempt(s, RunInfo("nf", 0, world_size=1))
        thermometers.append(s, "nf", 0, [StepRecord(step=i, values={"loss": v})
                                          for i, v in enumerate([1.5, math.nan, math.inf, -math.inf, 2.5])])
    body = client.get("/api/runs/nf/history", params={"key": "loss"}).json()
    assert body["values"] == [1.5, "NaN", "Infinity", "-Infinity", 2.5]
    back = np.array([_num(v) for v in body["values"]])
    assert np.isnan(back[1]) and back[2] == np.inf and back[3] == -np.inf


def test_incidents_with_findings(client, seeded):
    body = client.get(f"/api/runs/{RUN}/incidents").json()
    [inc] = body["incidents"]
    assert (inc["id"], inc["signal"], inc["module"], inc["onset_step"], inc["detect_step"]) == (
        seeded.incident, "attn_logit_growth", "blocks.2.attn", 185, 205)
    assert inc["state"] == "resolved" and inc["resolution"] == "rollback done at step 100"
    assert [f["signal"] for f in inc["findings"]] == ["attn_logit_growth", "non_finite"]
    assert inc["findings"][0]["evidence"]["ratio"] in ("inf", "Infinity")  # stored as 'inf' by the store


def test_actions_and_audit(client, seeded):
    acts = client.get(f"/api/runs/{RUN}/actions").json()["actions"]
    assert [a["id"] for a in acts] == [seeded.set_lr, seeded.rollback]  # newest first
    rb = acts[1]
    assert (rb["kind"], rb["state"], rb["ack_step"], rb["origin"], rb["who"]) == ("rollback", "done", 100, "auto", "policy")
    assert rb["args"]["skip_ranges"] == [[1440, 1648]] and rb["incident_id"] == seeded.incident
    assert acts[0]["who"] == "alice" and acts[0]["state"] == "pending"
    assert len(client.get(f"/api/runs/{RUN}/actions", params={"limit": 1}).json()["actions"]) == 1
    events = [a["event"] for a in client.get(f"/api/runs/{RUN}/audit").json()["audit"]]
    assert events == ["done", "enqueued"]


def test_unknown_run_is_404_naming_it(client, seeded):
    for path in ("", "/series", "/incidents", "/actions", "/audit", "/history?key=loss"):
        r = client.get(f"/api/runs/nope{path}")
        assert r.status_code == 404, path
        assert "no run 'nope'" in r.json()["detail"] and RUN in r.json()["detail"]


def test_unknown_key_is_404_listing_known_keys(client, seeded):
    r = client.get(f"/api/runs/{RUN}/history", params={"key": "attn_logit_max/blocks.9.attn"})
    assert r.status_code == 404
    detail = r.json()["detail"]
    assert "'attn_logit_max/blocks.9.attn'" in detail and "attn_logit_max/blocks.2.attn" in detail
    r = client.get(f"/api/runs/{RUN}/history", params={"key": "perplexity"})
    assert r.status_code == 404 and "loss" in r.json()["detail"]


@pytest.mark.parametrize("params, word", [
    ({"key": "loss", "step_lo": -1}, "step_lo"),
    ({"key": "loss", "max_points": 1}, "max_points"),
    ({"key": "loss", "step_hi": "ten"}, "step_hi"),
    ({}, "key"),
    ({"key": ""}, "key"),
])
def test_bad_params_are_422_naming_the_param(client, seeded, params, word):
    r = client.get(f"/api/runs/{RUN}/history", params=params)
    assert r.status_code == 422
    assert word in str(r.json()["detail"])


def test_history_downsampled_keeps_spike(db, client, seeded):
    n, spike_at = 100_000, 73_457
    values = np.sin(np.arange(n) / 500.0)
    values[spike_at] = 1e6
    values[20_000] = np.nan
    with db.sessions.begin() as s:
        runs.open_attempt(s, RunInfo("long", 0, world_size=1))
        for lo in range(0, n, 25_000):
            thermometers.append(s, "long", 0, [StepRecord(step=i, values={"attn_logit_max/b.0": float(values[i])})
                                               for i in range(lo, lo + 25_000)])
    body = client.get("/api/runs/long/history", params={"key": "attn_logit_max/b.0", "max_points": 2000}).json()
    assert body["points"] == n and body["downsampled"] is True
    assert 1000 <= len(body["steps"]) <= 2000 <= 2000 * 2
    assert body["steps"] == sorted(body["steps"])
    vals = [_num(v) for v in body["values"]]
    i = vals.index(max(v for v in vals if not math.isnan(v)))
    assert (body["steps"][i], vals[i]) == (spike_at, 1e6)
    assert 20_000 in body["steps"] and math.isnan(vals[body["steps"].index(20_000)])
    assert min(v for v in vals if not math.isnan(v)) == pytest.approx(-1.0, abs=1e-4)  # troughs kept too


def test_envelope_keeps_extremes_per_bucket():
    steps = np.arange(10_000, dtype=np.int64)
    rng = np.random.default_rng(0)
    values = rng.normal(size=10_000)
    values[[5, 5000, 9999]] = [50.0, -60.0, np.inf]
    s, v = envelope(steps, values, 100)
    assert len(s) <= 100 and np.all(np.diff(s) > 0)
    assert {5, 5000, 9999} <= set(s.tolist())
    # every bucket's max is in the output
    buckets = (steps * 50 // 10_000)
    for b in (0, 17, 49):
        m = buckets == b
        assert values[m].max() in v
    # short series pass through untouched
    s2, v2 = envelope(steps[:50], values[:50], 100)
    assert s2 is steps[:50] or np.array_equal(s2, steps[:50])


def test_run_status_follows_the_rows(db, client):
    """GET /api/runs/{run_id}/status's state (issue 12): running while records arrive, stalled
    after the stall timeout of silence, paused by a done pause until a done resume, finished by a
    done stop; approvals waiting are listed with the commands that settle them."""
    import datetime as dt

    from thermowatch.supervisor.store import judged

    seed(db)
    with db.sessions.begin() as s:
        judged.mark(s, RUN, 1, 260)
        waiting = actions.enqueue_action(s, RUN, "rollback", {"to_step": 200}, "logits", "auto", "supervisor",
                                         requires_approval=True)
    now = dt.datetime.now(dt.timezone.utc)

    def status(at=now):
        with db.sessions() as s:
            return views.run_status(s, RUN, stall_after_s=600, now=at)

    st = status()
    assert (st["state"], st["last_step"], st["attempt"]) == ("running", 260, 1)
    assert 0 <= st["last_record_age_s"] < 60
    assert [(a["id"], a["approve"], a["cancel"]) for a in st["pending_approvals"]] == [
        (waiting, f"thermowatch approve {waiting}", f"thermowatch cancel {waiting}")]
    assert [i["signal"] for i in st["open_incidents"]] == []  # the seeded incident was resolved
    later = status(now + dt.timedelta(seconds=900))
    assert later["state"] == "stalled" and "no record for 9" in later["why"]

    def done(kind):
        with db.sessions.begin() as s:
            aid = actions.enqueue_action(s, RUN, kind, {}, "", "manual", "bob")
            for state in ("sent", "acked", "done"):
                actions.set_action_state(s, aid, state, ack_step=261)
        return aid

    pause = done("pause")
    assert status()["state"] == "paused" and f"action {pause}" in status()["why"]
    done("resume")
    assert status()["state"] == "running"
    stop = done("stop")
    assert (status()["state"], status()["why"]) == ("finished", f"stopped by action {stop} at step 261")
    r = client.get(f"/api/runs/{RUN}/status")
    assert r.status_code == 200 and r.json()["state"] == "finished" and r.json()["last_step"] == 260
    assert client.get("/api/runs/nope/status").status_code == 404


def test_run_status_is_finished_when_the_newest_attempt_says_so(db, client):
    """Issue 22, item 9: a loop that ended early (no stop, the planned steps not reached) reads
    finished once its newest attempt reported it, with the reason and the final loss; a newer
    attempt that has not reported it reads as before."""
    from thermowatch.monitors.contract import RunFinished
    from thermowatch.supervisor.operate.report import render_status

    seed(db)
    with db.sessions() as s:
        assert views.run_status(s, RUN, stall_after_s=600)["state"] == "running"
    with db.sessions.begin() as s:
        assert runs.finish_attempt(s, RUN, 0, RunFinished(150, 9.0, "closed")) is None
    with db.sessions() as s:  # an older attempt finishing says nothing of the newest
        assert views.run_status(s, RUN, stall_after_s=600)["state"] == "running"
    with db.sessions.begin() as s:
        runs.finish_attempt(s, RUN, 1, RunFinished(260, math.nan, "closed"))
    st = client.get(f"/api/runs/{RUN}/status").json()
    assert (st["state"], st["finish_reason"], st["final_step"], st["final_loss"]) == ("finished", "closed", 260, "NaN")
    assert st["why"] == "closed at step 260 (attempt 1)"
    assert "finished: closed at step 260, final loss NaN" in render_status(st)
    with db.sessions.begin() as s:
        runs.open_attempt(s, RunInfo(RUN, 2, world_size=1, start_step=260))
    st = client.get(f"/api/runs/{RUN}/status").json()
    assert st["state"] != "finished" and st["finish_reason"] is None and st["final_loss"] is None


# --- the runs list: pages, their cost, their order (issue 21, item 4) ---------------------------------


def _bulk_runs(db, n: int, *, per_second: int = 7, prefix: str = "bulk") -> list[str]:
    """n runs created `per_second` to a second (ties that only run_id orders), each with an
    attempt, steps of its own and, every third, an open incident; their ids newest first."""
    import datetime as dt

    from thermowatch.supervisor.store.orm import Attempt, Incident, Run, Step

    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    rows = [(f"{prefix}-{i:05d}", t0 + dt.timedelta(seconds=i // per_second)) for i in range(n)]
    with db.sessions.begin() as s:
        s.execute(Run.__table__.insert(), [{"run_id": r, "config": {}, "created_at": at} for r, at in rows])
        s.execute(Attempt.__table__.insert(), [{"run_id": r, "attempt": 0, "world_size": 1, "started_at": at}
                                               for r, at in rows])
        s.execute(Step.__table__.insert(), [{"run_id": r, "step": k, "attempt": 0, "sample_lo": k, "sample_hi": k + 1}
                                            for i, (r, _) in enumerate(rows) for k in range(i % 5)])
        s.execute(Incident.__table__.insert(), [{"run_id": r, "signal": "loss_spike", "onset_step": 1, "detect_step": 2}
                                                for i, (r, _) in enumerate(rows) if i % 3 == 0])
    return [r for r, _ in sorted(rows, key=lambda x: (x[1], x[0]), reverse=True)]


def _walk(client, limit: int) -> list[dict]:
    out, cursor, pages = [], None, 0
    while True:
        body = client.get("/api/runs", params={"limit": limit, **({"cursor": cursor} if cursor else {})}).json()
        out += body["runs"]
        pages += 1
        assert len(body["runs"]) == limit or body["next_cursor"] is None, body
        cursor = body["next_cursor"]
        if cursor is None:
            return out
        assert pages < 1000, "the pages never end"


def test_runs_pages_walk_every_run_once_newest_first(db, client):
    expected = _bulk_runs(db, 250)
    for limit in (1, 17, 250, 1000):
        walked = _walk(client, limit)
        assert [r["run_id"] for r in walked] == expected, limit  # each exactly once, in order
    by_id = {r["run_id"]: r for r in _walk(client, 100)}
    for i in (0, 1, 3, 4, 249):
        assert by_id[f"bulk-{i:05d}"] == {
            "run_id": f"bulk-{i:05d}", "created_at": by_id[f"bulk-{i:05d}"]["created_at"],
            "last_step": (i % 5) - 1 if i % 5 else None, "attempt": 0, "attempts": 1,
            "open_incidents": int(i % 3 == 0)}
    first = client.get("/api/runs").json()
    assert len(first["runs"]) == 100 and first["runs"][0]["run_id"] == expected[0]  # the default page


def test_runs_list_last_step_is_the_newest_attempt_with_steps(db, client, seeded):
    # attempt 1 re-trained to step 260 after attempt 0 reached 219; attempt 2 has no step yet
    with db.sessions.begin() as s:
        runs.open_attempt(s, RunInfo(RUN, 2, world_size=2, start_step=240))
    (row,) = [r for r in client.get("/api/runs").json()["runs"] if r["run_id"] == RUN]
    assert (row["last_step"], row["attempt"], row["attempts"]) == (260, 2, 3)
    with db.sessions.begin() as s:
        steps_store.record_steps(s, RUN, 2, [StepRecord(step=241, values={}, sample_lo=0, sample_hi=8)])
    (row,) = [r for r in client.get("/api/runs").json()["runs"] if r["run_id"] == RUN]
    assert row["last_step"] == 241  # the newest attempt's, though attempt 1 went further
    with db.sessions() as s:
        assert thermometers.latest_step(s, RUN) == 241  # the same rule as the run's own pages


def _statements(db, fn) -> list[str]:
    """The SQL statements `fn` sends to the database."""
    import sqlalchemy as sa

    sent: list[str] = []

    def grab(conn, cursor, statement, params, context, executemany):
        sent.append(statement)

    sa.event.listen(db.engine, "before_cursor_execute", grab)
    try:
        fn()
    finally:
        sa.event.remove(db.engine, "before_cursor_execute", grab)
    return sent


def test_runs_pages_cost_the_same_statements_at_any_number_of_runs(db, client):
    """The honest, untimed form of "indexed and constant": a page, the index page and a 404 send
    as many statements with 30 runs as with 600, and the list's one statement reads by index
    (the query plans are printed by bench/listing.py --explain)."""
    def cost() -> dict[str, int]:
        body = client.get("/api/runs", params={"limit": 20}).json()
        middle = lambda: client.get("/api/runs", params={"limit": 20, "cursor": body["next_cursor"]})  # noqa: E731
        return {"first": len(_statements(db, lambda: client.get("/api/runs", params={"limit": 20}))),
                "middle": len(_statements(db, middle)),
                "404": len(_statements(db, lambda: client.get("/api/runs/nope")))}

    _bulk_runs(db, 30, prefix="a")
    small = cost()
    _bulk_runs(db, 570, prefix="b")
    big = cost()
    assert big == small, (small, big)
    assert big["first"] == big["middle"] == 1  # the page and every summary on it: one statement
    assert big["404"] <= 2  # the run's lookup and the 10 newest ids
    detail = client.get("/api/runs/nope").json()["detail"]
    assert detail.count("b-") == 10 and "b-00569" in detail and "a-" not in detail  # the newest, not all


@pytest.mark.parametrize("params, word", [
    ({"limit": 0}, "limit"),
    ({"limit": 1001}, "limit"),
    ({"cursor": "not-a-cursor"}, "cursor"),
    ({"cursor": "WzEsMiwzXQ"}, "cursor"),  # base64 of [1,2,3]
    ({"cursor": "WyIyMDI2LTAxLTAxVDAwOjAwOjAwIiwieCJd"}, "cursor"),  # a naive time
])
def test_runs_list_bad_page_params_are_422(client, seeded, params, word):
    r = client.get("/api/runs", params=params)
    assert r.status_code == 422 and word in json.dumps(r.json()), r.text
