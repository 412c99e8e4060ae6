"""Decide and act on each finding the judge stage hands on.

The detectors (monitors.detectors, in the judge stage's banks: supervisor.judge.banks) judge the
series; the policy (supervisor.decide.policy) decides from the finding and the run's state in the
DB; the executor writes the decision as action rows before anything is carried out (STYLE.md
rule 2). This module glues them: the incident bookkeeping and the policy's view of the run.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Sequence

from sqlalchemy.orm import sessionmaker

from thermowatch.monitors.commands import ActionOrigin, ActionState, CommandKind
from thermowatch.monitors.contract import CheckpointInfo, Finding, Outcome, Signal
from thermowatch.supervisor.act.executor import Executor
from thermowatch.supervisor.decide.policy import Intervention, PolicyConfig, PolicyInput, make_decision
from thermowatch.supervisor.judge.banks import Banks
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import checkpoints as ckpt_store
from thermowatch.supervisor.store import findings as findings_store
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store import lr_changes as lr_store
from thermowatch.supervisor.store import runs as runs_store

log = logging.getLogger(__name__)

# Signals that say nothing about the weights: a checkpoint saved during them is still healthy.
_NOT_DIVERGENCE = frozenset({Signal.STALL.value, Signal.OUTLIER_RANK.value})


class Responder:
    def __init__(self, session_factory: sessionmaker, executor: Executor, policy: PolicyConfig, banks: Banks,
                 clock: Callable[[], float] = time.time):
        self._session = session_factory
        self._executor = executor
        self._policy = policy
        self._banks = banks
        self._clock = clock
        # One decision at a time: the judge thread, the scheduler and an acked rollback's triage
        # (the executor) all decide, and each reads the actions the one before wrote.
        self._lock = executor.deciding

    def diverging_since(self, run_id: str) -> int | None:
        """The earliest onset among the run's open divergence incidents (None if there is none)."""
        with self._session() as s:
            onsets = [i.onset_step for i in incidents_store.open_incidents(s, run_id)
                      if i.signal not in _NOT_DIVERGENCE]
        return min(onsets) if onsets else None

    def check_stalls(self, now: float | None = None) -> list[Finding]:
        """The wall-clock detectors' findings (Banks.stalls), each decided; run by the scheduler."""
        found = self._banks.stalls(self._clock() if now is None else now)
        for run_id, finding in found:
            self.handle(run_id, finding)
        return [f for _, f in found]

    # --- decide and act ---------------------------------------------------------------------

    def handle(self, run_id: str, finding: Finding, attempt: int | None = None) -> int | None:
        """Record the finding in an incident, decide, and write the actions. Returns the incident id.

        A `watch` finding is only stored (drawn on the run's page): no incident, no decision.
        A finding already stored for this attempt (the same batch delivered twice, judged again
        by a supervisor that lost its detector state) is not decided again."""
        if finding.outcome is Outcome.WATCH:
            with self._lock, self._session.begin() as s:
                findings_store.add_finding(s, run_id, finding, None, attempt)
            return None
        with self._lock, self._session.begin() as s:
            key = findings_store.stored_key(finding, attempt)
            if key is not None:
                old = findings_store.find_key(s, run_id, key)
                if old is not None:
                    log.info("run %s: %s at step %d already stored (row %d); not decided again", run_id,
                             finding.signal.value, finding.detect_step, old.id)
                    return old.incident_id
            # Only the supervisor's own actions in flight hold a decision back; a person's pending
            # command (a profile, a pause) must not swallow a divergence found meanwhile.
            in_flight = [a for a in actions_store.open_actions(s, run_id)
                         if a.state in (ActionState.PENDING, ActionState.SENT) and a.origin is ActionOrigin.AUTO]
            if in_flight and in_flight[0].incident_id is not None:
                # One divergence trips several detectors (logits, then loss, then grad norm):
                # while its repair is on the way, later findings join that incident.
                findings_store.add_finding(s, run_id, finding, in_flight[0].incident_id, attempt)
                log.info("run %s: %s joins incident %s (action %s in flight)", run_id, finding.signal.value,
                         in_flight[0].incident_id, in_flight[0].id)
                return in_flight[0].incident_id
            incident_id = incidents_store.open_incident(
                s, run_id, finding.signal.value, finding.module, finding.onset_step, finding.detect_step,
                severity=finding.severity.value)
            findings_store.add_finding(s, run_id, finding, incident_id, attempt)
            self._distrust_checkpoints(s, run_id, finding)
            decision = make_decision(self._policy_input(s, run_id, finding, bool(in_flight), attempt), self._policy)
            if decision.distrust_step is not None:
                # Its weights went non-finite right after loading: never a rollback target again
                # (written with the decision, before the rollback away from it is carried out).
                n = ckpt_store.distrust_step(s, run_id, decision.distrust_step)
                log.warning("run %s: checkpoint %d went non-finite right after loading; %d row(s) marked unhealthy",
                            run_id, decision.distrust_step, n)
            log.info("run %s: %s on %r onset %d detect %d -> %s (%s)", run_id, finding.signal.value, finding.module,
                     finding.onset_step, finding.detect_step, decision.word, "; ".join(decision.reasons))
            self._executor.carry_out(s, run_id, incident_id, finding, decision)
            if not decision.acts:
                incidents_store.resolve_incident(s, incident_id, f"{decision.word}: {decision.reasons[0]}"
                                                 if decision.reasons else decision.word)
        if decision.recheck_step is not None and attempt is not None:
            # After the decision's lock: the judge thread holds the banks' lock and then this one.
            self._banks.recheck_at(run_id, attempt, decision.recheck_step)
        self._executor.flush_alerts()
        return incident_id

    def _distrust_checkpoints(self, s, run_id: str, finding: Finding) -> None:
        """A checkpoint saved after the onset was saved while unhealthy: never a rollback target.
        Only an `act` finding says the run is unhealthy: a healthy logit rise that alerts must not
        leave the run with no rollback target when a real divergence comes later."""
        if finding.outcome is Outcome.ACT and finding.signal.value not in _NOT_DIVERGENCE:
            ckpt_store.distrust_from(s, run_id, finding.onset_step)

    def _policy_input(self, s, run_id: str, finding: Finding, in_flight: bool, attempt: int | None) -> PolicyInput:
        cks = [CheckpointInfo(step=c.step, path=c.path, sample_cursor=c.sample_cursor, healthy=c.healthy,
                              manifest=c.manifest) for c in ckpt_store.checkpoints(s, run_id)]
        history = []
        rows = actions_store.actions(s, run_id)
        incs = {i.id: i for i in incidents_store.incidents(s, run_id)}
        attempts = findings_store.incident_attempts(s, run_id, [a.incident_id for a in rows if a.incident_id])
        recent: list = []  # the newest attempts, newest first: what a manual rollback left (below)
        if any(a.kind is CommandKind.ROLLBACK and not a.incident_id for a in rows):
            recent, _ = runs_store.attempts_page(s, run_id, limit=50)
        for a in rows:
            inc = incs.get(a.incident_id) if a.incident_id else None
            done = a.state in (ActionState.ACKED, ActionState.DONE)
            history.append(Intervention(
                kind=_intervention_kind(a.kind),
                signal=Signal(inc.signal) if inc else None,
                module=inc.module if inc else "",
                step=inc.detect_step if inc else (a.ack_step or 0),
                time=a.created_at.timestamp() if a.created_at else self._clock(),
                ok=a.state is not ActionState.FAILED,
                automatic=a.origin is ActionOrigin.AUTO,
                to_step=a.args.get("to_step") if a.kind is CommandKind.ROLLBACK else None,
                lowered_lr=a.args.get("lr_multiplier") is not None,
                # what it skipped: a precise skip's ack says (none, when replay triage cleared the data)
                skipped_samples=a.kind is CommandKind.ROLLBACK and bool(
                    a.result["skip_ranges"] if done and a.result and a.result.get("bisected") else a.args.get("skip_ranges")),
                # Cooldowns count from the first step trained after it (not from the detection
                # step, nor in seconds: issue 22); the attempt tells late findings apart.
                first_step=a.ack_step if done else None,
                attempt=attempts.get(a.incident_id) if a.incident_id else None,
                # a manual rollback has no finding: the attempt it left is the one running when it was asked
                left_attempt=(None if a.incident_id or a.kind is not CommandKind.ROLLBACK or a.created_at is None
                              else next((r.attempt for r in recent if r.started_at <= a.created_at), None)),
                seq=a.id,
                # what the trainer loaded (it falls back past a corrupt target): a NaN right after
                # the load indicts this one (policy._bad_load)
                checkpoint_step=a.checkpoint_step if done and a.kind is CommandKind.ROLLBACK else None,
                onset=inc.onset_step if inc else None,
            ))
        # The multiplier in force at the step the trainer trains next (absolute, newest change
        # wins: contract.multiplier_at), not the last row's: a temporary change may have ended.
        current = lr_store.multiplier_in_force(s, run_id, max(finding.detect_step, 0) + 1)
        return PolicyInput(
            finding=finding,
            now=self._clock(),
            checkpoints=cks,
            history=history,
            current_lr_multiplier=current,
            failed_action_pending=_failed_and_unattended(rows),
            action_in_flight=in_flight,
            paused=_paused(rows),
            attempt=attempt,
        )


def _paused(rows: Sequence[actions_store.ActionRow]) -> bool:
    """The newest pause, resume, rollback or stop the trainer carried out was a pause (rows: newest
    first; a rollback ends a pause: issue 35)."""
    done = next((a for a in rows if a.kind in actions_store.DIRECTING
                 and a.state in (ActionState.ACKED, ActionState.DONE)), None)
    return done is not None and done.kind is CommandKind.PAUSE


def _failed_and_unattended(rows: Sequence[actions_store.ActionRow]) -> bool:
    """The newest automatic action failed and no human has acted since: the run is not in the
    state the supervisor believes, so the policy pauses (rung 3). Any manual command after the
    failure (a resume, a rollback by hand) means a human has taken over and clears it."""
    newest_auto = next((a for a in rows if a.origin is ActionOrigin.AUTO), None)  # rows: newest first
    if newest_auto is None or newest_auto.state is not ActionState.FAILED:
        return False
    return not any(a.origin is ActionOrigin.MANUAL and a.id > newest_auto.id for a in rows)


def _intervention_kind(kind: CommandKind) -> CommandKind:
    """A past command as the policy's history counts it: a manual skip as a rollback (it changed
    which samples the run trains, as a data rollback does); the rest as they are (a resume, a stop
    or a profile is no intervention: policy.ACTIONS leaves them out)."""
    return CommandKind.ROLLBACK if kind is CommandKind.SKIP else kind
