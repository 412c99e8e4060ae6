"""`GET /metrics` (issue 12, "Nothing for Grafana") on real SQLite and PostgreSQL, over the real
app: the read scope (and public_read), per-run gauges, the ingest and HTTP counters, the
judge, the alert outbox per channel and the scheduler's jobs, parsed with Prometheus' own
text parser (what a scrape would see); and a scrape at 10^4 runs (issue 21: 13.5 s at 10^5):
series only for the active runs, counts for all, the same few statements whatever the count."""

from __future__ import annotations

import datetime as dt

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from thermowatch.supervisor.app.scheduler import Job, Scheduler
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import alerts as alerts_store
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store.orm import Action, Alert, Attempt, Incident, JudgeMark, Run
from tests.supervisor.auth_helpers import AUTH, bearer, make_token, sup  # noqa: F401  (sup: the fixture)


def samples(text: str) -> dict[tuple[str, tuple], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out[(smp.name, tuple(sorted(smp.labels.items())))] = smp.value
    return out


def test_metrics_needs_the_read_scope_or_public_read(sup, db, tmp_path):
    trainer = make_token(sup.sessions, "trainer", "ingest")
    reader = make_token(sup.sessions, "grafana", "read")
    with TestClient(build_app(sup)) as c:
        assert c.get("/metrics").status_code == 401
        r = c.get("/metrics", headers=bearer(trainer))
        assert r.status_code == 403 and "`read` scope" in r.json()["detail"]
        r = c.get("/metrics", headers=bearer(reader))
        assert r.status_code == 200 and r.headers["content-type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert "# TYPE thermowatch_judge_backlog gauge" in r.text
    sup.cfg.public_read = True
    with TestClient(build_app(sup)) as c:
        assert c.get("/metrics").status_code == 200


def test_metrics_tell_what_the_daemon_holds_and_counted(sup, db):
    scheduler = Scheduler([Job("sweep", lambda: None, every_s=3600), Job("broken", lambda: 1 / 0, every_s=3600)])
    scheduler.start()
    try:
        scheduler.run_now("sweep")
        scheduler.run_now("broken")
        with TestClient(build_app(sup, scheduler=scheduler), headers=AUTH) as c:
            for run_id in ("a", "b"):
                assert c.post("/api/runs", json={"run_id": run_id, "attempt": 0, "world_size": 1}).status_code == 201
            assert c.post("/api/runs", json={"run_id": "a", "attempt": 1, "world_size": 1}).status_code == 201
            for lo in (0, 10):
                r = c.post("/api/runs/a/attempts/1/steps", json={"records": [
                    {"step": i, "loss": 3.0 - i / 100, "grad_norm": 1.0, "wall_time": 1000.0 + 0.5 * i, "tokens": 4096}
                    for i in range(lo, lo + 10)]})
                assert r.status_code == 200, r.text
            assert c.post("/api/runs/a/attempts/1/steps", json={"records": [{"step": "x"}]}).status_code == 422
            assert c.post("/api/runs/nope/attempts/0/steps", json={"records": [{"step": 1}]}).status_code == 404
            assert c.get("/api/runs/a/history?key=loss").status_code == 200
            assert c.get("/no/such/path").status_code == 404
            assert sup.judge.wait(30)
            with sup.sessions.begin() as s:
                incidents_store.open_incident(s, "a", "loss_spike", "", 5, 7, severity="warn")
                actions_store.enqueue_action(s, "a", "rollback", {"to_step": 0}, "x", "auto", "sup",
                                             requires_approval=True)
                actions_store.enqueue_action(s, "a", "pause", {}, "x", "manual", "bob")
                # a channel nobody sends to (a Slack that was configured before): stays pending
                alerts_store.enqueue(s, "a", ["slack"], "old alert", {"run_id": "a", "title": "old alert"})
                s.execute(sa.update(Alert).where(Alert.channel == "slack")
                          .values(created_at=dt.datetime.now(dt.timezone.utc) - dt.timedelta(seconds=300)))
            text = c.get("/metrics").text
    finally:
        scheduler.shutdown()
    m = samples(text)
    run = lambda r: (("run_id", r),)  # noqa: E731
    assert m[("thermowatch_run_last_step", run("a"))] == 19
    # what Grafana users look for (issue 23): the newest loss, step time and throughput
    assert m[("thermowatch_run_loss", run("a"))] == pytest.approx(2.81)
    assert m[("thermowatch_run_step_seconds", run("a"))] == pytest.approx(0.5)
    assert m[("thermowatch_run_tokens_per_second", run("a"))] == pytest.approx(8192)
    assert ("thermowatch_run_loss", run("b")) not in m
    assert ("thermowatch_run_last_step", run("b")) not in m  # no step yet: absent, not 0
    assert m[("thermowatch_run_attempts", run("a"))] == 2 and m[("thermowatch_run_attempts", run("b"))] == 1
    assert m[("thermowatch_run_open_incidents", run("a"))] == 1 and m[("thermowatch_run_open_incidents", run("b"))] == 0
    assert 0 <= m[("thermowatch_run_last_record_age_seconds", run("a"))] < 60
    assert m[("thermowatch_run_actions", (("kind", "rollback"), ("run_id", "a"), ("state", "pending")))] == 1
    assert m[("thermowatch_run_actions", (("kind", "pause"), ("run_id", "a"), ("state", "pending")))] == 1
    assert (m[("thermowatch_ingest_batches_total", ())], m[("thermowatch_ingest_records_total", ())],
            m[("thermowatch_ingest_values_total", ())]) == (2, 20, 40)
    assert m[("thermowatch_ingest_refused_total", (("status", "422"),))] == 1
    assert m[("thermowatch_ingest_refused_total", (("status", "404"),))] == 1
    http = lambda method, route, status: ("thermowatch_http_requests_total",  # noqa: E731
                                          (("method", method), ("route", route), ("status", status)))
    steps = "/api/runs/{run_id}/attempts/{attempt}/steps"
    assert m[http("POST", steps, "2xx")] == 2 and m[http("POST", steps, "4xx")] == 2
    assert m[http("GET", "/api/runs/{run_id}/history", "2xx")] == 1
    assert m[http("GET", "unmatched", "4xx")] == 1  # the raw path never becomes a label
    assert not any("no/such" in str(k) for k in m)
    assert m[("thermowatch_judge_backlog", ())] == 0 and m[("thermowatch_judge_up", ())] == 1
    assert m[("thermowatch_judge_dropped_batches_total", ())] == 0
    assert m[("thermowatch_outbox_alerts", (("channel", "slack"), ("state", "pending")))] == 1
    assert m[("thermowatch_outbox_alerts", (("channel", "console"), ("state", "failed")))] == 0
    assert 290 < m[("thermowatch_outbox_oldest_pending_age_seconds", (("channel", "slack"),))] < 400
    assert m[("thermowatch_scheduler_up", ())] == 1
    assert m[("thermowatch_job_runs_total", (("job", "sweep"),))] == 1
    assert m[("thermowatch_job_failures_total", (("job", "broken"),))] == 1
    assert m[("thermowatch_job_failures_total", (("job", "sweep"),))] == 0
    assert ("thermowatch_job_last_success_timestamp_seconds", (("job", "broken"),)) not in m
    assert m[("thermowatch_job_last_success_timestamp_seconds", (("job", "sweep"),))] > 1.7e9


def test_a_scrape_lists_only_active_runs_in_a_few_statements_whatever_the_run_count(sup, db):
    now = dt.datetime.now(dt.timezone.utc)
    old = now - dt.timedelta(days=30)

    def old_run(c, run_id: str) -> None:
        c.execute(sa.insert(Run), {"run_id": run_id, "config": {}, "created_at": old, "created_by": "t"})
        c.execute(sa.insert(Attempt), {"run_id": run_id, "attempt": 0, "started_at": old, "world_size": 1,
                                       "start_step": 0, "hosts": {}, "config": {}})

    with sup.sessions.begin() as s:
        for run_id in ("stepping", "incident", "waiting", "quiet"):
            old_run(s, run_id)
        # Active: steps judged an hour ago; an incident opened a month ago and still open; an
        # action a month old still waiting for approval; a run opened just now.
        s.execute(sa.insert(JudgeMark), {"run_id": "stepping", "attempt": 0, "through_step": 41,
                                         "updated_at": now - dt.timedelta(hours=1)})
        incidents_store.open_incident(s, "incident", "loss_spike", "", 5, 7)
        actions_store.enqueue_action(s, "waiting", "rollback", {"to_step": 0}, "x", "auto", "sup",
                                     requires_approval=True)
        # Not active: everything of it is a month old, its incident resolved, its action done.
        s.execute(sa.insert(JudgeMark), {"run_id": "quiet", "attempt": 0, "through_step": 9, "updated_at": old})
        incidents_store.resolve_incident(s, incidents_store.open_incident(s, "quiet", "stall", "", 1, 2))
        actions_store.enqueue_action(s, "quiet", "pause", {}, "x", "manual", "bob")
        s.execute(sa.update(Action).where(Action.run_id == "quiet").values(state="done"))
        s.execute(sa.update(Incident).values(opened_at=old))
        s.execute(sa.update(Action).values(created_at=old))
    statements: list[str] = []
    sa.event.listen(sup.engine, "before_cursor_execute",
                    lambda conn, cur, stmt, params, ctx, many: statements.append(stmt))
    with TestClient(build_app(sup), headers=AUTH) as c:
        assert c.post("/api/runs", json={"run_id": "new", "attempt": 0, "world_size": 1}).status_code == 201

        def scrape() -> tuple[dict, int]:
            statements.clear()
            text = c.get("/metrics").text
            return samples(text), len(statements)

        few, few_statements = scrape()
        n = 12_000
        with db.engine.begin() as conn:  # the flood: old runs, one executemany
            conn.execute(sa.insert(Run), [{"run_id": f"flood-{i:05d}", "config": {}, "created_at": old,
                                           "created_by": "flood"} for i in range(n)])
        many, many_statements = scrape()
        sup.ingestor.limits.max_runs_in_metrics = 2
        capped, _ = scrape()

    active = {"stepping", "incident", "waiting", "new"}
    for m in (few, many):
        listed = {dict(k)["run_id"] for (name, k) in m if name.startswith("thermowatch_run_")}
        assert listed == active
    assert many[("thermowatch_run_last_step", (("run_id", "stepping"),))] == 41
    assert 3000 < many[("thermowatch_run_last_record_age_seconds", (("run_id", "stepping"),))] < 4000
    assert many[("thermowatch_run_open_incidents", (("run_id", "incident"),))] == 1
    assert many[("thermowatch_run_actions", (("kind", "rollback"), ("run_id", "waiting"), ("state", "pending")))] == 1
    assert few[("thermowatch_runs", ())] == 5 and many[("thermowatch_runs", ())] == 5 + n
    assert many[("thermowatch_runs_active", ())] == 4 and many[("thermowatch_runs_listed", ())] == 4
    assert many[("thermowatch_open_incidents", ())] == 1
    assert many[("thermowatch_actions", (("kind", "rollback"), ("state", "pending")))] == 1
    assert many[("thermowatch_actions", (("kind", "pause"), ("state", "done")))] == 1
    # The same statements at 5 runs as at 12,005 (auth and the scrape together).
    assert many_statements == few_statements <= 10, statements
    # Past the cap the runs waiting on someone keep their series; the others are only counted.
    listed = {dict(k)["run_id"] for (name, k) in capped if name.startswith("thermowatch_run_")}
    assert listed == {"incident", "waiting"}
    assert capped[("thermowatch_runs_active", ())] == 4 and capped[("thermowatch_runs_listed", ())] == 2


def test_progress_reads_the_same_from_records_and_from_columns():
    """The daemon's per-run progress (thermowatch_run_loss, _step_seconds, _tokens_per_second)
    comes from a batch's first and last row, sent as JSON records or as the sink's columns."""
    import math

    from thermowatch.monitors.columns import StepColumns
    from thermowatch.monitors.contract import StepRecord
    from thermowatch.supervisor.app.service import Progress

    def batch(lo, tps=None):
        return [StepRecord(step=s, values={"loss": 3.0 - s / 100, **({"tokens_per_s": tps} if tps else {})},
                           wall_time=1000.0 + 0.5 * s, tokens=4096) for s in range(lo, lo + 10)]

    as_columns = Progress()  # every batch reaches it as columns (JSON is converted at the edge)
    for lo in (0, 10):
        as_columns.note("r", 1, StepColumns.from_records(batch(lo)))
    got = as_columns.get("r")
    assert (got.step, got.loss, got.step_s, got.tokens_per_s) == (19, pytest.approx(2.81), 0.5, 8192)
    as_columns.note("r", 1, StepColumns.from_records(batch(20, tps=5000.0)))  # the trainer's own figure wins
    assert as_columns.get("r").tokens_per_s == 5000.0
    mixed = batch(30)
    del mixed[-1].values["loss"]  # the last row without a loss: NaN, not the row before's
    as_columns.note("r", 1, StepColumns.from_records(mixed))
    assert math.isnan(as_columns.get("r").loss)


def test_the_thermometers_cost_is_a_figure_of_the_run_on_metrics_and_on_its_page(sup, db):
    """Issue 36: a user sees what the watchdog costs without a benchmark. The client sends its
    measured share of the step and each group's cadence on some steps (absent on others, as a
    budget's figures are); /metrics and the run page show the newest told."""
    recs = []
    for i in range(12):
        r = {"step": i, "loss": 3.0, "wall_time": 1000.0 + i}
        if i % 4 == 0:  # the cost and cadences told on these steps only
            r.update({"thermometer_cost": 0.01 + i / 1000, "thermometer_every/act": 16.0,
                      "thermometer_every/attn": 4.0, "thermometer_every/grad": 1.0})
        recs.append(r)
    with TestClient(build_app(sup), headers=AUTH) as c:
        assert c.post("/api/runs", json={"run_id": "cost", "attempt": 0, "world_size": 1}).status_code == 201
        assert c.post("/api/runs", json={"run_id": "plain", "attempt": 0, "world_size": 1}).status_code == 201
        assert c.post("/api/runs/cost/attempts/0/steps", json={"records": recs}).status_code == 200
        assert c.post("/api/runs/plain/attempts/0/steps",
                      json={"records": [{"step": 0, "loss": 2.0, "wall_time": 1.0}]}).status_code == 200
        assert sup.judge.wait(30)
        m = samples(c.get("/metrics").text)
        page = c.get("/runs/cost").text
        plain_page = c.get("/runs/plain").text
    assert m[("thermowatch_run_thermometer_cost", (("run_id", "cost"),))] == pytest.approx(0.018)  # step 8's
    assert m[("thermowatch_run_thermometer_every", (("group", "attn"), ("run_id", "cost")))] == 4
    assert m[("thermowatch_run_thermometer_every", (("group", "act"), ("run_id", "cost")))] == 16
    assert ("thermowatch_run_thermometer_cost", (("run_id", "plain"),)) not in m  # no budget: nothing told
    assert "<b id='thermometer-cost'>1.8%</b> of a step (act every 16, attn every 4, grad every 1)" in page
    assert "thermometer-cost" not in plain_page
