"""Does the trainer run with what the supervisor recorded? (DESIGN.md, "Trust": "the trainer
reports its effective LR multiplier and ledger digest in every step record, and a disagreement
with the supervisor's view is a critical finding".)

Called by the ingestor after each batch commits. The supervisor's view is the LR changes and
skip ranges it booked from acknowledgements; the trainer's is in every record (`lr_multiplier`,
`ledger_digest`). A difference means one side lost a command (a relaunch from an old
checkpoint, an ack booked twice or never): a `state_mismatch` finding is stored and a human is
paged. It never goes to the policy: acting on a state nobody understands would make it worse.

Not compared: records of an attempt the run has left, batches while a command is delivered but
not yet acknowledged (the trainer may already run with it: sent, or re-queued after a lost ack),
and the ledger digest of steps
before the last acknowledged skip (they ran under the older ledger).
"""

from __future__ import annotations

import logging
import math
from typing import Sequence

from sqlalchemy.orm import sessionmaker

from thermowatch.monitors.contract import LR_MULTIPLIER, Finding, Severity, Signal, StepRecord, multiplier_at
from thermowatch.monitors.commands import ActionState, CommandKind
from thermowatch.supervisor.notify.base import Alert
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import findings as findings_store
from thermowatch.supervisor.store import lr_changes as lr_store
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import skips as skips_store

log = logging.getLogger(__name__)

_SKIPPING = (CommandKind.SKIP, CommandKind.ROLLBACK)


class ConsistencyCheck:
    reads = (LR_MULTIPLIER,)  # the keys it reads (and each step's ledger digest)

    def __init__(self, session_factory: sessionmaker, executor) -> None:
        self._session = session_factory
        self._executor = executor
        self._paged: dict[str, tuple] = {}  # run -> the last disagreement paged (page once per new one)

    def __call__(self, run_id: str, attempt: int, records: Sequence[StepRecord]) -> Finding | None:
        recs = [r for r in records if LR_MULTIPLIER in r.values or r.ledger_digest]
        if not recs:
            return None
        with self._session() as s:
            latest = runs_store.latest_attempt(s, run_id)
            if latest is not None and attempt < latest.attempt:
                return None
            open_rows = actions_store.open_actions(s, run_id)
            # Delivered and not yet booked (sent, or re-queued after a lost ack): the trainer may
            # already run with it.
            if any(a.state in (ActionState.SENT, ActionState.ACKED) or a.attempts > 0 for a in open_rows):
                return None
            changes = lr_store.changes(s, run_id)
            digest = skips_store.digest(s, run_id)
            skip_from = max((a.ack_step or 0 for a in actions_store.actions(s, run_id, limit=1000)
                             if a.state is ActionState.DONE and a.kind in _SKIPPING), default=0)
        finding = None
        for r in recs:
            got = r.values.get(LR_MULTIPLIER)
            want = multiplier_at(r.step, changes)
            if got is not None and not (math.isfinite(got) and math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12)):
                finding = _finding(r.step, records[-1].step, LR_MULTIPLIER, got, want)
                break
            if r.ledger_digest and r.step >= skip_from and r.ledger_digest != digest:
                finding = _finding(r.step, records[-1].step, "ledger_digest", r.ledger_digest, digest)
                break
        if finding is None:
            self._paged.pop(run_id, None)
            return None
        key = (finding.metric, finding.evidence["trainer"], finding.evidence["supervisor"])
        if self._paged.get(run_id) == key:
            return finding  # already paged for this very disagreement
        self._paged[run_id] = key
        with self._session.begin() as s:
            findings_store.add_finding(s, run_id, finding)
        what = "LR multiplier" if finding.metric == LR_MULTIPLIER else "skip-ledger digest"
        ev = finding.evidence
        log.error("run %s: trainer's %s %r != supervisor's %r at step %d", run_id, what, ev["trainer"],
                  ev["supervisor"], finding.onset_step)
        self._executor.notify(Alert(
            run_id=run_id, severity=Severity.CRITICAL,
            title=f"{run_id}: state mismatch: the trainer's {what} differs from the supervisor's record",
            text=(f"at step {finding.onset_step} the trainer reports {ev['trainer']!r}, the supervisor recorded "
                  f"{ev['supervisor']!r}. A command was lost or applied differently (a relaunch from an old "
                  "checkpoint?). Nothing was changed automatically; compare `thermowatch actions` with the run."),
            fields={"step": finding.onset_step, "trainer": ev["trainer"], "supervisor": ev["supervisor"]}))
        return finding


def _finding(step: int, detect: int, metric: str, got, want) -> Finding:
    return Finding(signal=Signal.STATE_MISMATCH, module="", severity=Severity.CRITICAL, onset_step=step,
                   detect_step=detect, metric=metric, evidence={"trainer": got, "supervisor": want})
