"""Periodic jobs of the daemon (detector sweeps, ack timeouts, stall checks, retention) on
APScheduler 3's BackgroundScheduler, the only module that imports APScheduler (STYLE.md 6).

A job that raises is logged with its traceback and simply runs again at its next tick: the
scheduler never stops for one bad item (STYLE.md 9). `max_instances=1` plus coalescing means a
slow job is never run twice at once and missed ticks collapse into one run instead of piling up.
Each job keeps a status (last run, last error) for the web page and `thermowatch status`.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from dataclasses import dataclass, field, replace
from datetime import timezone
from typing import Callable, Sequence

from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler
from apscheduler.triggers.interval import IntervalTrigger

from thermowatch.supervisor.errors import NotFound, UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    name: str  # unique; the id in status and run_now
    fn: Callable[[], object]
    every_s: float
    # Up to this many seconds of random delay per run, so daemons started together do not
    # hit the DB or Slack in lockstep. 0 = exact.
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not self.name:
            raise UserError("a scheduler Job needs a name")
        if not self.every_s > 0:
            raise UserError(f"job {self.name!r}: every_s={self.every_s!r} must be > 0 seconds")
        if self.jitter < 0:
            raise UserError(f"job {self.name!r}: jitter={self.jitter!r} must be >= 0 seconds")


@dataclass(frozen=True)
class JobStatus:
    name: str
    every_s: float
    runs: int = 0
    failures: int = 0
    running: bool = False
    ok: bool | None = None  # outcome of the last finished run; None before the first
    last_start: float | None = None  # epoch seconds
    last_end: float | None = None
    last_duration_s: float | None = None
    last_ok_at: float | None = None
    last_error: str | None = None  # traceback of the last failure (kept after later successes)
    last_error_at: float | None = None
    next_run: float | None = None  # epoch seconds; None when the scheduler is not running


@dataclass
class _State:
    job: Job
    lock: threading.Lock = field(default_factory=threading.Lock)  # one run at a time, run_now included
    status: JobStatus | None = None


class Scheduler:
    """`Scheduler([Job("sweep", fn, every_s=5)]).start()`; `shutdown()` at exit."""

    def __init__(self, jobs: Sequence[Job]):
        names = [j.name for j in jobs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise UserError(f"scheduler job names must be unique; repeated: {dupes}")
        self._states = {j.name: _State(j, status=JobStatus(j.name, j.every_s)) for j in jobs}
        self._status_lock = threading.Lock()
        self._sched = BackgroundScheduler(
            timezone=timezone.utc,
            # One worker per job: a slow job never delays another.
            executors={"default": ThreadPoolExecutor(max_workers=max(1, len(jobs)))},
            # misfire_grace_time=None: a late tick still runs (coalesced into one) rather than
            # being dropped with a warning when the machine was busy.
            job_defaults={"max_instances": 1, "coalesce": True, "misfire_grace_time": None},
        )
        for j in jobs:
            self._sched.add_job(self._tick, IntervalTrigger(seconds=j.every_s, jitter=j.jitter or None),
                                args=[j.name], id=j.name, name=j.name)

    @property
    def running(self) -> bool:
        return self._sched.running

    def start(self) -> None:
        if self._sched.running:
            raise UserError("the scheduler is already running; call shutdown() before starting it again")
        self._sched.start()
        log.info("scheduler started with jobs %s", sorted(self._states))

    def shutdown(self, wait: bool = True) -> None:
        """Stop ticking; with wait=True, let running jobs finish first. Safe to call twice."""
        if self._sched.running:
            self._sched.shutdown(wait=wait)

    def __enter__(self) -> "Scheduler":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def run_now(self, name: str) -> JobStatus:
        """Run one job in this thread (waiting for a scheduled run of it to finish first) and
        return its status. Errors are recorded and logged, not raised, as for scheduled runs."""
        state = self._state(name)
        with state.lock:
            self._run(state)
        return self.status()[name]

    def status(self) -> dict[str, JobStatus]:
        with self._status_lock:
            out = {}
            for name, state in self._states.items():
                job = self._sched.get_job(name) if self._sched.running else None
                nxt = getattr(job, "next_run_time", None) if job else None
                out[name] = replace(state.status, next_run=nxt.timestamp() if nxt else None)
            return out

    # --- internals -------------------------------------------------------------------------

    def _state(self, name: str) -> _State:
        try:
            return self._states[name]
        except KeyError:
            raise NotFound(f"unknown job {name!r}; known jobs: {sorted(self._states)}") from None

    def _tick(self, name: str) -> None:
        state = self._states[name]
        if not state.lock.acquire(blocking=False):
            log.debug("job %s is already running (run_now); skipping this tick", name)
            return
        try:
            self._run(state)
        finally:
            state.lock.release()

    def _run(self, state: _State) -> None:
        name = state.job.name
        start, t0 = time.time(), time.perf_counter()
        self._update(name, running=True, last_start=start)
        error = None
        try:
            state.job.fn()
        except Exception:  # noqa: BLE001 - a job's bug must not stop the scheduler
            error = traceback.format_exc()
            log.exception("scheduled job %s failed; it runs again at its next tick (every %gs)",
                          name, state.job.every_s)
        end = time.time()
        with self._status_lock:
            st = state.status
            common = dict(running=False, runs=st.runs + 1, last_end=end, last_duration_s=time.perf_counter() - t0)
            if error is None:
                state.status = replace(st, ok=True, last_ok_at=end, **common)
            else:
                state.status = replace(st, ok=False, failures=st.failures + 1, last_error=error,
                                       last_error_at=end, **common)

    def _update(self, name: str, **changes: object) -> None:
        with self._status_lock:
            state = self._states[name]
            state.status = replace(state.status, **changes)
