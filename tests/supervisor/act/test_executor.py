"""thermowatch.supervisor.act.executor: the action state machine through poll/ack/expire, manual submits,
approve/cancel conflicts, and alerts (the fake Slack server for the one thing off the machine),
on SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
import io
import json
import time

import pytest

from thermowatch.monitors.contract import Ack, FinishReason, RunFinished, RunInfo, SampleRange
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.errors import Conflict, NotFound, UserError
from thermowatch.supervisor.notify.base import Alert, FanOut
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.notify.slack import SlackNotifier
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import alerts as alerts_store
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store import skips as skips_store
from tests.fakes.slack_server import FakeSlack
from tests.fixtures.diverging import DETECTORS, POLICY, diverging_records, feed

RUN = "ex"


def make_sup(db, tmp_path, notifier=None, **over) -> Supervisor:
    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, policy=dict(POLICY),
                           detectors=dict(DETECTORS), **over)
    sup = Supervisor(cfg, notifier=notifier if notifier is not None else ConsoleNotifier(io.StringIO()))
    sup.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
    return sup


@pytest.fixture
def slack():
    with FakeSlack() as fake:
        yield fake


@pytest.fixture
def stream():
    return io.StringIO()


@pytest.fixture
def sup(db, tmp_path, stream):
    s = make_sup(db, tmp_path, ConsoleNotifier(stream), ack_timeout_s=5.0, ack_retries=1)
    yield s
    s.close()


@pytest.fixture
def slack_sup(db, tmp_path, slack):
    """A supervisor whose alerts go to the fake Slack's #training-alerts, as the daemon posts them."""
    s = make_sup(db, tmp_path, SlackNotifier(slack.token, "#training-alerts", base_url=slack.base_url, retries=0))
    yield s
    s.close()


def action(sup, action_id):
    with sup.sessions() as s:
        return actions_store.get_action(s, action_id)


def alerts(sup):
    assert sup.executor.outbox.drain(30, due_only=True), "the alert sender did not catch up"
    with sup.sessions() as s:
        return list(reversed(alerts_store.alerts(s, RUN)))


def skip(sup, lo=100, hi=200, who="bob") -> int:
    return sup.executor.submit(RUN, "skip", {"skip_ranges": [[lo, hi]]}, who, "bad shard")


def test_ack_moves_sent_to_done_and_a_duplicate_ack_is_ignored(sup):
    aid = skip(sup)
    assert action(sup, aid).state == "pending"
    assert [c.id for c in sup.poll(RUN)] == [aid]
    sup.ack(RUN, Ack(aid, ok=True, first_step=7))
    row = action(sup, aid)
    assert (row.state, row.ack_step) == ("done", 7)
    sup.ack(RUN, Ack(aid, ok=True, first_step=9))  # the controller re-sends its ack
    sup.ack(RUN, Ack(aid, ok=False, first_step=9, detail="late"))
    row = action(sup, aid)
    assert (row.state, row.ack_step, row.error) == ("done", 7, "")
    with sup.sessions() as s:
        assert skips_store.skip_ranges(s, RUN) == [(100, 200)]  # booked once


def test_failed_ack_marks_failed_and_sends_a_critical_alert(sup, stream):
    aid = skip(sup)
    sup.poll(RUN)
    sup.ack(RUN, Ack(aid, ok=False, first_step=3, detail="checkpoint step_35 is unreadable"))
    row = action(sup, aid)
    assert row.state == "failed" and "unreadable" in row.error
    with sup.sessions() as s:
        assert skips_store.skip_ranges(s, RUN) == []  # nothing booked for a refused command
    got = [a for a in alerts(sup) if "FAILED" in a.text]
    assert len(got) == 1 and got[0].ok and str(aid) in got[0].text
    assert "[CRITICAL]" in stream.getvalue() and "unreadable" in stream.getvalue()


def test_ack_for_another_runs_action_or_an_unknown_one_is_not_found(sup):
    aid = skip(sup)
    sup.open_run(RunInfo(run_id="other", attempt=0, world_size=1))
    with pytest.raises(NotFound, match="has no action"):
        sup.ack("other", Ack(aid, ok=True, first_step=1))
    with pytest.raises(NotFound):
        sup.ack(RUN, Ack(aid + 1000, ok=True, first_step=1))
    assert action(sup, aid).state == "pending"


def test_expire_redelivers_then_fails_with_an_alert(sup, stream):
    aid = skip(sup)
    sup.poll(RUN)
    sent_at = action(sup, aid).updated_at
    # not yet past the timeout: nothing happens
    assert sup.executor.expire(now=sent_at + dt.timedelta(seconds=4)) == []
    assert action(sup, aid).state == "sent"
    # past it, with a retry left: back to pending, handed out again with the same id
    assert sup.executor.expire(now=sent_at + dt.timedelta(seconds=6)) == []
    assert action(sup, aid).state == "pending"
    assert [c.id for c in sup.poll(RUN)] == [aid]
    row = action(sup, aid)
    assert row.state == "sent" and row.attempts == 2
    # retries used up: failed, loudly
    assert sup.executor.expire(now=row.updated_at + dt.timedelta(seconds=6)) == [aid]
    row = action(sup, aid)
    assert row.state == "failed" and "no acknowledgement" in row.error
    assert any("never acknowledged" in a.text for a in alerts(sup))
    assert "never acknowledged" in stream.getvalue()
    assert sup.poll(RUN) == []
    with sup.sessions() as s:
        events = [e.event for e in audit_store.audit_log(s, RUN)]
    assert events.count("redeliver") == 1


def test_expire_leaves_pending_and_done_actions_alone(sup):
    a1 = skip(sup)
    a2 = skip(sup, 300, 400)
    sup.poll(RUN)
    sup.ack(RUN, Ack(a2, ok=True, first_step=2))
    a3 = skip(sup, 500, 600)  # pending, never polled
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=10)  # past the ack timeout, not the expiry
    sup.executor.expire(now=later)
    assert action(sup, a1).state == "pending"  # redelivered (was sent)
    assert action(sup, a2).state == "done"
    assert action(sup, a3).state == "pending"
    # a day without a poll: what is still open can never be carried out, and says so
    far = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=1)
    assert sorted(sup.executor.expire(now=far)) == [a1, a3]
    for aid in (a1, a3):
        row = action(sup, aid)
        assert row.state == "expired" and "has not asked for commands for 864" in row.error, row
    assert action(sup, a2).state == "done"
    assert sup.executor.expire(now=far) == []  # final: nothing moves twice


def test_a_polling_run_keeps_its_pending_proposal_and_a_silent_one_loses_it(db, tmp_path):
    sup = make_sup(db, tmp_path, advise_only=True, command_expiry_s=0.5)
    try:
        aid = sup.executor.submit(RUN, "pause", {}, "bob", "look at it")  # manual: never needs approval
        with sup.sessions() as s:
            proposal = actions_store.enqueue_action(s, RUN, "pause", {}, "policy's", "auto", "policy",
                                                    requires_approval=True)
            s.commit()
        assert [c.id for c in sup.poll(RUN)] == [aid]
        time.sleep(0.6)
        assert sup.poll(RUN) == []  # alive: the proposal waits for a human however old it is
        assert sup.executor.expire() == [] and action(sup, proposal).state == "pending"
        time.sleep(0.6)  # silent past command_expiry_s
        assert sorted(sup.executor.expire()) == [aid, proposal]
        assert {action(sup, a).state for a in (aid, proposal)} == {"expired"}
        with sup.sessions() as s:
            assert [e.event for e in audit_store.audit_log(s, RUN)].count("expired") == 2
    finally:
        sup.close()


def test_a_finished_run_expires_what_is_open_and_refuses_new_commands_until_relaunched(sup):
    sent = skip(sup)
    sup.poll(RUN)
    queued = skip(sup, 300, 400)
    with sup.sessions() as s:
        proposal = actions_store.enqueue_action(s, RUN, "pause", {}, "policy's", "auto", "policy",
                                                requires_approval=True)
        s.commit()
    sup.finish_run(RUN, 0, RunFinished(step=31, final_loss=2.5, reason=FinishReason.STOPPED))
    for aid in (sent, queued, proposal):
        row = action(sup, aid)
        assert row.state == "expired" and row.error == (
            "the run finished (stopped at step 31) before the trainer carried it out"), row
    assert any("expired" in a.text and str(queued) in a.text for a in alerts(sup))
    with pytest.raises(Conflict, match=r"run 'ex' has finished \(stopped at step 31, final loss 2.5 \(the last step's\)\)"):
        skip(sup, 500, 600)
    with sup.sessions() as s:
        late = actions_store.enqueue_action(s, RUN, "pause", {}, "a proposal the judge wrote late", "auto", "policy",
                                            requires_approval=True)
        s.commit()
    with pytest.raises(Conflict, match="cannot be approved: run 'ex' has finished"):
        sup.executor.approve(late, "ana")
    assert action(sup, late).state == "pending" and sup.executor.expire() == [late]
    with sup.sessions() as s:
        assert len(actions_store.actions(s, RUN)) == 4  # the refused submit wrote nothing
    sup.open_run(RunInfo(run_id=RUN, attempt=1, world_size=1))  # relaunched: it takes commands again
    again = skip(sup, 500, 600)
    assert [c.id for c in sup.poll(RUN)] == [again]


@pytest.mark.parametrize("kind, args, who, run, exc, match", [
    ("explode", {}, "bob", RUN, UserError, "unknown command 'explode'"),
    ("pause", {}, "", RUN, UserError, "needs a `who`"),
    ("pause", {}, "bob", "no-such-run", NotFound, "no run 'no-such-run'"),
])
def test_manual_submit_validation(sup, kind, args, who, run, exc, match):
    with pytest.raises(exc, match=match):
        sup.executor.submit(run, kind, args, who, "why")
    with sup.sessions() as s:
        assert actions_store.actions(s, RUN) == []


def test_manual_submit_writes_a_manual_row_without_approval(db, tmp_path):
    sup = make_sup(db, tmp_path, advise_only=True)  # manual commands never wait for approval
    try:
        aid = sup.executor.submit(RUN, "rollback", {"to_step": 10}, "carol", "spike at 12")
        row = action(sup, aid)
        assert (row.kind, row.origin, row.who, row.reason, row.requires_approval) == (
            "rollback", "manual", "carol", "spike at 12", False)
        assert [c.args for c in sup.poll(RUN)] == [{"to_step": 10}]
    finally:
        sup.close()


def test_approve_and_cancel_conflicts(sup):
    aid = skip(sup)
    with pytest.raises(Conflict, match="not a pending action awaiting approval"):
        sup.executor.approve(aid, "alice")  # manual: nothing to approve
    with pytest.raises(NotFound):
        sup.executor.approve(aid + 1000, "alice")
    with pytest.raises(NotFound):
        sup.executor.cancel(aid + 1000, "alice")
    sup.executor.cancel(aid, "alice")
    assert action(sup, aid).state == "cancelled"
    with pytest.raises(Conflict, match="cannot go from 'cancelled'"):
        sup.executor.cancel(aid, "alice")
    assert sup.poll(RUN) == []
    sent = skip(sup, 300, 400)
    sup.poll(RUN)
    with pytest.raises(Conflict, match="cannot go from 'sent' to 'cancelled'"):
        sup.executor.cancel(sent, "alice")
    assert action(sup, sent).state == "sent"


def _diverge(sup, tmp_path):
    feed(sup, RUN, 0, diverging_records(), ckpt_root=tmp_path / "ckpt",
         stop=lambda: bool(sup.executor and _open(sup)))
    acts = _open(sup)
    assert len(acts) == 1
    return acts[0]


def _open(sup):
    with sup.sessions() as s:
        return actions_store.open_actions(s, RUN)


def test_advise_only_approve_then_approve_again_conflicts(db, tmp_path):
    sup = make_sup(db, tmp_path, advise_only=True)
    try:
        act = _diverge(sup, tmp_path)
        assert act.requires_approval
        sup.executor.approve(act.id, "alice")
        with pytest.raises(Conflict):
            sup.executor.approve(act.id, "alice")
        with sup.sessions() as s:
            assert [e.event for e in audit_store.audit_log(s, RUN)].count("approved") == 1
    finally:
        sup.close()


def test_decision_alert_reaches_slack_with_the_reasons(slack_sup, slack, tmp_path):
    act = _diverge(slack_sup, tmp_path)
    assert slack_sup.executor.outbox.drain(30)
    posted = slack.posted()
    # Alert-only findings (growth with no witness yet) may be posted before the one that acts.
    acting = [m for m in posted if f"rollback to step {act.args['to_step']}" in m["text"]]
    assert len(acting) == 1, [m["text"] for m in posted]
    msg = acting[0]
    assert msg["channel"] == "#training-alerts"
    blocks = msg["blocks"] if isinstance(msg["blocks"], list) else json.loads(msg["blocks"])
    text = "\n".join(str(b) for b in blocks)
    # the policy's reasons, as stored in the action row, are what the human reads
    reasons = act.reason.split("; ")
    assert any("rung 1" in r for r in reasons)
    for r in reasons[1:]:
        assert r.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")[:60] in text
    assert f"step {act.args['to_step']}" in text
    assert RUN in text
    assert all(a.ok for a in alerts(slack_sup))


def test_a_failing_notifier_does_not_undo_the_decision(db, tmp_path, slack):
    # A revoked bot token: every post is refused by Slack, the notifier raises NotifyError.
    notifier = SlackNotifier("xoxb-revoked", "#training-alerts", base_url=slack.base_url, retries=0)
    sup = make_sup(db, tmp_path, notifier)
    try:
        act = _diverge(sup, tmp_path)
        assert sup.executor.outbox.drain(30, due_only=True)
        assert act.kind == "rollback" and act.state == "pending"
        with sup.sessions() as s:
            assert incidents_store.get_incident(s, act.incident_id).state == "open"
        got = alerts(sup)
        # Nothing delivered, nothing lost: the oldest alert holds the error and every row stays
        # pending (in order) for a retry once the token is fixed.
        assert got and not got[0].ok and "invalid_auth" in got[0].error
        assert all(a.state == "pending" and not a.ok and a.sent_at is None for a in got)
        assert any("rollback to step" in a.text for a in got)
        assert slack.posted() == [] and slack.calls("chat.postMessage")
        # the run controller still gets its command
        assert [c.id for c in sup.poll(RUN)] == [act.id]
    finally:
        sup.close()


def test_an_ack_cannot_bypass_approval(db, tmp_path):
    """Advise-only: an action waiting for a human is never delivered, so an ack for it (a
    confused or stale controller, or anyone with the API token) must not carry it out."""
    sup = make_sup(db, tmp_path, advise_only=True)
    try:
        act = _diverge(sup, tmp_path)
        assert act.requires_approval and sup.poll(RUN) == []
        with pytest.raises(Conflict):
            sup.ack(RUN, Ack(act.id, ok=True, first_step=act.args["to_step"] + 1))
        row = action(sup, act.id)
        assert (row.state, row.requires_approval) == ("pending", True)
        with sup.sessions() as s:
            assert skips_store.skip_ranges(s, RUN) == []
            assert incidents_store.get_incident(s, act.incident_id).state == "open"
    finally:
        sup.close()


def test_approval_alert_carries_the_action_id_the_commands_and_the_run_page(db, tmp_path, slack, stream):
    """Advise-only (issue 12): the on-call reads what is waiting and exactly what to type."""
    notifier = SlackNotifier(slack.token, "#training-alerts", base_url=slack.base_url, retries=0,
                             web_base_url="https://thermowatch.example/")
    sup = make_sup(db, tmp_path, FanOut([ConsoleNotifier(stream), notifier]), advise_only=True)
    try:
        act = _diverge(sup, tmp_path)
        assert act.requires_approval
        assert sup.executor.outbox.drain(30)
        (msg,) = [m for m in slack.posted() if "approval needed" in m["text"]]
        assert f"[action {act.id}]" in msg["text"]
        blocks = json.dumps(msg["blocks"] if isinstance(msg["blocks"], list) else json.loads(msg["blocks"]))
        for expected in (f"`thermowatch approve {act.id}`", f"`thermowatch cancel {act.id}`",
                         f"*action*\\n{act.id}", f"https://thermowatch.example/runs/{RUN}?incident={act.incident_id}"):
            assert expected in blocks, expected
        assert f"$ thermowatch approve {act.id}" in stream.getvalue()
        assert f"*now:* awaiting approval (action {act.id})" in blocks
        sup.executor.approve(act.id, "alice")  # the decision is a reply, and the top message says so
        assert sup.executor.outbox.drain(30)
        (top,) = [m for m in slack.top_level() if m["text"] == msg["text"]]
        # the reply says what the yes does now: the checkpoint it loads and what that discards (issue 23)
        reply = slack.thread(top["ts"])[-1]["text"]
        assert reply.startswith(f"[INFO] {RUN}: alice approved rollback (action {act.id}): loads checkpoint "), reply
        assert "discards: steps " in reply and "steps to train again" in reply, reply
        assert f"*now:* rollback (action {act.id}) approved by alice" in json.dumps(top["blocks"])
    finally:
        sup.close()


def test_done_and_failed_actions_report_in_their_thread(slack_sup, slack):
    """A manual command's story: asked, then what the trainer did; a failure is broadcast."""
    ok, bad = skip(slack_sup), skip(slack_sup, 300, 400)
    slack_sup.poll(RUN)
    slack_sup.ack(RUN, Ack(ok, ok=True, first_step=12, skip_ranges=(SampleRange(100, 200),)))
    slack_sup.ack(RUN, Ack(bad, ok=False, first_step=12, detail="ledger is read-only"))
    assert slack_sup.executor.outbox.drain(30)
    parents = slack.top_level()
    assert len(parents) == 2 and all(p["reply_count"] == 1 for p in parents)
    done = slack.thread(parents[0]["ts"])[1]
    assert f"skip (action {ok}) done: skip applied, first step trained 12, skipped [100, 200)" in done["text"]
    assert done["text"].count("first step trained") == 1, done["text"]  # said once (issue 23's wording)
    assert "subtype" not in done
    failed = slack.thread(parents[1]["ts"])[1]
    assert "FAILED" in failed["text"] and "read-only" in failed["text"]
    assert failed["subtype"] == "thread_broadcast"


def test_the_finish_closes_open_incidents_and_tells_the_story_in_one_message(db, tmp_path):
    """Issue 23: a run finished with two incidents open and no word in Slack. Through the real
    outbox and slack-sdk into the fake Slack: the open incident's thread says it closed (its top
    message restated), and one top-level "run finished" message gives the numbers in words,
    counted from the attempts, the actions and the skip ledger."""
    from thermowatch.monitors.contract import CheckpointInfo, Finding, Severity as Sev, Signal, StepRecord
    from thermowatch.supervisor.store import story as story_store

    with FakeSlack() as fake:
        sup = make_sup(db, tmp_path, SlackNotifier(fake.token, "#train", base_url=fake.base_url, retries=1))
        try:
            recs = lambda lo, hi: [StepRecord(step=s, values={"loss": 3.0 - s / 100}, sample_lo=8 * s,  # noqa: E731
                                              sample_hi=8 * s + 8) for s in range(lo, hi + 1)]
            sup.write(RUN, 0, recs(1, 60))
            sup.checkpoint_saved(RUN, 0, CheckpointInfo(20, str(tmp_path / "c20"), 20 * 8, True))
            with sup.sessions.begin() as s:  # what the policy writes when it rolls back (the responder's part)
                inc = incidents_store.open_incident(s, RUN, "loss_spike", "", 50, 55, "critical")
                rb = actions_store.enqueue_action(s, RUN, "rollback", {"to_step": 20, "skip_ranges": [[400, 480]]},
                                                  "spike", "auto", "policy", incident_id=inc)
            sup.executor.notify(Alert(RUN, Sev.CRITICAL, f"{RUN}: loss spike", incident_id=inc))
            sup.poll(RUN)
            sup.ack(RUN, Ack(rb, ok=True, first_step=21, checkpoint_step=20, checkpoint_path=str(tmp_path / "c20"),
                             skip_ranges=(SampleRange(400, 480),)))
            sup.open_run(RunInfo(run_id=RUN, attempt=1, world_size=1, start_step=20))
            sup.write(RUN, 1, recs(21, 100))
            with sup.sessions.begin() as s:
                still = incidents_store.open_incident(s, RUN, "attn_logit_growth", "blocks.1.attn", 90, 95, "warn")
            sup.executor.notify(Alert(RUN, Sev.INFO, f"{RUN}: logits rising", incident_id=still))
            sup.finish_run(RUN, 1, RunFinished(step=100, final_loss=2.0, reason=FinishReason.COMPLETED))
            assert sup.executor.outbox.drain(30)
            with sup.sessions() as s:
                told = story_store.story(s, RUN)
                assert [i.state for i in incidents_store.incidents(s, RUN)] == ["resolved", "resolved"]
            assert (told.auto_rollbacks, told.steps_retrained, told.samples_skipped, told.attempts,
                    told.open_incidents) == (1, 40, 80, 2, 0)
            top = fake.top_level()
            done = [m for m in top if "finished (completed at step 100)" in m["text"]]
            assert len(done) == 1, [m["text"] for m in top]
            blocks = json.dumps(done[0]["blocks"])
            for words in ("final loss 2", "1 automatic rollback", "40 steps re-trained", "80 samples skipped",
                          "2 incidents, 0 open", "2 attempts"):
                assert words in blocks, (words, blocks)
            # steps 90-95 lie within 50 steps of 50-55: one divergence episode, one thread (issue 37)
            thread = next(m for m in top if any("logits rising" in r["text"] for r in fake.thread(m["ts"])))
            assert "loss spike" in thread["text"]
            assert "closed, the run ended (completed at step 100)" in fake.thread(thread["ts"])[-1]["text"]
            assert "*now:* closed: the run ended" in json.dumps(fake.messages[thread["ts"]]["blocks"])
        finally:
            sup.close()


def test_a_sent_command_goes_out_again_until_acknowledged_without_a_new_attempt(db, tmp_path):
    """A poll answer lost on the way (issue 34: re-sent only by the ack watchdog, 121-145 s later):
    every poll `redeliver_s` after the command last went out carries it again; its state and
    attempts stay (ack_timeout_s still bounds how long it may go unanswered), and an ack ends it."""
    sup = make_sup(db, tmp_path, redeliver_s=0.5)
    try:
        aid = skip(sup)
        assert [c.id for c in sup.poll(RUN)] == [aid]  # the answer that is lost
        assert sup.poll(RUN) == []  # too soon: the trainer may have it
        time.sleep(0.6)
        again = sup.poll(RUN)
        assert [(c.id, c.body.to_args()) for c in again] == [(aid, {"skip_ranges": [[100, 200]]})]
        assert sup.poll(RUN) == []  # and not at every poll: once per redeliver_s
        later = skip(sup, 300, 400)
        time.sleep(0.6)
        assert [c.id for c in sup.poll(RUN)] == [aid, later]  # in order, with the new one
        row = action(sup, aid)
        assert (row.state, row.attempts) == ("sent", 1)
        sup.ack(RUN, Ack(aid, ok=True, first_step=7))
        sup.ack(RUN, Ack(later, ok=True, first_step=7))
        time.sleep(0.6)
        assert sup.poll(RUN) == []
        with sup.sessions() as s:
            assert skips_store.skip_ranges(s, RUN) == [(100, 200), (300, 400)]  # each booked once
    finally:
        sup.close()
