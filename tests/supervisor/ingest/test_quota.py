"""The run-creation quota (supervisor.ingest.quota, issue 21 item 4) on real SQLite and PostgreSQL: in
process (Ingestor.open_run) and over HTTP (POST /api/runs answers 429 with Retry-After)."""

from __future__ import annotations

import datetime as dt
import threading

import pytest
import sqlalchemy as sa
from fastapi import FastAPI
from fastapi.testclient import TestClient

from thermowatch.monitors.contract import RunInfo
from thermowatch.supervisor.serve.api.ingest import make_router
from thermowatch.supervisor.errors import QuotaExceeded
from thermowatch.supervisor.ingest.ingestor import Ingestor
from thermowatch.supervisor.limits import Limits
from tests.supervisor.auth_helpers import bearer, guard, make_token

LIMIT = 3


@pytest.fixture
def ingestor(db):
    return Ingestor(db.sessions, limits=Limits(max_new_runs_per_token_per_hour=LIMIT))


def _stored(db) -> tuple[list[tuple[str, str]], int]:
    """(run id, creator) of every run, and the number of attempts."""
    with db.sessions() as s:
        runs = [tuple(r) for r in s.execute(sa.text("SELECT run_id, created_by FROM runs ORDER BY run_id")).all()]
        return runs, s.execute(sa.text("SELECT count(*) FROM attempts")).scalar()


def _age(db, run_id: str, minutes: float) -> None:
    at = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=minutes)
    with db.sessions.begin() as s:
        from thermowatch.supervisor.store.orm import Run

        s.execute(sa.update(Run).where(Run.run_id == run_id).values(created_at=at))


def test_the_limit_plus_first_new_run_is_refused_and_nothing_is_stored(db, ingestor):
    for i in range(LIMIT):
        ingestor.open_run(RunInfo(f"r{i}", 0, world_size=1))  # the embedded mode's actor
    with pytest.raises(QuotaExceeded, match=r"'run-controller' opened 3 new runs in the last hour") as exc:
        ingestor.open_run(RunInfo("r3", 0, world_size=1))
    assert "limits.max_new_runs_per_token_per_hour" in str(exc.value)
    assert 3590 <= exc.value.retry_after_s <= 3600  # the oldest of the three leaves the window in an hour
    assert _stored(db) == ([(f"r{i}", "run-controller") for i in range(LIMIT)], LIMIT)
    # a restart of a run is a new attempt, never a new run; a re-sent open is neither
    ingestor.open_run(RunInfo("r0", 1, world_size=1, start_step=100))
    ingestor.open_run(RunInfo("r0", 1, world_size=1, start_step=100))
    ingestor.open_run(RunInfo("r1", 0, world_size=1))
    assert _stored(db)[1] == LIMIT + 1
    ingestor.open_run(RunInfo("theirs", 0, world_size=1), actor="another-token")  # per token
    assert ("theirs", "another-token") in _stored(db)[0]


def test_runs_older_than_an_hour_do_not_count_and_retry_after_says_when(db, ingestor):
    for i in range(LIMIT):
        ingestor.open_run(RunInfo(f"r{i}", 0, world_size=1))
    _age(db, "r0", 61)
    ingestor.open_run(RunInfo("r3", 0, world_size=1))  # r0 left the window
    _age(db, "r1", 59)
    with pytest.raises(QuotaExceeded) as exc:
        ingestor.open_run(RunInfo("r4", 0, world_size=1))
    assert 55 <= exc.value.retry_after_s <= 61  # when r1 leaves it


def test_concurrent_creations_by_one_token_never_pass_the_limit(db):
    """Eight threads open eight new runs at once with one token: the database decides, so
    exactly the limit's worth are stored, whatever order the transactions commit in."""
    ingestor = Ingestor(db.sessions, limits=Limits(max_new_runs_per_token_per_hour=5))
    start, refused, failed = threading.Barrier(8), [], []

    def open_one(i: int) -> None:
        start.wait()
        try:
            ingestor.open_run(RunInfo(f"c{i}", 0, world_size=1), actor="flood")
        except QuotaExceeded:
            refused.append(i)
        except Exception as exc:  # noqa: BLE001 - reported below
            failed.append(repr(exc))

    threads = [threading.Thread(target=open_one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert failed == []
    runs, attempts = _stored(db)
    assert len(refused) == 3 and len(runs) == attempts == 5
    assert {r for r, _ in runs} == {f"c{i}" for i in range(8)} - {f"c{i}" for i in refused}


def test_http_answers_429_with_retry_after_and_the_openapi_says_so(db, ingestor):
    app = FastAPI()
    app.include_router(make_router(ingestor, guard=guard(db.sessions)))
    a, b = make_token(db.sessions, "trainer-a", "ingest"), make_token(db.sessions, "trainer-b", "ingest")
    with TestClient(app, raise_server_exceptions=False) as c:
        for i in range(LIMIT):
            assert c.post("/api/runs", json={"run_id": f"a{i}", "attempt": 0, "world_size": 1},
                          headers=bearer(a)).status_code == 201
        r = c.post("/api/runs", json={"run_id": "a3", "attempt": 0, "world_size": 1}, headers=bearer(a))
        assert r.status_code == 429, r.text
        assert 3590 <= int(r.headers["retry-after"]) <= 3600
        assert "'trainer-a'" in r.json()["detail"] and "limits.max_new_runs_per_token_per_hour" in r.json()["detail"]
        assert c.post("/api/runs", json={"run_id": "a0", "attempt": 1, "world_size": 1},
                      headers=bearer(a)).status_code == 201  # a new attempt
        assert c.post("/api/runs", json={"run_id": "b0", "attempt": 0, "world_size": 1},
                      headers=bearer(b)).status_code == 201  # another token
        assert "429" in c.get("/openapi.json").json()["paths"]["/api/runs"]["post"]["responses"]
    runs, _ = _stored(db)
    assert runs == [("a0", "trainer-a"), ("a1", "trainer-a"), ("a2", "trainer-a"), ("b0", "trainer-b")]


def test_the_default_is_generous_and_the_config_can_change_it():
    assert Limits().max_new_runs_per_token_per_hour == 1000
    assert Limits.from_dict({"max_new_runs_per_token_per_hour": 50}).max_new_runs_per_token_per_hour == 50
    with pytest.raises(ValueError, match="max_new_runs_per_token_per_hour"):
        Limits.from_dict({"max_new_runs_per_token_per_hour": 0})


def test_new_attempts_are_bounded_per_run_and_per_token(db):
    """Issue 34: 10^4 new attempts of one run by one token were all accepted. Restarts count
    against the run's hourly budget and the token's over all its runs; the one past either is a
    QuotaExceeded naming the setting, and stores nothing. A re-sent open of an attempt that exists
    is not a new one; attempts older than an hour leave the window."""
    ingestor = Ingestor(db.sessions, limits=Limits(max_new_attempts_per_run_per_hour=3,
                                                   max_new_attempts_per_token_per_hour=5))
    ingestor.open_run(RunInfo("a", 0, world_size=1), actor="trainer")
    for k in (1, 2, 3):
        ingestor.open_run(RunInfo("a", k, world_size=1, start_step=10 * k), actor="trainer")
    ingestor.open_run(RunInfo("a", 3, world_size=1, start_step=30), actor="trainer")  # re-sent: nothing new
    before = _stored(db)
    with pytest.raises(QuotaExceeded, match=r"run 'a' opened 3 new attempts in the last hour") as exc:
        ingestor.open_run(RunInfo("a", 4, world_size=1, start_step=40), actor="trainer")
    assert "limits.max_new_attempts_per_run_per_hour" in str(exc.value) and 3590 <= exc.value.retry_after_s <= 3600
    assert _stored(db) == before
    # the token's budget spans its runs: 3 restarts of `a` + 2 of `b`, then the sixth is refused
    ingestor.open_run(RunInfo("b", 0, world_size=1), actor="trainer")
    ingestor.open_run(RunInfo("b", 1, world_size=1), actor="trainer")
    ingestor.open_run(RunInfo("b", 2, world_size=1), actor="trainer")
    with pytest.raises(QuotaExceeded, match=r"'trainer' opened 5 new attempts") as exc:
        ingestor.open_run(RunInfo("b", 3, world_size=1), actor="trainer")
    assert "max_new_attempts_per_token_per_hour" in str(exc.value)
    # an hour later the run's oldest restarts have left the window
    at = dt.datetime.now(dt.timezone.utc) - dt.timedelta(minutes=61)
    with db.sessions.begin() as s:
        from thermowatch.supervisor.store.orm import Attempt

        s.execute(sa.update(Attempt).where(Attempt.run_id == "a").values(started_at=at))
    ingestor.open_run(RunInfo("a", 4, world_size=1, start_step=40), actor="trainer")


def test_a_restart_past_the_budget_is_429_over_http(db):
    app = FastAPI()
    ingestor = Ingestor(db.sessions, limits=Limits(max_new_attempts_per_run_per_hour=1))
    app.include_router(make_router(ingestor, guard=guard(db.sessions)))
    trainer = bearer(make_token(db.sessions, "trainer", "ingest"))
    with TestClient(app) as c:
        for k in (0, 1):
            r = c.post("/api/runs", json={"run_id": "loop", "attempt": k, "world_size": 1}, headers=trainer)
            assert r.status_code == 201, r.text
        r = c.post("/api/runs", json={"run_id": "loop", "attempt": 2, "world_size": 1}, headers=trainer)
        assert r.status_code == 429 and int(r.headers["retry-after"]) > 3000, r.text
        assert "max_new_attempts_per_run_per_hour" in r.json()["detail"]
    assert _stored(db)[1] == 2
