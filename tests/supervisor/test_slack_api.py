"""Approve / Cancel from Slack (supervisor.api.slack): the buttons on an approval alert and the
interactivity endpoint, over real HTTP (uvicorn) with requests signed as Slack signs them, on the
real Supervisor with a real divergence in advise-only mode, the real outbox, slack-sdk and the
fake Slack, on SQLite and PostgreSQL. A correctly signed click approves as the Slack user and the
reply lands in the incident's thread; a bad signature, a replayed old timestamp, an unknown
action, an unknown action id and a second click are 4xx and change nothing. Without a signing
secret there are no buttons and the endpoint is a 404."""

from __future__ import annotations

import io
import json
import time
from urllib.parse import urlencode

import httpx
import pytest
from slack_sdk.signature import SignatureVerifier

from monitors.contract import RunInfo
from supervisor.config import SupervisorConfig
from supervisor.notify.base import FanOut
from supervisor.notify.console import ConsoleNotifier
from supervisor.notify.slack import APPROVE, CANCEL, SlackNotifier
from supervisor.server import build_app
from supervisor.service import Supervisor
from supervisor.store import actions as actions_store
from supervisor.store import audit as audit_store
from tests.fakes.slack_server import FakeSlack
from tests.fixtures.diverging import DETECTORS, POLICY, diverging_records, feed
from tests.live_server import running
from tests.supervisor.auth_helpers import ADMIN_TOKEN

pytestmark = pytest.mark.timeout(120)
RUN = "ask"
SECRET = "8f742231b10e8888abcd99yyyzzz85a5"  # a Slack app signing secret's shape
URL = "/api/slack/interactions"


@pytest.fixture
def slack():
    with FakeSlack() as fake:
        yield fake


def make_sup(db, tmp_path, slack: FakeSlack, *, secret: str | None = SECRET) -> Supervisor:
    slack_cfg = {"signing_secret_env": ""}  # never the test runner's environment
    if secret is not None:
        (tmp_path / "signing-secret").write_text(secret + "\n")
        slack_cfg["signing_secret_file"] = str(tmp_path / "signing-secret")
    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, policy=dict(POLICY), detectors=dict(DETECTORS),
                           advise_only=True, api_token=ADMIN_TOKEN, slack=slack_cfg)
    notifier = FanOut([ConsoleNotifier(io.StringIO()),
                       SlackNotifier(slack.token, "#training-alerts", base_url=slack.base_url, retries=1,
                                     interactive=secret is not None)])
    sup = Supervisor(cfg, notifier=notifier)
    sup.executor.outbox.retry_s = 0.1
    sup.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
    return sup


def _waiting(sup, tmp_path) -> actions_store.ActionRow:
    """A real divergence; in advise-only mode its rollback waits for a human."""
    def waiting():
        with sup.sessions() as s:
            return [a for a in actions_store.open_actions(s, RUN) if a.requires_approval]

    feed(sup, RUN, 0, diverging_records(), ckpt_root=tmp_path / "ckpt", stop=lambda: bool(waiting()))
    (act,) = waiting()
    return act


def click(base: str, action_id: int | str, button: str = APPROVE, *, secret: str = SECRET,
          age_s: float = 0.0, user: str = "alice") -> httpx.Response:
    """POST a block_actions payload as Slack does: a form body `payload=<JSON>`, signed with
    HMAC-SHA256 over `v0:<timestamp>:<body>`."""
    payload = {"type": "block_actions", "user": {"id": "U0ALICE", "username": user, "name": user, "team_id": "T0FAKE"},
               "team": {"id": "T0FAKE"}, "container": {"type": "message", "channel_id": "C00000001"},
               "actions": [{"type": "button", "action_id": button, "block_id": f"approval:{action_id}",
                            "value": str(action_id), "action_ts": str(time.time())}]}
    body = urlencode({"payload": json.dumps(payload)})
    ts = str(int(time.time() - age_s))
    sig = SignatureVerifier(secret).generate_signature(timestamp=ts, body=body)
    return httpx.post(base + URL, content=body, timeout=10,
                      headers={"Content-Type": "application/x-www-form-urlencoded",
                               "X-Slack-Request-Timestamp": ts, "X-Slack-Signature": sig})


def _state(sup, action_id: int) -> tuple:
    with sup.sessions() as s:
        a = actions_store.get_action(s, action_id)
        decided = [r for r in audit_store.audit_log(s, RUN) if r.event in ("approved", "cancelled")]
        return a.state, a.requires_approval, a.who, len(decided)


def test_a_signed_click_approves_as_the_slack_user_and_replies_in_the_thread(db, tmp_path, slack):
    sup = make_sup(db, tmp_path, slack)
    try:
        act = _waiting(sup, tmp_path)
        assert sup.executor.outbox.drain(60)
        (top,) = [m for m in slack.top_level() if f"[action {act.id}]" in m["text"]]
        (buttons,) = [b for b in top["blocks"] if b["type"] == "actions"]
        assert [(e["action_id"], e["value"]) for e in buttons["elements"]] == [(APPROVE, str(act.id)),
                                                                                (CANCEL, str(act.id))]
        before = _state(sup, act.id)
        assert before[:2] == ("pending", True) and before[3] == 0
        with running(build_app(sup)) as base:
            refused = {
                "bad signature": click(base, act.id, secret="not-the-secret"),
                "replayed old timestamp": click(base, act.id, age_s=6 * 60),
                "unknown action": click(base, act.id, "thermowatch_rm_rf"),
                "unknown action id": click(base, 999_999),
                "unsigned": httpx.post(base + URL, content="payload={}", timeout=10),
            }
            assert {k: r.status_code for k, r in refused.items()} == {
                "bad signature": 401, "replayed old timestamp": 401, "unknown action": 400,
                "unknown action id": 404, "unsigned": 401}
            assert "unknown Slack action 'thermowatch_rm_rf'" in refused["unknown action"].json()["detail"]
            assert _state(sup, act.id) == before, "a refused click changed something"

            ok = click(base, act.id)  # no thermowatch token: Slack's signature is the credential
            assert ok.status_code == 200, ok.text
            assert ok.json() == {"ok": True, "action_id": act.id, "event": "approved", "who": "slack:alice"}
            again = click(base, act.id, CANCEL)  # a second click on the stale message
            assert again.status_code == 409
        state, needs_ok, who, decided = _state(sup, act.id)
        assert (state, needs_ok, who, decided) == ("pending", False, "slack:alice", 1)
        with sup.sessions() as s:
            (row,) = [r for r in audit_store.audit_log(s, RUN) if r.event == "approved"]
        assert row.actor == "slack:alice" and row.detail == {"action_id": act.id}
        assert [c.id for c in sup.poll(RUN)] == [act.id]  # approved: it goes to the trainer
        # The reply is in the incident's thread; the top message says so and has no buttons left.
        assert sup.executor.outbox.drain(30)
        thread = [m for m in slack.thread(top["ts"]) if m.get("subtype") != "file_share"]
        assert f"slack:alice approved rollback (action {act.id})" in thread[-1]["text"]
        now = slack.messages[top["ts"]]
        assert not [b for b in now["blocks"] if b["type"] == "actions"]
        assert f"*now:* rollback (action {act.id}) approved by slack:alice" in json.dumps(now["blocks"])
    finally:
        sup.close()


def test_cancel_from_slack(db, tmp_path, slack):
    sup = make_sup(db, tmp_path, slack)
    try:
        act = _waiting(sup, tmp_path)
        with running(build_app(sup)) as base:
            r = click(base, act.id, CANCEL, user="bob")
        assert r.status_code == 200 and r.json()["event"] == "cancelled"
        assert _state(sup, act.id)[0] == "cancelled"
        assert sup.poll(RUN) == []
    finally:
        sup.close()


def test_without_a_signing_secret_no_buttons_and_the_endpoint_is_404(db, tmp_path, slack):
    sup = make_sup(db, tmp_path, slack, secret=None)
    try:
        act = _waiting(sup, tmp_path)
        assert sup.executor.outbox.drain(60)
        (top,) = [m for m in slack.top_level() if f"[action {act.id}]" in m["text"]]
        assert not [b for b in top["blocks"] if b["type"] == "actions"]
        assert f"thermowatch approve {act.id}" in json.dumps(top["blocks"])  # the command still is
        with running(build_app(sup)) as base:
            r = click(base, act.id)
        assert r.status_code == 404 and "signing_secret" in r.json()["detail"]
        assert _state(sup, act.id)[:2] == ("pending", True)
    finally:
        sup.close()


def test_from_config_turns_buttons_on_only_with_a_secret(tmp_path, slack):
    settings = SupervisorConfig(data_dir=tmp_path, slack={"channel": "#c", "base_url": slack.base_url,
                                                          "signing_secret_env": "SIGNING"}).slack
    env = {"SLACK_BOT_TOKEN": slack.token}
    assert not SlackNotifier.from_config(settings, environ=env).interactive
    assert SlackNotifier.from_config(settings, environ={**env, "SIGNING": SECRET}).interactive
    missing = SupervisorConfig(data_dir=tmp_path, slack={"channel": "#c", "signing_secret_file": "/nonexistent/s"}).slack
    with pytest.raises(Exception, match="signing secret file /nonexistent/s cannot be read"):
        SlackNotifier.from_config(missing, environ=env)


def test_an_unreadable_signing_secret_file_stops_the_start(tmp_path):
    from supervisor.errors import UserError

    cfg = SupervisorConfig(data_dir=tmp_path / "data", slack={"signing_secret_file": str(tmp_path / "nope")})
    with pytest.raises(UserError, match="signing secret file .*nope cannot be read"):
        Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()))
    assert not (tmp_path / "data").exists()  # refused before anything was created
