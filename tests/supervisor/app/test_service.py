"""thermowatch.supervisor.app.service.Supervisor end to end, fed with thermometer records from a real diverging
training run (tests/fixtures/diverging.py), on SQLite and PostgreSQL: detect -> incident ->
rollback action -> poll/ack -> skip ledger, LR change, rewound detectors, rung 2, advise-only."""

from __future__ import annotations

import io

import pytest

from thermowatch.monitors.columns import StepColumns
from thermowatch.monitors.contract import Ack, CommandKind, RunInfo
from thermowatch import cli
from thermowatch.supervisor.app.config import SlackConfig, SupervisorConfig
from thermowatch.supervisor.notify.base import NotifyConfigError
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import checkpoints as ckpt_store
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store import lr_changes as lr_store
from thermowatch.supervisor.store import skips as skips_store
from thermowatch.supervisor.store import steps as steps_store
from tests.fakes.slack_server import FakeSlack
from tests.fixtures.diverging import (
    DETECTORS,
    POLICY,
    after_skip,
    diverging_records,
    feed,
    healthy_records,
    samples_of,
)

RUN = "div"
ATTN_SIGNALS = {"attn_logit_growth", "attn_logit_ceiling"}
MARGIN = POLICY["rollback_margin_steps"]


def make_sup(db, tmp_path, **over) -> Supervisor:
    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, policy=dict(POLICY), detectors=dict(DETECTORS),
                           **over)
    return Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()))


@pytest.fixture
def sup(db, tmp_path):
    s = make_sup(db, tmp_path)
    yield s
    s.close()


def open_actions(s: Supervisor, run_id: str = RUN):
    with s.sessions() as ses:
        return actions_store.open_actions(ses, run_id)


def incidents(s: Supervisor, run_id: str = RUN):
    with s.sessions() as ses:
        return incidents_store.incidents(ses, run_id)


def acted(s: Supervisor, run_id: str = RUN):
    """Incidents the policy did something about: an attention finding may alert first (ceiling
    crossed, no witness of harm yet), which opens an incident and closes it at once."""
    return [i for i in incidents(s, run_id) if not i.resolution.startswith(("alert:", "noop:"))]


def feed_until_action(s: Supervisor, attempt: int, recs, tmp_path) -> int:
    return feed(s, RUN, attempt, recs, ckpt_root=tmp_path / "ckpt" / f"a{attempt}",
                stop=lambda: bool(open_actions(s)))


def diverge(s: Supervisor, tmp_path, recs=None):
    """Attempt 0 of the diverging run until the supervisor queues an action; returns
    (records, last step fed, incident, action)."""
    recs = recs or diverging_records()
    s.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
    last = feed_until_action(s, 0, recs, tmp_path)
    acts = open_actions(s)
    assert len(acts) == 1, f"expected one action after the divergence, got {acts}"
    incs = acted(s)
    assert len(incs) == 1
    return recs, last, incs[0], acts[0]


def test_divergence_rolls_back_to_a_healthy_checkpoint_before_the_onset(sup, tmp_path):
    recs, last, inc, act = diverge(sup, tmp_path)
    assert last < recs[-1].step, "the divergence must be caught before the run ends"
    assert inc.signal in ATTN_SIGNALS and inc.module.startswith("blocks.")
    assert inc.state == "open"
    assert inc.onset_step <= inc.detect_step <= last
    # Onset and detection sit where the recorded attention logits really took off.
    key = next(k for k in recs[0].values if k.startswith("attn_logit_") and k.endswith(inc.module))
    at_detect = next(r for r in recs if r.step == inc.detect_step).values[key]
    assert at_detect > 100.0

    assert act.kind == "rollback" and act.state == "pending" and act.origin == "auto"
    assert act.incident_id == inc.id and not act.requires_approval
    to_step = act.args["to_step"]
    assert to_step <= inc.onset_step - MARGIN
    assert to_step % 5 == 0, "the target is a reported checkpoint"
    with sup.sessions() as s:
        cks = {c.step: c for c in ckpt_store.checkpoints(s, RUN)}
    assert cks[to_step].healthy and act.args["checkpoint"] == cks[to_step].path
    # the newest healthy one at or before onset - margin: no healthy checkpoint in between
    assert not [c for c in cks.values() if to_step < c.step <= inc.onset_step - MARGIN and c.healthy]
    lo = max(inc.onset_step - MARGIN, to_step + 1)
    assert act.args["skip_ranges"] == [samples_of(recs, lo, inc.detect_step)]
    assert "lr_multiplier" not in act.args


def test_checkpoints_saved_at_or_after_the_onset_are_distrusted(sup, tmp_path):
    _recs, _last, inc, _act = diverge(sup, tmp_path)
    with sup.sessions() as s:
        cks = ckpt_store.checkpoints(s, RUN)
    assert [c.step for c in cks if c.step < inc.onset_step and not c.healthy] == []
    after = [c for c in cks if c.step >= inc.onset_step]
    assert after, "the feed reports checkpoints past the onset (the batch that detects it holds some)"
    # Every checkpoint past the onset was trained on diverging weights, whether it was reported
    # before the finding or right after it (the controller flushes the steps, then reports the
    # checkpoint, so one saved at or just after the detection step always arrives after it).
    assert [(c.step, c.healthy) for c in after] == [(c.step, False) for c in after]


def test_poll_ack_books_the_skip_and_resolves_the_incident(sup, tmp_path):
    _recs, _last, inc, act = diverge(sup, tmp_path)
    cmds = sup.poll(RUN)
    assert [(c.id, c.kind) for c in cmds] == [(act.id, CommandKind.ROLLBACK)]
    assert cmds[0].args == act.args
    assert sup.poll(RUN) == [], "a sent command is not handed out twice"
    with sup.sessions() as s:
        row = actions_store.get_action(s, act.id)
    assert row.state == "sent" and row.attempts == 1

    to_step = act.args["to_step"]
    sup.ack(RUN, Ack(command_id=act.id, ok=True, first_step=to_step + 1, detail="rolled back"))
    with sup.sessions() as s:
        row = actions_store.get_action(s, act.id)
        assert row.state == "done" and row.ack_step == to_step + 1
        assert skips_store.skip_ranges(s, RUN) == [tuple(act.args["skip_ranges"][0])]
        assert lr_store.lr_changes(s, RUN) == []  # rung 1 keeps the LR
        got = incidents_store.get_incident(s, inc.id)
    assert got.state == "resolved" and "rollback done" in got.resolution


def test_recurrence_after_the_rollback_is_rung_2_with_a_lower_lr(sup, tmp_path):
    recs, _last, _inc, act = diverge(sup, tmp_path)
    sup.poll(RUN)
    to_step = act.args["to_step"]
    skip = act.args["skip_ranges"][0]
    sup.ack(RUN, Ack(command_id=act.id, ok=True, first_step=to_step + 1))

    # Attempt 1 re-trains from the checkpoint at the same LR: the same divergence comes back,
    # on the samples the loader serves once the skipped range is passed over.
    sup.open_run(RunInfo(run_id=RUN, attempt=1, world_size=1, start_step=to_step))
    again = after_skip(recs, to_step + 1, cursor=recs[to_step - 1].sample_hi, skip=tuple(skip))
    feed_until_action(sup, 1, again, tmp_path)
    acts = open_actions(sup)
    assert len(acts) == 1
    act2 = acts[0]
    incs = acted(sup)
    assert len(incs) == 2 and incs[1].state == "open" and incs[1].signal in ATTN_SIGNALS
    inc2 = incs[1]
    assert act2.kind == "rollback" and act2.incident_id == inc2.id
    assert act2.args["lr_multiplier"] == pytest.approx(POLICY["lr_factor"])
    # rung 2 goes back no later than where rung 1 went: the checkpoints since had the same LR
    assert act2.args["to_step"] <= to_step and act2.args["to_step"] <= inc2.onset_step - MARGIN
    # rung 2 cuts the LR and skips nothing: the skip before it did not stop it (issue 35)
    assert not act2.args.get("skip_ranges")

    assert [c.id for c in sup.poll(RUN)] == [act2.id]
    ack_step = act2.args["to_step"] + 1
    sup.ack(RUN, Ack(command_id=act2.id, ok=True, first_step=ack_step))
    with sup.sessions() as s:
        changes = lr_store.lr_changes(s, RUN)
        assert [(c.multiplier, c.start_step, c.action_id) for c in changes] == [
            (pytest.approx(POLICY["lr_factor"]), ack_step, act2.id)]
        ranges = skips_store.skip_ranges(s, RUN)
        assert incidents_store.get_incident(s, inc2.id).state == "resolved"
    # the first skip is the ledger's, alone
    assert any(a <= skip[0] and skip[1] <= b for a, b in ranges) and len(ranges) == 1, (skip, ranges)


def test_two_divergences_seconds_apart_climb_the_ladder_with_the_default_cooldowns(db, tmp_path):
    """Issue 22: a fast loop re-diverges seconds after its first rollback. With the default
    cooldowns (steps; no wall-clock cooldown) the recurrence on the re-trained attempt is rung 2,
    not silenced by a 600 s window."""
    policy = {k: v for k, v in POLICY.items() if k != "cooldown_s"}
    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, policy=policy, detectors=dict(DETECTORS))
    sup = Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()))
    try:
        recs, _last, _inc, act = diverge(sup, tmp_path)
        sup.poll(RUN)
        to_step = act.args["to_step"]
        sup.ack(RUN, Ack(command_id=act.id, ok=True, first_step=to_step + 1))
        sup.open_run(RunInfo(run_id=RUN, attempt=1, world_size=1, start_step=to_step))
        again = after_skip(recs, to_step + 1, cursor=recs[to_step - 1].sample_hi,
                           skip=tuple(act.args["skip_ranges"][0]))
        feed_until_action(sup, 1, again, tmp_path)
        acts = open_actions(sup)
        assert len(acts) == 1, acts
        act2 = acts[0]
        assert (act2.created_at - act.created_at).total_seconds() < 60, "the two actions are seconds apart"
        assert "rung 1" in act.reason and "rung 2" in act2.reason, (act.reason, act2.reason)
        assert act2.kind == "rollback" and act2.args["lr_multiplier"] == pytest.approx(POLICY["lr_factor"])
        assert "cooldown" not in act2.reason
    finally:
        sup.close()


def test_late_findings_of_the_abandoned_attempt_do_not_act_before_its_successor_opens(sup, tmp_path):
    """The ack can come before the new attempt's RunInfo (they travel on different channels):
    the rest of attempt 0 is then still judged, against rewound detectors, and finds the same
    blowup again. The policy knows that attempt was left behind and does nothing."""
    recs, last, _inc, act = diverge(sup, tmp_path)
    sup.poll(RUN)
    sup.ack(RUN, Ack(command_id=act.id, ok=True, first_step=act.args["to_step"] + 1))
    late = [r for r in recs if r.step > act.args["to_step"]]
    sup.write(RUN, 0, late)
    assert open_actions(sup) == []
    assert len(acted(sup)) == 1
    noops = [i for i in incidents(sup) if i.resolution.startswith("noop:")]
    assert noops, "the late records were judged (nothing else opened attempt 1) and found the blowup again"
    with sup.sessions() as s:
        assert [a.kind for a in actions_store.actions(s, RUN)] == ["rollback"]


def test_late_records_of_an_older_attempt_are_stored_not_judged(sup, tmp_path):
    recs, last, _inc, act = diverge(sup, tmp_path)
    sup.poll(RUN)
    sup.ack(RUN, Ack(command_id=act.id, ok=True, first_step=act.args["to_step"] + 1))
    sup.open_run(RunInfo(run_id=RUN, attempt=1, world_size=1, start_step=act.args["to_step"]))
    # The rest of attempt 0 (its logits keep blowing up, other layers included) arrives late.
    late = [r for r in recs if r.step > last]
    assert late
    sup.write(RUN, 0, late)
    with sup.sessions() as s:
        assert steps_store.sample_range(s, RUN, late[0].step, late[-1].step) == (late[0].sample_lo,
                                                                                  late[-1].sample_hi)
    assert len(acted(sup)) == 1
    assert open_actions(sup) == []


def test_a_fresh_supervisor_knows_the_newest_attempt_before_judging(db, tmp_path):
    """A restarted supervisor learns the newest attempt from the DB, so late records of an older
    attempt are not judged even before any open_run in this process."""
    sup = make_sup(db, tmp_path)
    recs, last, _inc, act = diverge(sup, tmp_path)
    sup.poll(RUN)
    sup.ack(RUN, Ack(command_id=act.id, ok=True, first_step=act.args["to_step"] + 1))
    sup.open_run(RunInfo(run_id=RUN, attempt=1, world_size=1, start_step=act.args["to_step"]))
    sup.close()
    sup2 = make_sup(db, tmp_path)
    try:
        sup2.write(RUN, 0, [r for r in recs if r.step > last])
        assert len(acted(sup2)) == 1 and open_actions(sup2) == []
    finally:
        sup2.close()


def test_healthy_run_produces_no_action(sup, tmp_path):
    recs = healthy_records()
    sup.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
    feed(sup, RUN, 0, recs, ckpt_root=tmp_path / "ckpt")
    with sup.sessions() as s:
        assert actions_store.actions(s, RUN) == []
        assert all(c.healthy for c in ckpt_store.checkpoints(s, RUN))
    assert incidents(sup) == []  # not even an alert: no detector fired on the healthy run


def test_advise_only_waits_for_approval(db, tmp_path):
    sup = make_sup(db, tmp_path, advise_only=True)
    try:
        _recs, last, _inc, act = diverge(sup, tmp_path)
        assert act.kind == "rollback" and act.requires_approval
        # the question says what a yes costs (issue 23): the steps to train again, the samples skipped
        from thermowatch.supervisor.store import alerts as alerts_store

        with sup.sessions() as s:
            asks = [r.payload["fields"] for r in alerts_store.alerts(s, RUN, limit=100)
                    if r.payload and "approval needed" in r.payload.get("title", "")]
        to = act.args["to_step"]
        assert asks and asks[0]["discards"].startswith(f"steps {to + 1}-{last}: {last - to} steps to train again")
        lo, hi = act.args["skip_ranges"][0]
        assert asks[0]["skips"] == f"{hi - lo:,} samples: [{lo}, {hi})"
        assert sup.poll(RUN) == []
        assert sup.poll(RUN) == []
        with sup.sessions() as s:
            assert actions_store.get_action(s, act.id).state == "pending"
        sup.executor.approve(act.id, "alice")
        cmds = sup.poll(RUN)
        assert [c.id for c in cmds] == [act.id]
        with sup.sessions() as s:
            row = actions_store.get_action(s, act.id)
        assert row.state == "sent" and row.who == "alice" and not row.requires_approval
    finally:
        sup.close()


def test_a_pending_manual_command_does_not_swallow_a_divergence(sup, tmp_path):
    """A person's command on its way (here a `profile` nobody polled yet) must not make the
    policy wait: only the supervisor's own actions in flight hold a decision back. The
    divergence seen meanwhile is acted on at once, queued behind the person's command, and its
    incident stays open until the rollback is done."""
    recs = diverging_records()
    sup.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
    manual = sup.executor.submit(RUN, "profile", {"steps": 5}, "bob", "why is it slow")
    feed(sup, RUN, 0, [r for r in recs if r.step <= 70], ckpt_root=tmp_path / "ckpt")
    (inc,) = acted(sup)
    assert inc.signal in ATTN_SIGNALS and inc.detect_step <= 70
    assert inc.state == "open", f"closed while the run diverges: {inc.resolution!r}"
    rollbacks = [a for a in open_actions(sup) if a.kind == "rollback"]
    assert rollbacks, "the divergence seen while the manual command was in flight was never acted on"
    assert rollbacks[0].incident_id == inc.id and rollbacks[0].origin == "auto"
    assert rollbacks[0].args["to_step"] <= inc.onset_step - MARGIN

    # Both go to the trainer, the person's first (the order they were written).
    assert [c.id for c in sup.poll(RUN)] == [manual, rollbacks[0].id]


def test_checkpoints_of_the_abandoned_trajectory_are_not_targets_after_a_rollback(sup, tmp_path):
    """After a rollback to step T is done, the older attempt's checkpoints after T belong to the
    trajectory the run walked away from (trained on the samples now skipped; the trainer
    abandons them, trainer/controller.py `store.abandon_after`). They must not stay healthy
    rollback targets, or a later finding with a later onset (another signal: no cap from the
    ladder) picks one, and where a step exists in both attempts the policy's `max()` over
    (step, attempt)-ordered rows returns the OLD attempt's path."""
    _recs, _last, _inc, act = diverge(sup, tmp_path)
    to_step = act.args["to_step"]
    sup.poll(RUN)
    sup.ack(RUN, Ack(command_id=act.id, ok=True, first_step=to_step + 1))
    sup.open_run(RunInfo(run_id=RUN, attempt=1, world_size=1, start_step=to_step))
    with sup.sessions() as s:
        stale = [(c.attempt, c.step) for c in ckpt_store.checkpoints(s, RUN)
                 if c.attempt == 0 and c.step > to_step and c.healthy and not c.deleted]
    assert stale == []


def test_detector_state_is_throttled_but_written_on_close(db, tmp_path):
    """State is saved on the first batch, then at most every few seconds unless a batch raised a
    finding; close() writes what the throttle held back, so a clean restart loses nothing."""
    from thermowatch.supervisor.store import detector_state

    recs = healthy_records()
    s1 = make_sup(db, tmp_path)
    s1.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
    s1.write(RUN, 0, recs[:10])
    s1.write(RUN, 0, recs[10:20])  # within the throttle window, no finding: not saved yet
    with s1.sessions() as s:
        assert detector_state.load(s, RUN)["stall"]["last_step"] == recs[9].step
    s1.close()
    with s1.sessions() as s:
        assert detector_state.load(s, RUN)["stall"]["last_step"] == recs[19].step


# --- the Slack bot token is checked at start-up (issue 12) ----------------------------------------


def slack_cfg(db, tmp_path, fake, **over) -> SupervisorConfig:
    return SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, policy=dict(POLICY),
                            detectors=dict(DETECTORS),
                            slack=SlackConfig(channel="#training-alerts", token_env="TW_TEST_SLACK_TOKEN",
                                              base_url=fake.base_url), **over)


def test_a_refused_slack_token_stops_the_daemon_at_start_naming_the_token_source(db, tmp_path, monkeypatch):
    with FakeSlack() as fake:
        monkeypatch.setenv("TW_TEST_SLACK_TOKEN", "xoxb-revoked")
        with pytest.raises(NotifyConfigError, match=r"auth\.test: invalid_auth.*environment variable "
                                                    r"TW_TEST_SLACK_TOKEN.*xoxb"):
            Supervisor(slack_cfg(db, tmp_path, fake))
        assert [r.api_method for r in fake.requests] == ["auth.test"]  # checked once, nothing posted


def test_serve_exits_2_with_the_message_on_a_refused_token(db, tmp_path, monkeypatch, capsys):
    with FakeSlack() as fake:
        monkeypatch.setenv("TW_TEST_SLACK_TOKEN", "xoxb-revoked")
        config = tmp_path / "serve.yaml"
        config.write_text(f"slack:\n  channel: '#training-alerts'\n  token_env: TW_TEST_SLACK_TOKEN\n"
                          f"  base_url: '{fake.base_url}'\napi_token: tw-test-admin-token-0123456789\n")
        assert cli.main(["serve", "--config", str(config), "--db", db.url, "--data-dir", str(tmp_path / "d"),
                         "--port", "8769"]) == 2  # never bound: the check comes first
        assert "Slack refused the bot token at start-up" in capsys.readouterr().err
        assert fake.calls("chat.postMessage") == []


def test_a_good_token_starts_and_an_unreachable_slack_starts_degraded(db, tmp_path, monkeypatch):
    with FakeSlack() as fake:
        monkeypatch.setenv("TW_TEST_SLACK_TOKEN", fake.token)
        sup = Supervisor(slack_cfg(db, tmp_path, fake))
        try:
            assert sup.notifier_status() == {"ok": True, "channels": {"console": "ok", "slack:#training-alerts": "ok"}}
            assert len(fake.calls("auth.test")) == 1
        finally:
            sup.close()
        # Slack down at start-up is not the daemon's fault: it starts, alerts wait in the outbox,
        # and the status says why (for /healthz).
        fake.server_error(calls=10**6)
        sup = Supervisor(slack_cfg(db, tmp_path, fake))
        try:
            status = sup.notifier_status()
            assert status["ok"] is False and "HTTP 500" in status["channels"]["slack:#training-alerts"]
            # /healthz: still 200 (the daemon works, alerts wait), with a warning that says why.
            from starlette.testclient import TestClient

            from thermowatch.supervisor.serve.server import build_app

            with TestClient(build_app(sup), raise_server_exceptions=False) as c:
                r = c.get("/healthz")
            assert r.status_code == 200, r.text
            assert any("slack:#training-alerts" in w and "HTTP 500" in w for w in r.json()["warnings"]), r.json()
        finally:
            sup.close()


def test_a_cooldown_reminder_survives_a_daemon_restart_and_releases_the_latches_when_due(db, tmp_path):
    """Issue 22, item 9: the step at which a held-back finding is judged again is saved with the
    run's detector state, so a daemon restarted inside the cooldown still releases the latches
    when the run reaches it (a latched detector would stay silent for the rest of the excursion)."""
    recs = diverging_records()
    a = make_sup(db, tmp_path)
    try:
        a.open_run(RunInfo(RUN, 1, 1))
        # the ceiling detectors latch (logits > 150 from ~44)
        a.banks.judge(RUN, 1, StepColumns.from_records(recs[:60]), a.responder.handle)
        a.banks.recheck_at(RUN, 1, 70)  # as handle() leaves it when a cooldown holds a finding back
        a.banks._save_state(RUN)
    finally:
        a.close()
    b = make_sup(db, tmp_path)
    try:
        b.banks.bank(RUN)  # loads the saved state, the reminder with it
        assert b.banks._recheck[RUN] == (1, 70)
        b.banks.judge(RUN, 1, StepColumns.from_records(recs[60:65]), b.responder.handle)
        assert b.banks._recheck[RUN] == (1, 70)  # not due yet
        # reaches step 70: released, and forgotten
        b.banks.judge(RUN, 1, StepColumns.from_records(recs[65:70]), b.responder.handle)
        assert RUN not in b.banks._recheck
        found = b.banks.judge(RUN, 1, StepColumns.from_records(recs[70:71]), b.responder.handle)
        assert any(f.signal.value == "attn_logit_ceiling" for f in found), found  # what persists fires again
    finally:
        b.close()


def test_a_persons_rollback_supersedes_the_open_proposal_and_its_incident(db, tmp_path):
    """Issue 23, advise-only: the engineer fixed the run by hand while the policy's proposal
    waited; the incident stayed open, so every later checkpoint counted as unhealthy and the next
    proposal went back hundreds of steps. A person's rollback now resolves the incident as
    superseded and cancels the proposal, saying by what; the checkpoints after it are targets again."""
    sup = make_sup(db, tmp_path, advise_only=True)
    try:
        _recs, _last, inc, proposal = diverge(sup, tmp_path)
        assert proposal.requires_approval and sup.responder.diverging_since(RUN) == inc.onset_step
        mine = sup.executor.submit(RUN, "rollback", {"to_step": proposal.args["to_step"], "lr_multiplier": 0.5},
                                   "bob", "fixing it myself")
        with sup.sessions() as s:
            row = actions_store.get_action(s, proposal.id)
            closed = incidents_store.get_incident(s, inc.id)
            events = [e.event for e in audit_store.audit_log(s, RUN)]
        assert row.state == "cancelled" and f"superseded by bob's rollback (action {mine}: roll back to" in row.error
        assert closed.state == "resolved" and closed.resolution.startswith(f"superseded by bob's rollback (action {mine}")
        assert "superseded" in events
        assert sup.responder.diverging_since(RUN) is None  # later checkpoints are healthy targets again
        assert [c.id for c in sup.poll(RUN)] == [mine]  # the person's command goes; the proposal never does
    finally:
        sup.close()


def test_a_declined_proposal_does_not_silence_the_divergence_that_goes_on(db, tmp_path):
    """Issue 23: after a cancelled approval, logits of 600-2,648 for 500 steps paged nobody (the
    detectors stayed latched on the finding the person declined). Now a cancel releases them
    `cooldown_steps` later: the declined detector, its divergence still there, fires again and the
    policy asks again (without the release it stayed silent for the rest of this recorded run)."""
    sup = make_sup(db, tmp_path, advise_only=True)
    try:
        recs, last, inc, proposal = diverge(sup, tmp_path)
        sup.executor.cancel(proposal.id, "alice")
        with sup.sessions() as s:  # declined: the incident closes (later checkpoints stay targets)
            assert incidents_store.get_incident(s, inc.id).resolution.startswith("declined by alice")
        rest = [r for r in recs if r.step > last]
        assert len(rest) > 2 * POLICY["cooldown_steps"]
        feed(sup, RUN, 0, rest, ckpt_root=tmp_path / "ckpt" / "a0", stop=lambda: bool(open_actions(sup)))
        from thermowatch.supervisor.store import findings as findings_store

        with sup.sessions() as s:  # the very detector the person declined, on the same module
            again = [f.finding for f in findings_store.findings(s, RUN) if f.finding.detect_step > last
                     and (f.finding.signal.value, f.finding.module) == (inc.signal, inc.module)]
        assert again and again[0].detect_step >= last + POLICY["cooldown_steps"], again
        asked = [i for i in incidents(sup) if i.id > inc.id and (i.signal, i.module) == (inc.signal, inc.module)]
        assert asked and asked[0].detect_step == again[0].detect_step
        asks = open_actions(sup)
        assert asks and asks[0].requires_approval and asks[0].incident_id == asked[0].id
    finally:
        sup.close()


@pytest.mark.parametrize("after", [20, None])
def test_a_run_waiting_for_approval_is_paused_before_it_trains_far_into_the_divergence(db, tmp_path, after):
    """Issue 37: while a rollback waited for approval the run trained on into the divergence (the
    approval's cost grew from 74 to 130 discarded steps). Once it has trained
    approval_pause_after_steps past the finding, the next poll pauses it (once per proposal); the
    approval then delivers the rollback, which ends the pause. None: it trains on."""
    from thermowatch.monitors.contract import Pause

    cfg = SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, advise_only=True, detectors=dict(DETECTORS),
                           policy={**POLICY, "approval_pause_after_steps": after})
    sup = Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()))
    try:
        recs, last, inc, act = diverge(sup, tmp_path)
        assert act.requires_approval and last - inc.detect_step < 20
        assert sup.poll(RUN) == []  # not yet 20 steps past the finding
        more = [r for r in recs if last < r.step <= inc.detect_step + 25]
        feed(sup, RUN, 0, more, ckpt_root=tmp_path / "ckpt" / "a0")
        cmds = sup.poll(RUN)
        if after is None:
            assert cmds == []
            return
        (pause,) = cmds
        assert isinstance(pause.body, Pause) and f"action {act.id} (rollback) has waited for approval" in pause.body.reason
        sup.ack(RUN, Ack(command_id=pause.id, ok=True, first_step=inc.detect_step + 26))
        assert sup.poll(RUN) == []  # once per proposal
        with sup.sessions() as s:
            assert actions_store.get_action(s, act.id).state == "pending"  # the proposal still waits
        sup.executor.approve(act.id, "alice")
        assert [c.id for c in sup.poll(RUN)] == [act.id]
    finally:
        sup.close()
