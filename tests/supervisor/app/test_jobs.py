"""The daemon's periodic jobs (supervisor.app.jobs) on SQLite and PostgreSQL: checkpoint scan,
retention, daily digest, and the stall check with an injected clock."""

from __future__ import annotations

import io
from pathlib import Path
import math

import numpy as np
import pytest

from thermowatch.monitors.contract import CheckpointInfo, RunInfo
from thermowatch.supervisor.app import jobs
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import checkpoints as ckpt_store
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store import thermometers as thermo_store
from tests.fixtures.diverging import DETECTORS, POLICY, WALL_T0, healthy_records

RUN = "jobs"


class Clock:
    """An adjustable wall clock for the supervisor (the stall check reads it)."""

    def __init__(self, now: float):
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def stream():
    return io.StringIO()


@pytest.fixture
def clock():
    return Clock(WALL_T0)


@pytest.fixture
def sup(db, tmp_path, stream, clock):
    detectors = {**DETECTORS, "stall": {"timeout_s": 60.0}}
    s = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url, policy=dict(POLICY),
                                    detectors=detectors), notifier=ConsoleNotifier(stream), clock=clock)
    s.open_run(RunInfo(run_id=RUN, attempt=0, world_size=1))
    yield s
    s.close()


def _checkpoint_dir(root, step, files=None):
    """A committed checkpoint written by the trainer's own store (its manifest format)."""
    from thermowatch.trainer.checkpoint import CheckpointStore, make_manifest

    files = files if files is not None else {"model.pt": b"weights" * 10}

    def write(d):
        for name, data in files.items():
            (d / name).write_bytes(data)

    info = CheckpointStore(root).save(step, write, make_manifest({"cursor": step * 16, "tokens_consumed": step * 1024}))
    return Path(info.path)


def _ckpts(sup):
    with sup.sessions() as s:
        return {c.step: c for c in ckpt_store.checkpoints(s, RUN)}


def test_checkpoint_scan_distrusts_missing_and_broken_checkpoints(sup, tmp_path):
    root = tmp_path / "ckpt"
    good = _checkpoint_dir(root, 10)
    no_manifest = _checkpoint_dir(root, 20)
    (no_manifest / "manifest.json").unlink()
    truncated = _checkpoint_dir(root, 30)
    (truncated / "model.pt").write_bytes(b"w")  # size differs from the manifest
    lost_file = _checkpoint_dir(root, 40)
    (lost_file / "model.pt").unlink()
    for step, path in ((10, good), (20, no_manifest), (30, truncated), (40, lost_file), (50, root / "step_50")):
        sup.checkpoint_saved(RUN, 0, CheckpointInfo(step=step, path=str(path), sample_cursor=step * 16, healthy=True))
    bad = jobs.checkpoint_scan(sup)
    assert sorted((run, step) for run, step, _ in bad) == [(RUN, 20), (RUN, 30), (RUN, 40), (RUN, 50)]
    why = {step: problem for _, step, problem in bad}
    assert "manifest.json is missing" in why[20]
    assert "bytes, the manifest says" in why[30]
    assert "is missing" in why[40]
    assert "is gone" in why[50]
    # 50's directory is gone: deleted from the list (the page and the policy no longer offer it).
    assert {s: c.healthy for s, c in _ckpts(sup).items()} == {10: True, 20: False, 30: False, 40: False}
    assert jobs.checkpoint_scan(sup) == []  # already distrusted: reported once


def test_a_checkpoint_path_cannot_forge_a_log_line(sup, tmp_path, caplog):
    """A checkpoint's path is the trainer's text (only NUL is refused): logged as is, its newline
    started a line of its own in the daemon's log (issue 34)."""
    import logging

    path = str(tmp_path / "step_60\n2030-01-01 00:00:00 INFO all checkpoints verified")
    sup.checkpoint_saved(RUN, 0, CheckpointInfo(step=60, path=path, sample_cursor=960, healthy=True))
    with caplog.at_level(logging.WARNING, logger="thermowatch.supervisor.app.jobs"):
        assert [step for _, step, _ in jobs.checkpoint_scan(sup)] == [60]
    (line,) = [r.getMessage() for r in caplog.records if "distrusted" in r.getMessage()]
    assert "\n" not in line and "step_60\\n2030-01-01" in line


def test_checkpoint_scan_leaves_good_checkpoints_alone(sup, tmp_path):
    d = _checkpoint_dir(tmp_path / "ckpt", 5, files={})
    sup.checkpoint_saved(RUN, 0, CheckpointInfo(step=5, path=str(d), sample_cursor=80, healthy=True))
    assert jobs.checkpoint_scan(sup) == []
    assert _ckpts(sup)[5].healthy


def test_retention_thins_old_points_and_keeps_recent_ones(sup):
    recs = healthy_records()
    sup.write(RUN, 0, recs[:60])
    sup.write(RUN, 0, recs[60:])
    key = "loss"
    with sup.sessions() as s:
        before = thermo_store.history(s, RUN, key)
        attn_key = next(k for k in thermo_store.series_keys(s, RUN) if k.startswith("attn_logit"))
        attn_before = thermo_store.history(s, RUN, attn_key)
        # what thinning the batch of steps 1-60 must remove: each series' points there but one
        # per 10-step window (a budget reads some series on some steps only: issue 36)
        expected = 0
        for k in thermo_store.series_keys(s, RUN):
            st = thermo_store.history(s, RUN, k, None, 60)[0]
            expected += len(st) - len(set((st // 10).tolist()))
    assert len(before[0]) == 120
    removed = jobs.retention(sup, full_steps=50, every=10)
    assert removed == expected > 0
    with sup.sessions() as s:
        steps, values = thermo_store.history(s, RUN, key)
        a_steps, a_values = thermo_store.history(s, RUN, attn_key)
    # Retention works on whole chunks (one per series per ingest batch): the batch of steps 1-60
    # ends before 120 - 50 = 70 and is thinned; the batch of steps 61-120 reaches past it and
    # stays in full.
    assert list(steps[steps > 60]) == list(range(61, 121))
    np.testing.assert_array_equal(values[steps > 60], before[1][before[0] > 60])
    old = steps[steps <= 60]
    assert list(old // 10) == list(range(7)), old  # one point per 10-step window
    # a mean-reduced series keeps each window's first point, a max-reduced one its maximum,
    # so a spike survives thinning
    assert list(old) == [1, 10, 20, 30, 40, 50, 60]
    for w in range(7):
        sel = (attn_before[0] // 10 == w) & (attn_before[0] <= 60)
        kept = a_values[(a_steps // 10 == w) & (a_steps <= 60)]
        assert list(kept) == [attn_before[1][sel].max()]
    assert jobs.retention(sup, full_steps=50, every=10) == 0  # idempotent
    assert jobs.retention(sup) == 0  # the default keeps 100k steps in full: nothing to do


def test_daily_digest_sends_one_alert_per_run(sup, stream):
    sup.open_run(RunInfo(run_id="other", attempt=0, world_size=1))
    sup.write(RUN, 0, healthy_records()[:25])
    sent = jobs.daily_digest(sup)
    assert sorted(a.run_id for a in sent) == sorted([RUN, "other"])
    by_run = {a.run_id: a for a in sent}
    assert "last step 25" in by_run[RUN].text and "last step None" in by_run["other"].text
    assert sup.executor.outbox.drain(30)
    assert stream.getvalue().count("daily digest") == 2


def test_daily_digest_leaves_out_runs_idle_for_a_day(sup, db):
    """One message a day per run active that day, not per run ever made (issue 21, item 4: an
    ingest token made 10^5 runs; a digest for each would be 10^5 messages a day)."""
    import datetime as dt

    import sqlalchemy as sa

    from thermowatch.supervisor.store.orm import Attempt, Run

    sup.open_run(RunInfo(run_id="idle", attempt=0, world_size=1))
    sup.open_run(RunInfo(run_id="restarted", attempt=0, world_size=1))
    old = dt.datetime.now(dt.timezone.utc) - dt.timedelta(days=2)
    with sup.sessions.begin() as s:
        for table in (Run, Attempt):
            s.execute(sa.update(table).where(table.run_id.in_(["idle", "restarted"]))
                      .values({"created_at" if table is Run else "started_at": old}))
    sup.open_run(RunInfo(run_id="restarted", attempt=1, world_size=1))  # a new attempt today
    assert sorted(a.run_id for a in jobs.daily_digest(sup)) == [RUN, "restarted"]


def test_stall_check_finds_a_stall_only_after_the_timeout(sup, clock):
    recs = healthy_records()[:30]
    sup.write(RUN, 0, recs)
    last_wall = recs[-1].wall_time
    clock.now = last_wall + 59.0
    assert sup.responder.check_stalls() == []
    clock.now = last_wall + 61.0
    found = sup.responder.check_stalls()
    assert [(f.signal.value, f.detect_step, f.severity.value) for f in found] == [("stall", 30, "warn")]
    assert found[0].evidence["silent_s"] == pytest.approx(61.0)
    assert sup.responder.check_stalls() == []  # latched until the next step
    with sup.sessions() as s:
        incs = incidents_store.incidents(s, RUN)
        acts = actions_store.actions(s, RUN)
    assert [(i.signal, i.onset_step) for i in incs] == [("stall", 30)]
    assert incs[0].state == "resolved" and incs[0].resolution.startswith("alert")  # alert only, paged
    assert acts == []  # a stall is not in the weights: no rollback


@pytest.mark.parametrize("reason", ["completed", "stopped", "closed"])
def test_a_finished_run_is_never_stalled(sup, clock, stream, reason):
    """Issue 35: 10 and 30 minutes after a run finished, every one of 14 finished runs got
    `[CRITICAL] <run>: alert (stall on step)` while its status read FINISHED. A run whose newest
    attempt said it finished is silent on purpose; a relaunch (a new attempt) is watched again."""
    from thermowatch.monitors.contract import FinishReason, RunFinished

    recs = healthy_records()[:30]
    sup.write(RUN, 0, recs)
    sup.ingestor.finish_run(RUN, 0, RunFinished(30, 2.5, FinishReason(reason)))
    for minutes in (10, 30, 24 * 60):
        clock.now = recs[-1].wall_time + minutes * 60.0
        assert sup.responder.check_stalls() == []
    with sup.sessions() as s:
        assert incidents_store.incidents(s, RUN) == []
    assert "stall" not in stream.getvalue()
    sup.open_run(RunInfo(run_id=RUN, attempt=1, world_size=1, start_step=30))  # relaunched: watched again
    clock.now += 10 * 60.0
    assert [f.signal.value for f in sup.responder.check_stalls()] == ["stall"]


def test_stall_check_job_uses_the_supervisors_clock(sup, clock, stream):
    recs = healthy_records()[:10]
    sup.write(RUN, 0, recs)
    by_name = {j.name: j for j in sup.jobs()}
    assert {"ack_watchdog", "stall_check", "retention", "checkpoint_scan", "daily_digest"} <= set(by_name)
    clock.now = recs[-1].wall_time + 10 * 60.0  # > critical_factor (3) x timeout: critical
    found = by_name["stall_check"].fn()
    assert [(f.signal.value, f.severity.value) for f in found] == [("stall", "critical")]
    assert sup.executor.outbox.drain(30)
    assert "stall" in stream.getvalue()
    # a new step clears the latch; silence after it is a new stall
    sup.write(RUN, 0, [healthy_records()[10]])
    clock.now = healthy_records()[10].wall_time + 61.0
    assert [f.detect_step for f in by_name["stall_check"].fn()] == [11]
    assert math.isfinite(clock.now)


# --- pause re-page (issue 35, item 3: a paused run waited until someone happened to look) -----------


def _carry_out(sup, kind: str, args: dict | None = None, who: str = "ana", reason: str = "") -> int:
    """`kind` submitted as a person would, delivered and acknowledged as the trainer does."""
    from thermowatch.protocol import Directive, Outcome, ack_for

    action_id = sup.executor.submit(RUN, kind, args or {}, who, reason)
    cmd = next(c for c in sup.poll(RUN) if c.id == action_id)
    out = {"pause": Outcome("paused before step 31", directive=Directive.PAUSE),
           "resume": Outcome("resumed", directive=Directive.RUN),
           "stop": Outcome("stopping after step 30", directive=Directive.STOP)}.get(kind)
    if kind == "rollback":
        from thermowatch.protocol import CheckpointRef

        out = Outcome("rolled back to checkpoint 20", checkpoint=CheckpointRef(20, "/c/step_20"),
                      directive=Directive.RUN)
    sup.ack(RUN, ack_for(cmd, out, None, first_step=31 if kind != "rollback" else 21, lr_changes=[], skip_ranges=[]))
    return action_id


def _after(minutes: float):
    import datetime as dt

    return dt.datetime.now(dt.timezone.utc) + dt.timedelta(minutes=minutes)


def test_a_pause_pages_again_once_per_pause_repage_s_with_the_reason_and_the_commands(sup, stream):
    assert sup.cfg.pause_repage_s == 1800.0  # the default: half an hour
    sup.write(RUN, 0, healthy_records()[:30])
    pause = _carry_out(sup, "pause", reason="the loss looks odd")
    assert jobs.pause_repage(sup, now=_after(29)) == []  # not yet
    sent = jobs.pause_repage(sup, now=_after(31))
    assert [(a.severity.value, a.broadcast) for a in sent] == [("critical", True)]
    page = sent[0]
    assert page.title.startswith(f"{RUN}: still paused after 3") and f"(action {pause})" in page.title
    assert page.text == "paused before step 31 by ana: paused by ana: the loss looks odd"
    assert page.commands == (f"thermowatch resume {RUN}", f"thermowatch rollback {RUN} --to-step N",
                             f"thermowatch stop {RUN}")
    assert sup.executor.outbox.drain(30)
    assert "still paused after" in stream.getvalue() and f"thermowatch resume {RUN}" in stream.getvalue()
    # at most once per interval, counted from the last page (kept in the audit trail)
    assert jobs.pause_repage(sup, now=_after(45)) == []
    assert len(jobs.pause_repage(sup, now=_after(62))) == 1
    assert jobs.pause_repage(sup, now=_after(62)) == []
    with sup.sessions() as s:
        from thermowatch.supervisor.store import audit as audit_store

        rows = audit_store.events(s, RUN, jobs.REPAGED)
    assert [r.detail["action_id"] for r in rows] == [pause, pause]
    # resumed: never again
    _carry_out(sup, "resume")
    assert jobs.pause_repage(sup, now=_after(24 * 60)) == []


@pytest.mark.parametrize("ends", ["resume", "rollback", "stop", "finished", "relaunched"])
def test_a_run_no_longer_paused_is_not_paged_again(sup, ends):
    from thermowatch.monitors.contract import FinishReason, RunFinished
    from thermowatch.supervisor.store.views import run_status

    recs = healthy_records()[:30]
    sup.write(RUN, 0, recs)
    sup.checkpoint_saved(RUN, 0, CheckpointInfo(20, "/c/step_20", 20 * 16, True, {}))
    _carry_out(sup, "pause")
    with sup.sessions() as s:
        assert run_status(s, RUN, stall_after_s=1e9)["state"] == "paused"
    if ends in ("resume", "rollback", "stop"):
        _carry_out(sup, ends, {"to_step": 20} if ends == "rollback" else None)
    elif ends == "finished":
        sup.ingestor.finish_run(RUN, 0, RunFinished(30, 2.5, FinishReason.CLOSED))
    else:  # the process was killed while paused and launched again: the new loop trains
        sup.open_run(RunInfo(run_id=RUN, attempt=1, world_size=1, start_step=20))
    assert jobs.pause_repage(sup, now=_after(31)) == []
    with sup.sessions() as s:
        state = run_status(s, RUN, stall_after_s=1e9)["state"]
    assert state == ("finished" if ends in ("stop", "finished") else "running")


def test_the_pause_repage_job_is_scheduled_and_pages_a_pause_the_policy_made(sup, stream):
    by_name = {j.name: j for j in sup.jobs()}
    assert by_name["pause_repage"].every_s == 60.0
    sup.write(RUN, 0, healthy_records()[:30])
    from thermowatch.monitors.contract import Finding, Outcome, Severity, Signal

    # rung 3: a spike whose onset no checkpoint precedes; the trainer carries the pause out
    sup.responder.handle(RUN, Finding(Signal.LOSS_SPIKE, "", Severity.CRITICAL, onset_step=3, detect_step=30,
                                      metric="loss", outcome=Outcome.ACT))
    from thermowatch.protocol import Directive, Outcome as Done, ack_for

    cmd = next(c for c in sup.poll(RUN) if c.kind.value == "pause")
    assert "no healthy checkpoint before the onset at step 3" in cmd.body.reason
    sup.ack(RUN, ack_for(cmd, Done("paused before step 31", directive=Directive.PAUSE), None, first_step=31,
                         lr_changes=[], skip_ranges=[]))
    assert by_name["pause_repage"].fn() == []  # just paused
    sent = jobs.pause_repage(sup, now=_after(31))
    assert len(sent) == 1 and "no healthy checkpoint before the onset at step 3" in sent[0].text
    assert sent[0].incident_id is not None  # in the incident's thread, broadcast to the channel
