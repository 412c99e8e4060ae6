"""Commit, answer, then judge (DESIGN.md, "Nothing blocks training").

The ingest request stores a batch, commits and answers; the detectors judge it afterwards on
this module's one thread, in arrival order. A durable marker per attempt (store.judged: the
newest judged step) is advanced after each judged batch, so:

- a SIGKILL between the commit and the judgement loses no finding: at start-up `catch_up()`
  reads back every stored step beyond the marker and judges it;
- nothing is judged twice: batches are cut to the steps beyond the marker before judging (a
  re-sent batch, or one queued while a catch-up already read it from the database);
- memory stays bounded: when the queue is full the batch is dropped from memory only and the
  thread catches up from the database, where it is already committed.

The marker is written by a second thread (`thermowatch-judge-mark`), after the batch's findings
are stored and while the detectors judge the next batch: on SQLite a marker UPDATE waits for the
write lock that the ingest requests hold, and the detectors need not wait with it. Pending marks
of one attempt coalesce to the newest. The order per batch stays: judge, store the findings, mark.
A SIGKILL after the findings are stored and before the mark is written judges that batch again at
the next start: the bank restored from its saved state skips the steps it had judged, and a
finding judged again is not stored or decided twice (Responder.handle, findings.stored_key).
The detectors are this stage's: `banks` (supervisor.judge.banks) judges each batch and hands
every finding to `on_finding`, the act stage's Responder.handle.

The embedded mode (the trainer in the supervisor's process) waits for the judge after each
write (`Supervisor(judge_inline=True)`), so a write returns after its batch is judged; the daemon
(`thermowatch serve`) answers the HTTP request without waiting.
"""

from __future__ import annotations

import collections
import logging
import threading
from sqlalchemy.orm import sessionmaker

from thermowatch.monitors.columns import StepColumns
from thermowatch.supervisor.judge.banks import Banks, OnFinding
from thermowatch.supervisor.store import judged as judged_store
from thermowatch.supervisor.store import thermometers

log = logging.getLogger(__name__)

_CATCH_UP_STEPS = 500  # steps read back per catch-up batch


class Judge:
    def __init__(self, sessions: sessionmaker, banks: Banks, on_finding: OnFinding, *,
                 max_queued_batches: int = 1000) -> None:
        self._sessions = sessions
        self.banks = banks  # the detectors, one bank per run
        self._on_finding = on_finding  # the act stage: each finding is decided there
        self.max_queued_batches = max_queued_batches
        self._queue: collections.deque[tuple[str, int, StepColumns]] = collections.deque()
        self._cv = threading.Condition()
        self._busy = False
        self._catch_up = True  # at start: steps committed by an earlier process but never judged
        self._routine = False  # the catch-up asked for is the leader's routine one (request_catch_up)
        self._stop = False
        self._through: dict[tuple[str, int], int] = {}  # the newest step judged, per attempt (in memory)
        self._marks: dict[tuple[str, int], int] = {}  # markers to write (the marker thread's queue)
        self._marking = False  # the marker thread is writing
        self._rows: set[tuple[str, int]] = set()  # attempts whose marker row exists in the database
        self._thread: threading.Thread | None = None
        self._mark_thread: threading.Thread | None = None
        self.dropped = 0  # batches left to the catch-up because the queue was full

    # --- the ingest side ---------------------------------------------------------------------------

    def submit(self, run_id: str, attempt: int, batch: StepColumns) -> None:
        """Queue a committed batch for judging. Never blocks."""
        with self._cv:
            if len(self._queue) >= self.max_queued_batches:
                self.dropped += 1
                self._catch_up = True  # it is in the database: read it back from there
            else:
                self._queue.append((run_id, attempt, batch))
            self._cv.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until everything submitted so far is judged (False on timeout)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy and not self._catch_up
                                     and not self._marks and not self._marking, timeout)

    def request_catch_up(self) -> None:
        """Read back what this process did not submit (another replica stored it, supervisor.app.
        lease): the next turn judges every attempt's stored steps beyond its marker."""
        with self._cv:
            self._catch_up = True
            self._routine = True  # every second on a leader: not worth a log line per run
            self._cv.notify_all()

    @property
    def backlog(self) -> int:
        """Batches queued and not judged yet (for /healthz)."""
        with self._cv:
            return len(self._queue) + (1 if self._busy or self._catch_up else 0)

    @property
    def alive(self) -> bool:
        """The judging thread is running (for /healthz and /metrics)."""
        return (self._thread is not None and self._thread.is_alive()
                and self._mark_thread is not None and self._mark_thread.is_alive())

    # --- the thread ---------------------------------------------------------------------------------

    def start(self) -> "Judge":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="thermowatch-judge", daemon=True)
            self._mark_thread = threading.Thread(target=self._write_marks, name="thermowatch-judge-mark", daemon=True)
            self._thread.start()
            self._mark_thread.start()
        return self

    def close(self, timeout: float = 30.0) -> None:
        """Judge what is queued (bounded), then stop; what is left is caught up at the next start."""
        if self._thread is None:
            return
        self.wait(timeout)
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout)
        if self._mark_thread is not None:
            self._mark_thread.join(timeout)  # it writes what is pending before it stops
        self._thread = self._mark_thread = None

    def _run(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._queue or self._catch_up or self._stop)
                if self._stop and not self._queue:
                    return
                catch_up, self._catch_up = self._catch_up, False
                if catch_up:
                    self._queue.clear()  # everything queued is committed: the catch-up reads it all
                item = None if catch_up else self._queue.popleft()
                self._busy = True
            try:
                if catch_up:
                    self.catch_up()
                else:
                    self._judge(*item)
            except Exception:  # noqa: BLE001 - the judge outlives a bad batch or a DB hiccup
                log.exception("judge: a batch could not be judged; the next catch-up retries from the marker")
                with self._cv:
                    self._catch_up = True
                    self._cv.wait(1.0)  # a database outage: do not spin
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _judge(self, run_id: str, attempt: int, batch: StepColumns) -> None:
        done = self._marker(run_id, attempt)
        new = batch.steps > done
        fresh = batch if new.all() else batch.select(new)
        top = int(fresh.steps.max()) if len(fresh) else done
        if not len(fresh):
            return
        self.banks.judge(run_id, attempt, fresh, self._on_finding)
        self._through[(run_id, attempt)] = top
        with self._cv:
            self._marks[(run_id, attempt)] = top  # steps only rise here: the newest wins
            self._cv.notify_all()

    def _marker(self, run_id: str, attempt: int) -> int:
        key = (run_id, attempt)
        if key not in self._through:
            with self._sessions() as s:
                self._through[key] = judged_store.through(s, run_id, attempt)
            if self._through[key] >= 0:
                with self._cv:
                    self._rows.add(key)
        return self._through[key]

    def _write_marks(self) -> None:
        """The marker thread: writes each pending marker, the newest per attempt, one transaction."""
        while True:
            with self._cv:
                self._cv.wait_for(lambda: self._marks or (self._stop and not self._busy))
                if not self._marks:
                    return  # stopping, the judge is done, and nothing is pending
                marks, self._marks = self._marks, {}
                rows = set(self._rows)
                self._marking = True
            try:
                with self._sessions.begin() as s:
                    for (run_id, attempt), top in marks.items():
                        judged_store.mark(s, run_id, attempt, top, exists=(run_id, attempt) in rows)
            except Exception:  # noqa: BLE001 - a database hiccup: keep them pending, try again
                log.exception("judge: could not write the judged marker; retrying")
                with self._cv:
                    for key, top in marks.items():
                        self._marks[key] = max(top, self._marks.get(key, top))
                    self._marking = False
                    self._cv.notify_all()
                    self._cv.wait(1.0)
                continue
            with self._cv:
                self._rows.update(marks)
                self._marking = False
                self._cv.notify_all()

    def catch_up(self) -> int:
        """Judge every stored step beyond the marker of each run's newest attempt; returns how many."""
        n = 0
        with self._sessions() as s:
            todo = judged_store.behind(s)
        for run_id, attempt, through in todo:
            if through >= 0:
                with self._cv:
                    self._rows.add((run_id, attempt))
            # A marker still waiting for the marker thread is newer than the stored one.
            through = max(through, self._through.get((run_id, attempt), -1))
            self._through[(run_id, attempt)] = through
            while True:
                with self._sessions() as s:
                    recs = thermometers.records_after(s, run_id, attempt, through, _CATCH_UP_STEPS)
                if not recs:
                    break
                log.log(logging.DEBUG if self._routine else logging.INFO,
                        "judge: catching up run %s attempt %d, steps %d..%d", run_id, attempt, recs[0].step,
                        recs[-1].step)
                self._judge(run_id, attempt, StepColumns.from_records(recs))  # what ingest hands over
                n += len(recs)
                through = recs[-1].step
        return n
