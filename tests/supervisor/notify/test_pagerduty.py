"""Paging through PagerDuty's Events API v2 (supervisor.notify.pagerduty) over real HTTP to a local
fake that keeps PagerDuty's wire format and incident rule (tests/fakes/pager_server.py), through
the real outbox and database: a critical alert pages once however often it is sent, its story's
end resolves the page, what the daemon did by itself never pages, a 5xx is retried and a 400 is
marked failed without holding up the next page, a configuration that cannot work stops the start
naming its key, and a real Supervisor's approval question pages and its rollback resolves."""

from __future__ import annotations

import io

import pytest
import yaml

from thermowatch.monitors.contract import Ack, RunInfo, Severity
from thermowatch.supervisor.app.config import ConfigError, SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor, build_notifier
from thermowatch.supervisor.notify.base import Alert, FanOut, NotifyConfigError, NotifyError, StoryState
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.notify.pagerduty import PagerDutyNotifier
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import alerts as alerts_store
from tests.fakes.pager_server import ROUTING_KEY, FakePagerDuty
from tests.fixtures.diverging import DETECTORS, POLICY, diverging_records, feed

RUN = "pd-run"


@pytest.fixture
def pd():
    with FakePagerDuty() as fake:
        yield fake


def _page(incident: int = 7, **kw) -> Alert:
    return Alert(**{"run_id": RUN, "severity": Severity.CRITICAL, "title": f"{RUN}: approval needed: rollback",
                    "text": "attention logits grew 4x in 30 steps", "incident_id": incident,
                    "fields": {"signal": "attn_logit_growth", "module": "blocks.1.attn", "detect step": 48,
                               "onset step": 41}, **kw})


def test_a_critical_alert_triggers_with_the_run_and_a_stable_dedup_key(pd):
    pager = PagerDutyNotifier(ROUTING_KEY, base_url=pd.url, web_base_url="https://tw.example.org/")
    first = pager.send(_page())
    again = pager.send(_page())  # the outbox re-sending after a lost answer, or a re-page
    other = pager.send(_page(incident=8))
    trig = pd.events("trigger")
    assert len(trig) == 3 and first == again != other
    assert trig[0]["dedup_key"] == trig[1]["dedup_key"] == f"thermowatch/{RUN}/incident:7"
    assert [i.dedup_key for i in pd.incidents] == [f"thermowatch/{RUN}/incident:7", f"thermowatch/{RUN}/incident:8"]
    assert len(pd.incidents[0].events) == 2  # joined the open incident: one page, not two
    p = trig[0]["payload"]
    assert (p["summary"], p["source"], p["severity"], p["class"], p["component"]) == (
        f"{RUN}: approval needed: rollback", RUN, "critical", "attn_logit_growth", "blocks.1.attn")
    d = p["custom_details"]
    assert (d["run"], d["incident"], d["step"], d["signal"], d["onset step"]) == (RUN, 7, 48, "attn_logit_growth", 41)
    assert trig[0]["links"] == [{"href": f"https://tw.example.org/runs/{RUN}?incident=7", "text": f"run {RUN} in thermowatch"}]
    assert trig[0]["routing_key"] == ROUTING_KEY and trig[0]["client"] == "thermowatch"


def test_no_public_url_no_links_and_a_long_run_id_keeps_a_valid_key(pd):
    pager = PagerDutyNotifier(ROUTING_KEY, base_url=pd.url)
    long_run = "r" * 240
    got = pager.send(_page(run_id=long_run))
    ev = pd.events("trigger")[0]
    assert "links" not in ev and "client_url" not in ev
    assert len(ev["dedup_key"]) <= 255 and ev["dedup_key"].startswith("thermowatch/rrr")
    assert len(got) <= 64  # the outbox's ts column


def test_a_refused_event_is_not_retryable_an_outage_is(pd):
    pager = PagerDutyNotifier(ROUTING_KEY, base_url=pd.url)
    for status, retryable in ((400, False), (422, False), (429, True), (500, True), (503, True), (401, True)):
        pd.fail_next(status)
        with pytest.raises(NotifyError) as exc:
            pager.send(_page())
        assert exc.value.retryable is retryable and f"HTTP {status}" in str(exc.value), status
    wrong_key = PagerDutyNotifier("not-the-key", base_url=pd.url)
    with pytest.raises(NotifyError, match="Invalid Routing Key") as exc:
        wrong_key.send(_page())
    assert exc.value.retryable is False
    gone = PagerDutyNotifier(ROUTING_KEY, base_url="http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(NotifyError, match="could not reach http://127.0.0.1:9/v2/enqueue") as exc:
        gone.send(_page())
    assert exc.value.retryable is True


# --- through the outbox and the database --------------------------------------------------------

def make_sup(db, tmp_path, pd: FakePagerDuty, **over) -> Supervisor:
    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, policy=dict(POLICY), detectors=dict(DETECTORS),
                           **over)
    sup = Supervisor(cfg, notifier=FanOut([ConsoleNotifier(io.StringIO()),
                                           PagerDutyNotifier(ROUTING_KEY, base_url=pd.url)]))
    sup.executor.outbox.retry_s = 0.05  # seconds to the first retry; doubles per attempt
    sup.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
    return sup


def _rows(sup, channel="pagerduty"):
    with sup.sessions() as s:
        return sorted((a for a in alerts_store.alerts(s, RUN) if a.channel == channel), key=lambda a: a.id)


def test_info_and_warn_never_page_and_a_story_never_paged_is_never_resolved(db, tmp_path, pd):
    sup = make_sup(db, tmp_path, pd)
    try:
        sup.executor.notify(Alert(run_id=RUN, severity=Severity.INFO, title=f"{RUN}: alert only", incident_id=None))
        sup.executor.notify(Alert(run_id=RUN, severity=Severity.WARN, title=f"{RUN}: rolled back by itself",
                                  thread="action:1"))
        sup.executor.notify(Alert(run_id=RUN, severity=Severity.INFO, title=f"{RUN}: rollback done",
                                  thread="action:1", story_state=StoryState.RESOLVED))
        assert sup.executor.outbox.drain(10)
        assert _rows(sup) == [] and pd.requests == []
        assert len(_rows(sup, "console")) == 3  # the other channels still got every one
    finally:
        sup.close()


def test_a_page_is_acknowledged_and_resolved_in_its_story(db, tmp_path, pd):
    sup = make_sup(db, tmp_path, pd)
    try:
        sup.executor.notify(_page(thread="action:5", incident=None))
        sup.executor.notify(Alert(run_id=RUN, severity=Severity.INFO, title="approved", thread="action:5",
                                  story_state=StoryState.ANSWERED))
        sup.executor.notify(Alert(run_id=RUN, severity=Severity.INFO, title="done", thread="action:5",
                                  story_state=StoryState.RESOLVED))
        assert sup.executor.outbox.drain(10)
        assert [e["event_action"] for e in pd.events()] == ["trigger", "acknowledge", "resolve"]
        assert {e["dedup_key"] for e in pd.events()} == {f"thermowatch/{RUN}/action:5"}
        assert [i.state for i in pd.incidents] == ["resolved"]
        assert [r.state for r in _rows(sup)] == ["sent"] * 3
    finally:
        sup.close()


def test_a_500_is_retried_and_a_400_fails_without_holding_up_the_next_page(db, tmp_path, pd):
    sup = make_sup(db, tmp_path, pd)
    try:
        pd.fail_next(500, calls=2)
        sup.executor.notify(_page(incident=None, title=f"{RUN}: checkpoint saves are failing"))
        assert sup.executor.outbox.drain(20)
        first = _rows(sup)
        assert [(r.state, r.attempts) for r in first] == [("sent", 3)]
        assert [r.status for r in pd.requests] == [500, 500, 202]

        pd.fail_next(400)
        sup.executor.notify(_page(incident=None, title=f"{RUN}: state mismatch"))
        sup.executor.notify(_page(incident=None, title=f"{RUN}: pause (action 9) FAILED"))
        assert sup.executor.outbox.drain(20)
        rows = _rows(sup)[1:]
        assert [r.state for r in rows] == ["failed", "sent"]
        assert "HTTP 400" in rows[0].error and "not sent again" in rows[0].error
        assert [e["payload"]["summary"] for e in pd.events("trigger")][-1] == f"{RUN}: pause (action 9) FAILED"
    finally:
        sup.close()


# --- configuration ------------------------------------------------------------------------------

def test_config_errors_name_the_key(tmp_path):
    cfg = SupervisorConfig(data_dir=tmp_path, pagerduty={"routing_key_env": "TW_TEST_PD_KEY"})
    with pytest.raises(NotifyConfigError, match=r"pagerduty\.routing_key_env: environment variable TW_TEST_PD_KEY "
                                                r"is unset or empty; .*pagerduty\.routing_key_file"):
        build_notifier(cfg, environ={})
    cfg = SupervisorConfig(data_dir=tmp_path, pagerduty={"routing_key_file": str(tmp_path / "missing")})
    with pytest.raises(NotifyConfigError, match=r"pagerduty\.routing_key_file: the routing key file .*missing "
                                                r"cannot be read"):
        build_notifier(cfg, environ={})
    (tmp_path / "empty").write_text("\n")
    cfg = SupervisorConfig(data_dir=tmp_path, pagerduty={"routing_key_file": str(tmp_path / "empty")})
    with pytest.raises(NotifyConfigError, match=r"pagerduty\.routing_key_file: .* is empty"):
        build_notifier(cfg, environ={})
    for section, message in (({"base_url": "events.pagerduty.com"}, r"pagerduty\.base_url must be an http"),
                             ({"timeout_s": 0}, r"pagerduty\.timeout_s must be in \(0, 120\]"),
                             ({"routing_key": ROUTING_KEY}, r"pagerduty\.routing_key: unknown key; did you mean "
                                                            r"'routing_key_env'")):
        path = tmp_path / "sup.yaml"
        path.write_text(yaml.safe_dump({"pagerduty": section}))
        with pytest.raises(ConfigError, match=message):
            SupervisorConfig.load(path, env={}, data_dir=tmp_path)
    assert not SupervisorConfig(data_dir=tmp_path).pagerduty.enabled  # off by default


def test_the_key_file_from_the_environment_turns_pagerduty_on(tmp_path, pd):
    key = tmp_path / "pd-key"
    key.write_text(ROUTING_KEY + "\n")
    path = tmp_path / "sup.yaml"
    path.write_text(f"pagerduty: {{base_url: '{pd.url}'}}\n")
    cfg = SupervisorConfig.load(path, env={"THERMOWATCH_PAGERDUTY_ROUTING_KEY_FILE": str(key)}, data_dir=tmp_path)
    notifier = build_notifier(cfg, environ={})
    try:
        assert [type(p).__name__ for p in notifier.parts] == ["ConsoleNotifier", "PagerDutyNotifier"]
        assert notifier.check()["pagerduty"]["routing_key"] == f"from file {key}"
        notifier.parts[1].send(_page())
        assert pd.events("trigger")[0]["routing_key"] == ROUTING_KEY
    finally:
        notifier.close()


# --- end to end: a real Supervisor --------------------------------------------------------------

def test_an_approval_question_pages_and_the_rollback_resolves_the_page(db, tmp_path, pd, monkeypatch):
    """advise_only: the real divergence's rollback waits for a person, which is a page (one
    PagerDuty incident, keyed by the run and the incident); approving acknowledges it; the
    trainer's ack of the rollback resolves the incident, and the page with it. The notifier is
    the daemon's own, built from the config's `pagerduty:` section."""
    monkeypatch.delenv("SLACK_SIGNING_SECRET", raising=False)
    key = tmp_path / "pd-key"
    key.write_text(ROUTING_KEY)
    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, policy=dict(POLICY), detectors=dict(DETECTORS),
                           advise_only=True, public_url="https://tw.example.org",
                           pagerduty={"routing_key_file": str(key), "base_url": pd.url})
    sup = Supervisor(cfg)
    try:
        assert sup.notifier_status()["channels"]["pagerduty"] == "ok"
        sup.executor.outbox.retry_s = 0.05
        sup.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
        feed(sup, RUN, 0, diverging_records(), ckpt_root=tmp_path / "ckpt", stop=lambda: bool(_open(sup)))
        (ask,) = _open(sup)
        assert ask.requires_approval and ask.kind == "rollback"
        assert sup.executor.outbox.drain(20)
        trig = pd.events("trigger")
        assert len(trig) == 1 and len(pd.incidents) == 1, [e["payload"]["summary"] for e in trig]
        assert trig[0]["dedup_key"] == f"thermowatch/{RUN}/incident:{ask.incident_id}"
        assert f"[action {ask.id}]" in trig[0]["payload"]["summary"]
        assert trig[0]["payload"]["custom_details"]["commands"] == [f"thermowatch approve {ask.id}",
                                                                    f"thermowatch cancel {ask.id}"]
        # the daemon's own signed link (auth is on): it opens this run's incident, read only, once
        href = trig[0]["links"][0]["href"]
        assert href.startswith("https://tw.example.org/go/") and trig[0]["client_url"] == href
        grant = sup.link_grants.verify(href.rsplit("/", 1)[1])
        assert (grant.run_id, grant.incident_id, grant.channel) == (RUN, str(ask.incident_id), "pagerduty")

        sup.executor.approve(ask.id, "alice")
        assert sup.executor.outbox.drain(20)
        assert pd.incidents[0].state == "acknowledged"
        (cmd,) = sup.poll(RUN)
        sup.ack(RUN, Ack(command_id=cmd.id, ok=True, first_step=ask.args["to_step"] + 1, detail="rolled back"))
        assert sup.executor.outbox.drain(20)
        assert [e["event_action"] for e in pd.events()] == ["trigger", "acknowledge", "resolve"]
        assert pd.incidents[0].state == "resolved" and len(pd.incidents) == 1
        assert [r.state for r in _rows(sup)] == ["sent"] * 3
    finally:
        sup.close()


def _open(sup):
    with sup.sessions() as s:
        return actions_store.open_actions(s, RUN)
