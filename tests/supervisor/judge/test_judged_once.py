"""Judged once (issue 8): a batch the sink delivers twice (it replays its spool after a time-out)
gives the same findings, incidents and actions as one delivery, through the real ingest path,
on SQLite and PostgreSQL; and a supervisor that lost its detector state and judges a stored
batch again does not store or decide its findings twice."""

from __future__ import annotations

import io

from thermowatch.monitors.contract import RunInfo
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import detector_state
from thermowatch.supervisor.store import findings as findings_store
from thermowatch.supervisor.store import incidents as incidents_store
from tests.fixtures.diverging import DETECTORS, POLICY, checkpoint_for, diverging_records


def _supervisor(db, data_dir) -> Supervisor:
    return Supervisor(SupervisorConfig(data_dir=data_dir, db_url=db.url, policy=dict(POLICY),
                                       detectors=dict(DETECTORS)), notifier=ConsoleNotifier(io.StringIO()))


def _outcome(sup: Supervisor, run: str):
    with sup.sessions() as s:
        fs = [(f.finding.signal, f.finding.metric, f.finding.detect_step, f.finding.outcome)
              for f in findings_store.findings(s, run)]
        incs = [(i.signal, i.module, i.detect_step) for i in incidents_store.incidents(s, run)]
        acts = [(a.kind, a.args.get("to_step")) for a in actions_store.actions(s, run)]
    return fs, incs, acts


def _send(sup: Supervisor, run: str, recs, times: int, tmp_path) -> None:
    sup.open_run(RunInfo(run_id=run, attempt=0, world_size=1))
    for r in recs:  # healthy checkpoints every 5 steps, reported before the batch lands
        if r.step % 5 == 0 and r.step < 20:
            sup.checkpoint_saved(run, 0, checkpoint_for(r, tmp_path / run))
    for _ in range(times):
        sup.write(run, 0, recs)  # one batch holding the whole diverging run


def test_a_batch_delivered_three_times_is_judged_once(db, tmp_path):
    recs = diverging_records()
    sup = _supervisor(db, tmp_path / "d")
    try:
        _send(sup, "once", recs, 1, tmp_path)
        _send(sup, "thrice", recs, 3, tmp_path)
        once, thrice = _outcome(sup, "once"), _outcome(sup, "thrice")
    finally:
        sup.close()
    assert once[0], "the diverging run must give findings, or this test proves nothing"
    assert thrice == once


def test_a_supervisor_that_lost_its_detector_state_stores_and_decides_once(db, tmp_path):
    recs = diverging_records()
    sup = _supervisor(db, tmp_path / "d1")
    try:
        _send(sup, "r", recs, 1, tmp_path)
        first = _outcome(sup, "r")
        with sup.sessions.begin() as s:
            detector_state.save(s, "r", {"version": -1})  # unreadable: the next bank starts fresh
    finally:
        sup.close()
    again = _supervisor(db, tmp_path / "d2")
    try:
        with again.sessions.begin() as s:
            detector_state.save(s, "r", {"version": -1})
        again.write("r", 0, recs)  # the spool's replay after a restart: judged by a fresh bank
        assert _outcome(again, "r") == first and first[0]
    finally:
        again.close()


def test_store_keeps_one_row_per_key_and_attempt(db):
    from thermowatch.monitors.contract import Finding, Outcome, Severity, Signal

    f = Finding(Signal.LOSS_SPIKE, "", Severity.CRITICAL, 90, 100, metric="loss", outcome=Outcome.ACT)
    with db.sessions.begin() as s:
        from thermowatch.supervisor.store import runs as runs_store

        runs_store.open_attempt(s, RunInfo("k", 0, world_size=1))
        a, new_a = findings_store.add_finding(s, "k", f, None, attempt=0)
        b, new_b = findings_store.add_finding(s, "k", f, None, attempt=0)
        c, new_c = findings_store.add_finding(s, "k", f, None, attempt=1)  # re-trained step, new attempt
    assert (new_a, new_b, new_c) == (True, False, True) and a == b != c
    with db.sessions() as s:
        got = findings_store.findings(s, "k")
    assert [x.finding.outcome for x in got] == [Outcome.ACT, Outcome.ACT]
