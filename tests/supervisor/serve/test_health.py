"""`GET /healthz` tells the truth (issue 12), on real SQLite and PostgreSQL: 200 while every part
can do its job, 503 naming the part and why when one cannot (a database that does not answer,
the judge thread gone or far behind, an alert sender gone, the scheduler stopped), 200 with a
warning for a degraded channel. The unreachable database is a real one: PostgreSQL on a port
where nothing listens, a SQLite "file" that is a directory."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from thermowatch.monitors.contract import RunInfo, StepRecord
from thermowatch.supervisor import db as dbmod
from thermowatch.supervisor.serve.health import Health, HealthConfig
from thermowatch.supervisor.app.scheduler import Job, Scheduler
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.store import alerts as alerts_store
from thermowatch.supervisor.store.orm import Alert
from tests.live_server import free_port
from tests.supervisor.auth_helpers import sup  # noqa: F401  (sup: the fixture)


def probe(app) -> tuple[int, dict]:
    with TestClient(app, raise_server_exceptions=False) as c:  # no token: the probe holds none
        r = c.get("/healthz")
    return r.status_code, r.json()


def failing(body: dict) -> dict[str, str]:
    return {name: c["why"] for name, c in body["checks"].items() if not c["ok"]}


def test_healthy_daemon_is_200_and_says_nothing_about_runs(sup):
    sup.open_run(RunInfo(run_id="secret-run", attempt=0, world_size=1))
    with Scheduler([Job("noop", lambda: None, every_s=3600)]) as sched:
        code, body = probe(build_app(sup, scheduler=sched))
    assert code == 200 and body["ok"] and failing(body) == {} and body["warnings"] == []
    assert set(body["checks"]) == {"database", "judge", "alert_senders", "scheduler"}
    assert "secret-run" not in str(body)


def test_database_unreachable_is_503(sup, db, tmp_path):
    dead = (f"postgresql+psycopg://postgres@127.0.0.1:{free_port()}/test?connect_timeout=2" if db.dialect == "postgresql"
            else f"sqlite:///{tmp_path}")  # a directory: SQLite cannot open it as a database
    live = sup.sessions
    engine = dbmod.make_engine(dead)
    sup.sessions = dbmod.make_sessionmaker(engine)
    try:
        code, body = probe(build_app(sup))
    finally:
        sup.sessions = live
        engine.dispose()
    assert code == 503 and not body["ok"]
    assert list(failing(body)) == ["database"] and "SELECT 1 failed: OperationalError" in failing(body)["database"]


def test_a_database_that_hangs_is_503_within_the_timeout(sup, db):
    gate = threading.Event()
    health = Health(sup, cfg=HealthConfig(db_timeout_s=0.2))
    health._ping = lambda: gate.wait(30)  # the probe's own bound, not the database: nothing mocked below
    try:
        assert health.report()["checks"]["database"] == {"ok": False, "why": "SELECT 1 did not answer within 0.2 s"}
        assert "still waiting" in health.report()["checks"]["database"]["why"]  # no second thread piles up
    finally:
        gate.set()


def test_judge_dead_or_far_behind_is_503(sup):
    release = threading.Event()
    judge = sup.judge.banks.judge  # held up, then judged as ever
    sup.judge.banks.judge = lambda *a: (release.wait(30), judge(*a))[1]
    sup.open_run(RunInfo(run_id="r", attempt=0, world_size=1))
    for i in range(4):
        sup.write("r", 0, [StepRecord(step=i, values={"loss": 1.0})])
    try:
        body = Health(sup, cfg=HealthConfig(max_judge_backlog=1)).report()
        assert not body["ok"] and "wait to be judged" in failing(body)["judge"]
    finally:
        release.set()
    assert sup.judge.wait(30)
    assert probe(build_app(sup))[0] == 200
    sup.judge.close()
    code, body = probe(build_app(sup))
    assert code == 503 and list(failing(body)) == ["judge"] and "judge thread is not running" in failing(body)["judge"]


def test_alert_senders_dead_is_503(sup):
    sup.executor.outbox.close()
    code, body = probe(build_app(sup))
    assert code == 503 and list(failing(body)) == ["alert_senders"] and "console" in failing(body)["alert_senders"]


def test_scheduler_stopped_is_503(sup):
    sched = Scheduler([Job("noop", lambda: None, every_s=3600)])
    sched.start()
    app = build_app(sup, scheduler=sched)
    assert probe(app)[0] == 200
    sched.shutdown()
    code, body = probe(app)
    assert code == 503 and list(failing(body)) == ["scheduler"] and "stopped" in failing(body)["scheduler"]


def test_alerts_waiting_on_a_failing_channel_are_a_warning_not_a_503(sup):
    with sup.sessions.begin() as s:
        alerts_store.enqueue(s, None, ["slack"], "spike", {"run_id": "r", "title": "spike"})
        s.execute(sa.update(Alert).values(created_at=dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=10),
                                          attempts=7, error="slack 503"))
    code, body = probe(build_app(sup))
    assert code == 200 and body["ok"]
    (warning,) = body["warnings"]
    assert "1 alert(s) to slack undelivered" in warning


def test_readyz_adds_the_schema_revision(sup, db):
    """Liveness is not readiness: a database whose schema is not the revision this code needs
    (another daemon version migrated it, or it was rolled back) keeps /healthz at 200 and makes
    /readyz 503, naming both revisions."""
    import sqlalchemy as sa

    from thermowatch.supervisor import db as dbmod

    head = dbmod.head_revision()
    with Scheduler([Job("noop", lambda: None, every_s=3600)]) as sched:
        app = build_app(sup, scheduler=sched)
        with TestClient(app, raise_server_exceptions=False) as c:
            r = c.get("/readyz")
            assert r.status_code == 200 and r.json()["checks"]["schema"] == {"ok": True}, r.json()
            with db.engine.begin() as conn:  # what an older daemon's `db` would have left
                conn.execute(sa.text("UPDATE alembic_version SET version_num = '0001'"))
            try:
                r = c.get("/readyz")
                assert r.status_code == 503, r.json()
                why = failing(r.json())["schema"]
                assert "revision 0001" in why and head in why and "db upgrade" in why
                assert c.get("/healthz").status_code == 200  # alive: nothing to restart
            finally:
                with db.engine.begin() as conn:
                    conn.execute(sa.text("UPDATE alembic_version SET version_num = :h"), {"h": head})
            assert c.get("/readyz").status_code == 200
