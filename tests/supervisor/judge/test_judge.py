"""Commit, answer, then judge (supervisor.judge.judge), on SQLite and PostgreSQL, with records from a
real diverging run: a crash between the commit and the judgement loses no finding and judges
nothing twice; a judge whose queue overflows catches up from the database; a re-sent batch is
not judged again."""

from __future__ import annotations

import io

import pytest

from thermowatch.monitors.contract import RunInfo
from thermowatch.supervisor.app.config import SupervisorConfig
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.app.service import Supervisor
from thermowatch.supervisor.store import findings as findings_store
from thermowatch.supervisor.store import judged as judged_store
from tests.fixtures.diverging import DETECTORS, POLICY, diverging_records, uninterrupted

RUN = "jg"


def make_sup(url: str, data_dir, **kw) -> Supervisor:
    cfg = SupervisorConfig(data_dir=data_dir, db_url=url, policy=dict(POLICY), detectors=dict(DETECTORS))
    return Supervisor(cfg, notifier=ConsoleNotifier(io.StringIO()), **kw)


def batches():
    recs = diverging_records()
    return [recs[i:i + 10] for i in range(0, len(recs), 10)]


def findings(sup):
    with sup.sessions() as s:
        return sorted((f.finding.signal.value, f.finding.module, f.finding.metric, f.finding.detect_step)
                      for f in findings_store.findings(s, RUN))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """What an uninterrupted supervisor finds in the run (its own SQLite file)."""
    d = tmp_path_factory.mktemp("ref")
    sup = make_sup(f"sqlite:///{d / 'ref.db'}", d / "data")
    found = uninterrupted(sup, RUN, batches(), findings)
    assert found, "the diverging run raised no finding"
    return found


def test_a_crash_between_commit_and_judgement_loses_no_finding(db, tmp_path, reference):
    bs = batches()
    half = len(bs) // 2
    sup = make_sup(db.url, tmp_path / "a")
    sup.open_run(RunInfo(RUN, 0, world_size=1))
    for b in bs[:half]:
        sup.write(RUN, 0, b)  # committed and judged
    sup.judge.close()  # the judge thread is gone: what follows is committed, never judged
    for b in bs[half:]:
        sup.ingestor.write(RUN, 0, b)
    with sup.sessions() as s:
        assert judged_store.through(s, RUN, 0) == bs[half - 1][-1].step
    sup.engine.dispose()  # "SIGKILL": no close(), no detector-state save, the queue is lost
    sup.executor.outbox._stop.set()  # a killed daemon's alert senders die with it, unlike this
    sup.executor.outbox.wake()        # test process's threads, which would outlive the test
    sup2 = make_sup(db.url, tmp_path / "a")  # a new daemon on the same database catches up
    try:
        assert sup2.judge.wait(120)
        assert findings(sup2) == reference
        with sup2.sessions() as s:
            assert judged_store.through(s, RUN, 0) == bs[-1][-1].step
        sup2.write(RUN, 0, bs[-1])  # the sink re-sends the last batch: stored once, judged once
        assert findings(sup2) == reference
    finally:
        sup2.close()


def test_an_overflowing_queue_is_caught_up_from_the_database(db, tmp_path, reference):
    sup = make_sup(db.url, tmp_path / "b", judge_inline=False)
    sup.judge.max_queued_batches = 0  # every batch overflows: the judge reads them all back
    try:
        sup.open_run(RunInfo(RUN, 0, world_size=1))
        for b in batches():
            sup.write(RUN, 0, b)
        assert sup.judge.wait(120)
        assert sup.judge.dropped == len(batches())
        assert findings(sup) == reference
    finally:
        sup.close()


def test_a_database_that_refuses_the_findings_for_a_while_loses_none(tmp_path, reference, caplog):
    """The judge finds a divergence while SQLite's write lock is held elsewhere for longer than
    the busy timeout (the URL's 1 s here; 10 s by default): storing its findings fails. The
    responder forgets the bank that judged them, so the judge's retry from its marker judges the
    steps again from the saved state and stores every finding, once."""
    import logging
    import sqlite3
    import time

    from thermowatch.supervisor.judge.judge import Judge

    path = tmp_path / "locked.db"
    sup = make_sup(f"sqlite:///{path}?timeout=1", tmp_path / "d", judge_inline=False)
    bs = batches()
    first = min(f[3] for f in reference)
    cut = next(i for i, b in enumerate(bs) if b[-1].step >= first)
    try:
        sup.open_run(RunInfo(RUN, 0, world_size=1))
        for b in bs[:cut]:
            sup.write(RUN, 0, b)
        assert sup.judge.wait(120)
        assert findings(sup) == []
        sup.banks.save_states()
        sup.judge.close()  # what follows is committed and waits for a judge
        for b in bs[cut:]:
            sup.ingestor.write(RUN, 0, b)
        lock = sqlite3.connect(path, isolation_level=None)
        lock.execute("BEGIN EXCLUSIVE")  # WAL: readers go on, writers wait (busy timeout 1 s), then fail
        with caplog.at_level(logging.ERROR, logger="thermowatch.supervisor.judge.judge"):
            sup.judge = Judge(sup.sessions, sup.banks, sup.responder.handle).start()
            time.sleep(3)
        assert findings(sup) == []  # nothing could be stored yet
        assert any("could not be judged" in r.getMessage() for r in caplog.records)  # it failed, and retries
        lock.execute("COMMIT")
        lock.close()
        assert sup.judge.wait(120)
        assert findings(sup) == reference
    finally:
        sup.close()
