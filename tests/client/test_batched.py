"""thermowatch.transport.Batched: the one place records wait in front of an in-process sink (the
embedded Supervisor): steps go on as one write per `every_steps` (or `every_s`), anything else
sends what waits first, attempts never mix in one write, and a failed write loses nothing."""

from __future__ import annotations

import io

import numpy as np

from thermowatch.monitors.contract import CheckpointInfo, RunFinished, RunInfo, StepRecord
from thermowatch.trainer.local import ListSink
from thermowatch.transport import Batched


def rec(step: int) -> StepRecord:
    return StepRecord(step=step, values={"loss": float(step)}, sample_lo=step * 4, sample_hi=step * 4 + 4)


def test_steps_go_as_one_write_per_batch_and_in_order_with_everything_else():
    inner = ListSink()
    sink = Batched(inner, every_steps=4, every_s=3600)
    sink.open_run(RunInfo("r", 0, world_size=1))
    for s in range(1, 10):
        sink.write("r", 0, [rec(s)])
    assert inner.writes == 2 and len(inner.attempt("r", 0)) == 8  # step 9 waits
    sink.checkpoint_saved("r", 0, CheckpointInfo(9, "/ck/9", 36, True))  # sends step 9 first
    assert inner.writes == 3 and [r.step for r in inner.attempt("r", 0)] == list(range(1, 10))
    sink.write("r", 0, [rec(10)])
    sink.open_run(RunInfo("r", 1, world_size=1, start_step=8))  # a new attempt: the old one's step goes first
    sink.write("r", 1, [rec(9)])
    sink.finish_run("r", 1, RunFinished(step=9, final_loss=9.0, reason="completed"))
    assert [r.step for r in inner.attempt("r", 0)] == list(range(1, 11))
    assert [r.step for r in inner.attempt("r", 1)] == [9]
    assert inner.finished[("r", 1)].step == 9


def test_attempts_never_share_a_write():
    inner = ListSink()
    sink = Batched(inner, every_steps=100, every_s=3600)
    sink.write("r", 0, [rec(1), rec(2)])
    sink.write("r", 1, [rec(2)])
    sink.write("r", 0, [rec(3)])  # a late step of attempt 0 (a retry keeps its attempt)
    assert sink.drain()
    assert inner.writes == 3
    assert [r.step for r in inner.attempt("r", 0)] == [1, 2, 3] and [r.step for r in inner.attempt("r", 1)] == [2]


def test_time_sends_a_batch_that_never_fills():
    inner = ListSink()
    sink = Batched(inner, every_steps=1000, every_s=0.0)
    sink.write("r", 0, [rec(1)])
    assert inner.writes == 1


class _DownFor(ListSink):
    """An in-process sink whose store is down for its first `n` writes (a database restart)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.down = n

    def write(self, run_id, attempt, records):
        if self.down:
            self.down -= 1
            raise ConnectionError("database restarting")
        super().write(run_id, attempt, records)


def test_a_failed_write_keeps_its_steps_for_the_next_try_up_to_max_held():
    inner = _DownFor(10**6)
    sink = Batched(inner, every_steps=2, every_s=3600, max_held=5)
    for s in range(1, 5):
        sink.write("r", 0, [rec(s)])  # every step from the 2nd tries a write; all fail
    assert inner.writes == 0
    inner.down = 0
    assert sink.drain()
    assert [r.step for r in inner.attempt("r", 0)] == [1, 2, 3, 4]
    inner.down = 1
    for s in range(5, 12):
        sink.write("r", 0, [rec(s)])  # the first try fails; the rest go
    assert sink.drain()
    assert [r.step for r in inner.attempt("r", 0)] == list(range(1, 12))
    inner.down = 10**6  # down for good: only the newest max_held steps are kept
    for s in range(12, 30):
        sink.write("r", 0, [rec(s)])
    assert not sink.drain()
    inner.down = 0
    assert sink.drain()
    got = [r.step for r in inner.attempt("r", 0)]
    assert got[:11] == list(range(1, 12)) and got[-1] == 29 and len(got) - 11 <= 5 + 1


def test_in_front_of_the_embedded_supervisor(db, tmp_path):
    """The real in-process sink: the batch is stored and judged as one write."""
    from thermowatch.supervisor.app.config import SupervisorConfig
    from thermowatch.supervisor.app.service import Supervisor
    from thermowatch.supervisor.notify.console import ConsoleNotifier
    from thermowatch.supervisor.store import thermometers

    sup = Supervisor(SupervisorConfig(data_dir=tmp_path / "data", db_url=db.url), notifier=ConsoleNotifier(io.StringIO()))
    try:
        sink = Batched(sup, every_steps=5, every_s=3600)
        sink.open_run(RunInfo("r", 0, world_size=1))
        for s in range(1, 13):
            sink.write("r", 0, [rec(s)])
        with sup.sessions() as s:
            assert list(thermometers.history(s, "r", "loss")[0]) == list(range(1, 11))
        sink.finish_run("r", 0, RunFinished(step=12, final_loss=12.0, reason="completed"))
        with sup.sessions() as s:
            steps, vals = thermometers.history(s, "r", "loss")
        np.testing.assert_array_equal(steps, np.arange(1, 13))
        np.testing.assert_array_equal(vals, np.arange(1.0, 13.0))
    finally:
        sup.close()
