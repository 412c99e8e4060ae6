"""What follows a rollback whose replay triage named a cause (issue 39).

The newest done rollback's ack says what the triage found; the policy says what follows
(policy.after_triage: the LR cut when it is the optimizer), and the executor writes it in the
rollback's incident, right after booking the ack. Once per rollback: a set_lr, pause or rollback
written after it ends it. A manual rollback has no finding to decide on; its reply shows the cause
to its author.
"""

from __future__ import annotations

import logging

from sqlalchemy.orm import Session

from thermowatch.monitors.commands import ActionState, CommandKind
from thermowatch.monitors.contract import Ack, ContractError, Finding
from thermowatch.supervisor.decide.policy import Decision, PolicyConfig, after_triage
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import findings as findings_store
from thermowatch.supervisor.store import lr_changes as lr_store

log = logging.getLogger(__name__)

_ENDS_IT = (CommandKind.SET_LR, CommandKind.PAUSE, CommandKind.ROLLBACK)


def decision_after_rollback(s: Session, run_id: str, policy: PolicyConfig) -> tuple[int, Finding, Decision] | None:
    """(incident, its first finding, the decision) after the run's newest done rollback, or None
    when its ack names no cause, it was manual, or something was decided since."""
    rows = actions_store.actions(s, run_id, limit=50)  # newest first
    done = next((a for a in rows if a.kind is CommandKind.ROLLBACK and a.state is ActionState.DONE), None)
    if done is None or done.incident_id is None or not done.result:
        return None
    try:
        ack = Ack.from_json(done.result)
    except ContractError:
        return None
    b = ack.bisected
    if b is None or b.cause is None:
        return None
    if any(a.id > done.id and a.kind in _ENDS_IT for a in rows):
        return None
    found = findings_store.findings(s, run_id, done.incident_id)
    if not found:
        return None
    current = lr_store.multiplier_in_force(s, run_id, max(done.ack_step or 0, 1))
    decision = after_triage(found[0].finding, b.cause.label, current, policy,
                            findings_store.incident_attempts(s, run_id, [done.incident_id]).get(done.incident_id),
                            rank=b.cause.rank, checkpoint=None if ack.checkpoint_step is None
                            else (ack.checkpoint_step, ack.checkpoint_path))
    if decision is None:
        return None
    log.info("run %s: rollback %d's replay triage says %s -> %s (%s)", run_id, done.id, b.cause.label,
             decision.word, "; ".join(decision.reasons))
    return done.incident_id, found[0].finding, decision
