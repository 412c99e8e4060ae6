"""Can the trainer still save checkpoints? (issue 13, the fault matrix: "a checkpoint write that
fails").

A save that fails (the volume full or read-only, a rank's save raising) does not end the run:
the controller trains on from the checkpoints it has and reports the consecutive failures in
every record (`checkpoint_failures`, contract.CHECKPOINT_FAILURES). Training on is the right
default for a cluster-month run, but every step after the last good checkpoint is now at risk:
a crash or a rollback would go back further and further. So the first failure pages a human
(a `checkpoint_failed` finding, critical, and an alert) and a save that succeeds again says so.
It never goes to the policy: nothing the supervisor can do to the run frees a disk.

Called by the ingestor after each batch commits, beside supervisor.judge.consistency.
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

from sqlalchemy.orm import sessionmaker

from thermowatch.monitors.contract import CHECKPOINT_FAILURES, Finding, Severity, Signal, StepRecord
from thermowatch.supervisor.notify.base import Alert
from thermowatch.supervisor.store import findings as findings_store

log = logging.getLogger(__name__)


class CheckpointFailures:
    reads = (CHECKPOINT_FAILURES,)  # the keys it reads

    def __init__(self, session_factory: sessionmaker, executor) -> None:
        self._session = session_factory
        self._executor = executor
        self._failing: dict[str, int] = {}  # run -> step of the first failed save paged (until resolved)

    def __call__(self, run_id: str, attempt: int, records: Sequence[StepRecord]) -> Finding | None:
        found = None
        for r in records:
            n = r.values.get(CHECKPOINT_FAILURES)
            if n is None or not math.isfinite(n):
                continue
            if n >= 1 and run_id not in self._failing:
                self._failing[run_id] = r.step
                found = self._page(run_id, r.step, int(n))
            elif n == 0 and run_id in self._failing:
                since = self._failing.pop(run_id)
                log.warning("run %s: checkpoints are saved again (failing since step %d)", run_id, since)
                self._executor.notify(Alert(
                    run_id=run_id, severity=Severity.INFO,
                    title=f"{run_id}: checkpoints are saved again",
                    text=f"the save before step {r.step} succeeded; the saves had failed since step {since}.",
                    fields={"step": r.step, "failing_since": since}))
        return found

    def _page(self, run_id: str, step: int, failures: int) -> Finding:
        finding = Finding(signal=Signal.CHECKPOINT_FAILED, module="", severity=Severity.CRITICAL, onset_step=step,
                          detect_step=step, metric=CHECKPOINT_FAILURES, evidence={"consecutive_failures": failures})
        with self._session.begin() as s:
            findings_store.add_finding(s, run_id, finding)
        log.error("run %s: the trainer could not save a checkpoint (reported at step %d)", run_id, step)
        self._executor.notify(Alert(
            run_id=run_id, severity=Severity.CRITICAL,
            title=f"{run_id}: checkpoint saves are failing",
            text=(f"the trainer could not save its checkpoint before step {step} ({failures} in a row) and trains on "
                  "from the checkpoints it has: a crash or a rollback now loses every step since the last good one. "
                  "Check the checkpoint volume (full? read-only? permissions?) and the trainer's log for the error; "
                  "the next save is tried at the next interval."),
            fields={"step": step, "consecutive_failures": failures}))
        return finding
