"""The durable alert outbox (supervisor.notify.outbox) with the real Supervisor, real records from
a diverging run, the real slack-sdk client and the fake Slack server, on SQLite and PostgreSQL:
nothing on the ingest or command path waits for Slack, a Slack outage (a hang, 429 with a long
Retry-After, then 500s) loses no alert and reorders none, a daemon restart delivers what was
left pending, and each row tells the truth."""

from __future__ import annotations

import io
import threading
import time

import pytest

from monitors.contract import RunInfo
from supervisor.config import SupervisorConfig
from supervisor.notify.base import FanOut
from supervisor.notify.console import ConsoleNotifier
from supervisor.notify.slack import SlackNotifier
from supervisor.service import Supervisor
from supervisor.store import actions as actions_store
from supervisor.store import alerts as alerts_store
from tests.fakes.slack_server import FakeSlack
from tests.fixtures.diverging import DETECTORS, POLICY, diverging_records, feed

RUN = "ob"
SLACK = "slack:#training-alerts"


@pytest.fixture
def slack():
    with FakeSlack() as fake:
        yield fake


def make_sup(db, tmp_path, slack: FakeSlack) -> Supervisor:
    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, policy=dict(POLICY), detectors=dict(DETECTORS))
    # One slack-sdk retry, its Retry-After wait capped short: the outbox's own backoff does the rest.
    notifier = FanOut([ConsoleNotifier(io.StringIO()),
                       SlackNotifier(slack.token, "#training-alerts", base_url=slack.base_url, retries=1,
                                     max_retry_wait_s=0.2)])
    sup = Supervisor(cfg, notifier=notifier)
    sup.executor.outbox.retry_s = 0.1  # seconds to the first retry; doubles per attempt
    sup.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
    return sup


def _rows(sup, channel=SLACK):
    with sup.sessions() as s:
        return sorted((a for a in alerts_store.alerts(s, RUN) if a.channel == channel), key=lambda a: a.id)


def _diverge_and_submit(sup, tmp_path):
    """A real divergence (the policy decides a rollback: one alert) and three manual commands."""
    feed(sup, RUN, 0, diverging_records(), ckpt_root=tmp_path / "ckpt",
         stop=lambda: bool(_open(sup)))
    for i in range(3):
        sup.executor.submit(RUN, "profile", {"steps": i + 1}, "bob", f"manual {i}")


def _open(sup):
    with sup.sessions() as s:
        return actions_store.open_actions(s, RUN)


def test_a_slack_outage_never_blocks_ingest_and_loses_no_alert(db, tmp_path, slack):
    sup = make_sup(db, tmp_path, slack)
    try:
        slack.hold()  # Slack accepts the connection and answers nothing
        work = threading.Thread(target=_diverge_and_submit, args=(sup, tmp_path))
        work.start()
        work.join(120)
        assert not work.is_alive(), "ingest or a command waited for Slack"
        assert _open(sup), "the divergence was not acted on"
        pending = _rows(sup)
        assert len(pending) >= 4 and all(r.state == "pending" and not r.ok for r in pending)
        deadline = time.monotonic() + 10  # the console's own sender is not held up by Slack
        while not (len(_rows(sup, "console")) == len(pending) and all(r.state == "sent" for r in _rows(sup, "console"))):
            assert time.monotonic() < deadline, "a hanging Slack held up the console channel"
            time.sleep(0.02)
        # Slack comes back rate limited with a long Retry-After, then fails with 500s.
        slack.rate_limit(calls=4, retry_after=10)
        slack.server_error(calls=3)
        slack.release()
        assert sup.executor.outbox.drain(60), "alerts were not delivered after the outage"
        rows = _rows(sup)
        assert [r.state for r in rows] == ["sent"] * len(rows) and all(r.ok and r.sent_at for r in rows)
        assert rows[0].attempts > 1 and ("rate limited" in rows[0].error or "HTTP 500" in rows[0].error)
        posted = [m["text"] for m in slack.posted()]
        assert posted == [f"[{r.payload['severity'].upper()}] {r.payload['title']}" + (
            f": {r.payload['text']}" if r.payload["text"] else "") for r in rows], "delivered out of order"
        assert [r.text for r in _rows(sup, "console")] == [r.text for r in rows]
    finally:
        slack.release()
        sup.close()


def test_pending_alerts_survive_a_daemon_restart(db, tmp_path, slack):
    sup = make_sup(db, tmp_path, slack)
    slack.server_error(calls=10**6)  # Slack is down for as long as this daemon lives
    sup.executor.submit(RUN, "pause", {}, "bob", "before the restart")
    assert sup.executor.outbox.drain(30, due_only=True)
    sup.close()
    (row,) = _rows(sup)
    assert (row.state, row.ok, row.sent_at) == ("pending", False, None) and row.attempts >= 1
    slack.server_error(calls=0)
    sup2 = make_sup(db, tmp_path, slack)  # a new daemon process on the same database
    try:
        sup2.executor.outbox.retry_s = 0.1
        assert sup2.executor.outbox.drain(30)
        (row,) = _rows(sup2)
        assert row.state == "sent" and row.ok
        assert [m["text"] for m in slack.posted()] == ["[INFO] ob: bob asked for pause: before the restart"]
    finally:
        sup2.close()


def test_a_message_slack_refuses_for_good_is_failed_and_the_next_goes_out(db, tmp_path, slack):
    sup = make_sup(db, tmp_path, slack)
    try:
        slack.fail_next("msg_too_long")
        sup.executor.submit(RUN, "pause", {}, "bob", "first")
        sup.executor.submit(RUN, "resume", {}, "bob", "second")
        assert sup.executor.outbox.drain(30)
        first, second = _rows(sup)
        assert (first.state, first.ok) == ("failed", False) and "msg_too_long" in first.error
        assert (second.state, second.ok) == ("sent", True)
        assert [m["text"] for m in slack.posted()] == ["[INFO] ob: bob asked for resume: second"]
    finally:
        sup.close()
