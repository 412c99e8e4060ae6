"""Auth on by default (issue 11), on real SQLite and PostgreSQL: every route but the open few
refuses a request without a valid token (401) and changes nothing; every route refuses a valid
token without its scope (403); tokens are stored hashed, revocable, made by the CLI and the API;
the first start writes an admin token to a 0600 file; an open daemon never listens off loopback.

The routes are enumerated from the app itself, so a new route that forgets its scope fails here.
"""

from __future__ import annotations

import io
import os
import socket
import stat
import subprocess
import sys

import httpx
import pytest
import sqlalchemy as sa
from fastapi.routing import iter_route_contexts
from fastapi.testclient import TestClient

from tests.live_server import wait_healthy
from thermowatch.monitors.contract import RunInfo, StepRecord
from thermowatch.supervisor.serve.auth import Authenticator, bootstrap_admin, check_bind, is_loopback
from thermowatch.cli import main
from thermowatch.supervisor.app.config import ConfigError, SupervisorConfig
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import tokens as tokens_store
from thermowatch.supervisor.store.orm import load_models
from tests.supervisor.auth_helpers import ADMIN_TOKEN, AUTH, bearer, make_token
from tests.supervisor import ROOT

RUN = "auth"
# Open on purpose: the liveness probe; the API's schema and its viewers (no run data in them);
# the sign-in and sign-out forms (which check the Origin themselves: test_web.py); Slack's
# interactivity callbacks (Slack's request signature instead of a token: test_slack_api.py).
OPEN = {("POST", "/api/slack/interactions"), ("GET", "/healthz"), ("GET", "/readyz"), ("GET", "/readyz/leader"), ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/docs/oauth2-redirect"),
        ("GET", "/login"), ("POST", "/login"), ("POST", "/logout"),
        ("GET", "/go/{grant}")}  # an alert's signed link: the grant is the credential (test_link_grants)
SCOPE = {
    ("POST", "/api/runs"): "ingest",
    ("POST", "/api/runs/{run_id}/attempts/{attempt}/steps"): "ingest",
    ("POST", "/api/runs/{run_id}/attempts/{attempt}/checkpoints"): "ingest",
    ("POST", "/api/runs/{run_id}/attempts/{attempt}/checkpoints/deleted"): "ingest",
    ("POST", "/api/runs/{run_id}/attempts/{attempt}/finished"): "ingest",
    ("GET", "/api/runs/{run_id}/commands"): "ingest",
    ("POST", "/api/runs/{run_id}/acks"): "ingest",
    ("POST", "/api/runs/{run_id}/actions"): "operate",
    ("POST", "/api/actions/{action_id}/approve"): "operate",
    ("POST", "/api/actions/{action_id}/cancel"): "operate",
    ("POST", "/api/runs/{run_id}/silences"): "operate",
    ("POST", "/api/silences/{silence_id}/end"): "operate",
    ("POST", "/api/runs/{run_id}/acknowledge"): "operate",
    ("GET", "/api/runs/{run_id}/silences"): "read",
    ("GET", "/api/tokens"): "admin",
    ("POST", "/api/tokens"): "admin",
    ("POST", "/api/tokens/{name}/revoke"): "admin",
    ("GET", "/api/runs"): "read",
    ("GET", "/api/runs/{run_id}"): "read",
    ("GET", "/api/runs/{run_id}/series"): "read",
    ("GET", "/api/runs/{run_id}/history"): "read",
    ("GET", "/api/runs/{run_id}/status"): "read",
    ("GET", "/api/runs/{run_id}/chart"): "read",
    ("GET", "/api/runs/{run_id}/times"): "read",
    ("GET", "/api/runs/{run_id}/chart.png"): "read",
    ("GET", "/api/runs/{run_id}/events"): "read",
    ("GET", "/api/runs/{run_id}/envelope"): "read",
    ("GET", "/api/runs/{run_id}/incidents"): "read",
    ("GET", "/api/runs/{run_id}/actions"): "read",
    ("GET", "/api/runs/{run_id}/audit"): "read",
    ("GET", "/api/runs/{run_id}/quarantine"): "read",
    ("GET", "/api/actions/{action_id}"): "read",
    ("GET", "/metrics"): "read",
    ("GET", "/"): "read",
    ("GET", "/runs/{run_id}/plot.png"): "read",
    ("GET", "/runs/{run_id}"): "read",
    ("GET", "/compare"): "read",
    ("GET", "/runs/{run_id}/attention"): "read",
}
# A token holding every scope but the one a route needs (admin would imply it).
ALL_BUT = {"ingest": ("read", "operate"), "read": ("ingest",), "operate": ("ingest", "read"),
           "admin": ("ingest", "read", "operate")}
# Bodies that would succeed with the right token: a refusal is the auth's doing, not the body's.
BODIES = {
    "/api/runs": {"run_id": "intruder", "attempt": 0, "world_size": 1},
    "/api/runs/{run_id}/attempts/{attempt}/steps": {"records": [{"step": 99, "loss": 1.0}]},
    "/api/runs/{run_id}/attempts/{attempt}/checkpoints": {"step": 3, "path": "/x", "sample_cursor": 48,
                                                          "healthy": True},
    "/api/runs/{run_id}/attempts/{attempt}/checkpoints/deleted": {"steps": [3], "reason": "x"},
    "/api/runs/{run_id}/attempts/{attempt}/finished": {"step": 5, "final_loss": 1.0, "reason": "closed"},
    "/api/runs/{run_id}/acks": {"command_id": 1, "ok": True, "first_step": 5},
    "/api/runs/{run_id}/actions": {"kind": "stop", "reason": "intruder"},
    "/api/actions/{action_id}/approve": {}, "/api/actions/{action_id}/cancel": {},
    "/api/runs/{run_id}/silences": {"signal": "stall", "for_s": 60},
    "/api/silences/{silence_id}/end": {},
    "/api/runs/{run_id}/acknowledge": {"incident": 1},
    "/api/tokens": {"name": "intruder", "scopes": ["admin"]},
}


def routes(app) -> set[tuple[str, str]]:
    out = set()
    for ctx in iter_route_contexts(app.routes):
        for m in ctx.methods or ():
            if m != "HEAD":
                out.add((m, ctx.path))
    return out


def snapshot(sup) -> dict[str, list]:
    """Every row of every table: what a refused request must leave as it was."""
    out = {}
    with sup.engine.connect() as c:
        for table in load_models().sorted_tables:
            rows = c.execute(sa.select(table)).all()
            out[table.name] = sorted(map(repr, rows))
    return out


@pytest.fixture
def sup(db, tmp_path):
    s = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, api_token=ADMIN_TOKEN),
                   notifier=ConsoleNotifier(io.StringIO()))
    s.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1, config={"steps": 100, "data": {"global_batch": 16}}))
    s.write(RUN, 0, [StepRecord(step=i, values={"loss": 2.0}) for i in range(5)])
    with s.sessions.begin() as ss:
        actions_store.enqueue_action(ss, RUN, "pause", {}, "seed", "manual", "seed", requires_approval=True)
    yield s
    s.close()


def _url(path: str, action_id: int) -> str:
    return (path.replace("{run_id}", RUN).replace("{attempt}", "0").replace("{action_id}", str(action_id))
            .replace("{name}", "alice"))


def _send(c, method, path, action_id, headers):
    body = BODIES.get(path)
    url = _url(path, action_id)
    if path.endswith("/history") or path.endswith("plot.png") or path.endswith("/chart") or path.endswith("/chart.png"):
        url += "?key=loss&metric=loss"
    return c.request(method, url, headers=headers, **({"json": body} if method == "POST" else {}))


def test_every_route_is_open_on_purpose_or_has_a_scope(sup):
    found = routes(build_app(sup))
    assert found - OPEN == set(SCOPE), ("routes without a declared scope (add them to SCOPE here, and "
                                        f"guard them): {sorted(found - OPEN - set(SCOPE))}; "
                                        f"stale entries: {sorted(set(SCOPE) - found)}")
    assert OPEN <= found


def test_no_token_bad_token_revoked_token_are_401_and_change_nothing(sup):
    alice = make_token(sup.sessions, "alice", "admin")
    with TestClient(build_app(sup), headers=AUTH) as c:
        assert c.post("/api/tokens/alice/revoke").status_code == 200
    with sup.sessions() as s:
        (action_id,) = [a.id for a in actions_store.actions(s, RUN)]
    before = snapshot(sup)
    with TestClient(build_app(sup), raise_server_exceptions=False) as c:
        for method, path in sorted(SCOPE):
            for headers in ({}, bearer("tw_" + "x" * 43), bearer(alice), {"Authorization": f"Basic {ADMIN_TOKEN}"}):
                r = _send(c, method, path, action_id, headers)
                assert r.status_code == 401, (method, path, headers, r.status_code, r.text[:300])
                if path.startswith("/api/"):
                    assert SCOPE[(method, path)] in r.json()["detail"] or "Bearer" in r.json()["detail"]
        assert c.get("/healthz").status_code == 200  # the liveness probe stays open
    assert snapshot(sup) == before


def test_a_token_without_the_scope_is_403_and_changes_nothing(sup):
    with sup.sessions() as s:
        (action_id,) = [a.id for a in actions_store.actions(s, RUN)]
    tokens = {scope: make_token(sup.sessions, f"all-but-{scope}", *others) for scope, others in ALL_BUT.items()}
    reader = make_token(sup.sessions, "reader", "read")
    trainer = make_token(sup.sessions, "trainer", "ingest")
    before = snapshot(sup)
    with TestClient(build_app(sup), raise_server_exceptions=False) as c:
        for (method, path), scope in sorted(SCOPE.items()):
            r = _send(c, method, path, action_id, bearer(tokens[scope]))
            assert r.status_code == 403, (method, path, r.status_code, r.text[:300])
            if path.startswith("/api/"):
                assert f"`{scope}` scope" in r.json()["detail"]
            if scope != "read":  # a read-only token cannot act, an ingest token cannot command
                assert _send(c, method, path, action_id, bearer(reader)).status_code == 403, (method, path)
            if scope not in ("ingest",):
                assert _send(c, method, path, action_id, bearer(trainer)).status_code == 403, (method, path)
    assert snapshot(sup) == before


def test_operate_implies_read_and_admin_everything(sup):
    op = make_token(sup.sessions, "oncall", "operate")
    with TestClient(build_app(sup)) as c:
        assert c.get(f"/api/runs/{RUN}", headers=bearer(op)).status_code == 200
        r = c.post(f"/api/runs/{RUN}/actions", json={"kind": "pause"}, headers=bearer(op))
        assert r.status_code == 201
        assert c.get(f"/api/runs/{RUN}/commands", headers=bearer(op)).status_code == 403
        assert c.get(f"/api/runs/{RUN}/commands", headers=AUTH).status_code == 200


def test_every_audit_row_of_a_request_names_its_token(sup):
    trainer = bearer(make_token(sup.sessions, "trainer-run7", "ingest"))
    oncall = bearer(make_token(sup.sessions, "oncall", "operate"))
    with TestClient(build_app(sup)) as c:
        assert c.post("/api/runs", json={"run_id": "r7", "attempt": 0, "world_size": 1,
                                         "config": {"steps": 50, "data": {"global_batch": 8}}},
                      headers=trainer).status_code == 201
        aid = c.post("/api/runs/r7/actions", json={"kind": "pause"}, headers=oncall).json()["action_id"]
        assert [x["id"] for x in c.get("/api/runs/r7/commands", headers=trainer).json()["commands"]] == [aid]
        assert c.post("/api/runs/r7/acks", json={"command_id": aid, "ok": True, "first_step": 3},
                      headers=trainer).status_code == 200
        audit = [(a["actor"], a["event"]) for a in c.get("/api/runs/r7/audit", headers=oncall).json()["audit"]]
    assert sorted(audit) == [("oncall", "enqueued"), ("trainer-run7", "attempt_opened"), ("trainer-run7", "done")]


def test_tokens_over_http_secret_once_hashed_at_rest_revocable(sup):
    with TestClient(build_app(sup), headers=AUTH) as c:
        r = c.post("/api/tokens", json={"name": "ci-bot", "scopes": ["operate", "read"]})
        assert r.status_code == 201, r.text
        secret = r.json()["secret"]
        assert r.json()["scopes"] == ["operate", "read"] and secret.startswith("tw_") and len(secret) > 40
        assert c.post("/api/tokens", json={"name": "ci-bot", "scopes": ["read"]}).status_code == 409
        r = c.post("/api/tokens", json={"name": "x", "scopes": ["root"]})
        assert r.status_code == 422 and "root" in r.json()["detail"]
        listed = c.get("/api/tokens").json()["tokens"]
        assert [t["name"] for t in listed] == ["ci-bot"] and secret not in str(listed)
        act = c.post(f"/api/runs/{RUN}/actions", json={"kind": "pause", "who": "bob"}, headers=bearer(secret))
        assert act.status_code == 201
        # at rest: only the digest; the secret is nowhere in any table
        dump = repr(snapshot(sup))
        assert secret not in dump and tokens_store.digest(secret) in dump
        assert ADMIN_TOKEN not in dump  # the configured token is never stored either
        assert c.post("/api/tokens/ci-bot/revoke").status_code == 200
        assert c.post("/api/tokens/ci-bot/revoke").status_code == 409
        assert c.post("/api/tokens/nobody/revoke").status_code == 404
        r = c.get(f"/api/runs/{RUN}", headers=bearer(secret))
        assert r.status_code == 401 and "revoked" in r.json()["detail"]
        audit = {(a["actor"], a["event"]) for a in c.get(f"/api/runs/{RUN}/audit").json()["audit"]}
        assert ("ci-bot (bob)", "enqueued") in audit
    with sup.sessions() as s:
        (row,) = tokens_store.list_tokens(s)
        assert row.revoked_at is not None
        from thermowatch.supervisor.store import audit as audit_store

        events = [(a.actor, a.event, a.detail.get("name")) for a in audit_store.audit_log(s) if a.run_id is None]
        assert ("config-admin", "token_created", "ci-bot") in events and ("config-admin", "token_revoked", "ci-bot") in events


def test_token_cli_create_list_revoke(db, tmp_path, capsys):
    from thermowatch.supervisor import db as dbmod

    assert main(["token", "create", "alice", "--scope", "read", "--scope", "operate", "--db", db.url]) == 0
    out = capsys.readouterr()
    secret = out.out.strip()
    assert secret.startswith("tw_") and "shown only now" in out.err and secret not in out.err
    authn = Authenticator(dbmod.make_sessionmaker(db.engine))
    p = authn.authenticate(secret)
    assert p.name == "alice" and p.scopes == frozenset({"read", "operate"})
    assert main(["token", "create", "alice", "--scope", "read", "--db", db.url]) == 2
    assert "exists already" in capsys.readouterr().err
    assert main(["token", "list", "--db", db.url]) == 0
    listing = capsys.readouterr().out
    assert "alice" in listing and "operate,read" in listing and "active" in listing and secret not in listing
    assert main(["token", "revoke", "alice", "--db", db.url]) == 0
    assert authn.authenticate(secret) is None
    assert main(["token", "list", "--db", db.url]) == 0
    assert "revoked" in capsys.readouterr().out
    assert main(["token", "revoke", "bob", "--db", db.url]) == 2
    with pytest.raises(SystemExit):
        main(["token", "create", "x", "--scope", "root", "--db", db.url])


def test_first_start_writes_an_owner_only_admin_token_once(db, tmp_path, caplog):
    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url)
    sessions = __import__("supervisor.db", fromlist=["x"]).make_sessionmaker(db.engine)
    old = os.umask(0o000)  # even under a permissive umask
    try:
        with caplog.at_level("WARNING"):
            path = bootstrap_admin(cfg, sessions)
    finally:
        os.umask(old)
    assert path == tmp_path / "data" / "admin-token"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    secret = path.read_text().strip()
    assert str(path.resolve()) in caplog.text and secret not in caplog.text
    p = Authenticator(sessions).authenticate(secret)
    assert p.name == "bootstrap-admin" and "admin" in p.scopes
    assert bootstrap_admin(cfg, sessions) is None and path.read_text().strip() == secret  # once
    with sessions.begin() as s:
        tokens_store.revoke(s, "bootstrap-admin")
    path.unlink()
    assert bootstrap_admin(cfg, sessions) is None and not path.exists()  # revoked != none: no new admin
    # a configured admin token: nothing is created
    cfg2 = SupervisorConfig(data_dir=tmp_path / "d2", db_url=db.url, api_token=ADMIN_TOKEN)
    assert bootstrap_admin(cfg2, sessions) is None


def test_configured_admin_token_from_env_or_file(tmp_path):
    f = tmp_path / "token"
    f.write_text(ADMIN_TOKEN + "\n")
    assert SupervisorConfig.load(env={"THERMOWATCH_API_TOKEN_FILE": str(f)}).api_token == ADMIN_TOKEN
    assert SupervisorConfig.load(env={"THERMOWATCH_API_TOKEN": "tw_abc"}).api_token == "tw_abc"
    (tmp_path / "db-url").write_text("sqlite:////var/lib/thermowatch/x.db\n")
    assert SupervisorConfig.load(env={"THERMOWATCH_DB_URL_FILE": str(tmp_path / "db-url")}).db_url == \
        "sqlite:////var/lib/thermowatch/x.db"
    cfg = SupervisorConfig.load(ROOT / "deploy" / "supervisor.example.yaml",
                                env={"THERMOWATCH_SLACK_TOKEN_FILE": "/run/credentials/x/slack"})
    assert (cfg.slack.channel, cfg.slack.token_file) == ("#training-oncall", "/run/credentials/x/slack")
    assert cfg.auth and is_loopback(cfg.host) and not cfg.public_read  # the shipped example: closed, loopback
    with pytest.raises(ConfigError, match="cannot read"):
        SupervisorConfig(api_token_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ConfigError, match="empty"):
        SupervisorConfig(api_token_file=str(tmp_path / "empty"))


@pytest.mark.parametrize("host, loopback", [("127.0.0.1", True), ("::1", True), ("[::1]", True),
                                            ("localhost", True), ("127.0.0.2", True), ("0.0.0.0", False),
                                            ("::", False), ("10.0.0.5", False), ("thermowatch.internal", False)])
def test_loopback(host, loopback):
    assert is_loopback(host) is loopback


def test_refuses_to_listen_off_loopback_without_auth(tmp_path, capsys):
    cfg = tmp_path / "sup.yaml"
    cfg.write_text(f"data_dir: {tmp_path / 'data'}\nauth: false\nhost: 0.0.0.0\n")
    assert main(["serve", "--config", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "refusing to listen on 0.0.0.0" in err and "auth: false" in err
    assert not (tmp_path / "data").exists()  # refused before anything was opened
    check_bind(SupervisorConfig(data_dir=tmp_path, host="0.0.0.0"))  # auth on: fine
    check_bind(SupervisorConfig(data_dir=tmp_path, host="127.0.0.1", auth=False))  # loopback dev: fine


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_first_start_as_deployed(tmp_path):
    """`thermowatch serve` with no token anywhere: it starts closed, writes the admin token file,
    logs its path (never the secret), and that token works."""
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("THERMOWATCH_")}
    log = tmp_path / "serve.log"
    proc = subprocess.Popen([sys.executable, "-m", "thermowatch.cli", "serve", "--data-dir", str(tmp_path / "data"),
                             "--port", str(port)], env={**env, "PYTHONUNBUFFERED": "1"}, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, proc, log)
        path = tmp_path / "data" / "admin-token"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        secret = path.read_text().strip()
        text = log.read_text()
        assert str(path.resolve()) in text and secret not in text
        assert httpx.get(f"{url}/api/runs", timeout=5).status_code == 401
        assert httpx.get(f"{url}/", timeout=5).status_code == 401
        r = httpx.get(f"{url}/api/tokens", headers=bearer(secret), timeout=5)
        assert r.status_code == 200 and [t["name"] for t in r.json()["tokens"]] == ["bootstrap-admin"]
    finally:
        proc.terminate()
        proc.wait(30)
