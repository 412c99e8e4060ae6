"""Approve / Cancel from Slack (supervisor.serve.api.slack): the buttons on an approval alert and the
interactivity endpoint, over real HTTP (uvicorn) with requests signed as Slack signs them, on the
real Supervisor with a real divergence in advise-only mode, the real outbox, slack-sdk and the
fake Slack, on SQLite and PostgreSQL. A correctly signed click by an approver (slack.approvers,
issue 21) approves as the Slack user and the reply lands in the incident's thread; a bad
signature, a replayed old timestamp, an unknown action, an unknown action id and a second click
are 4xx and change nothing. Without a signing secret there are no buttons and the endpoint is a
404. Hostile requests (issue 21: bytes that are not UTF-8, Unicode digits, a non-ASCII
signature) are 4xx through the real app, and a NUL in a Slack name never reaches the database."""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import logging
import time
from urllib.parse import urlencode

import httpx
import pytest
from fastapi.testclient import TestClient
from slack_sdk.signature import SignatureVerifier

from thermowatch.monitors.contract import RunInfo
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.notify.base import FanOut
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.notify.slack import APPROVE, CANCEL, SlackNotifier
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import audit as audit_store
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


def slack_config(tmp_path, slack: FakeSlack, *, secret: str | None = SECRET, approvers=("U0ALICE", "U0BOB"),
                 **more) -> dict:
    """The `slack:` section: the fake's address, its token and the signing secret in files (never
    the test runner's environment), and who may click."""
    (tmp_path / "bot-token").write_text(slack.token + "\n")
    cfg = {"channel": "#training-alerts", "base_url": slack.base_url, "token_file": str(tmp_path / "bot-token"),
           "signing_secret_env": "", "approvers": list(approvers), **more}
    if secret is not None:
        (tmp_path / "signing-secret").write_text(secret + "\n")
        cfg["signing_secret_file"] = str(tmp_path / "signing-secret")
    return cfg


def advise_only(db, tmp_path, **over) -> SupervisorConfig:
    """The diverging fixture's detectors and policy in advise-only mode (a rollback waits for a
    human), auth on."""
    return SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, policy=dict(POLICY), detectors=dict(DETECTORS),
                            advise_only=True, api_token=ADMIN_TOKEN, **over)


def opened(cfg: SupervisorConfig, notifier, run: str, retry_s: float) -> Supervisor:
    """A Supervisor whose outbox retries every `retry_s`, with attempt 0 of `run` open."""
    sup = Supervisor(cfg, notifier=notifier)
    sup.executor.outbox.retry_s = retry_s
    sup.open_run(RunInfo(run_id=run, attempt=0, world_size=1))
    return sup


def make_sup(db, tmp_path, slack: FakeSlack, *, secret: str | None = SECRET, approvers=("U0ALICE", "U0BOB"),
             **more) -> Supervisor:
    cfg = advise_only(db, tmp_path, slack=slack_config(tmp_path, slack, secret=secret, approvers=approvers, **more))
    # The notifier serve() builds (buttons only with a secret and approvers), with one retry.
    notifier = FanOut([ConsoleNotifier(io.StringIO()), SlackNotifier.from_config(cfg.slack, retries=1)])
    return opened(cfg, notifier, RUN, retry_s=0.1)


def _waiting(sup, tmp_path, run: str = RUN) -> actions_store.ActionRow:
    """A real divergence; in advise-only mode its rollback waits for a human."""
    def waiting():
        with sup.sessions() as s:
            return [a for a in actions_store.open_actions(s, run) if a.requires_approval]

    feed(sup, run, 0, diverging_records(), ckpt_root=tmp_path / "ckpt", stop=lambda: bool(waiting()))
    (act,) = waiting()
    return act


USERS = {"alice": "U0ALICE", "bob": "U0BOB", "mallory": "U0MALLORY", "carol": "U0CAROL", "dave": "U0DAVE"}


def payload(action_id: int | str, button: str = APPROVE, *, user: str = "alice", user_id: str | None = None) -> dict:
    """Slack's block_actions payload for a click on one of the alert's buttons."""
    return {"type": "block_actions",
            "user": {"id": user_id or USERS.get(user, "U0ALICE"), "username": user, "name": user, "team_id": "T0FAKE"},
            "team": {"id": "T0FAKE"}, "container": {"type": "message", "channel_id": "C00000001"},
            "actions": [{"type": "button", "action_id": button, "block_id": f"approval:{action_id}",
                         "value": str(action_id), "action_ts": str(time.time())}]}


def click(base: str | TestClient, action_id: int | str, button: str = APPROVE, *, secret: str = SECRET,
          age_s: float = 0.0, user: str = "alice", user_id: str | None = None) -> httpx.Response:
    """POST a block_actions payload as Slack does: a form body `payload=<JSON>`, signed with
    HMAC-SHA256 over `v0:<timestamp>:<body>` (by slack-sdk's own SignatureVerifier)."""
    body = urlencode({"payload": json.dumps(payload(action_id, button, user=user, user_id=user_id))})
    ts = str(int(time.time() - age_s))
    sig = SignatureVerifier(secret).generate_signature(timestamp=ts, body=body)
    return post(base, body.encode(), ts.encode(), sig.encode())


def sign(body: bytes, ts: bytes, secret: str = SECRET) -> bytes:
    """Slack's signature over raw bytes, so a body that is not UTF-8 can be signed too."""
    return b"v0=" + hmac.new(secret.encode(), b"v0:" + ts + b":" + body, hashlib.sha256).hexdigest().encode()


def post(base: str | TestClient, body: bytes, ts: bytes, sig: bytes) -> httpx.Response:
    """Headers as bytes: the server reads them as latin-1, as Starlette and uvicorn do."""
    headers = {"Content-Type": "application/x-www-form-urlencoded", "X-Slack-Request-Timestamp": ts,
               "X-Slack-Signature": sig}
    if isinstance(base, TestClient):
        return base.post(URL, content=body, headers=headers)
    return httpx.post(base + URL, content=body, headers=headers, timeout=10)


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
            assert ok.json() == {"ok": True, "action_id": act.id, "event": "approved", "who": "slack:alice (U0ALICE)"}
            again = click(base, act.id, CANCEL)  # a second click on the stale message
            assert again.status_code == 409
        state, needs_ok, who, decided = _state(sup, act.id)
        assert (state, needs_ok, who, decided) == ("pending", False, "slack:alice (U0ALICE)", 1)
        with sup.sessions() as s:
            (row,) = [r for r in audit_store.audit_log(s, RUN) if r.event == "approved"]
        assert row.actor == "slack:alice (U0ALICE)" and row.detail["action_id"] == act.id
        assert row.detail["said"].startswith("loads checkpoint ")  # re-read at approval (issue 23)
        assert [c.id for c in sup.poll(RUN)] == [act.id]  # approved: it goes to the trainer
        # The reply is in the incident's thread; the top message says so and has no buttons left.
        assert sup.executor.outbox.drain(30)
        thread = [m for m in slack.thread(top["ts"]) if m.get("subtype") != "file_share"]
        assert f"slack:alice (U0ALICE) approved rollback (action {act.id})" in thread[-1]["text"]
        now = slack.messages[top["ts"]]
        assert not [b for b in now["blocks"] if b["type"] == "actions"]
        assert f"*now:* rollback (action {act.id}) approved by slack:alice (U0ALICE)" in json.dumps(now["blocks"])
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


def test_from_config_turns_buttons_on_only_with_a_secret_and_approvers(tmp_path, slack):
    def settings(**more):
        return SupervisorConfig(data_dir=tmp_path, slack={"channel": "#c", "base_url": slack.base_url,
                                                          "signing_secret_env": "SIGNING", **more}).slack

    env, signed = {"SLACK_BOT_TOKEN": slack.token}, {"SLACK_BOT_TOKEN": slack.token, "SIGNING": SECRET}
    assert not SlackNotifier.from_config(settings(approvers=["U0ALICE"]), environ=env).interactive
    assert SlackNotifier.from_config(settings(approvers=["U0ALICE"]), environ=signed).interactive
    assert SlackNotifier.from_config(settings(approver_groups=["S0ONCALL"]), environ=signed).interactive
    # closed by default: a secret and nobody who may click is no buttons
    assert not SlackNotifier.from_config(settings(), environ=signed).interactive
    missing = SupervisorConfig(data_dir=tmp_path, slack={"channel": "#c", "signing_secret_file": "/nonexistent/s"}).slack
    with pytest.raises(Exception, match="signing secret file /nonexistent/s cannot be read"):
        SlackNotifier.from_config(missing, environ=env)


def test_an_unreadable_signing_secret_file_stops_the_start(tmp_path):
    from thermowatch.supervisor.errors import UserError

    cfg = SupervisorConfig(data_dir=tmp_path / "data", slack={"signing_secret_file": str(tmp_path / "nope")})
    with pytest.raises(UserError, match="signing secret file .*nope cannot be read"):
        Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()))
    assert not (tmp_path / "data").exists()  # refused before anything was created


# --- hostile requests (issue 21): a 4xx naming what was wrong, never a 500; nothing changes ----------

ARABIC_INDIC = str.maketrans("0123456789", "\u0660\u0661\u0662\u0663\u0664\u0665\u0666\u0667\u0668\u0669")


def _signed(p: dict) -> tuple[bytes, bytes, bytes]:
    body = urlencode({"payload": json.dumps(p)}).encode()
    ts = str(int(time.time())).encode()
    return body, ts, sign(body, ts)


def _hostile(case: str, action_id: int) -> tuple[bytes, bytes, bytes]:
    """(body, X-Slack-Request-Timestamp, X-Slack-Signature) as bytes on the wire."""
    if case == "a body that is not UTF-8":
        ts = str(int(time.time())).encode()
        return b"payload=\xff", ts, sign(b"payload=\xff", ts)  # correctly signed over the bytes
    if case == "a timestamp in superscript digits":
        body, _, _ = _signed(payload(action_id))
        return body, "\u00b2".encode("latin-1"), sign(body, "\u00b2".encode("latin-1"))  # '²'.isdigit() is True
    if case == "a signature that is not ASCII":
        body, ts, sig = _signed(payload(action_id))
        return body, ts, sig[:-1] + "\u00e9".encode("latin-1")
    p = payload(action_id)
    # '²' makes int() raise; Arabic-Indic digits make int() read the very action id the click names
    p["actions"][0]["value"] = "\u00b2" if case == "a button value '²'" else str(action_id).translate(ARABIC_INDIC)
    return _signed(p)


@pytest.mark.parametrize("case, status, message", [
    ("a body that is not UTF-8", 400, "the body is not UTF-8 text (byte 0xff at 8)"),
    ("a timestamp in superscript digits", 401, "X-Slack-Request-Timestamp: ASCII digits"),
    ("a signature that is not ASCII", 401, "X-Slack-Signature: v0=<64 hex>"),
    ("a button value '²'", 400, "the button's value must be an action id (1 to 9 ASCII digits), got '\\xb2'"),
    ("a button value in Arabic-Indic digits", 400, "the button's value must be an action id (1 to 9 ASCII digits)"),
])
def test_a_hostile_request_is_a_4xx_with_its_reason_and_changes_nothing(db, tmp_path, slack, case, status, message):
    sup = make_sup(db, tmp_path, slack)
    try:
        act = _waiting(sup, tmp_path)
        before = _state(sup, act.id)
        # Over real HTTP: TestClient re-encodes header values as UTF-8, so a lone byte such as
        # 0xb2 ('²' in latin-1, as servers read headers) only arrives as sent through uvicorn.
        with running(build_app(sup)) as base:
            r = post(base, *_hostile(case, act.id))
            assert (r.status_code, message in r.json()["detail"]) == (status, True), r.text
            assert _state(sup, act.id) == before
            with sup.sessions() as s:
                assert not [e for e in audit_store.audit_log(s) if e.event == "refused"]
            assert click(base, act.id).status_code == 200  # and the honest click still works
    finally:
        sup.close()


def test_control_characters_in_a_slack_name_never_reach_the_database(db, tmp_path, slack):
    """A NUL was stored on SQLite and refused by PostgreSQL (a 500 there): `who` is now the
    user id plus the handle cut to word characters, the same on both databases."""
    sup = make_sup(db, tmp_path, slack)
    try:
        act = _waiting(sup, tmp_path)
        client = TestClient(build_app(sup), raise_server_exceptions=False)
        # a handle dressed up as someone else's id, with a NUL and a right-to-left override
        r = click(client, act.id, user="mal\x00lory\u202e (U0ALICE)\n", user_id="U0MALLORY")
        assert r.status_code == 403 and r.json()["detail"].startswith("slack:malloryU0ALICE (U0MALLORY) may not")
        no_id = {**payload(act.id), "user": {"username": "alice"}}
        for r in (click(client, act.id, user_id="alice"), click(client, act.id, user_id="U0ALICE\x00"),
                  post(client, *_signed(no_id))):  # the id is who they are: none, no click
            assert r.status_code == 400 and "not a Slack member id" in r.json()["detail"], r.text
        # an approver whose handle is nothing but NUL, a lone surrogate and DEL: recorded by id alone
        r = click(client, act.id, user="\x00\ud800\x7f", user_id="U0ALICE")
        assert r.status_code == 200 and r.json()["who"] == "slack:U0ALICE", r.text
        assert _state(sup, act.id) == ("pending", False, "slack:U0ALICE", 1)
        with sup.sessions() as s:
            actors = [(e.event, e.actor) for e in audit_store.audit_log(s, RUN) if e.event in ("refused", "approved")]
        assert actors == [("approved", "slack:U0ALICE"), ("refused", "slack:malloryU0ALICE (U0MALLORY)")]
    finally:
        sup.close()


# --- who may click (issue 21; supervisor.decide.approvers) -------------------------------------------------


def _refusals(sup) -> list:
    with sup.sessions() as s:
        return [(e.run_id, e.actor, e.detail) for e in reversed(audit_store.audit_log(s)) if e.event == "refused"]


def test_a_click_by_someone_not_in_slack_approvers_is_refused_logged_audited_and_said_in_the_thread(
        db, tmp_path, slack, caplog):
    sup = make_sup(db, tmp_path, slack)  # approvers: alice and bob
    try:
        act = _waiting(sup, tmp_path)
        assert sup.executor.outbox.drain(60)
        (top,) = [m for m in slack.top_level() if f"[action {act.id}]" in m["text"]]
        before = _state(sup, act.id)
        with running(build_app(sup)) as base, caplog.at_level(logging.WARNING, logger="thermowatch.supervisor.serve.api.slack"):
            approve, cancel = click(base, act.id, user="mallory"), click(base, act.id, CANCEL, user="mallory")
            assert (approve.status_code, cancel.status_code) == (403, 403)
            assert approve.json()["detail"] == (
                f"slack:mallory (U0MALLORY) may not approve action {act.id} from Slack: U0MALLORY is not an approver: "
                "add that id to slack.approvers, or the user to one of the Slack user groups in "
                "slack.approver_groups (none configured)")
            assert cancel.json()["detail"].startswith(f"slack:mallory (U0MALLORY) may not cancel action {act.id}")
            assert _state(sup, act.id) == before, "a refused click changed the action"
            assert [m for m in caplog.messages if "refused" in m and "slack:mallory (U0MALLORY)" in m]
            why = approve.json()["detail"].split("from Slack: ", 1)[1]
            assert _refusals(sup) == [(RUN, "slack:mallory (U0MALLORY)", {"action_id": act.id, "wanted": w, "why": why})
                                      for w in ("approve", "cancel")]
            assert sup.executor.outbox.drain(30)  # the thread says so; the question stays open
            replies = [m["text"] for m in slack.thread(top["ts"])[1:] if m.get("subtype") != "file_share"]
            assert [t for t in replies if f"slack:mallory (U0MALLORY) may not approve rollback (action {act.id}); "
                                          "nothing changed" in t]
            assert [b for b in slack.messages[top["ts"]]["blocks"] if b["type"] == "actions"], "buttons gone"
            # who may click is decided before the action is looked up: no probing for ids
            assert click(base, 999_999, user="mallory").status_code == 403
            assert _refusals(sup)[-1][:2] == (None, "slack:mallory (U0MALLORY)")  # no run to file it under
            ok = click(base, act.id, user="bob")
        assert ok.status_code == 200 and _state(sup, act.id)[:3] == ("pending", False, "slack:bob (U0BOB)")
    finally:
        sup.close()


def test_closed_by_default_a_secret_without_approvers_offers_no_buttons_and_refuses_clicks(db, tmp_path, slack):
    sup = make_sup(db, tmp_path, slack, approvers=())
    try:
        act = _waiting(sup, tmp_path)
        assert sup.executor.outbox.drain(60)
        (top,) = [m for m in slack.top_level() if f"[action {act.id}]" in m["text"]]
        assert not [b for b in top["blocks"] if b["type"] == "actions"]
        assert f"thermowatch approve {act.id}" in json.dumps(top["blocks"])  # the command is the way
        before = _state(sup, act.id)
        r = click(TestClient(build_app(sup)), act.id)  # a message from before, or a forged payload
        assert r.status_code == 403, r.text
        assert "nobody may approve from Slack until approvers are configured (closed by default)" in r.json()["detail"]
        assert "slack.approvers" in r.json()["detail"]
        assert _state(sup, act.id) == before
        assert [(run, who) for run, who, _ in _refusals(sup)] == [(RUN, "slack:alice (U0ALICE)")]
    finally:
        sup.close()


def test_a_member_of_an_approver_group_may_click_and_the_group_is_read_once_per_ttl(db, tmp_path, slack):
    slack.usergroups["S0ONCALL"] = ["U0CAROL"]
    sup = make_sup(db, tmp_path, slack, approvers=(), approver_groups=["S0ONCALL"])
    try:
        act = _waiting(sup, tmp_path)
        assert sup.executor.outbox.drain(60)
        (top,) = [m for m in slack.top_level() if f"[action {act.id}]" in m["text"]]
        assert [b for b in top["blocks"] if b["type"] == "actions"]  # a group alone offers the buttons
        client = TestClient(build_app(sup))
        no = click(client, act.id, user="dave")
        assert no.status_code == 403 and "slack.approver_groups (S0ONCALL)" in no.json()["detail"]
        yes = click(client, act.id, user="carol")
        assert yes.status_code == 200 and yes.json()["who"] == "slack:carol (U0CAROL)"
        (call,) = slack.calls("usergroups.users.list")  # two clicks, one read
        assert call.body["usergroup"] == "S0ONCALL" and call.headers["Authorization"] == f"Bearer {slack.token}"
        assert _state(sup, act.id)[:3] == ("pending", False, "slack:carol (U0CAROL)")
    finally:
        sup.close()


def test_an_approver_group_that_cannot_be_read_admits_nobody(db, tmp_path, slack):
    slack.usergroups["S0ONCALL"] = ["U0CAROL"]
    sup = make_sup(db, tmp_path, slack, approvers=("U0ALICE",), approver_groups=["S0ONCALL"],
                   approver_groups_ttl_s=0.05)
    try:
        act = _waiting(sup, tmp_path)
        before = _state(sup, act.id)
        client = TestClient(build_app(sup))
        slack.server_error(1, "usergroups.users.list")
        r = click(client, act.id, user="carol")  # in the group, but Slack cannot say so now
        assert r.status_code == 503, r.text
        assert "S0ONCALL (Slack usergroups.users.list S0ONCALL: HTTP 500" in r.json()["detail"]
        assert _state(sup, act.id) == before
        slack.usergroups["S0ONCALL"] = []  # carol leaves on-call; the cached list expires
        time.sleep(0.1)
        assert click(client, act.id, user="carol").status_code == 403
        assert [who for _, who, _ in _refusals(sup)] == ["slack:carol (U0CAROL)"] * 2
        slack.server_error(10, "usergroups.users.list")
        reads = len(slack.calls("usergroups.users.list"))
        ok = click(client, act.id, user="alice")  # slack.approvers never waits on Slack
        assert ok.status_code == 200 and len(slack.calls("usergroups.users.list")) == reads
    finally:
        sup.close()


def test_an_approver_group_slack_will_not_list_stops_the_start(tmp_path, slack):
    from thermowatch.supervisor.errors import UserError

    cfg = SupervisorConfig(data_dir=tmp_path / "data", slack=slack_config(tmp_path, slack, approvers=(),
                                                                          approver_groups=["S0NOPE"]))
    with pytest.raises(UserError, match=r"slack\.approver_groups: Slack refused to list the user group S0NOPE "
                                        r"\(no_such_subteam\); check the id"):
        Supervisor(cfg)
    assert not (tmp_path / "data").exists()


def test_approver_groups_without_a_bot_token_stop_the_start(tmp_path):
    from thermowatch.supervisor.errors import UserError

    (tmp_path / "secret").write_text(SECRET)
    cfg = SupervisorConfig(data_dir=tmp_path / "data", slack={
        "signing_secret_file": str(tmp_path / "secret"), "approver_groups": ["S0ONCALL"],
        "token_env": "TW_TEST_NO_SUCH_TOKEN"})
    with pytest.raises(UserError, match="slack.approver_groups are read with the bot token: slack.token_env: "
                                        "environment variable TW_TEST_NO_SUCH_TOKEN"):
        Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()))
    assert not (tmp_path / "data").exists()


def test_mentions_in_a_run_id_and_a_slack_name_never_reach_slack_unescaped(db, tmp_path, slack):
    """Issue 34: a run id `<!channel> <@U0ALICE>` reached the fallback `text` of every alert as is.
    The whole story (the finding, the approval request, a click by someone whose display name is
    `<!here>`, the reply and the top message's update) is sent through the real slack-sdk to the
    fake; no text Slack parses (the fallback `text`, every mrkdwn object) holds a raw `<!` or `<@`."""
    run_id = "<!channel> <@U0ALICE> & co"
    sup = make_sup(db, tmp_path, slack)
    try:
        sup.open_run(RunInfo(run_id=run_id, attempt=0, world_size=1))

        def waiting():
            with sup.sessions() as s:
                return [a for a in actions_store.open_actions(s, run_id) if a.requires_approval]

        feed(sup, run_id, 0, diverging_records(), ckpt_root=tmp_path / "ckpt", stop=lambda: bool(waiting()))
        (act,) = waiting()
        with TestClient(build_app(sup)) as client:
            r = click(client, act.id, user="<!here>")
            assert r.status_code == 200, r.text
        assert sup.executor.outbox.drain(60)
    finally:
        sup.close()
    sent = [r.body for r in slack.requests if r.api_method in ("chat.postMessage", "chat.update")]
    assert len(sent) >= 3  # the alert, the approval reply, the top message's update
    assert any("&lt;!channel&gt; &lt;@U0ALICE&gt; &amp; co" in b["text"] for b in sent)
    # who clicked, as the daemon names a Slack user: the display name without its markup
    assert any("slack:here (U0ALICE) approved rollback" in b["text"] for b in sent), [b["text"] for b in sent]
    for body in sent:
        blocks = json.loads(body["blocks"]) if isinstance(body.get("blocks"), str) else body.get("blocks") or []
        parsed = [body["text"]] + [o["text"] for o in _text_objects(blocks) if o["type"] == "mrkdwn"]
        for text in parsed:
            assert "<!" not in text and "<@" not in text, text


def _text_objects(x):
    if isinstance(x, dict):
        if x.get("type") in ("mrkdwn", "plain_text") and isinstance(x.get("text"), str):
            yield x
        for v in x.values():
            yield from _text_objects(v)
    elif isinstance(x, list):
        for v in x:
            yield from _text_objects(v)
