"""On call, end to end (issue 37 item 3 and 4): a page names who it is for, escalates once when
nobody takes it, and stops escalating when someone does (`thermowatch ack`, the API, Slack's
Acknowledge button), on every channel at once: Slack, PagerDuty, the signed webhook and email,
each a local fake speaking its wire format (tests/fakes), through the real outbox, the real
database and a real divergence in advise-only mode."""

from __future__ import annotations

import datetime as dt

import pytest
from fastapi.testclient import TestClient

from thermowatch.monitors.contract import Ack, Severity
from thermowatch.supervisor.app import jobs
from thermowatch.supervisor.app.config import ConfigError, SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor, build_notifier
from thermowatch.supervisor.notify.base import Alert, NotifyError
from thermowatch.supervisor.notify.email import EmailNotifier
from thermowatch.supervisor.notify.slack import ACK
from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import incidents as incidents_store
from tests.fakes.pager_server import ROUTING_KEY, FakePagerDuty, FakeWebhook
from tests.fakes.slack_server import FakeSlack
from tests.fakes.smtp_server import FakeSMTP
from tests.supervisor.auth_helpers import AUTH
from tests.supervisor.notify.test_slack_api import SECRET, _waiting, advise_only, click, opened, slack_config

pytestmark = pytest.mark.timeout(180)
RUN = "oncall"
ONCALL, LEAD = "S0ONCALL", "U0LEAD"
WEBHOOK_SECRET = "whsec-0123456789abcdef"


@pytest.fixture
def fakes():
    with FakeSlack() as slack, FakePagerDuty() as pd, FakeWebhook(WEBHOOK_SECRET) as hook, FakeSMTP() as smtp:
        yield slack, pd, hook, smtp


def make_sup(db, tmp_path, fakes, **over) -> Supervisor:
    """The daemon's own notifier (build_notifier) from a config with all four channels."""
    slack, pd, hook, smtp = fakes
    (tmp_path / "pd-key").write_text(ROUTING_KEY)
    (tmp_path / "hook-secret").write_text(WEBHOOK_SECRET)
    cfg = advise_only(
        db, tmp_path, public_url="https://tw.example.org",
        slack=slack_config(tmp_path, slack, oncall=[ONCALL], escalate_to=[LEAD]),
        pagerduty={"routing_key_file": str(tmp_path / "pd-key"), "base_url": pd.url},
        webhook={"url": hook.hook_url, "secret_file": str(tmp_path / "hook-secret")},
        email={"host": "127.0.0.1", "port": smtp.port, "security": "none", "from_addr": "thermowatch@example.org",
               "to": ["oncall@example.org"], "escalate_to": ["lead@example.org"]}, **over)
    return opened(cfg, build_notifier(cfg), RUN, retry_s=0.05)


def _ask(sup, tmp_path) -> actions_store.ActionRow:
    ask = _waiting(sup, tmp_path, RUN)
    assert sup.executor.outbox.drain(20)
    return ask


@pytest.fixture
def sup(db, tmp_path, fakes):
    s = make_sup(db, tmp_path, fakes)
    yield s
    s.close()


@pytest.fixture
def ask(sup, tmp_path) -> actions_store.ActionRow:
    """A real divergence's rollback waiting for approval, every alert about it sent."""
    return _ask(sup, tmp_path)


def _later(minutes: float) -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=minutes)


def _mentions(msg: dict) -> str:
    return msg.get("text", "")


def test_a_page_names_the_oncall_escalates_once_and_ends_with_its_story(sup, ask, fakes):
    slack, pd, hook, smtp = fakes
    story = f"incident:{ask.incident_id}"
    # The page: for the on-call group on Slack, one PagerDuty incident, one webhook trigger, one mail.
    pages = [m for m in slack.posted() if f"<!subteam^{ONCALL}>" in _mentions(m)]
    assert len(pages) == 1 and f"<@{LEAD}>" not in _mentions(pages[0])
    buttons = [e for b in pages[0]["blocks"] if b["type"] == "actions" for e in b["elements"]]
    assert [(e["action_id"], e["value"]) for e in buttons][-1] == (ACK, story)
    # Nothing else the divergence said mentioned anyone: a rollback done by itself wakes nobody.
    assert sum("<!subteam^" in _mentions(m) for m in slack.posted()) == 1
    assert [e["event_action"] for e in pd.events()] == ["trigger"]
    assert [b["event"] for b in hook.accepted()] == ["trigger"] and hook.accepted()[0]["escalation"] == 0
    (mail,) = smtp.mails
    assert mail.rcpt_to == ["oncall@example.org"] and mail.subject.startswith("[thermowatch CRITICAL]")
    assert f"thermowatch approve {ask.id}" in mail.body and "https://tw.example.org/runs/oncall" in mail.body

    # Not yet due: nothing. Due: one escalation on every channel that has none of its own.
    assert jobs.escalate(sup, now=_later(10)) == []
    (esc,) = jobs.escalate(sup, now=_later(16))
    assert esc.escalation == 1 and esc.thread == story and "not acknowledged for 1" in esc.title
    assert f"thermowatch ack {RUN} --incident {ask.incident_id}" in esc.commands
    assert jobs.escalate(sup, now=_later(40)) == []  # once
    assert sup.executor.outbox.drain(20)
    escalated = [m for m in slack.posted() if f"<@{LEAD}>" in _mentions(m)]
    assert len(escalated) == 1 and f"<!subteam^{ONCALL}>" in _mentions(escalated[0])
    assert escalated[0].get("thread_ts") and escalated[0].get("reply_broadcast") is True
    assert [e["event_action"] for e in pd.events()] == ["trigger"]  # PagerDuty escalates by its own policy
    assert [(b["event"], b["escalation"]) for b in hook.accepted()] == [("trigger", 0), ("trigger", 1)]
    assert len(smtp.mails) == 2
    second = smtp.mails[1]
    assert second.subject.startswith("[thermowatch ESCALATED]")
    assert second.rcpt_to == ["oncall@example.org", "lead@example.org"]
    assert second.message["References"] == mail.message["Message-ID"]  # one conversation
    with sup.sessions() as s:
        (audited,) = audit_store.events(s, RUN, jobs.ESCALATED)
        assert audited.detail["thread"] == story and audited.detail["waited_s"] >= 15 * 60

    # Approving answers the page; the rollback's ack ends it, on every channel that was paged.
    sup.executor.approve(ask.id, "alice")
    (cmd,) = sup.poll(RUN)
    sup.ack(RUN, Ack(command_id=cmd.id, ok=True, first_step=ask.args["to_step"] + 1, detail="rolled back"))
    assert sup.executor.outbox.drain(20)
    assert [e["event_action"] for e in pd.events()] == ["trigger", "acknowledge", "resolve"]
    assert [b["event"] for b in hook.accepted()][-2:] == ["acknowledge", "resolve"]
    assert [m.subject.split("]")[0] for m in smtp.mails[2:]] == ["[thermowatch ACKNOWLEDGED", "[thermowatch RESOLVED"]
    assert all(m.message["References"] == mail.message["Message-ID"] for m in smtp.mails[1:])
    assert jobs.escalate(sup, now=_later(120)) == []


def test_acknowledged_pages_do_not_escalate_from_the_api_the_button_or_twice(sup, ask, fakes):
    slack, pd, hook, smtp = fakes
    with TestClient(build_app(sup), headers=AUTH) as c:
        # Bad input: a 4xx naming the problem, nothing stored.
        for body, status, words in (({}, 422, "exactly one"), ({"incident": 1, "action": 1}, 422, "exactly one"),
                                    ({"incident": 99999}, 404, "no incident 99999"),
                                    ({"incident": "x"}, 422, "incident"), ({"incident": 1, "when": 2}, 422, "when")):
            r = c.post(f"/api/runs/{RUN}/acknowledge", json=body)
            assert r.status_code == status and words in r.text, (body, r.text)
        assert c.post("/api/runs/nope/acknowledge", json={"incident": ask.incident_id}).status_code == 404
        with sup.sessions() as s:
            assert audit_store.events(s, RUN, "page_acknowledged") == []

        r = c.post(f"/api/runs/{RUN}/acknowledge", json={"incident": ask.incident_id, "who": "alice",
                                                         "reason": "looking at the logits"})
        assert r.status_code == 200 and r.json()["already"] is False
        again = c.post(f"/api/runs/{RUN}/acknowledge", json={"incident": ask.incident_id}).json()
        assert again["already"] is True and "alice" in again["who"] and again["reason"] == "looking at the logits"
        # Slack's button on the same story: already taken, nothing more sent.
        got = click(c, f"incident:{ask.incident_id}", ACK, user="bob")
        assert got.status_code == 200 and got.json()["already"] is True
    assert sup.executor.outbox.drain(20)
    assert [e["event_action"] for e in pd.events()] == ["trigger", "acknowledge"]
    assert [m.subject.split("]")[0] for m in smtp.mails] == ["[thermowatch CRITICAL", "[thermowatch ACKNOWLEDGED"]
    assert "looking at the logits" in smtp.mails[1].body
    assert any("acknowledged the page" in m.get("text", "") for m in slack.posted())
    assert jobs.escalate(sup, now=_later(60)) == []  # taken: never escalated
    with sup.sessions() as s:
        assert actions_store.get_action(s, ask.id).state == "pending"  # the approval still waits
        assert len(audit_store.events(s, RUN, "page_acknowledged")) == 1


def test_the_slack_button_acknowledges_as_the_clicker_and_refuses_strangers(sup, ask, fakes):
    slack, pd, hook, smtp = fakes
    with TestClient(build_app(sup)) as c:
        assert click(c, f"incident:{ask.incident_id}", ACK, user="mallory").status_code == 403
        assert click(c, "incident:x", ACK).status_code == 400
        assert click(c, "incident:99999", ACK).status_code == 404
        r = click(c, f"incident:{ask.incident_id}", ACK, user="alice")
        assert r.status_code == 200 and r.json()["event"] == "acknowledged", r.text
    with sup.sessions() as s:
        (row,) = audit_store.events(s, RUN, "page_acknowledged")
        assert row.actor == "slack:alice (U0ALICE)" and row.detail["incident_id"] == ask.incident_id
    assert sup.executor.outbox.drain(20)
    assert [e["event_action"] for e in pd.events()] == ["trigger", "acknowledge"]


def test_a_page_whose_cause_ended_without_a_word_is_not_escalated(sup, ask):
    """The escalation reads the story's cause, not only its messages: an incident closed, or a
    run that finished, is never escalated even when no resolve went out."""
    with sup.sessions.begin() as s:
        incidents_store.resolve_incident(s, ask.incident_id, "closed by hand")
    assert jobs.escalate(sup, now=_later(30)) == []
    sup.executor.notify(Alert(run_id=RUN, severity=Severity.CRITICAL, title=f"{RUN}: checkpoint saves failing",
                              thread="action:4242"))  # no such action: a story of no cause is not escalated
    assert jobs.escalate(sup, now=_later(30)) == []


def test_escalation_is_off_at_zero_and_its_job_is_scheduled_otherwise(db, tmp_path, fakes):
    sup = make_sup(db, tmp_path, fakes, escalate_after_s=0)
    try:
        _ask(sup, tmp_path)
        assert jobs.escalate(sup, now=_later(600)) == []
        assert "escalate" not in [j.name for j in jobs.default_jobs(sup)]
    finally:
        sup.close()
    with pytest.raises(ConfigError, match="escalate_after_s"):
        SupervisorConfig(data_dir=tmp_path / "d2", escalate_after_s=-1)
    with pytest.raises(ConfigError, match="oncall"):
        SupervisorConfig(data_dir=tmp_path / "d2", slack={"oncall": ["@alice"]})


# --- email on its own -----------------------------------------------------------------------------


def _page(**kw) -> Alert:
    return Alert(**{"run_id": RUN, "severity": Severity.CRITICAL, "title": f"{RUN}: paused", "incident_id": 7, **kw})


def test_email_logs_in_and_a_temporary_refusal_is_retried_a_permanent_one_is_not():
    with FakeSMTP(users={"tw": "s3cret"}) as smtp:
        mailer = EmailNotifier("127.0.0.1", smtp.port, "tw@example.org", ["oncall@example.org"], security="none",
                               username="tw", password="s3cret")
        assert mailer.send(_page()) == "thermowatch/oncall/incident:7"
        assert smtp.logins == ["tw"] and len(smtp.mails) == 1
        for code, retryable in ((451, True), (554, False)):
            smtp.fail_next(code)
            with pytest.raises(NotifyError) as exc:
                mailer.send(_page())
            assert exc.value.retryable is retryable and str(code) in str(exc.value)
        wrong = EmailNotifier("127.0.0.1", smtp.port, "tw@example.org", ["oncall@example.org"], security="none",
                              username="tw", password="nope", password_source="file /run/secrets/smtp")
        with pytest.raises(NotifyError, match="refused the login of tw.*file /run/secrets/smtp") as exc:
            wrong.send(_page())
        assert exc.value.retryable  # a configuration to fix: the alert is kept
        assert len(smtp.mails) == 1
        port = smtp.port
    gone = EmailNotifier("127.0.0.1", port, "tw@example.org", ["oncall@example.org"], security="none", timeout_s=2)
    with pytest.raises(NotifyError, match="could not reach") as exc:
        gone.send(_page())
    assert exc.value.retryable


def test_email_config_errors_name_the_key(tmp_path):
    base = {"host": "smtp.example.org", "from_addr": "tw@example.org", "to": ["a@example.org"]}
    for over, words in (({"to": []}, "email.to"), ({"to": ["alice"]}, "email.to[0]"),
                        ({"from_addr": "thermowatch"}, "from_addr"), ({"security": "tls"}, "email.security"),
                        ({"port": 0}, "email.port"), ({"timeout_s": 0}, "email.timeout_s")):
        with pytest.raises(ConfigError, match=words.replace("[", r"\[")):
            SupervisorConfig(data_dir=tmp_path, email={**base, **over})
    cfg = SupervisorConfig(data_dir=tmp_path, email={**base, "username": "tw", "password_env": "TW_SMTP_PW"})
    from thermowatch.supervisor.notify.base import NotifyConfigError

    with pytest.raises(NotifyConfigError, match="TW_SMTP_PW"):
        build_notifier(cfg, environ={})
    assert build_notifier(cfg, environ={"TW_SMTP_PW": "x"}).parts[-1].check()["smtp"] == "smtp.example.org:587 (starttls)"
