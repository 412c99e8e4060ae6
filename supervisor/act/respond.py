"""Detect -> decide -> act, as each ingested batch lands.

The detectors (monitors.detectors) judge the series; the policy (supervisor.decide.policy) decides
from the finding and the run's state in the DB; the executor writes the decision as action rows
before anything is carried out (STYLE.md rule 2). This module only glues them: it owns the
per-run detector banks and the incident bookkeeping.

Detector state survives a supervisor restart: each bank's state is saved in the DB whenever a
batch raised a finding (latches must survive), else at most every `state_save_every_s`, and on
close. A save writes only what changed since the last one (the counters, and the ring-buffer
chunks written since: store/detector_state.py); a bank that started fresh replaces every part.
After a rollback to step s the bank forgets what it saw after s but keeps the healthy baseline
before it (steps after s are re-trained in a new attempt and must not be judged
against their own diverged past, nor wait through a fresh warm-up).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from typing import Callable, Sequence

from sqlalchemy.orm import sessionmaker

from thermowatch.monitors.columns import StepColumns
from thermowatch.monitors.commands import ActionOrigin, ActionState, CommandKind
from thermowatch.monitors.contract import CheckpointInfo, Finding, Outcome, Signal
from thermowatch.monitors.detectors import BankConfig, DetectorBank
from thermowatch.supervisor.judge.bank_process import BankProcess, RemoteBank
from thermowatch.supervisor.act.executor import Executor
from thermowatch.monitors.contract import Ack, ContractError
from thermowatch.supervisor.decide.policy import (Intervention, PolicyConfig, PolicyInput, after_triage,
                                                  make_decision)
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import checkpoints as ckpt_store
from thermowatch.supervisor.store import detector_state
from thermowatch.supervisor.store import findings as findings_store
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store import lr_changes as lr_store
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import steps as steps_store

log = logging.getLogger(__name__)

# Signals that say nothing about the weights: a checkpoint saved during them is still healthy.
_NOT_DIVERGENCE = frozenset({Signal.STALL.value, Signal.OUTLIER_RANK.value})


# The responder's own part of a run's saved detector state (beside the bank's parts).
_RESPONDER_PART = "responder"


class Responder:
    def __init__(self, session_factory: sessionmaker, executor: Executor, policy: PolicyConfig,
                 detectors: BankConfig, clock: Callable[[], float] = time.time, state_save_every_s: float = 5.0,
                 process: BankProcess | None = None):
        self._session = session_factory
        self._executor = executor
        self._policy = policy
        self._detector_cfg = detectors
        self._clock = clock
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
        self._lock = threading.RLock()  # ingest (HTTP threads) and the scheduler both reach here

    # --- detectors --------------------------------------------------------------------------

    def _new_bank(self, run_id: str) -> DetectorBank | RemoteBank:
        return self._process.bank(run_id) if self._process is not None else DetectorBank(self._detector_cfg)

    def bank(self, run_id: str) -> DetectorBank | RemoteBank:
        with self._lock:
            bank = self._banks.get(run_id)
            if bank is None or bank.lost:
                # Not loaded yet, or its process died: from the state saved in the DB (what came
                # after the last save is judged again from the judge's marker, as after a SIGKILL).
                bank = self._new_bank(run_id)
                with self._session() as s:
                    saved = detector_state.load_parts(s, run_id)
                self._load_recheck(run_id, saved.pop(_RESPONDER_PART, None))
                if not saved:
                    self._state_whole.add(run_id)
                else:
                    try:
                        bank.load_state_parts(saved)
                    except (ValueError, KeyError) as exc:  # an older state format: start fresh, say so
                        log.warning("run %s: detector state not restored (%s); starting fresh", run_id, exc)
                        bank = self._new_bank(run_id)
                        self._state_whole.add(run_id)  # its first save replaces the unreadable parts
                self._banks[run_id] = bank
            return bank

    def note_attempt(self, run_id: str, attempt: int) -> None:
        with self._lock:
            self._attempts[run_id] = max(attempt, self._attempts.get(run_id, attempt))

    def on_records(self, run_id: str, attempt: int, records: StepColumns) -> list[Finding]:
        """Called by the judge after a batch is committed, with its columns (the one ingest path's
        form: a JSON batch was converted at the edge)."""
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
                    self.handle(run_id, finding, attempt)
                if found or time.monotonic() - self._state_saved.get(run_id, -math.inf) >= self._state_every:
                    self._save_state(run_id)
            except Exception:
                # The database refused the findings or the state: this bank has judged a batch
                # the database does not know was judged. Forget it, so that the judge's retry
                # from its marker judges the batch again from the saved state.
                self._banks.pop(run_id, None)
                raise
            return found

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
        """After a rollback took effect, `first_step` its first re-trained step: the detectors
        forget every point at or after it, and what its replay triage found is acted on
        (after_triage)."""
        with self._lock:
            self.bank(run_id).reset(first_step)
            self._save_state(run_id)
        self._after_triage(run_id)

    def _after_triage(self, run_id: str) -> None:
        """The newest done rollback's ack names a cause (issue 39): the policy says what follows
        (policy.after_triage: the LR cut when it is the optimizer), the executor writes it, in the
        rollback's incident. Once per rollback: a set_lr, pause or rollback written after it ends it. A
        manual rollback has no finding to decide on; its reply shows the cause to its author."""
        with self._lock, self._session.begin() as s:
            rows = actions_store.actions(s, run_id, limit=50)  # newest first
            done = next((a for a in rows if a.kind is CommandKind.ROLLBACK and a.state is ActionState.DONE), None)
            if done is None or done.incident_id is None or not done.result:
                return
            try:
                ack = Ack.from_json(done.result)
            except ContractError:
                return
            b = ack.bisected
            if b is None or b.cause is None:
                return
            if any(a.id > done.id and a.kind in (CommandKind.SET_LR, CommandKind.PAUSE, CommandKind.ROLLBACK)
                   for a in rows):
                return
            found = findings_store.findings(s, run_id, done.incident_id)
            if not found:
                return
            current = lr_store.multiplier_in_force(s, run_id, max(done.ack_step or 0, 1))
            decision = after_triage(found[0].finding, b.cause.label, current, self._policy,
                                    findings_store.incident_attempts(s, run_id, [done.incident_id]).get(done.incident_id),
                                    rank=b.cause.rank, checkpoint=None if ack.checkpoint_step is None
                                    else (ack.checkpoint_step, ack.checkpoint_path))
            if decision is None:
                return
            log.info("run %s: rollback %d's replay triage says %s -> %s (%s)", run_id, done.id, b.cause.label,
                     decision.word, "; ".join(decision.reasons))
            self._executor.carry_out(s, run_id, done.incident_id, found[0].finding, decision)
        self._executor.flush_alerts()

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
        mine = {_RESPONDER_PART: json.dumps({"recheck": list(due) if due else None}).encode()}
        with self._session.begin() as s:
            if whole:
                detector_state.replace_parts(s, run_id, {**bank.state_parts(), **mine})
            else:
                detector_state.save_parts(s, run_id, {**bank.state_parts(dirty_only=True), **mine})
        # After the commit: a failed save leaves the chunks dirty for the next one.
        bank.mark_saved()
        self._state_whole.discard(run_id)
        self._state_saved[run_id] = time.monotonic()

    def diverging_since(self, run_id: str) -> int | None:
        """The earliest onset among the run's open divergence incidents (None if there is none)."""
        with self._session() as s:
            onsets = [i.onset_step for i in incidents_store.open_incidents(s, run_id)
                      if i.signal not in _NOT_DIVERGENCE]
        return min(onsets) if onsets else None

    def check_stalls(self, now: float | None = None) -> list[Finding]:
        """Wall-clock detectors (no step for too long); run by the scheduler. A run whose newest
        attempt said it finished (completed, stopped, closed) sends no more steps on purpose: it
        is never checked (issue 35: every finished run got a CRITICAL stall page at 10 and 30 min)."""
        now = self._clock() if now is None else now
        out = []
        with self._lock:
            runs = list(self._banks)
            with self._session() as s:
                done = runs_store.ended_runs(s, runs)
            for run_id in runs:
                if run_id in done:
                    continue
                for finding in self.bank(run_id).check(now):
                    out.append(finding)
                    self.handle(run_id, finding)
        return out

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
            if decision.recheck_step is not None and attempt is not None:
                self._recheck[run_id] = (attempt, decision.recheck_step)
            log.info("run %s: %s on %r onset %d detect %d -> %s (%s)", run_id, finding.signal.value, finding.module,
                     finding.onset_step, finding.detect_step, decision.word, "; ".join(decision.reasons))
            self._executor.carry_out(s, run_id, incident_id, finding, decision)
            if not decision.acts:
                incidents_store.resolve_incident(s, incident_id, f"{decision.word}: {decision.reasons[0]}"
                                                 if decision.reasons else decision.word)
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
                target_step=a.args.get("to_step") if a.kind is CommandKind.ROLLBACK else None,
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
                loaded_step=a.checkpoint_step if done and a.kind is CommandKind.ROLLBACK else None,
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
