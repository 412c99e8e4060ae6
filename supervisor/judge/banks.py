"""The judge stage's detector banks, one per run: what the detectors remember between batches.

`Banks.judge` runs a committed batch through the run's bank and hands each finding on (to the act
stage's `Responder.handle`), then saves the bank's state; `stalls` asks the wall-clock detectors.
The act stage asks back only through `recheck_at`, `recheck_after` and `rewind`; nothing here
imports it.

Detector state survives a supervisor restart: each bank's state is saved in the DB whenever a
batch raised a finding (latches must survive), else at most every `state_save_every_s`, and on
close. A save writes only what changed since the last one (the counters, and the ring-buffer
chunks written since: store/detector_state.py); a bank that started fresh replaces every part.
After a rollback whose first re-trained step is s, the bank forgets what it saw at or after s but
keeps the healthy baseline before it (those steps are re-trained in a new attempt and must not be
judged against their own diverged past, nor wait through a fresh warm-up).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from typing import Callable

from sqlalchemy.orm import sessionmaker

from thermowatch.monitors.columns import StepColumns
from thermowatch.monitors.contract import Finding
from thermowatch.monitors.detectors import BankConfig, DetectorBank
from thermowatch.supervisor.judge.bank_process import BankProcess, RemoteBank
from thermowatch.supervisor.store import detector_state
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import steps as steps_store

log = logging.getLogger(__name__)

# The cooldown reminder's part of a run's saved detector state, beside the bank's parts. Its stored
# name is the one it had when the responder kept it; states saved since then carry it.
RECHECK_PART = "responder"

OnFinding = Callable[[str, Finding, "int | None"], object]  # the act stage: run, finding, attempt


class Banks:
    def __init__(self, sessions: sessionmaker, config: BankConfig, *, process: BankProcess | None = None,
                 state_save_every_s: float = 5.0) -> None:
        self._session = sessions
        self._config = config
        # process: the banks live in the detectors' process (supervisor.judge.bank_process, the daemon);
        # None: in this one (embedded mode, tests, replay).
        self._process = process
        self._banks: dict[str, DetectorBank | RemoteBank] = {}
        self._attempts: dict[str, int] = {}  # newest attempt per run: older ones are not judged
        # run -> (attempt, step): a step cooldown held a finding back until that step; once the
        # run's records reach it the detectors' latches are released, so a divergence that is
        # still there fires again and the policy decides, with the cooldown over (issue 22).
        self._recheck: dict[str, tuple[int, int]] = {}
        self._state_every = state_save_every_s
        self._state_saved: dict[str, float] = {}  # run -> monotonic time of the last state save
        self._state_whole: set[str] = set()  # runs whose next save replaces every stored part
        self._lock = threading.RLock()  # the judge thread, the scheduler and acks all reach here

    def bank(self, run_id: str) -> DetectorBank | RemoteBank:
        with self._lock:
            bank = self._banks.get(run_id)
            if bank is None or bank.lost:
                # Not loaded yet, or its process died: from the state saved in the DB (what came
                # after the last save is judged again from the judge's marker, as after a SIGKILL).
                bank = self._new(run_id)
                with self._session() as s:
                    saved = detector_state.load_parts(s, run_id)
                self._load_recheck(run_id, saved.pop(RECHECK_PART, None))
                if not saved:
                    self._state_whole.add(run_id)
                else:
                    try:
                        bank.load_state_parts(saved)
                    except (ValueError, KeyError) as exc:  # an older state format: start fresh, say so
                        log.warning("run %s: detector state not restored (%s); starting fresh", run_id, exc)
                        bank = self._new(run_id)
                        self._state_whole.add(run_id)  # its first save replaces the unreadable parts
                self._banks[run_id] = bank
            return bank

    def _new(self, run_id: str) -> DetectorBank | RemoteBank:
        return DetectorBank(self._config) if self._process is None else self._process.bank(run_id)

    def note_attempt(self, run_id: str, attempt: int) -> None:
        with self._lock:
            self._attempts[run_id] = max(attempt, self._attempts.get(run_id, attempt))

    # --- judging --------------------------------------------------------------------------------

    def judge(self, run_id: str, attempt: int, records: StepColumns, on_finding: OnFinding) -> list[Finding]:
        """A committed batch through the run's bank; each finding to `on_finding`, then the state."""
        with self._lock:
            if run_id not in self._attempts:
                with self._session() as s:
                    latest = runs_store.latest_attempt(s, run_id)
                self._attempts[run_id] = latest.attempt if latest else attempt
            if attempt < self._attempts[run_id]:
                # Late records of an attempt the run has left (a rollback or restart came
                # between): stored, but not judged, or the diverged past would look like a
                # recurrence after the detectors were rewound.
                log.info("run %s: %d late record(s) of attempt %d (now %d) stored, not judged",
                         run_id, len(records), attempt, self._attempts[run_id])
                return []
            bank = self.bank(run_id)
            # With the attempt, the bank skips steps it already judged (a batch delivered twice).
            found = bank.observe_many(records, attempt)
            self._release_after_cooldown(run_id, attempt, records, bank)
            try:
                # The findings first, then the state: a state saved with this batch judged (and
                # its latches set) before its findings are stored would skip the batch when it is
                # judged again after a crash, and the findings would be lost. The other order
                # judges it again from the older state; a finding already stored is not stored
                # or decided twice (findings.stored_key).
                for finding in found:
                    on_finding(run_id, finding, attempt)
                if found or time.monotonic() - self._state_saved.get(run_id, -math.inf) >= self._state_every:
                    self._save_state(run_id)
            except Exception:
                # The database refused the findings or the state: this bank has judged a batch
                # the database does not know was judged. Forget it, so that the judge's retry
                # from its marker judges the batch again from the saved state.
                self._banks.pop(run_id, None)
                raise
            return found

    def stalls(self, now: float) -> list[tuple[str, Finding]]:
        """(run, finding) from the wall-clock detectors (no step for too long). A run whose newest
        attempt said it finished (completed, stopped, closed) sends no more steps on purpose: it
        is never checked (issue 35: every finished run got a CRITICAL stall page at 10 and 30 min)."""
        with self._lock:
            runs = list(self._banks)
            with self._session() as s:
                done = runs_store.ended_runs(s, runs)
            return [(run_id, f) for run_id in runs if run_id not in done for f in self.bank(run_id).check(now)]

    # --- what the act stage asks ------------------------------------------------------------------

    def recheck_at(self, run_id: str, attempt: int, step: int) -> None:
        """A step cooldown held a finding back until `step` of `attempt`: release the latches then."""
        with self._lock:
            self._recheck[run_id] = (attempt, step)

    def recheck_after(self, run_id: str, steps: int) -> None:
        """Release the run's detector latches once its newest attempt has trained `steps` more
        steps than it has now: a divergence a person declined to act on is judged again, so it
        alerts (and proposes) again if it persists or worsens, instead of staying latched."""
        with self._session() as s:
            latest = runs_store.latest_attempt(s, run_id)
            if latest is None:
                return
            last = steps_store.last_step(s, run_id, latest.attempt)
        with self._lock:
            due = (latest.attempt, (last if last is not None else latest.start_step) + max(1, steps))
            cur = self._recheck.get(run_id)
            if cur is None or cur[0] != due[0] or cur[1] > due[1]:
                self._recheck[run_id] = due
        log.info("run %s: a proposal was declined; the detectors fire again from step %d on what persists",
                 run_id, due[1])

    def rewind(self, run_id: str, first_step: int) -> None:
        """A rollback took effect and `first_step` is its first re-trained step: the detectors
        forget every point at or after it."""
        with self._lock:
            self.bank(run_id).reset(first_step)
            self._save_state(run_id)

    # --- state ----------------------------------------------------------------------------------

    def _load_recheck(self, run_id: str, part: bytes | None) -> None:
        """The cooldown reminder saved with the detectors' state: a daemon restarted inside a
        cooldown still releases the latches when it ends."""
        try:
            due = json.loads(part)["recheck"] if part else None
        except (ValueError, KeyError, TypeError):
            log.warning("run %s: unreadable cooldown reminder in the detector state; dropped", run_id)
            due = None
        if due:
            self._recheck[run_id] = (int(due[0]), int(due[1]))

    def _release_after_cooldown(self, run_id: str, attempt: int, records: StepColumns, bank) -> None:
        due = self._recheck.get(run_id)
        if due is None:
            return
        if due[0] != attempt:  # another attempt since (a rollback rewound the detectors already)
            del self._recheck[run_id]
            return
        last = int(records.steps.max()) if len(records.steps) else -1
        if last >= due[1]:
            del self._recheck[run_id]
            bank.release_latches()
            log.info("run %s: the cooldown that held a finding back ended at step %d; the detectors fire again "
                     "on what persists", run_id, due[1])

    def save_states(self) -> None:
        """Write every loaded bank's state (on close)."""
        with self._lock:
            for run_id, bank in list(self._banks.items()):
                if not bank.lost:  # a lost bank's state died with its process
                    self._save_state(run_id)

    def _save_state(self, run_id: str) -> None:
        bank = self._banks[run_id]
        whole = run_id in self._state_whole
        due = self._recheck.get(run_id)
        mine = {RECHECK_PART: json.dumps({"recheck": list(due) if due else None}).encode()}
        with self._session.begin() as s:
            if whole:
                detector_state.replace_parts(s, run_id, {**bank.state_parts(), **mine})
            else:
                detector_state.save_parts(s, run_id, {**bank.state_parts(dirty_only=True), **mine})
        # After the commit: a failed save leaves the chunks dirty for the next one.
        bank.mark_saved()
        self._state_whole.discard(run_id)
        self._state_saved[run_id] = time.monotonic()
