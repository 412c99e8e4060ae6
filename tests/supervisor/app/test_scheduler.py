"""The scheduler wrapper on real APScheduler at sub-second intervals."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from thermowatch.supervisor.errors import NotFound, UserError
from thermowatch.supervisor.app.scheduler import Job, Scheduler


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


class Counter:
    def __init__(self, fail_first: int = 0, fail_always: bool = False, sleep_s: float = 0.0):
        self.calls = 0
        self.active = 0
        self.max_active = 0
        self.fail_first, self.fail_always, self.sleep_s = fail_first, fail_always, sleep_s
        self._lock = threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            self.calls += 1
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            n = self.calls
        try:
            if self.sleep_s:
                time.sleep(self.sleep_s)
            if self.fail_always or n <= self.fail_first:
                raise ValueError(f"boom #{n}")
        finally:
            with self._lock:
                self.active -= 1


def test_a_raising_job_is_retried_while_another_keeps_running(caplog):
    bad, good = Counter(fail_always=True), Counter()
    sched = Scheduler([Job("bad", bad, every_s=0.05), Job("good", good, every_s=0.05)])
    with caplog.at_level(logging.ERROR, logger="thermowatch.supervisor.app.scheduler"), sched:
        # the status books a run after its call returns: wait on the status, not the call counts
        assert wait_for(lambda: sched.status()["bad"].failures >= 4 and good.calls >= 4)
        assert sched.running
        status = sched.status()
    assert status["bad"].failures >= 4 and status["bad"].ok is False
    assert "ValueError: boom" in status["bad"].last_error and "Traceback" in status["bad"].last_error
    assert status["good"].failures == 0 and status["good"].ok is True and status["good"].last_ok_at
    assert status["good"].next_run is not None
    failures = [r for r in caplog.records if "scheduled job bad failed" in r.getMessage()]
    assert len(failures) >= 4 and all(r.exc_info for r in failures)


def test_a_slow_job_never_overlaps_itself():
    slow = Counter(sleep_s=0.25)
    with Scheduler([Job("slow", slow, every_s=0.02)]):
        time.sleep(1.0)
    assert slow.max_active == 1
    # Missed ticks are coalesced, not queued: ~1 s / 0.25 s runs, not ~50.
    assert 2 <= slow.calls <= 6


def test_a_job_that_recovers_reports_ok_and_keeps_its_last_error():
    flaky = Counter(fail_first=2)
    with Scheduler([Job("flaky", flaky, every_s=0.05)]) as sched:
        assert wait_for(lambda: sched.status()["flaky"].ok is True)
        st = sched.status()["flaky"]
    assert st.failures == 2 and st.runs >= 3
    assert "boom #2" in st.last_error and st.last_error_at < st.last_ok_at


def test_run_now_runs_in_the_caller_and_records_errors():
    bad = Counter(fail_always=True)
    sched = Scheduler([Job("bad", bad, every_s=3600)])
    st = sched.run_now("bad")  # works without start(), for the CLI
    assert bad.calls == 1 and st.runs == 1 and st.failures == 1 and "boom #1" in st.last_error
    assert st.next_run is None and not st.running
    with pytest.raises(NotFound, match=r"unknown job 'nope'; known jobs: \['bad'\]"):
        sched.run_now("nope")


def test_shutdown_stops_the_ticks():
    good = Counter()
    sched = Scheduler([Job("good", good, every_s=0.03)])
    sched.start()
    assert wait_for(lambda: good.calls >= 2)
    sched.shutdown()
    sched.shutdown()  # twice is fine
    calls = good.calls
    time.sleep(0.2)
    assert good.calls == calls and not sched.running


@pytest.mark.parametrize("jobs, match", [
    ([Job("a", print, 1), Job("a", print, 2)], r"unique; repeated: \['a'\]"),
], ids=["duplicate-names"])
def test_scheduler_rejects_bad_jobs(jobs, match):
    with pytest.raises(UserError, match=match):
        Scheduler(jobs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(every_s=0), "every_s=0 must be > 0"),
    (dict(every_s=1, jitter=-1), "jitter=-1 must be >= 0"),
], ids=["zero-interval", "negative-jitter"])
def test_job_rejects_bad_values(kwargs, match):
    with pytest.raises(UserError, match=match):
        Job("sweep", print, **kwargs)
