"""Migrations: one head, upgrade from empty, downgrade to base and back with data present,
and the migrated schema matches the ORM (no autogenerate diff) on SQLite and PostgreSQL."""

from __future__ import annotations

import math

import numpy as np
import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory

from thermowatch.monitors.contract import RunFinished, RunInfo, StepRecord
from thermowatch.supervisor import db as dbmod
from thermowatch.supervisor.store import actions, runs, thermometers
from thermowatch.supervisor.store.orm import load_models


@pytest.fixture
def engine(empty_url):
    """An engine on a database with no tables yet, disposed after the test."""
    eng = dbmod.make_engine(empty_url)
    yield eng
    eng.dispose()


def test_single_head():
    cfg = Config()
    cfg.set_main_option("script_location", str(dbmod.MIGRATIONS_DIR))
    heads = ScriptDirectory.from_config(cfg).get_heads()
    assert len(heads) == 1, f"several migration heads: {heads}"
    assert dbmod.head_revision() == heads[0]


def test_upgrade_from_empty_matches_orm(engine):
    with pytest.raises(dbmod.DatabaseBehind, match="thermowatch db upgrade"):
        dbmod.check_current(engine)
    dbmod.upgrade(engine)
    dbmod.check_current(engine)
    with engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn, opts={"compare_type": True}), load_models())
    assert diff == [], f"ORM and migrations differ: {diff}"
    assert set(sa.inspect(engine).get_table_names()) >= {t.name for t in load_models().sorted_tables}


def _seed(sessions):
    with sessions.begin() as s:
        runs.open_attempt(s, RunInfo("r", 0, world_size=2, hosts={0: "n0", 1: "n1"}))
        thermometers.append(s, "r", 0, [StepRecord(step=i, values={"loss": float(i), "z/head": math.inf}) for i in range(5)])
        return actions.enqueue_action(s, "r", "pause", {}, "seed", "manual", "tester")


def test_downgrade_to_base_and_back_with_data(engine):
    sessions = dbmod.make_sessionmaker(engine)
    dbmod.upgrade(engine)
    _seed(sessions)
    dbmod.downgrade(engine, "base")
    tables = set(sa.inspect(engine).get_table_names()) - {"alembic_version"}
    assert tables == set(), f"downgrade left tables behind: {tables}"
    with pytest.raises(dbmod.DatabaseBehind):
        dbmod.check_current(engine)
    dbmod.upgrade(engine)
    dbmod.check_current(engine)
    action_id = _seed(sessions)  # the schema works again and starts from scratch
    with sessions() as s:
        assert action_id == 1
        steps, vals = thermometers.history(s, "r", "loss")
        np.testing.assert_array_equal(vals, np.arange(5.0))


def test_upgrade_by_url_is_idempotent(empty_url, engine):
    dbmod.upgrade(empty_url)
    dbmod.upgrade(empty_url)  # already at head: nothing to do, no error
    assert dbmod.current_revision(engine) == dbmod.head_revision()


def test_0009_alert_threads_keep_older_alerts_and_downgrade_with_data(engine):
    """Alerts written before 0009 keep their text and state and stand alone (no thread); a
    downgrade to 0008 keeps the rows and drops only the thread columns."""
    dbmod.upgrade(engine, "0008")
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO alerts (channel, text, ok, error, state, attempts) "
                             "VALUES ('slack:#a', 'old alert', false, '', 'pending', 0)"))
    dbmod.upgrade(engine)
    with engine.begin() as conn:
        assert conn.execute(sa.text("SELECT text, state, thread_key, ts FROM alerts")).one() == (
            "old alert", "pending", None, None)
        conn.execute(sa.text("UPDATE alerts SET thread_key = 'incident:1', ts = '1700000000.000001'"))
    dbmod.downgrade(engine, "0008")
    cols = {c["name"] for c in sa.inspect(engine).get_columns("alerts")}
    assert "thread_key" not in cols and "ts" not in cols
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT text, state FROM alerts")).one() == ("old alert", "pending")
    dbmod.upgrade(engine)
    dbmod.check_current(engine)


def test_0012_attempt_finished_columns_up_and_down_with_data(engine):
    """Attempts from before 0012 read as not finished; a finished report (a NaN loss included)
    is stored and read back; a downgrade to 0011 keeps the attempts and drops only the columns."""
    sessions = dbmod.make_sessionmaker(engine)
    dbmod.upgrade(engine, "0011")
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO runs (run_id, config, created_at, created_by) "
                             "VALUES ('old', '{}', '2026-01-01 00:00:00', '')"))
        conn.execute(sa.text("INSERT INTO attempts (run_id, attempt, started_at, world_size, start_step, hosts, "
                             "config) VALUES ('old', 0, '2026-01-01 00:00:00', 1, 0, '{}', '{}')"))
    dbmod.upgrade(engine)
    with sessions.begin() as s:
        (old,) = runs.attempts(s, "old")
        assert old.finished is None and old.finished_at is None
        assert runs.finish_attempt(s, "old", 0, RunFinished(12, math.nan, "closed")) is None
    with sessions() as s:
        got = runs.latest_attempt(s, "old").finished
        assert (got.step, got.reason.value) == (12, "closed") and math.isnan(got.final_loss)
    dbmod.downgrade(engine, "0011")
    cols = {c["name"] for c in sa.inspect(engine).get_columns("attempts")}
    assert not cols & {"finished_at", "final_step", "final_loss", "finish_reason"}
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT run_id, attempt FROM attempts")).all() == [("old", 0)]
    dbmod.upgrade(engine)
    dbmod.check_current(engine)


def test_0020_stored_acks_say_first_step_and_skip_ranges_and_downgrade_back(engine):
    """Acks stored before 0020 said `step` and `skipped`: rewritten to `first_step` and
    `skip_ranges` (issue 38), read back through the store as the executor wrote them since; the
    rest of the row, other rows and a row with no result are untouched; a downgrade writes the
    old names again."""
    sessions = dbmod.make_sessionmaker(engine)
    old = {"command_id": 1, "ok": True, "step": 51, "checkpoint_step": 50, "skipped": [[800, 2400]], "detail": "x"}
    dbmod.upgrade(engine, "0019")
    with sessions.begin() as s:
        runs.open_attempt(s, RunInfo("r", 0, 1))
        done = actions.enqueue_action(s, "r", "rollback", {"to_step": 50}, "spike", "auto", "policy")
        actions.set_action_state(s, done, "sent")
        actions.set_action_state(s, done, "acked", ack_step=51, result=old)
        waiting = actions.enqueue_action(s, "r", "pause", {}, "x", "manual", "ana")
    dbmod.upgrade(engine)
    with sessions() as s:
        rows = {a.id: a for a in actions.actions(s, "r")}
    assert rows[done].result == {"command_id": 1, "ok": True, "first_step": 51, "checkpoint_step": 50,
                                 "skip_ranges": [[800, 2400]], "detail": "x"}
    assert rows[done].checkpoint_step == 50 and rows[waiting].result is None
    dbmod.downgrade(engine, "0019")
    with sessions() as s:
        assert actions.actions(s, "r")[-1].result == old
    dbmod.upgrade(engine)
    dbmod.check_current(engine)
