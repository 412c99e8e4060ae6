"""The durable alert outbox (supervisor.notify.outbox) with the real Supervisor, real records from
a diverging run, the real slack-sdk client and the fake Slack server, on SQLite and PostgreSQL:
nothing on the ingest or command path waits for Slack, a Slack outage (a hang, 429 with a long
Retry-After, then 500s) loses no alert and reorders none, a daemon restart delivers what was
left pending, and each row tells the truth."""

from __future__ import annotations

import io
import json
import threading
import time

import pytest

from thermowatch.monitors.contract import Ack, RunInfo
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.notify.base import FanOut
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.notify.slack import SlackNotifier
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import alerts as alerts_store
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


def _rows(sup, channel=SLACK, *, uploads=False):
    """The channel's text rows (`uploads`: its chart upload rows instead), oldest first."""
    with sup.sessions() as s:
        return sorted((a for a in alerts_store.alerts(s, RUN)
                       if a.channel == channel and bool((a.payload or {}).get("chart")) == uploads),
                      key=lambda a: a.id)


def _episode_key(sup, incident_id: int) -> str:
    """The thread of an incident's divergence episode (issue 37: one per episode)."""
    from thermowatch.supervisor.store import incidents as incidents_store

    with sup.sessions() as s:
        return f"incident:{incidents_store.episode(s, incident_id)}"


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
        assert [m["text"] for m in slack.posted()] == ["[INFO] ob: bob asked to pause: before the restart"]
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
        assert [m["text"] for m in slack.posted()] == ["[INFO] ob: bob asked to resume: second"]
    finally:
        sup.close()


# --- threads (issue 12): one Slack thread per incident, in order, through the real outbox ---------


def _diverge(sup, tmp_path):
    feed(sup, RUN, 0, diverging_records(), ckpt_root=tmp_path / "ckpt", stop=lambda: bool(_open(sup)))
    (act,) = _open(sup)
    assert act.kind == "rollback" and act.incident_id is not None
    return act


def _ack_rollback(sup, act):
    assert [c.id for c in sup.poll(RUN)] == [act.id]
    to = act.args["to_step"]
    sup.ack(RUN, Ack(act.id, ok=True, first_step=to + 1, checkpoint_step=to, checkpoint_path=f"/ckpt/{to}",
                     lr_multiplier=0.5, detail="reloaded"))
    return to


def _assert_threads(sup, slack):
    """Every story (thread_key) of the Slack channel is one thread: its first row top-level, the
    rest replies to it, in the order they were decided (row id). Returns {thread_key: messages}."""
    rows = [r for r in _rows(sup) if r.state == "sent"]
    stories: dict[str, list] = {}
    for r in rows:
        if r.thread_key:
            stories.setdefault(r.thread_key, []).append(r)
    threads = {}
    for key, story in stories.items():
        parent = story[0].ts
        assert parent and all(r.ts for r in story)
        messages = [m for m in slack.thread(parent) if m.get("subtype") != "file_share"]  # charts: own test
        assert [m["ts"] for m in messages] == [r.ts for r in story], f"{key}: not one thread in order"
        assert all(m.get("thread_ts") == parent for m in messages[1:])
        threads[key] = messages
    top = {m["ts"] for m in slack.top_level()}
    assert all(story[0].ts in top for story in stories.values())
    assert not any(r.ts in top for story in stories.values() for r in story[1:]), "a reply went top-level"
    return threads


def test_an_incident_is_one_thread_and_the_rollback_ack_is_its_last_reply(db, tmp_path, slack):
    sup = make_sup(db, tmp_path, slack)
    try:
        act = _diverge(sup, tmp_path)
        to = _ack_rollback(sup, act)
        assert sup.executor.outbox.drain(30)
        threads = _assert_threads(sup, slack)
        # the divergence's episode is one thread (issue 37): an alert on the ceiling came first
        thread = threads[_episode_key(sup, act.incident_id)]
        assert len(thread) >= 2 and any(f"rollback to step {to}" in m["text"] for m in thread)
        done = thread[-1]["text"]
        assert f"action {act.id}) done: rolled back to checkpoint {to}, first step trained {to + 1}, LR x0.5" in done
        assert f"incident {act.incident_id} resolved" in json.dumps(thread[-1]["blocks"])
        assert "subtype" not in thread[-1]  # good news is not broadcast to the channel
        # The top message now says where things stand, rewritten in place by its channel id.
        top = json.dumps(thread[0]["blocks"])
        assert f"*now:* resolved: rolled back to checkpoint {to}, first step trained {to + 1}" in top
        assert f"rollback to step {to}" in top  # headed by what was done, not the first detector's note
        updates = slack.calls("chat.update")
        assert updates and all(u.answer["ok"] and u.body["channel"].startswith("C") and u.body["ts"] == thread[0]["ts"]
                               for u in updates)
    finally:
        sup.close()


def test_a_slack_outage_mid_incident_still_ends_with_one_ordered_thread(db, tmp_path, slack):
    sup = make_sup(db, tmp_path, slack)
    try:
        slack.hold()  # the incident's first message is stuck behind a Slack that hangs
        act = _diverge(sup, tmp_path)
        to = _ack_rollback(sup, act)  # its reply is decided while the parent has no ts yet
        aid = sup.executor.submit(RUN, "pause", {}, "bob", "look at the logits")
        sup.poll(RUN)
        sup.ack(RUN, Ack(aid, ok=False, first_step=to + 3, detail="controller lost rank 1"))
        slack.rate_limit(calls=4, retry_after=10)  # then 429 with a long Retry-After, then 500s
        slack.server_error(calls=3)
        slack.release()
        assert sup.executor.outbox.drain(60), "alerts were not delivered after the outage"
        rows = _rows(sup)
        assert all(r.state == "sent" for r in rows) and rows[0].attempts > 1
        threads = _assert_threads(sup, slack)
        incident = threads[_episode_key(sup, act.incident_id)]
        assert "rolled back to checkpoint" in incident[-1]["text"]
        manual = threads[f"action:{aid}"]
        # the top message, first "[INFO] pause", is now headed by the failure (issue 37: the consequence)
        assert [m["text"].split(":")[0] for m in manual] == ["[CRITICAL] ob", "[CRITICAL] ob"]
        assert "FAILED" in manual[1]["text"] and manual[1]["subtype"] == "thread_broadcast"
        assert "*now:* pause (action" in json.dumps(manual[0]["blocks"]) and "FAILED" in json.dumps(manual[0]["blocks"])
        assert not [r for r in slack.calls("chat.postMessage") if r.answer.get("error") == "thread_not_found"]
    finally:
        slack.release()
        sup.close()


def test_a_reply_whose_parent_was_refused_goes_top_level_and_says_so(db, tmp_path, slack):
    sup = make_sup(db, tmp_path, slack)
    try:
        slack.fail_next("msg_too_long")  # the manual command's own message is refused for good
        aid = sup.executor.submit(RUN, "pause", {}, "bob", "first")
        sup.poll(RUN)
        sup.ack(RUN, Ack(aid, ok=False, first_step=5, detail="no GPU answered"))
        assert sup.executor.outbox.drain(30)
        first, second = _rows(sup)
        assert first.state == "failed" and second.state == "sent"
        (msg,) = slack.posted()
        assert "thread_ts" not in msg and "reply_broadcast" not in msg
        assert "posted on its own" in json.dumps(msg["blocks"]) and "msg_too_long" in json.dumps(msg["blocks"])
    finally:
        sup.close()


def test_one_divergence_is_one_message_in_the_channel_headed_by_what_was_done(db, tmp_path, slack):
    """Issue 37: one divergence made 9 INFO threads, one per (signal, module), then the rollbacks'.
    Every incident of the episode (any signal, any module, its steps within EPISODE_GAP_STEPS of the
    others') replies in the first one's thread; the channel shows one message, rewritten to what
    was done (the rollback) and where it stands (resolved)."""
    from thermowatch.supervisor.store import incidents as incidents_store

    sup = make_sup(db, tmp_path, slack)
    try:
        act = _diverge(sup, tmp_path)
        to = _ack_rollback(sup, act)
        assert sup.executor.outbox.drain(30)
        with sup.sessions() as s:
            incs = incidents_store.incidents(s, RUN)
            episodes = {incidents_store.episode(s, i.id) for i in incs}
        assert len(incs) >= 2 and len(episodes) == 1, [(i.id, i.signal, i.module, i.episode_id) for i in incs]
        tops = slack.top_level()
        assert len(tops) == 1, [m["text"] for m in tops]
        head = json.dumps(slack.messages[tops[0]["ts"]]["blocks"])
        assert f"rollback to step {to}" in head and "*now:* resolved: rolled back" in head
        assert tops[0]["text"].startswith("[WARN]")  # the consequence: acted on by itself
    finally:
        sup.close()
