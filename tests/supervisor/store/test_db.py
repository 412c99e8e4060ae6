"""Engine setup and the small store modules (runs, steps, checkpoints, incidents, findings,
actions, skips, lr_changes, alerts, audit) on real SQLite and PostgreSQL."""

from __future__ import annotations

import datetime as dt
import math

import pytest
import sqlalchemy as sa

from thermowatch.monitors.contract import CheckpointInfo, Finding, RunInfo, Severity, Signal, StepRecord
from thermowatch.supervisor import db as dbmod
from thermowatch.supervisor.store import (
    actions,
    alerts,
    audit,
    checkpoints,
    findings,
    incidents,
    lr_changes,
    runs,
    skips,
    steps,
)


def test_sqlite_engine_pragmas(tmp_path):
    engine = dbmod.make_engine(f"sqlite:///{tmp_path / 'sub' / 'x.db'}")  # creates the folder
    with engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert c.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert c.exec_driver_sql("PRAGMA synchronous").scalar() == 1  # NORMAL
        assert c.exec_driver_sql("PRAGMA busy_timeout").scalar() == 10000  # ms: the default
    engine.dispose()


def test_a_sqlite_url_may_set_its_own_busy_timeout(tmp_path):
    """`?timeout=` (seconds, the driver's own parameter) is kept, not overwritten by the 10 s
    default; the other pragmas still apply."""
    engine = dbmod.make_engine(f"sqlite:///{tmp_path / 'x.db'}?timeout=2.5")
    with engine.connect() as c:
        assert c.exec_driver_sql("PRAGMA busy_timeout").scalar() == 2500
        assert c.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert c.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
    engine.dispose()


def test_postgres_url_gets_psycopg3():
    engine = dbmod.make_engine("postgresql://u@h/db")
    assert engine.dialect.driver == "psycopg"


def test_postgres_connections_plan_without_jit_or_parallel_workers(pg_admin):
    """Kept across the pool's rollback on check-in (db._postgres_settings commits its SETs)."""
    from tests.supervisor.conftest import new_pg_schema, pg_schema_url

    engine = dbmod.make_engine(pg_schema_url(new_pg_schema(pg_admin)), pool_size=1, max_overflow=0)
    for _ in range(2):  # the second checkout gets the same connection back from the pool
        with engine.connect() as c:
            assert c.exec_driver_sql("SHOW jit").scalar() == "off"
            assert c.exec_driver_sql("SHOW max_parallel_workers_per_gather").scalar() == "0"
            c.rollback()
    engine.dispose()


def test_foreign_keys_are_enforced(db):
    with pytest.raises(sa.exc.IntegrityError):
        with db.sessions.begin() as s:
            actions.enqueue_action(s, "no-such-run", "pause", {}, "x", "manual", "me")


def _run(db, run_id="r", attempt=0, **kw):
    with db.sessions.begin() as s:
        runs.open_attempt(s, RunInfo(run_id, attempt, world_size=4, hosts={0: "a", 3: "b"}, **kw))


def test_runs_and_attempts(db):
    _run(db, config={"lr": 3e-4})
    _run(db)  # retried open_run: no duplicate
    _run(db, attempt=1, start_step=1200)
    with db.sessions() as s:
        assert runs.get_run(s, "r").config == {"lr": 3e-4}
        assert runs.get_run(s, "nope") is None
        att = runs.attempts(s, "r")
        assert [a.attempt for a in att] == [0, 1]
        assert att[0].hosts == {0: "a", 3: "b"} and att[1].start_step == 1200
        assert att[0].started_at.tzinfo is not None
        assert runs.latest_attempt(s, "r").attempt == 1
        page, more = runs.runs_page(s, 10)
        assert [(r.run_id, r.attempts) for r in page] == [("r", 2)] and more is None


def test_sample_range_uses_newest_attempt(db):
    _run(db)
    _run(db, attempt=1)
    with db.sessions.begin() as s:
        steps.record_steps(s, "r", 0, [StepRecord(step=i, values={}, sample_lo=8 * i, sample_hi=8 * i + 8) for i in range(20)])
        # attempt 1 re-trained 10..19 after skipping 16 samples
        steps.record_steps(s, "r", 1, [StepRecord(step=i, values={}, sample_lo=8 * i + 16, sample_hi=8 * i + 24) for i in range(10, 20)])
    with db.sessions() as s:
        assert steps.sample_range(s, "r", 2, 4) == (16, 40)
        assert steps.sample_range(s, "r", 12, 14) == (112, 136)
        assert steps.sample_range(s, "r", 100, 200) is None


def test_checkpoints(db):
    _run(db)
    with db.sessions.begin() as s:
        for step, healthy in ((100, True), (200, True), (300, False)):
            checkpoints.record_checkpoint(s, "r", 0, CheckpointInfo(step, f"/ck/{step}", step * 8, healthy, {"skip": [[1, 2]]}))
        checkpoints.record_checkpoint(s, "r", 0, CheckpointInfo(200, "/ck/200", 1600, True))  # retry
    with db.sessions.begin() as s:
        cks = checkpoints.checkpoints(s, "r")
        assert [c.step for c in cks] == [100, 200, 300] and cks[0].manifest == {"skip": [[1, 2]]}
        assert checkpoints.newest_healthy_before(s, "r", 350).step == 200
        assert checkpoints.newest_healthy_before(s, "r", 200).step == 100
        assert checkpoints.newest_healthy_before(s, "r", 100) is None
        checkpoints.mark_checkpoint(s, cks[1].id, deleted=True)
    with db.sessions() as s:
        assert checkpoints.newest_healthy_before(s, "r", 350).step == 100
        assert len(checkpoints.checkpoints(s, "r", include_deleted=True)) == 3


def test_incidents_and_findings(db):
    _run(db)
    f = Finding(Signal.ATTN_LOGIT_GROWTH, "blocks.3.attn", Severity.CRITICAL, 1200, 1260, "attn_logit_max/blocks.3.attn",
                {"slope": 0.4, "last": math.inf, "z": math.nan})
    with db.sessions.begin() as s:
        inc = incidents.open_incident(s, "r", f.signal.value, f.module, f.onset_step, f.detect_step, "critical")
        assert incidents.open_incident(s, "r", f.signal.value, f.module, 1250, 1270) == inc  # grouped
        other = incidents.open_incident(s, "r", "loss_spike", "", 5, 6)
        findings.add_finding(s, "r", f, inc)
    with db.sessions.begin() as s:
        assert [i.id for i in incidents.open_incidents(s, "r")] == [inc, other]
        got = findings.findings(s, "r", inc)
        assert len(got) == 1 and got[0].finding.signal is Signal.ATTN_LOGIT_GROWTH
        assert got[0].finding.evidence["slope"] == 0.4 and float(got[0].finding.evidence["last"]) == math.inf
        assert incidents.resolve_incident(s, inc, "rolled back")
        assert not incidents.resolve_incident(s, inc)
    with db.sessions() as s:
        assert [i.id for i in incidents.open_incidents(s)] == [other]
        closed = incidents.get_incident(s, inc)
        assert closed.state == "resolved" and isinstance(closed.closed_at, dt.datetime)


def test_action_state_machine(db):
    _run(db)
    with db.sessions.begin() as s:
        a = actions.enqueue_action(s, "r", "rollback", {"to_step": 1100, "lr": math.nan}, "attn blowup", "auto", "policy")
        b = actions.enqueue_action(s, "r", "set_lr", {"lr_multiplier": 0.5}, "advice", "auto", "policy",
                                   requires_approval=True)
    with db.sessions.begin() as s:
        assert [p.id for p in actions.pending_actions(s, "r")] == [a]
        assert [p.id for p in actions.pending_actions(s, "r", include_unapproved=True)] == [a, b]
        row = actions.set_action_state(s, a, "sent")
        assert row.state == "sent" and row.attempts == 1 and row.args["lr"] == "nan"
        with pytest.raises(actions.ActionStateError, match="cannot go from 'sent' to 'done'"):
            actions.set_action_state(s, a, "done")
        actions.set_action_state(s, a, "acked", ack_step=1101)
        done = actions.set_action_state(s, a, "done")
        assert done.ack_step == 1101 and done.updated_at >= done.created_at
        with pytest.raises(actions.ActionStateError, match="final"):
            actions.set_action_state(s, a, "failed")
        with pytest.raises(actions.ActionStateError, match="unknown action state"):
            actions.set_action_state(s, b, "bogus")
        with pytest.raises(actions.ActionStateError, match="no action"):
            actions.set_action_state(s, 9999, "sent")
        actions.approve_action(s, b, "alice")
        assert [p.id for p in actions.pending_actions(s, "r")] == [b]
        assert [o.id for o in actions.open_actions(s)] == [b]
        with pytest.raises(actions.ActionStateError):
            actions.enqueue_action(s, "r", "pause", {}, "x", "robot", "me")


def test_an_actions_words_are_enums_and_the_database_refuses_any_other(db):
    """Issue 38: kind, state and origin were strings compared by literal. They read back as their
    enums (ActionState knows is_final), and the database itself refuses a word outside them, on
    SQLite and PostgreSQL, even from a write that bypasses the ORM."""
    from sqlalchemy import text
    from sqlalchemy.exc import IntegrityError

    from thermowatch.monitors.commands import ActionOrigin, ActionState, CommandKind

    _run(db)
    with db.sessions.begin() as s:
        a = actions.enqueue_action(s, "r", CommandKind.PAUSE, {}, "x", ActionOrigin.MANUAL, "me")
        row = actions.get_action(s, a)
        assert (row.kind, row.state, row.origin) == (CommandKind.PAUSE, ActionState.PENDING, ActionOrigin.MANUAL)
        assert isinstance(row.state, ActionState) and not row.state.is_final
        assert actions.set_action_state(s, a, ActionState.CANCELLED).state.is_final
        assert f"{row.state} {row.kind}" == "pending pause"  # words print as words
    for column, bad in (("state", "finished"), ("kind", "reboot"), ("origin", "robot")):
        with pytest.raises(IntegrityError):
            with db.sessions.begin() as s:
                s.execute(text(f"UPDATE actions SET {column} = :bad WHERE id = :id"), {"bad": bad, "id": a})
    with db.sessions() as s:
        assert actions.get_action(s, a).state is ActionState.CANCELLED


def test_skips_lr_alerts_audit(db):
    _run(db)
    with db.sessions.begin() as s:
        aid = actions.enqueue_action(s, "r", "skip", {}, "x", "manual", "bob")
        skips.add_skip_range(s, "r", 500, 600, aid)
        skips.add_skip_range(s, "r", 100, 200)
        skips.add_skip_range(s, "r", 550, 700)
        skips.add_skip_range(s, "r", 200, 250)
        with pytest.raises(ValueError):
            skips.add_skip_range(s, "r", 10, 10)
        lr_changes.add_lr_change(s, "r", 0.5, 1200, 1000, aid)
        with pytest.raises(ValueError):
            lr_changes.add_lr_change(s, "r", 0.0, 1)
        alerts.enqueue(s, "r", ["slack:#train"], "rolled back", {"title": "rolled back"})
        audit.audit(s, "r", "bob", "manual_skip", {"lo": 500, "x": math.inf})
    with db.sessions() as s:
        assert skips.skip_ranges(s, "r") == [(100, 250), (500, 700)]
        ch = lr_changes.lr_changes(s, "r")
        assert (ch[0].multiplier, ch[0].start_step, ch[0].steps, ch[0].action_id) == (0.5, 1200, 1000, aid)
        al = alerts.alerts(s, "r")
        assert (al[0].ok, al[0].state, al[0].sent_at, al[0].payload) == (False, "pending", None, {"title": "rolled back"})
        log = audit.audit_log(s, "r")
        assert log[0].event == "manual_skip" and log[0].detail == {"lo": 500, "x": "inf"}
