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

The embedded mode (the trainer in the supervisor's process) waits for the judge after each
write (`Supervisor(judge_inline=True)`), so its behaviour is the one it always had; the daemon
(`thermowatch serve`) answers the HTTP request without waiting.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable, Sequence

from sqlalchemy.orm import sessionmaker

from monitors.columns import StepColumns
from monitors.contract import StepRecord
from supervisor.store import judged as judged_store
from supervisor.store import thermometers

log = logging.getLogger(__name__)

Batch = Sequence[StepRecord] | StepColumns  # as ingest committed it (columns) or as a catch-up read it
OnRecords = Callable[[str, int, Batch], object]
_CATCH_UP_STEPS = 500  # steps read back per catch-up batch


class Judge:
    def __init__(self, sessions: sessionmaker, on_records: OnRecords, *, max_queued_batches: int = 1000) -> None:
        self._sessions = sessions
        self._on_records = on_records
        self.max_queued_batches = max_queued_batches
        self._queue: collections.deque[tuple[str, int, Batch]] = collections.deque()
        self._cv = threading.Condition()
        self._busy = False
        self._catch_up = True  # at start: steps committed by an earlier process but never judged
        self._stop = False
        self._through: dict[tuple[str, int], int] = {}  # the marker, as this process last wrote it
        self._thread: threading.Thread | None = None
        self.dropped = 0  # batches left to the catch-up because the queue was full

    # --- the ingest side ---------------------------------------------------------------------------

    def submit(self, run_id: str, attempt: int, batch: Batch) -> None:
        """Queue a committed batch for judging. Never blocks."""
        with self._cv:
            if len(self._queue) >= self.max_queued_batches:
                self.dropped += 1
                self._catch_up = True  # it is in the database: read it back from there
            else:
                self._queue.append((run_id, attempt, batch if isinstance(batch, StepColumns) else list(batch)))
            self._cv.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until everything submitted so far is judged (False on timeout)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._queue and not self._busy and not self._catch_up, timeout)

    @property
    def backlog(self) -> int:
        """Batches queued and not judged yet (for /healthz)."""
        with self._cv:
            return len(self._queue) + (1 if self._busy or self._catch_up else 0)

    @property
    def alive(self) -> bool:
        """The judging thread is running (for /healthz and /metrics)."""
        return self._thread is not None and self._thread.is_alive()

    # --- the thread ---------------------------------------------------------------------------------

    def start(self) -> "Judge":
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="thermowatch-judge", daemon=True)
            self._thread.start()
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
        self._thread = None

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

    def _judge(self, run_id: str, attempt: int, batch: Batch) -> None:
        done = self._marker(run_id, attempt)
        if isinstance(batch, StepColumns):
            new = batch.steps > done
            fresh: Batch = batch if new.all() else batch.select(new)
            top = int(fresh.steps.max()) if len(fresh) else done
        else:
            fresh = [r for r in batch if r.step > done]
            top = max((r.step for r in fresh), default=done)
        if not len(fresh):
            return
        self._on_records(run_id, attempt, fresh)
        with self._sessions.begin() as s:
            judged_store.mark(s, run_id, attempt, top, exists=done >= 0)  # a marker >= 0 was read or written
        self._through[(run_id, attempt)] = top

    def _marker(self, run_id: str, attempt: int) -> int:
        key = (run_id, attempt)
        if key not in self._through:
            with self._sessions() as s:
                self._through[key] = judged_store.through(s, run_id, attempt)
        return self._through[key]

    def catch_up(self) -> int:
        """Judge every stored step beyond the marker of each run's newest attempt; returns how many."""
        n = 0
        with self._sessions() as s:
            todo = judged_store.behind(s)
        for run_id, attempt, through in todo:
            self._through[(run_id, attempt)] = through
            while True:
                with self._sessions() as s:
                    recs = thermometers.records_after(s, run_id, attempt, through, _CATCH_UP_STEPS)
                if not recs:
                    break
                log.info("judge: catching up run %s attempt %d, steps %d..%d", run_id, attempt,
                         recs[0].step, recs[-1].step)
                self._judge(run_id, attempt, recs)
                n += len(recs)
                through = recs[-1].step
        return n
