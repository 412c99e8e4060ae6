"""The signed webhook (supervisor.notify.webhook) over real HTTP to a local receiver that checks
the signature with the standard library alone (tests/fakes/pager_server.py): a receiver holding
the secret accepts the body, one holding another refuses it, an old or altered body fails
`verify`, the body carries what an Alertmanager- or Opsgenie-style bridge needs, the story's end
is a `resolve` under the same dedup key, and a configuration that cannot work names its key."""

from __future__ import annotations

import io
import json

import pytest
import yaml

from thermowatch.monitors.contract import RunInfo, Severity
from thermowatch.supervisor.app.config import ConfigError, SupervisorConfig
from thermowatch.supervisor.app.service import Supervisor, build_notifier
from thermowatch.supervisor.notify.base import Alert, FanOut, NotifyConfigError, NotifyError, StoryState
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.notify.webhook import SIGNATURE_HEADER, TIMESTAMP_HEADER, WebhookNotifier, sign, verify
from thermowatch.supervisor.store import alerts as alerts_store
from tests.fakes.pager_server import FakeWebhook

RUN = "wh-run"
SECRET = "whsec-test-secret"


@pytest.fixture
def hook():
    with FakeWebhook(SECRET) as fake:
        yield fake


def _page(**kw) -> Alert:
    return Alert(**{"run_id": RUN, "severity": Severity.CRITICAL, "title": f"{RUN}: paused (non_finite)",
                    "text": "a NaN loss three times", "incident_id": 3, "reasons": ("rung 3: pause",),
                    "fields": {"signal": "non_finite", "detect step": 90}, "status": "paused",
                    "commands": (f"thermowatch resume {RUN}",), **kw})


def test_the_receiver_holding_the_secret_accepts_and_one_holding_another_refuses(hook):
    WebhookNotifier(hook.hook_url, SECRET, web_base_url="https://tw.example.org").send(_page())
    assert [r.status for r in hook.requests] == [200]
    with pytest.raises(NotifyError, match="HTTP 401") as exc:
        WebhookNotifier(hook.hook_url, "another-secret").send(_page())
    assert exc.value.retryable  # a secret to fix, not a message to drop: it goes out once fixed
    body = hook.accepted()[0]
    assert body == {
        "version": 1, "source": "thermowatch", "event": "trigger", "dedup_key": f"thermowatch/{RUN}/incident:3",
        "run_id": RUN, "incident_id": 3, "severity": "critical", "title": f"{RUN}: paused (non_finite)",
        "text": "a NaN loss three times", "reasons": ["rung 3: pause"],
        "fields": {"signal": "non_finite", "detect step": 90}, "commands": [f"thermowatch resume {RUN}"],
        "status": "paused", "escalation": 0,
        "links": [{"href": f"https://tw.example.org/runs/{RUN}?incident=3", "text": f"run {RUN} in thermowatch"}]}


def test_verify_refuses_another_secret_an_altered_body_and_an_old_timestamp(hook):
    sent = WebhookNotifier(hook.hook_url, SECRET)
    sent.send(_page())
    req = hook.requests[-1]
    ts, sig = req.headers[TIMESTAMP_HEADER], req.headers[SIGNATURE_HEADER]
    assert sig.startswith("sha256=") and sig == sign(SECRET, ts, req.raw)
    assert verify(SECRET, req.raw, ts, sig)
    assert not verify("another-secret", req.raw, ts, sig)
    altered = json.dumps({**json.loads(req.raw), "severity": "info"}, separators=(",", ":")).encode()
    assert not verify(SECRET, altered, ts, sig)
    assert not verify(SECRET, req.raw, str(int(ts) + 1), sig)  # the time is signed: no re-dating
    assert not verify(SECRET, req.raw, ts, sig, now=int(ts) + 301)  # a replay minutes later
    assert not verify(SECRET, req.raw, None, sig) and not verify(SECRET, req.raw, "soon", sig)

    stale = WebhookNotifier(hook.hook_url, SECRET, clock=lambda: 1_700_000_000.0)  # a clock 2023 still shows
    with pytest.raises(NotifyError, match="HTTP 401"):
        stale.send(_page())  # the receiver's own replay window refuses it


def test_a_400_is_not_retried_a_500_is(hook):
    notifier = WebhookNotifier(hook.hook_url, SECRET)
    for status, retryable in ((400, False), (500, True), (429, True), (404, True)):
        hook.fail_next(status)
        with pytest.raises(NotifyError) as exc:
            notifier.send(_page())
        assert exc.value.retryable is retryable, status


def _sup(db, tmp_path, notifier) -> Supervisor:
    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url)
    sup = Supervisor(cfg, notifier=FanOut([ConsoleNotifier(io.StringIO()), notifier]))
    sup.executor.outbox.retry_s = 0.05
    sup.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
    return sup


def test_through_the_outbox_a_story_triggers_then_resolves_and_min_severity_is_kept(db, tmp_path, hook):
    sup = _sup(db, tmp_path, WebhookNotifier(hook.hook_url, SECRET, min_severity=Severity.WARN))
    try:
        sup.executor.notify(Alert(run_id=RUN, severity=Severity.INFO, title="alert only", incident_id=1))
        sup.executor.notify(Alert(run_id=RUN, severity=Severity.WARN, title="rolled back", incident_id=2))
        sup.executor.notify(Alert(run_id=RUN, severity=Severity.INFO, title="closed", incident_id=1,
                                  story_state=StoryState.RESOLVED))  # never triggered: nothing to resolve
        sup.executor.notify(Alert(run_id=RUN, severity=Severity.INFO, title="done", incident_id=2,
                                  story_state=StoryState.RESOLVED))
        assert sup.executor.outbox.drain(10)
        got = [(b["event"], b["title"], b["dedup_key"]) for b in hook.accepted()]
        assert got == [("trigger", "rolled back", f"thermowatch/{RUN}/incident:2"),
                       ("resolve", "done", f"thermowatch/{RUN}/incident:2")]
        with sup.sessions() as s:
            rows = [a for a in alerts_store.alerts(s, RUN) if a.channel == "webhook"]
        assert sorted(r.state for r in rows) == ["sent", "sent"]
    finally:
        sup.close()


def test_config_errors_name_the_key(tmp_path, hook):
    path = tmp_path / "sup.yaml"
    for section, message in (({"url": "hooks.example.org/x"}, r"webhook\.url must be an http"),
                             ({"url": hook.hook_url, "min_severity": "loud"}, r"webhook\.min_severity: expected one of"),
                             ({"timeout_s": 500}, r"webhook\.timeout_s must be in \(0, 120\]"),
                             ({"secret": "x"}, r"webhook\.secret: unknown key; did you mean")):
        path.write_text(yaml.safe_dump({"webhook": section}))
        with pytest.raises(ConfigError, match=message):
            SupervisorConfig.load(path, env={}, data_dir=tmp_path)
    cfg = SupervisorConfig(data_dir=tmp_path, webhook={"url": hook.hook_url})
    with pytest.raises(NotifyConfigError, match=r"webhook\.secret_env: environment variable THERMOWATCH_WEBHOOK_SECRET "
                                                r"is unset or empty"):
        build_notifier(cfg, environ={})
    cfg = SupervisorConfig(data_dir=tmp_path, webhook={"url": hook.hook_url, "secret_env": ""})
    with pytest.raises(NotifyConfigError, match=r"webhook is configured without a signing secret; set "
                                                r"webhook\.secret_env or webhook\.secret_file"):
        build_notifier(cfg, environ={})
    notifier = build_notifier(cfg.__class__(data_dir=tmp_path, webhook={"url": hook.hook_url + "?key=hidden"}),
                              environ={"THERMOWATCH_WEBHOOK_SECRET": SECRET})
    try:
        assert notifier.check()["webhook"]["url"] == hook.hook_url  # the query's key is kept out of sight
        hook.fail_next(500)
        with pytest.raises(NotifyError) as exc:
            notifier.parts[1].send(_page())
        assert "hidden" not in str(exc.value)
    finally:
        notifier.close()
