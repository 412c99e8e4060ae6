"""Ingest tokens are bound to the runs they opened (issue 33), on real SQLite and PostgreSQL.

Before, a token made for team B (`--scope ingest`) posted a NaN step into team A's run (200), and
registered and deleted its checkpoints: one team's trainer, or one leaked token, could make the
supervisor roll back, skip data in, or pause another team's run.

The matrix: every guarded route (tests/supervisor/serve/test_auth.py's SCOPE, itself checked against
the app's routes) x every kind of token x the token's own run and another team's run. A request
is *accepted* when it is past the auth (any answer but 401/403). Wrongly accepted must be 0, and
every refused request leaves every table as it was; wrongly refused must be 0 too, so the rule
cannot pass by refusing everything.
"""

from __future__ import annotations

import io
import json

import pytest
import sqlalchemy as sa
from fastapi.testclient import TestClient

from tests.supervisor.auth_helpers import AUTH, ADMIN_TOKEN, bearer, make_token
from tests.supervisor.serve.test_auth import BODIES, SCOPE, snapshot
from thermowatch.cli import main
from thermowatch.supervisor import db as dbmod
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.store import actions as actions_store

RUNS = {"a-run": "team-a", "b-run": "team-b"}  # run -> the ingest token that opened it
# token name -> its scopes (each token's own run is the one it opened; the others own none)
TOKENS = {"team-a": ("ingest",), "team-b": ("ingest",), "reader": ("read",), "oncall": ("operate",),
          "trainer-reader": ("ingest", "read"), "root": ("admin",)}


@pytest.fixture
def sup(db, tmp_path):
    s = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, api_token=ADMIN_TOKEN),
                   notifier=ConsoleNotifier(io.StringIO()))
    yield s
    s.close()


def _open_runs(sup, c: TestClient, secrets: dict[str, str]) -> dict[str, int]:
    """Each team opens its run over HTTP with its own token and writes a few steps; one pending
    action per run. Returns run -> action id."""
    out = {}
    for run, owner in RUNS.items():
        r = c.post("/api/runs", json={"run_id": run, "attempt": 0, "world_size": 1,
                                      "config": {"steps": 100, "data": {"global_batch": 16}}},
                   headers=bearer(secrets[owner]))
        assert r.status_code == 201, r.text
        r = c.post(f"/api/runs/{run}/attempts/0/steps", json={"records": [{"step": i, "loss": 2.0} for i in range(5)]},
                   headers=bearer(secrets[owner]))
        assert r.status_code == 200, r.text
        with sup.sessions.begin() as s:
            out[run] = actions_store.enqueue_action(s, run, "pause", {}, "seed", "manual", "seed",
                                                    requires_approval=True)
    return out


def _allowed(token: str, method: str, path: str, run: str) -> bool:
    """The rule, written out: the route's scope (admin implies all, operate implies read), and an
    ingest route with a run in it, or opening one, is for the run's own token or an admin."""
    scopes = set(TOKENS[token])
    if "admin" in scopes:
        return True
    need = SCOPE[(method, path)]
    if need not in scopes and not (need == "read" and "operate" in scopes):
        return False
    if need == "ingest":
        return RUNS[run] == token
    return True


def _request(c: TestClient, method: str, path: str, run: str, action_id: int, secret: str):
    url = (path.replace("{run_id}", run).replace("{attempt}", "0").replace("{action_id}", str(action_id))
           .replace("{name}", "nobody"))
    if path.endswith(("/history", "plot.png", "/chart", "/chart.png")):
        url += "?key=loss&metric=loss"
    body = BODIES.get(path)
    if path == "/api/runs":
        body = {"run_id": run, "attempt": 1, "world_size": 1}  # a new attempt of this run
    elif path == "/api/tokens":
        body = {"name": f"made-for-{run}", "scopes": ["read"]}
    kw = {"json": body} if method == "POST" else {}
    return c.request(method, url, headers=bearer(secret), **kw)


# The rule is the auth's, the same on both databases (CI time: 19-23 s a run); the owner's
# lookup on PostgreSQL is test_team_b_cannot_poison_team_a's, which runs on both.
@pytest.mark.parametrize("db", ["sqlite"], indirect=True)
def test_the_matrix_every_route_every_scope_own_and_other_run(sup):
    secrets = {name: make_token(sup.sessions, name, *scopes) for name, scopes in TOKENS.items()}
    with TestClient(build_app(sup), raise_server_exceptions=False) as c:
        actions = _open_runs(sup, c, secrets)
        cases = [(token, method, path, run) for (method, path) in sorted(SCOPE) for token in TOKENS for run in RUNS]
        refused = [x for x in cases if not _allowed(*x)]
        allowed = [x for x in cases if _allowed(*x)]
        assert len(refused) > 100 and len(allowed) > 100
        before = snapshot(sup)
        wrongly_accepted = []
        for token, method, path, run in refused:
            r = _request(c, method, path, run, actions[run], secrets[token])
            if r.status_code not in (401, 403):
                wrongly_accepted.append((token, method, path, run, r.status_code))
            elif SCOPE[(method, path)] == "ingest" and "ingest" in TOKENS[token]:
                # refused for the run, not the scope: the answer names the rule and the owner
                assert "may write only the runs it opened" in r.json()["detail"], r.text
                assert repr(RUNS[run]) in r.json()["detail"]
        assert wrongly_accepted == []
        assert snapshot(sup) == before, "a refused request changed a table"
        wrongly_refused = []
        # Past the auth a request does real work (a chart drawn, a page rendered); a route that
        # names no ingest rule answers alike for either run, so its allowed cases run on one.
        allowed = [x for x in allowed if SCOPE[(x[1], x[2])] == "ingest" or x[3] == "a-run"]
        for token, method, path, run in allowed:
            r = _request(c, method, path, run, actions[run], secrets[token])
            if r.status_code in (401, 403):
                wrongly_refused.append((token, method, path, run, r.status_code, r.text[:200]))
        assert wrongly_refused == []


def test_team_b_cannot_poison_team_a(sup):
    """The probe of issue 33, step by step: team B's token posts a NaN step, a checkpoint, a
    deletion, a finished report, polls and acks into team A's run; each is a 403 naming the rule,
    and team A's run holds exactly what team A sent."""
    a = make_token(sup.sessions, "team-a", "ingest")
    b = make_token(sup.sessions, "team-b", "ingest")
    with TestClient(build_app(sup)) as c:
        assert c.post("/api/runs", json={"run_id": "llm-a", "attempt": 0, "world_size": 1},
                      headers=bearer(a)).status_code == 201
        assert c.post("/api/runs/llm-a/attempts/0/steps", json={"records": [{"step": 0, "loss": 2.5}]},
                      headers=bearer(a)).status_code == 200
        hostile = [
            ("post", "/api/runs/llm-a/attempts/0/steps", {"records": [{"step": 1, "loss": float("nan")}]}),
            ("post", "/api/runs/llm-a/attempts/0/checkpoints", {"step": 1, "path": "/tmp/evil", "sample_cursor": 16,
                                                                "healthy": True}),
            ("post", "/api/runs/llm-a/attempts/0/checkpoints/deleted", {"steps": [0], "reason": "x"}),
            ("post", "/api/runs/llm-a/attempts/0/finished", {"step": 1, "final_loss": 9.0, "reason": "closed"}),
            ("get", "/api/runs/llm-a/commands", None),
            ("post", "/api/runs/llm-a/acks", {"command_id": 1, "ok": True, "first_step": 1}),
            ("post", "/api/runs", {"run_id": "llm-a", "attempt": 1, "world_size": 1}),
        ]
        for method, url, body in hostile:
            r = c.request(method.upper(), url, headers={**bearer(b), "content-type": "application/json"},
                          content=json.dumps(body) if body is not None else None)  # NaN as Python's json spells it
            assert r.status_code == 403, (url, r.status_code, r.text)
            assert "'team-b' may write only the runs it opened" in r.json()["detail"]
            assert "'team-a'" in r.json()["detail"]
        history = c.get("/api/runs/llm-a/history?key=loss", headers=AUTH).json()
        assert history["steps"] == [0]
        # team B's own run works as before, and team A's token cannot touch it either
        assert c.post("/api/runs", json={"run_id": "llm-b", "attempt": 0, "world_size": 1},
                      headers=bearer(b)).status_code == 201
        assert c.get("/api/runs/llm-b/commands", headers=bearer(b)).status_code == 200
        assert c.get("/api/runs/llm-b/commands", headers=bearer(a)).status_code == 403
        # an admin keeps its reach
        assert c.get("/api/runs/llm-a/commands", headers=AUTH).status_code == 200


def test_a_run_prefix_bounds_the_runs_a_token_may_open(sup, capsys, db):
    assert main(["token", "create", "team-c", "--scope", "ingest", "--run-prefix", "team-c/", "--db", db.url]) == 2
    assert "may not contain '/'" in capsys.readouterr().err  # a prefix is a run id's start: its rules
    assert main(["token", "create", "team-c", "--scope", "ingest", "--run-prefix", "teamc-", "--db", db.url]) == 0
    secret = capsys.readouterr().out.strip()
    assert main(["token", "create", "ops", "--scope", "admin", "--run-prefix", "x-", "--db", db.url]) == 2
    assert "cannot bind an admin token" in capsys.readouterr().err
    assert main(["token", "list", "--db", db.url]) == 0
    assert "runs teamc-*" in capsys.readouterr().out
    with TestClient(build_app(sup)) as c:
        r = c.post("/api/runs", json={"run_id": "llm-7", "attempt": 0, "world_size": 1}, headers=bearer(secret))
        assert r.status_code == 403 and "starts with 'teamc-'" in r.json()["detail"], r.text
        r = c.post("/api/runs", json={"run_id": "teamc-llm-7", "attempt": 0, "world_size": 1}, headers=bearer(secret))
        assert r.status_code == 201, r.text
        r = c.post("/api/tokens", json={"name": "team-d", "scopes": ["ingest"], "run_prefix": "teamd-"}, headers=AUTH)
        assert r.status_code == 201 and r.json()["run_prefix"] == "teamd-"
        listed = {t["name"]: t["run_prefix"] for t in c.get("/api/tokens", headers=AUTH).json()["tokens"]}
        assert listed == {"team-c": "teamc-", "team-d": "teamd-"}
    with sup.sessions() as s:
        assert sup.engine.dialect.name in ("sqlite", "postgresql")
        owners = dict(s.execute(sa.text("SELECT run_id, created_by FROM runs")).all())
    assert owners == {"teamc-llm-7": "team-c"}  # the refused run was never stored


def test_runs_opened_before_owners_were_recorded_keep_their_token(empty_url, tmp_path):
    """A run from before 0011 (no creator) gets the token that opened it, from the audit trail,
    when 0013 runs: that token keeps writing it, another ingest token is refused."""
    engine = dbmod.make_engine(empty_url)
    try:
        dbmod.upgrade(engine, "0012")
        with engine.begin() as conn:
            conn.execute(sa.text("INSERT INTO runs (run_id, config, created_at, created_by) "
                                 "VALUES ('old', '{}', '2026-01-01 00:00:00', ''), "
                                 "('orphan', '{}', '2026-01-01 00:00:00', '')"))
            for run in ("old", "orphan"):
                conn.execute(sa.text("INSERT INTO attempts (run_id, attempt, started_at, world_size, start_step, "
                                     "hosts, config) VALUES (:r, 0, '2026-01-01 00:00:00', 1, 0, '{}', '{}')"),
                             {"r": run})
            conn.execute(sa.text("INSERT INTO audit (at, run_id, actor, event, detail) VALUES "
                                 "('2026-01-01 00:00:00', 'old', 'old-trainer', 'attempt_opened', '{}'), "
                                 "('2026-01-02 00:00:00', 'old', 'someone-else', 'attempt_opened', '{}')"))
        dbmod.upgrade(engine)
        with engine.connect() as conn:
            owners = dict(conn.execute(sa.text("SELECT run_id, created_by FROM runs")).all())
        assert owners == {"old": "old-trainer", "orphan": ""}
        sessions = dbmod.make_sessionmaker(engine)
        old = make_token(sessions, "old-trainer", "ingest")
        other = make_token(sessions, "someone-else", "ingest")
    finally:
        engine.dispose()
    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=empty_url, api_token=ADMIN_TOKEN),
                     notifier=ConsoleNotifier(io.StringIO()))
    try:
        with TestClient(build_app(sup)) as c:
            step = {"records": [{"step": 0, "loss": 1.0}]}
            assert c.post("/api/runs/old/attempts/0/steps", json=step, headers=bearer(old)).status_code == 200
            r = c.post("/api/runs/old/attempts/0/steps", json=step, headers=bearer(other))
            assert r.status_code == 403
            r = c.post("/api/runs/orphan/attempts/0/steps", json=step, headers=bearer(old))
            assert r.status_code == 403 and "unknown token" in r.json()["detail"]
            assert c.post("/api/runs/orphan/attempts/0/steps", json=step, headers=AUTH).status_code == 200
    finally:
        sup.close()
