"""The command channel and manual actions over HTTP (supervisor.serve.api.commands via
server.build_app): happy paths, every 4xx with its message, token auth, and that a bad
request changes nothing stored. One test runs a real uvicorn server on a free port."""

from __future__ import annotations

import io
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from thermowatch.monitors.contract import RunInfo
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import skips as skips_store
from tests.fixtures.diverging import DETECTORS, POLICY, diverging_records, feed
from tests.supervisor.auth_helpers import ADMIN_TOKEN, AUTH, bearer, make_token

RUN = "api"


def make_sup(db, tmp_path, **over) -> Supervisor:
    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, policy=dict(POLICY),
                           detectors=dict(DETECTORS), **{"api_token": ADMIN_TOKEN, **over})
    sup = Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()))
    sup.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1), "trainer-1")  # as trainer-1's token would
    return sup


@pytest.fixture
def sup(db, tmp_path):
    s = make_sup(db, tmp_path)
    yield s
    s.close()


@pytest.fixture
def client(sup):
    with TestClient(build_app(sup), headers=AUTH) as c:
        yield c


def stored(sup) -> tuple:
    """Everything a command request could change."""
    with sup.sessions() as s:
        acts = [(a.id, a.kind, a.state, a.args, a.who, a.requires_approval, a.attempts, a.ack_step)
                for a in actions_store.actions(s, RUN)]
        return acts, skips_store.skip_ranges(s, RUN), len(audit_store.audit_log(s, RUN))


def submit(client, kind="skip", args=None, who="bob", **kw):
    body = {"kind": kind, "args": {"skip_ranges": [[10, 20]]} if args is None else args, "who": who, **kw}
    return client.post(f"/api/runs/{RUN}/actions", json=body)


def test_submit_poll_ack_happy_path(client, sup):
    r = submit(client, reason="bad shard")
    assert r.status_code == 201, r.text
    aid = r.json()["action_id"]
    r = client.get(f"/api/runs/{RUN}/commands")
    assert r.status_code == 200
    assert r.json() == {"commands": [{"id": aid, "kind": "skip", "args": {"skip_ranges": [[10, 20]]}}]}
    assert client.get(f"/api/runs/{RUN}/commands").json() == {"commands": []}
    r = client.post(f"/api/runs/{RUN}/acks", json={"command_id": aid, "ok": True, "step": 12, "detail": "ok"})
    assert r.status_code == 200 and r.json() == {"ok": True}
    with sup.sessions() as s:
        row = actions_store.get_action(s, aid)
        assert (row.state, row.ack_step, row.origin, row.who, row.reason) == ("done", 12, "manual", "config-admin (bob)", "bad shard")
        assert skips_store.skip_ranges(s, RUN) == [(10, 20)]
    # the read API shows the same row
    acts = client.get(f"/api/runs/{RUN}/actions").json()["actions"]
    assert [(a["id"], a["state"]) for a in acts] == [(aid, "done")]


def test_a_pause_says_why_in_its_args_as_the_document_states(client, sup):
    """The API's schema for each kind's args is checked against the command's own keys at import
    (schemas.ARGS_MODELS); a pause's `reason` was taken but documented nowhere."""
    from thermowatch.supervisor.serve.api.schemas import ManualActionBody

    body = {"kind": "pause", "args": {"reason": "eval shows a regression"}, "who": "bob"}
    ManualActionBody.model_validate(body)  # the document allows it ...
    r = client.post(f"/api/runs/{RUN}/actions", json=body)
    assert r.status_code == 201, r.text  # ... and the daemon takes it
    assert client.get(f"/api/runs/{RUN}/commands").json()["commands"][0]["args"] == {"reason": "eval shows a regression"}
    for bad, words in (({"why": "x"}, "why"), ({"reason": {}}, "reason must be a string")):
        r = client.post(f"/api/runs/{RUN}/actions", json={"kind": "pause", "args": bad})
        assert r.status_code == 422 and words in r.text, r.text  # never the default reason in its place


def test_ack_ok_must_be_a_boolean(client, sup):
    """`"ok": "false"` is a refusal spelled as a string; read as truthy it would book the
    command's effects (skip ranges, LR change) for a command the trainer refused."""
    aid = submit(client).json()["action_id"]
    client.get(f"/api/runs/{RUN}/commands")
    before = stored(sup)
    r = client.post(f"/api/runs/{RUN}/acks", json={"command_id": aid, "ok": "false", "step": 12})
    assert r.status_code == 422, (r.status_code, r.text)
    assert "ok" in r.json()["detail"]
    # Nothing booked, and the command does not hang in `sent`: it failed, saying why.
    acts, skips, _ = stored(sup)
    assert skips == before[1] == []
    with sup.sessions() as s:
        row = actions_store.get_action(s, aid)
    assert row.state == "failed" and "ok must be true or false" in row.error


def test_poll_for_an_unknown_run_is_404(client, sup):
    """A controller polling under a wrong run id must learn it, not wait forever for commands."""
    r = client.get("/api/runs/no-such-run/commands")
    assert r.status_code == 404, (r.status_code, r.text)
    assert "no-such-run" in r.json()["detail"]


def test_cancel_happy_path_and_twice_is_409(client, sup):
    aid = submit(client).json()["action_id"]
    r = client.post(f"/api/actions/{aid}/cancel", json={"who": "alice"})
    assert r.status_code == 200 and r.json() == {"ok": True}
    before = stored(sup)
    r = client.post(f"/api/actions/{aid}/cancel", json={"who": "alice"})
    assert r.status_code == 409 and "cancelled" in r.json()["detail"]
    assert client.get(f"/api/runs/{RUN}/commands").json() == {"commands": []}
    assert stored(sup) == before


def test_approve_happy_path_and_twice_is_409(db, tmp_path):
    sup = make_sup(db, tmp_path, advise_only=True)
    try:
        feed(sup, RUN, 0, diverging_records(), ckpt_root=tmp_path / "ckpt",
             stop=lambda: bool(stored(sup)[0]))
        (aid, kind, state, args, *_), = stored(sup)[0]
        assert (kind, state) == ("rollback", "pending")
        with TestClient(build_app(sup), headers=AUTH) as c:
            assert c.get(f"/api/runs/{RUN}/commands").json() == {"commands": []}
            r = c.post(f"/api/actions/{aid}/approve", json={"who": "alice"})
            assert r.status_code == 200, r.text
            before = stored(sup)
            r = c.post(f"/api/actions/{aid}/approve", json={"who": "alice"})
            assert r.status_code == 409 and "not a pending action awaiting approval" in r.json()["detail"]
            assert stored(sup) == before
            cmds = c.get(f"/api/runs/{RUN}/commands").json()["commands"]
            assert [(x["id"], x["kind"]) for x in cmds] == [(aid, "rollback")]
            assert cmds[0]["args"] == args
    finally:
        sup.close()


@pytest.mark.parametrize("method, path, body, status, words", [
    # unknown run / action
    ("post", "/api/runs/nope/actions", {"kind": "pause", "who": "bob"}, 404, "no run 'nope'"),
    ("post", f"/api/runs/{RUN}/acks", {"command_id": 999, "ok": True, "step": 1}, 404, "no action 999"),
    ("post", "/api/runs/nope/acks", {"command_id": 1, "ok": True, "step": 1}, 404, "has no action"),
    ("post", "/api/actions/999/approve", {"who": "alice"}, 404, "no action 999"),
    ("post", "/api/actions/999/cancel", {"who": "alice"}, 404, "no action 999"),
    # bad kind, bad args (the message names the field)
    ("post", f"/api/runs/{RUN}/actions", {"kind": "explode", "who": "bob"}, 422, "unknown command 'explode'"),
    ("post", f"/api/runs/{RUN}/actions", {"kind": "rollback", "args": {}, "who": "bob"}, 422, "to_step"),
    ("post", f"/api/runs/{RUN}/actions", {"kind": "rollback", "args": {"to_step": -3}, "who": "bob"}, 422, "to_step"),
    ("post", f"/api/runs/{RUN}/actions", {"kind": "skip", "args": {"skip_ranges": [[5, 5]]}, "who": "bob"}, 422,
     "lo must be < hi"),
    ("post", f"/api/runs/{RUN}/actions", {"kind": "set_lr", "args": {"lr_multiplier": 0}, "who": "bob"}, 422,
     "lr_multiplier"),
    ("post", f"/api/runs/{RUN}/actions", {"kind": "pause", "who": "x" * 91}, 422, "who"),
    ("post", f"/api/runs/{RUN}/acks", {"command_id": "x", "ok": True, "step": 1}, 422, "command_id"),
    ("post", f"/api/runs/{RUN}/acks", {"ok": True, "step": 1}, 422, "command_id"),
])
def test_bad_requests_are_4xx_with_a_message_and_change_nothing(client, sup, method, path, body, status, words):
    good = submit(client).json()["action_id"]
    before = stored(sup)
    r = getattr(client, method)(path, json=body)
    assert r.status_code == status, r.text
    assert words in str(r.json()["detail"])
    assert stored(sup) == before
    # and the next good request still works
    assert [c["id"] for c in client.get(f"/api/runs/{RUN}/commands").json()["commands"]] == [good]


@pytest.mark.parametrize("path", [f"/api/runs/{RUN}/acks", f"/api/runs/{RUN}/actions",
                                  "/api/actions/1/approve", "/api/actions/1/cancel"])
def test_malformed_json_is_400(client, sup, path):
    submit(client)
    before = stored(sup)
    r = client.post(path, content=b'{"command_id": 1, "ok": tru', headers={"content-type": "application/json"})
    assert r.status_code == 400, (r.status_code, r.text)
    assert "JSON" in str(r.json()["detail"])
    assert stored(sup) == before


def test_token_auth(db, tmp_path):
    """The command routes' scopes: the trainer's (`ingest`) polls and acks, a person's
    (`operate`) submits, approves and cancels; neither can do the other's."""
    sup = make_sup(db, tmp_path, api_token="")
    try:
        trainer = bearer(make_token(sup.sessions, "trainer-1", "ingest"))
        alice = bearer(make_token(sup.sessions, "alice", "operate"))
        with TestClient(build_app(sup)) as c:
            for method, path, body, scope in (("get", f"/api/runs/{RUN}/commands", None, "ingest"),
                                              ("post", f"/api/runs/{RUN}/actions", {"kind": "pause"}, "operate"),
                                              ("post", f"/api/runs/{RUN}/acks", {"command_id": 1, "ok": True, "step": 1},
                                               "ingest"),
                                              ("post", "/api/actions/1/cancel", {}, "operate"),
                                              ("post", "/api/actions/1/approve", {}, "operate")):
                kw = {"json": body} if body is not None else {}
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "Basic YTpi"}):
                    r = getattr(c, method)(path, headers=headers, **kw)
                    assert r.status_code == 401, (path, r.status_code)
                    assert r.headers["www-authenticate"].startswith("Bearer")
                wrong = alice if scope == "ingest" else trainer
                r = getattr(c, method)(path, headers=wrong, **kw)
                assert r.status_code == 403 and f"`{scope}` scope" in r.json()["detail"], (path, r.text)
            assert stored(sup)[0] == []
            r = c.post(f"/api/runs/{RUN}/actions", json={"kind": "pause"}, headers={"authorization": "bEaReR " +
                                                                                   alice["Authorization"][7:]})
            assert r.status_code == 201, r.text  # the scheme in any case (RFC 7235)
            cmds = c.get(f"/api/runs/{RUN}/commands", headers=trainer).json()["commands"]
            assert [x["kind"] for x in cmds] == ["pause"]
        with sup.sessions() as s:
            (act,) = actions_store.actions(s, RUN)
            assert act.who == "alice"  # the token's name, not a name the body claims
            assert [a.actor for a in audit_store.audit_log(s, RUN) if a.event == "enqueued"] == ["alice"]
    finally:
        sup.close()


def test_claimed_who_is_recorded_beside_the_token_name(client, sup):
    aid = submit(client, who="bob").json()["action_id"]
    assert client.post(f"/api/actions/{aid}/cancel", json={"who": "carol"}).status_code == 200
    with sup.sessions() as s:
        assert actions_store.get_action(s, aid).who == "config-admin (bob)"
        assert {a.event: a.actor for a in audit_store.audit_log(s, RUN) if a.event in ("enqueued", "cancelled")} == {
            "enqueued": "config-admin (bob)", "cancelled": "config-admin (carol)"}


def test_auth_is_checked_before_the_body(db, tmp_path):
    """Without the token every mutating call is 401, whatever the body: a client without the
    token learns nothing about what a valid request looks like."""
    sup = make_sup(db, tmp_path)
    try:
        with TestClient(build_app(sup)) as c:
            for path, body in ((f"/api/runs/{RUN}/actions", {"kind": "pause"}),
                               ("/api/actions/1/approve", {}), ("/api/actions/1/cancel", {"who": ""}),
                               (f"/api/runs/{RUN}/acks", {"ok": True}), ("/api/actions/x/approve", b"{"),
                               (f"/api/runs/{RUN}/attempts/-1/steps", b"nope")):
                kw = {"content": body} if isinstance(body, bytes) else {"json": body}
                r = c.post(path, **kw)
                assert r.status_code == 401, (path, r.status_code, r.text)
    finally:
        sup.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_real_uvicorn_server(sup):
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(sup), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, headers=AUTH) as c:
            r = c.post(f"/api/runs/{RUN}/actions", json={"kind": "set_lr", "args": {"lr_multiplier": 0.5},
                                                         "who": "bob", "reason": "loss noisy"})
            assert r.status_code == 201, r.text
            aid = r.json()["action_id"]
            assert c.post(f"/api/runs/{RUN}/actions", json={"kind": "set_lr", "args": {"lr_multiplier": 50},
                                                            "who": "bob"}).status_code == 422
            assert c.post(f"/api/runs/{RUN}/acks", content=b"not json").status_code == 400
            cmds = c.get(f"/api/runs/{RUN}/commands").json()["commands"]
            assert cmds == [{"id": aid, "kind": "set_lr", "args": {"lr_multiplier": 0.5, "lr_steps": None,
                                                                   "rewarmup_steps": 0}}]
            assert c.post(f"/api/runs/{RUN}/acks", json={"command_id": aid, "ok": True, "step": 40}).json() == {"ok": True}
    finally:
        server.should_exit = True
        thread.join(20)
    with sup.sessions() as s:
        from thermowatch.supervisor.store import lr_changes as lr_store

        assert [(c.multiplier, c.start_step) for c in lr_store.lr_changes(s, RUN)] == [(0.5, 40)]
        assert actions_store.get_action(s, aid).state == "done"
