"""Carries decisions out: action rows first, then commands, alerts and the audit trail.

Order matters (STYLE.md rule 2, Ray Train's "bookkeeping before side effects"): a decision is
written as a `pending` action row inside the caller's transaction; the run controller picks it
up on its next poll (`deliver`: pending -> sent), and acknowledges it with the step at which it
took effect (`acknowledge`: sent -> acked -> done, or failed). A supervisor that dies anywhere
in between finds the row in its state on restart: pending rows are delivered again, sent rows
are re-sent after the ack timeout (the controller ignores a command id it already applied and
acknowledges it again), so no action is lost or applied twice.

Every row holds a typed command (monitors.contract): the policy's decision, a manual request
and a delivered command are all built by the same constructors, so they cannot disagree on
what is valid. The acknowledgement is stored with the row (`result`) and its effects (skip
ranges, the LR change with its place in the trainer's list) are booked from what the trainer
says it did. An ack the supervisor cannot accept fails its action, loudly, and is answered with
the reason (a 4xx), so the trainer moves on to the next one.

Manual commands (CLI, HTTP API, web) call `submit`, which writes the same rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import logging
import threading
from typing import Any, Callable, Iterator

from sqlalchemy.exc import DataError, IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from thermowatch.monitors.commands import ActionOrigin, ActionState
from thermowatch.monitors.contract import (
    Ack,
    Command,
    CommandBody,
    CommandKind,
    ContractError,
    Finding,
    Pause,
    Rollback,
    RunFinished,
    SampleRange,
    SetLR,
    Severity,
    Signal,
    describe,
    Skip,
    parse_command,
)
from thermowatch.monitors.settings import SettingError, check_number
from thermowatch.supervisor.decide import feasibility
from thermowatch.supervisor.errors import Conflict, NotFound, UserError
from thermowatch.supervisor.notify import flap as flaps
from thermowatch.supervisor.notify.base import Alert, ChartRequest, Notifier, StoryState
from thermowatch.supervisor.notify.flap import FlapConfig
from thermowatch.supervisor.notify.outbox import Outbox
from thermowatch.supervisor.act.outcome import details, outcome, summary
from thermowatch.supervisor.act.triage import decision_after_rollback
from thermowatch.supervisor.decide.policy import Decision, PolicyConfig
from thermowatch.supervisor.judge.banks import Banks
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import checkpoints as ckpt_store
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store import lr_changes as lr_store
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import skips as skips_store
from thermowatch.supervisor.store import steps as steps_store
from thermowatch.supervisor.store import silences as silences_store
from thermowatch.supervisor.store import story as story_store
from thermowatch.supervisor.store import thermometers as thermo_store

log = logging.getLogger(__name__)

MANUAL_KINDS = {k.value for k in CommandKind}
REDELIVER_S = 5.0  # a sent, unacknowledged command goes out again this long after (Executor.deliver)


def ended(s: Session, run_id: str) -> RunFinished | None:
    """How the run ended, when its newest attempt has finished (contract.RunFinished); None while
    it may still train. A relaunch opens a new attempt and the run takes commands again."""
    latest = runs_store.latest_attempt(s, run_id)
    return latest.finished if latest is not None else None


def ended_words(run_id: str, fin: RunFinished) -> str:
    return (f"run {run_id!r} has finished ({fin.reason.value} at step {fin.step}, {story_store.loss_words(fin.final_loss)}); "
            "no trainer will carry a command out. Relaunching it with the same run id opens a new attempt, "
            "which takes commands again")


MAX_SILENCE_S = 7 * 86400.0  # a week: a silence is for a known, bounded situation, not a mute button
APPROVAL_PAUSE = "approval_pause"  # audit event: a run paused while a proposal waited for approval
PAGE_ACKNOWLEDGED = "page_acknowledged"  # audit event: a person took a page (acknowledge_page)


class Executor:
    def __init__(self, session_factory: sessionmaker, notifier: Notifier, *, advise_only: bool = False,
                 ack_timeout_s: float = 120.0, ack_retries: int = 2, command_expiry_s: float = 900.0,
                 banks: Banks | None = None, policy: PolicyConfig | None = None, flap: FlapConfig | None = None,
                 redeliver_s: float = REDELIVER_S,
                 approval_pause_after_steps: int | None = None, runbook_url: str = "",
                 fence: Callable[[Session], None] | None = None, may_send: Callable[[], bool] | None = None,
                 start_outbox: bool = True):
        self._session = session_factory
        # Several replicas on one database (supervisor.app.lease, issue 40): every write here is
        # the leader's, checked in its own transaction; a standby's or a deposed leader's raises
        # NotLeader (503) and changes nothing. None: the one daemon (or the embedded mode).
        self._fence = fence or (lambda s: None)
        self._runbook_url = runbook_url
        self._approval_pause_after = approval_pause_after_steps
        self._flap = flap or FlapConfig()
        self._notifier = notifier
        self._advise_only = advise_only
        self._ack_timeout = dt.timedelta(seconds=ack_timeout_s)
        self._ack_retries = ack_retries
        # A `sent` command not acknowledged yet is in every poll answer again once this long has
        # passed since it last went out: the answer that carried it may never have reached the
        # trainer (the ack watchdog's re-send waited ack_timeout_s, 121-145 s, issue 34). The
        # trainer hands a command out once however often it arrives (thermowatch.run.Run.commands;
        # the bundled controller answers it from its book), and ack_timeout_s still bounds how
        # long a command may go unanswered: a re-send changes neither its state nor its attempts.
        self._redeliver = dt.timedelta(seconds=redeliver_s)
        self._resent: dict[str, dict[int, dt.datetime]] = {}  # run -> sent action id -> when it last went out
        # A run that has not polled for this long takes no command: its open actions expire. The
        # last poll is kept in memory; a restarted daemon counts from its own start.
        self._expiry = dt.timedelta(seconds=command_expiry_s)
        self._started = dt.datetime.now(dt.timezone.utc)
        self._last_poll: dict[str, dt.datetime] = {}
        # The judge stage's detector banks: a done rollback rewinds them, a declined proposal
        # releases their latches later (None: no detectors, as in a bare executor's tests).
        self._banks = banks
        # What follows a rollback's replay triage is the policy's (act.triage; None: nothing).
        self._policy = policy
        # One decision at a time, here and in act.respond (which shares this lock).
        self.deciding = threading.RLock()
        # Alerts are rows written in the deciding transaction and sent by a background thread, so
        # no ingest or command request waits for Slack (DESIGN.md, "Nothing blocks training").
        self.outbox = Outbox(session_factory, notifier, may_send=may_send)
        if start_outbox:  # a standby's outbox starts when it leads (Supervisor.lead)
            self.outbox.start()

    @contextlib.contextmanager
    def _begin(self) -> Iterator[Session]:
        """A transaction of the leader's: fenced first (see __init__)."""
        with self._session.begin() as s:
            self._fence(s)
            yield s

    # --- decisions -> rows ---------------------------------------------------------------------

    def carry_out(self, s: Session, run_id: str, incident_id: int, finding: Finding, decision: Decision) -> list[int]:
        """Write what `decision` asks for as action rows (in the caller's transaction)."""
        self._fence(s)
        reasons = list(decision.reasons)
        needs_ok = decision.requires_approval or self._advise_only
        ids: list[int] = []
        body = None
        fin = ended(s, run_id) if decision.acts or decision.alert else None
        try:
            body = None if fin is not None else self._with_skip(s, run_id, decision)
        except ContractError as exc:  # never write a command the trainer could not carry out
            log.error("run %s: the policy's %s is not a valid command (%s); pausing", run_id, decision.word, exc)
            reasons.append(f"the decision is not a valid command ({exc}); pausing for a human instead")
            body = Pause.saying("; ".join(reasons))
        if fin is not None:  # the judge caught up after the run's last step: nothing to act on
            reasons.append(f"the run had finished ({fin.reason.value} at step {fin.step}): no action written")
        if body is not None:
            ids.append(self._enqueue(s, run_id, body, "; ".join(reasons), ActionOrigin.AUTO, "policy", incident_id, needs_ok))
        audit_store.audit(s, run_id, "policy", "decision", {
            "incident_id": incident_id, "finding": finding.to_json(), "decision": decision.word,
            "rung": decision.rung, "reasons": reasons, "actions": ids,
            "requires_approval": needs_ok})
        if decision.acts or decision.alert:
            alert = Alert.from_decision(run_id, finding, decision, incident_id, runbook_url=self._runbook_url)
            if needs_ok and ids:  # what the reader types: the id and the exact commands
                # (an alert-only decision writes no action: nothing awaits approval, so no prefix)
                title = alert.title if decision.requires_approval else f"approval needed: {alert.title}"
                alert = dataclasses.replace(
                    alert, title=f"{title} [action {ids[0]}]", severity=Severity.CRITICAL, broadcast=True,
                    fields={"action": ids[0], **story_store.cost(s, run_id, body), **alert.fields},
                    commands=(f"thermowatch approve {ids[0]}", f"thermowatch cancel {ids[0]}"),
                    status=f"awaiting approval (action {ids[0]})", approve_action=ids[0])
            # Only alert-only repeats fold: a decision that wrote an action (a pause, a rollback,
            # an approval to give) is a story of its own, never a counted reply in another
            # incident's thread (issue 23: an approval hidden as "repeat 2 in 1 min").
            fold = None if isinstance(decision.command, Pause) or ids else flaps.decide_fold(
                s, self._flap, run_id, finding.signal.value, finding.module, incident_id)
            if fold is not None:  # a repeat of a flapping signal: a counted reply, no page, no chart
                alert = dataclasses.replace(
                    alert, title=f"{alert.title} (repeat {fold.count} in {fold.minutes} min)",
                    thread=f"incident:{fold.into}", broadcast=False, fold_count=fold.count, status=fold.status)
            self._queue_alert(s, alert)
            if fold is None and finding.metric:
                self._queue_alert(s, Alert(
                    run_id=run_id, severity=Severity.INFO, incident_id=incident_id,
                    title=f"{run_id}: {finding.metric} around the onset (incident {incident_id})",
                    chart=ChartRequest.around(finding)))
        return ids

    def _with_skip(self, s: Session, run_id: str, decision: Decision) -> CommandBody | None:
        """The decision's command as it is, a rollback's `skip_steps` turned into sample ids from
        the run's stored steps (the one thing the pure policy cannot know)."""
        cmd = decision.command
        if not isinstance(cmd, Rollback) or decision.skip_steps is None:
            return cmd
        lo_step, hi_step = decision.skip_steps
        rng = steps_store.sample_range(s, run_id, lo_step, hi_step)
        if rng is None or rng[0] >= rng[1]:
            return cmd
        lo, hi = int(rng[0]), int(rng[1])
        if decision.skip_ahead_steps:  # at the steps' own width: samples no step has trained yet
            hi += decision.skip_ahead_steps * ((hi - lo) // (hi_step - lo_step + 1))
        return dataclasses.replace(cmd, skip=(SampleRange(lo, hi),))

    def submit(self, run_id: str, kind: str, args: dict[str, Any], who: str, reason: str) -> int:
        """A manual command (CLI, API, web): same rows, same executor, never needs approval.
        Refused (UserError, nothing stored) when the contract or the run's state rules it out."""
        if kind not in MANUAL_KINDS:
            raise UserError(f"unknown command {kind!r}; expected one of {sorted(MANUAL_KINDS)}")
        if not who:
            raise UserError("a manual command needs a `who` (your name), for the audit trail")
        with self._begin() as s:
            if runs_store.get_run(s, run_id) is None:
                raise NotFound(f"no run {run_id!r}; `thermowatch runs` lists the known runs")
            fin = ended(s, run_id)
            if fin is not None:
                raise Conflict(ended_words(run_id, fin))
            args = feasibility.resolve_relative(s, run_id, args or {})
            # what the paused loop prints; a reason that is no text ({}, 0) is the contract's to refuse
            if kind == CommandKind.PAUSE.value and isinstance(args, dict) and args.get("reason") in (None, ""):
                args = {**args, "reason": Pause.saying(f"paused by {who}" + (f": {reason}" if reason else "")).reason}
            try:
                body = parse_command(kind, args)
            except ContractError as exc:
                raise UserError(str(exc)) from None
            feasibility.check(s, run_id, body)
            action_id = self._enqueue(s, run_id, body, reason or "manual", ActionOrigin.MANUAL, who, None, False)
            if body.kind in (CommandKind.ROLLBACK, CommandKind.SET_LR):
                self._supersede(s, run_id, action_id, who, body)
            self._queue_alert(s, Alert(run_id=run_id, severity=Severity.INFO,
                                       title=f"{run_id}: {who} asked to {describe(body)}",
                                       text=reason, thread=_thread(action_id, None)))
        self.flush_alerts()
        return action_id

    def _supersede(self, s: Session, run_id: str, action_id: int, who: str, body: CommandBody) -> None:
        """A person's rollback or LR change answers the run's open incidents (issue 23: in
        advise-only mode an incident stayed open after the engineer fixed the run by hand, every
        later checkpoint counted as unhealthy, and the next proposal went back 547 steps). Each
        open incident whose only open actions are proposals awaiting approval is resolved as
        superseded, and those proposals are cancelled, saying by what. An incident with an
        automatic action already on its way is left to that action."""
        by = f"{who}'s {body.kind.value.replace('_', ' ')} (action {action_id}: {describe(body)})"
        open_now = actions_store.open_actions(s, run_id)
        for inc in incidents_store.open_incidents(s, run_id):
            mine = [a for a in open_now if a.incident_id == inc.id]
            if any(not (a.state is ActionState.PENDING and a.requires_approval) for a in mine):
                continue
            for a in mine:
                actions_store.set_action_state(s, a.id, ActionState.CANCELLED, error=f"superseded by {by}")
            incidents_store.resolve_incident(s, inc.id, f"superseded by {by}")
            audit_store.audit(s, run_id, who, "superseded", {"incident_id": inc.id, "by_action": action_id,
                                                            "cancelled": [a.id for a in mine]})
            self._queue_alert(s, Alert(run_id=run_id, severity=Severity.INFO, incident_id=inc.id,
                                       title=f"{run_id}: superseded by {by}",
                                       status=f"superseded by {who}'s action {action_id}",
                                       story_state=StoryState.RESOLVED))

    def approve(self, action_id: int, who: str) -> None:
        """Advise-only mode: a human lets a pending action go to the trainer. Refused (409) once
        the run has finished: the proposal then expires instead (expire)."""
        def change(s: Session) -> str | None:
            row = actions_store.get_action(s, action_id)
            fin = ended(s, row.run_id) if row is not None else None
            if fin is not None:
                raise actions_store.ActionStateError(f"action {action_id} cannot be approved: "
                                                     + ended_words(row.run_id, fin))
            said = self._rederive(s, row) if row is not None and row.kind is CommandKind.ROLLBACK else None
            actions_store.approve_action(s, action_id, who)
            return said

        self._human_decides(action_id, who, "approved", change, StoryState.ANSWERED)  # the page stops escalating

    @staticmethod
    def _rederive(s: Session, row: actions_store.ActionRow) -> str | None:
        """A rollback proposal, re-read against the run as it is when a person says yes (issue
        23): the checkpoint it will load now (retention may have deleted, or a later finding
        distrusted, the one proposed) and what that discards. Refused when no healthy checkpoint
        at or before its step is left: approving it could only fail at the trainer."""
        try:
            body = row.body
        except ContractError:
            return None  # delivered as it is and failed there, with the reason (deliver)
        target = ckpt_store.newest_healthy_before(s, row.run_id, body.to_step + 1)
        if target is None or (body.exact and target.step != body.to_step):
            raise actions_store.ActionStateError(
                f"action {row.id} cannot be approved: no healthy checkpoint at or before step {body.to_step} is left "
                "(deleted by retention or distrusted since it was proposed); cancel it "
                f"(`thermowatch cancel {row.id}`) and roll back by hand to a step that has one")
        cost = story_store.cost(s, row.run_id, dataclasses.replace(body, to_step=target.step, exact=True))
        return "; ".join([f"loads checkpoint {target.step}", *(f"{k}: {v}" for k, v in cost.items())])

    def cancel(self, action_id: int, who: str, *, only_awaiting_approval: bool = False) -> None:
        """`only_awaiting_approval`: refuse (Conflict) unless the action still waits for a human,
        for a Slack button clicked on a question someone else already answered."""
        def change(s: Session) -> None:
            row = actions_store.get_action(s, action_id)
            if only_awaiting_approval and row is not None and not (row.state is ActionState.PENDING and row.requires_approval):
                raise actions_store.ActionStateError(
                    f"action {action_id} no longer awaits approval (it is {row.state}"
                    f"{', approved by ' + row.who if row.state == 'pending' else ''}); "
                    f"`thermowatch cancel {action_id}` cancels it anyway")
            actions_store.set_action_state(s, action_id, ActionState.CANCELLED)
            if row is not None and row.origin is ActionOrigin.AUTO:
                cancelled.append(row.run_id)
                if row.incident_id is not None:  # declined: an open incident would keep later checkpoints unhealthy
                    incidents_store.resolve_incident(s, row.incident_id, f"declined by {who} (action {action_id} "
                                                     "cancelled); the detectors fire again if it goes on")

        cancelled: list[str] = []
        self._human_decides(action_id, who, "cancelled", change, StoryState.RESOLVED)  # the question is over
        for run_id in cancelled:
            # A person said no to the policy's proposal: the detectors must still speak up if the
            # divergence goes on (issue 23: logits of 600-2,648 for 500 steps paged nobody).
            if self._banks is not None and self._policy is not None:
                self._banks.recheck_after(run_id, self._policy.cooldown_steps)

    def refuse(self, action_id: int, who: str, wanted: str, why: str) -> None:
        """A human's answer that is not theirs to give (a Slack user who is not an approver,
        supervisor.decide.approvers): the action is left as it is; the audit trail and the action's
        thread say who tried what and why it was refused. An unknown action id is audited too."""
        with self._begin() as s:
            row = actions_store.get_action(s, action_id)
            audit_store.audit(s, row.run_id if row else None, who, "refused",
                              {"action_id": action_id, "wanted": wanted, "why": why})
            if row is not None:
                self._queue_alert(s, Alert(run_id=row.run_id, severity=Severity.INFO,
                                           title=f"{row.run_id}: {who} may not {wanted} {row.kind} "
                                                 f"(action {action_id}); nothing changed",
                                           text=why, incident_id=row.incident_id,
                                           thread=_thread(action_id, row.incident_id)))
        self.flush_alerts()

    def _human_decides(self, action_id: int, who: str, event: str, change: Callable[[Session], str | None],
                       story_state: StoryState) -> None:
        with self._begin() as s:
            row = actions_store.get_action(s, action_id)
            if row is None:
                raise NotFound(f"no action {action_id}")
            try:
                said = change(s)
            except actions_store.ActionStateError as exc:
                raise Conflict(str(exc)) from exc
            audit_store.audit(s, row.run_id, who, event, {"action_id": action_id, **({"said": said} if said else {})})
            self._queue_alert(s, Alert(run_id=row.run_id, severity=Severity.INFO,
                                       title=f"{row.run_id}: {who} {event} {row.kind} (action {action_id})",
                                       text=said or "", incident_id=row.incident_id,
                                       thread=_thread(action_id, row.incident_id),
                                       status=f"{row.kind} (action {action_id}) {event} by {who}",
                                       story_state=story_state))
        self.flush_alerts()

    def _enqueue(self, s: Session, run_id: str, body: CommandBody, reason: str, origin: str,
                 who: str, incident_id: int | None, needs_ok: bool) -> int:
        args = body.to_args()
        action_id = actions_store.enqueue_action(s, run_id, body.kind.value, args, reason, origin, who,
                                                 incident_id=incident_id, requires_approval=needs_ok)
        audit_store.audit(s, run_id, who, "enqueued", {"action_id": action_id, "kind": body.kind.value, "args": args})
        return action_id

    # --- the command channel ------------------------------------------------------------------

    def deliver(self, run_id: str) -> list[Command]:
        """Pending (approved) actions for the run controller; they become `sent`. With them, in
        order, every `sent` one not acknowledged `redeliver_s` after it last went out (its answer
        may have been lost). A stored row that is no valid command (written by an older version)
        fails instead of blocking the queue."""
        bad: list[tuple[actions_store.ActionRow, str]] = []
        now = dt.datetime.now(dt.timezone.utc)
        self._last_poll[run_id] = now
        resent = self._resent.get(run_id, {})
        still: dict[int, dt.datetime] = {}
        with self._begin() as s:
            if runs_store.get_run(s, run_id) is None:
                raise NotFound(f"no run {run_id!r}: open it first (POST /api/runs) or check the run id")
            out = []
            opened = actions_store.open_actions(s, run_id)
            if self._pause_for_approval(s, run_id, opened):
                opened = actions_store.open_actions(s, run_id)  # with the pause it wrote
            for a in opened:
                if a.state is ActionState.SENT:
                    last = max(a.updated_at, resent.get(a.id, a.updated_at))
                    if now - last >= self._redeliver:
                        try:
                            out.append(a.command)
                        except ContractError:  # cannot be: it was a valid command when it went out
                            continue
                        log.log(logging.DEBUG if a.id in resent else logging.INFO,  # once a command, not every 5 s
                                "run %s: action %s sent %.0f s ago and not acknowledged; sent again", run_id,
                                a.id, (now - a.updated_at).total_seconds())
                        last = now
                    still[a.id] = last
                    continue
                if a.state is not ActionState.PENDING or a.requires_approval:
                    continue
                try:
                    cmd = a.command
                except ContractError as exc:
                    bad.append((a, str(exc)))
                    continue
                actions_store.set_action_state(s, a.id, ActionState.SENT)
                out.append(cmd)
        self._resent[run_id] = still
        for a, why in bad:
            self.fail(run_id, a.id, f"not a valid command: {why}")
        return out

    def _pause_for_approval(self, s: Session, run_id: str, opened: list[actions_store.ActionRow]) -> bool:
        """While the policy's proposal waits for approval, pause the run once it has trained
        `approval_pause_after_steps` past the finding (PolicyConfig), once per proposal: the
        run does not train on into the divergence while nobody answers (issue 37). `opened`: the
        run's open actions. True when it wrote a pause."""
        if self._approval_pause_after is None:
            return False
        waiting = [a for a in opened
                   if a.state is ActionState.PENDING and a.requires_approval and a.origin is ActionOrigin.AUTO and a.incident_id]
        if not waiting or any(a.kind is CommandKind.PAUSE and a.state in (ActionState.PENDING, ActionState.SENT)
                              and not a.requires_approval
                              for a in opened):
            return False
        last = thermo_store.latest_step(s, run_id)
        done = {e.detail.get("for_action") for e in audit_store.events(s, run_id, APPROVAL_PAUSE)}
        for a in waiting:
            inc = incidents_store.get_incident(s, a.incident_id)
            if a.id in done or inc is None or last is None or last - inc.detect_step < self._approval_pause_after:
                continue
            why = (f"action {a.id} ({a.kind}) has waited for approval for {last - inc.detect_step} steps past the "
                   f"finding at step {inc.detect_step} (approval_pause_after_steps={self._approval_pause_after}): "
                   f"paused rather than training on into the divergence; `thermowatch approve {a.id}` rolls back "
                   "and ends the pause, `thermowatch resume` trains on")
            # the proposal's incident: its outcome and a re-page reply in the page's thread, not a new one
            pid = self._enqueue(s, run_id, Pause.saying(why), why, ActionOrigin.AUTO, "policy", a.incident_id, False)
            audit_store.audit(s, run_id, "policy", APPROVAL_PAUSE, {"for_action": a.id, "pause_action": pid,
                                                                   "step": last})
            self._queue_alert(s, Alert(run_id=run_id, severity=Severity.CRITICAL, incident_id=a.incident_id,
                                       title=f"{run_id}: paused while action {a.id} waits for approval [action {pid}]",
                                       text=why, broadcast=True, commands=(f"thermowatch approve {a.id}",
                                                                           f"thermowatch resume {run_id}")))
            return True
        return False

    def acknowledge(self, run_id: str, ack: Ack, actor: str = "trainer") -> None:
        """The run controller says what the command did (or that it failed). An ack that cannot
        be booked fails the action with an alert and raises UserError (a 4xx) with the reason."""
        first_step = None  # a rollback's first re-trained step: the detectors rewind to it
        try:
            with self._begin() as s:
                row = actions_store.get_action(s, ack.command_id)
                if row is None or row.run_id != run_id:
                    raise NotFound(f"run {run_id!r} has no action {ack.command_id}")
                if row.state.is_final:
                    log.info("action %s already %s; duplicate ack ignored", row.id, row.state)
                    return
                if row.requires_approval:
                    raise Conflict(f"action {row.id} awaits a human's approval and was never sent; "
                                   f"an acknowledgement for it cannot be right")
                result = ack.to_json()
                if not ack.ok:
                    actions_store.set_action_state(s, row.id, ActionState.FAILED, error=ack.detail or "the trainer refused it",
                                                   result=result)
                    audit_store.audit(s, run_id, actor, "failed", {"action_id": row.id, "detail": ack.detail})
                    self._queue_alert(s, Alert(run_id=run_id, severity=Severity.CRITICAL,
                                            title=f"{run_id}: {row.kind} (action {row.id}) FAILED",
                                            text=ack.detail or "the run controller refused the command",
                                            incident_id=row.incident_id, thread=_thread(row.id, row.incident_id),
                                            broadcast=True, status=f"{row.kind} (action {row.id}) FAILED"))
                else:
                    if row.state is ActionState.PENDING:  # acked before we saw our own `sent` commit (in-process race)
                        actions_store.set_action_state(s, row.id, ActionState.SENT)
                    actions_store.set_action_state(s, row.id, ActionState.ACKED, ack_step=ack.first_step, result=result)
                    first_step, resolved = self._book(s, run_id, row, ack)
                    actions_store.set_action_state(s, row.id, ActionState.DONE)
                    self._queue_alert(s, _done_alert(run_id, row, ack, result, resolved))
                    audit_store.audit(s, run_id, actor, "done", {"action_id": row.id, "step": ack.first_step,
                                                               "detail": ack.detail})
        except (ContractError, DataError, IntegrityError, actions_store.ActionStateError) as exc:
            why = f"the acknowledgement could not be booked: {type(exc).__name__}: {str(exc).splitlines()[0]}"
            self.fail(run_id, ack.command_id, why, result=ack.to_json())
            raise UserError(f"action {ack.command_id}: {why}") from None
        if first_step is not None:
            if self._banks is not None:
                self._banks.rewind(run_id, first_step)
            if self._policy is not None:
                self._after_triage(run_id)
        self.flush_alerts()

    def _after_triage(self, run_id: str) -> None:
        """What the policy says after the rollback's replay triage named a cause (act.triage)."""
        with self.deciding, self._begin() as s:
            then = decision_after_rollback(s, run_id, self._policy)
            if then is not None:
                self.carry_out(s, run_id, *then)

    def fail(self, run_id: str, action_id: int, why: str, result: dict[str, Any] | None = None) -> bool:
        """Fail an open action with an alert (a bad ack, an undeliverable row). False if there is
        no such open action of this run."""
        with self._begin() as s:
            row = actions_store.get_action(s, action_id)
            if row is None or row.run_id != run_id or row.state.is_final:
                return False
            actions_store.set_action_state(s, action_id, ActionState.FAILED, error=why, result=result)
            audit_store.audit(s, run_id, "supervisor", "failed", {"action_id": action_id, "detail": why})
            self._queue_alert(s, Alert(run_id=run_id, severity=Severity.CRITICAL,
                                    title=f"{run_id}: {row.kind} (action {action_id}) FAILED", text=why,
                                    incident_id=row.incident_id, thread=_thread(action_id, row.incident_id),
                                    broadcast=True, status=f"{row.kind} (action {action_id}) FAILED"))
        self.flush_alerts()
        return True

    def _book(self, s: Session, run_id: str, row: actions_store.ActionRow, ack: Ack) -> tuple[int | None, bool]:
        """The lasting effects of an acknowledged command, as the trainer reports them (a bare
        ack, from an older trainer, books what the command asked for). Returns a rollback's first
        re-trained step (the ack's `step`, the checkpoint's + 1; None for any other command) and
        whether it resolved the action's incident."""
        body = row.body
        asked_ranges = body.ranges if isinstance(body, Skip) else body.skip if isinstance(body, Rollback) else ()
        # A precise skip's ack says exactly what it skipped, nothing included (replay triage found
        # the cause was not the data); a bare ack from an older trainer books what was asked.
        for r in ack.skip_ranges if ack.bisected is not None else ack.skip_ranges or asked_ranges:
            skips_store.add_skip_range(s, run_id, r.lo, r.hi, action_id=row.id)
        change, seq = ack.lr_change, ack.lr_seq
        if change is None and ack.checkpoint_step is None:
            lr = body if isinstance(body, SetLR) else body.lr if isinstance(body, Rollback) else None
            change = lr.change(max(1, ack.first_step)) if lr is not None else None
        if change is not None:
            lr_store.add_lr_change(s, run_id, change.multiplier, change.start_step, change.steps, action_id=row.id,
                                   rewarmup_steps=change.rewarmup_steps, seq=seq)
        resolved = False
        if row.incident_id is not None and row.kind in (CommandKind.ROLLBACK, CommandKind.SET_LR, CommandKind.SKIP):
            resolved = incidents_store.resolve_incident(s, row.incident_id, f"{row.kind} done at step {ack.first_step}")
        if row.kind is CommandKind.ROLLBACK:
            # The trainer abandoned every checkpoint after the one it went back to (step ack - 1):
            # they belong to the trajectory left behind and are never a target again.
            ckpt_store.distrust_from(s, run_id, ack.first_step)
            return ack.first_step, resolved
        return None, resolved

    def run_finished(self, run_id: str) -> list[int]:
        """The run's newest attempt reported its finish: what is still open for it expires now,
        its open incidents close (each thread's top message says so), and one "run finished"
        message tells the story (store.story). Returns the action ids expired."""
        expired = self.expire(run_id=run_id)
        with self._begin() as s:
            fin = ended(s, run_id)
            if fin is None:  # a relaunch got in first
                return expired
            for inc in incidents_store.open_incidents(s, run_id):
                incidents_store.resolve_incident(s, inc.id, f"the run ended ({fin.reason.value} at step {fin.step})")
                self._queue_alert(s, Alert(run_id=run_id, severity=Severity.INFO, incident_id=inc.id,
                                           title=f"{run_id}: closed, the run ended ({fin.reason.value} at step {fin.step})",
                                           status=f"closed: the run ended ({fin.reason.value} at step {fin.step})",
                                           story_state=StoryState.RESOLVED))
            told = story_store.story(s, run_id)
            self._queue_alert(s, Alert(
                run_id=run_id, severity=Severity.INFO, title=f"{run_id}: {told.ending()}", text=told.words(),
                fields={"final step": fin.step, "final loss": "none" if fin.final_loss is None else f"{fin.final_loss:.4g}",
                        "automatic rollbacks": told.auto_rollbacks, "steps re-trained": told.steps_retrained,
                        "samples skipped": told.samples_skipped, "incidents": told.incidents,
                        "LR multiplier": f"x{told.lr_multiplier:g}"}))
            audit_store.audit(s, run_id, "supervisor", "run_finished_told", {"words": told.words()})
        self.flush_alerts()
        return expired

    def expire(self, now: dt.datetime | None = None, run_id: str | None = None) -> list[int]:
        """Scheduler job: every open action reaches a final state on its own. Sent actions with no
        ack after the timeout are re-sent, then failed. Open actions of a run that has finished, or
        that has not polled for commands for `command_expiry_s` (and are older than that), expire:
        no trainer will carry them out. Returns the ids failed or expired."""
        now = now or dt.datetime.now(dt.timezone.utc)
        failed = []
        with self._begin() as s:
            finished: dict[str, RunFinished | None] = {}
            for a in actions_store.open_actions(s, run_id):
                if a.run_id not in finished:
                    finished[a.run_id] = ended(s, a.run_id)
                why = self._expiry_reason(a, finished[a.run_id], now)
                if why is not None:
                    actions_store.set_action_state(s, a.id, ActionState.EXPIRED, error=why)
                    audit_store.audit(s, a.run_id, "supervisor", "expired", {"action_id": a.id, "why": why})
                    failed.append(a.id)
                    self._queue_alert(s, Alert(run_id=a.run_id, severity=Severity.INFO,
                                               title=f"{a.run_id}: {a.kind} (action {a.id}) expired: {why}",
                                               incident_id=a.incident_id, thread=_thread(a.id, a.incident_id),
                                               status=f"{a.kind} (action {a.id}) expired, never carried out"))
                    continue
                if a.state is not ActionState.SENT or a.updated_at + self._ack_timeout > now:
                    continue
                if a.attempts <= self._ack_retries:
                    actions_store.set_action_state(s, a.id, ActionState.PENDING)
                    audit_store.audit(s, a.run_id, "supervisor", "redeliver", {"action_id": a.id,
                                                                               "attempts": a.attempts})
                else:
                    actions_store.set_action_state(s, a.id, ActionState.FAILED, error="no acknowledgement from the trainer")
                    failed.append(a.id)
                    self._queue_alert(s, Alert(run_id=a.run_id, severity=Severity.CRITICAL,
                                            title=f"{a.run_id}: {a.kind} (action {a.id}) was never acknowledged",
                                            text=f"sent {a.attempts} times; is the run controller alive?",
                                            incident_id=a.incident_id, thread=_thread(a.id, a.incident_id),
                                            broadcast=True, status=f"{a.kind} (action {a.id}) never acknowledged"))
        self.flush_alerts()
        return failed

    def _expiry_reason(self, a: actions_store.ActionRow, fin: RunFinished | None, now: dt.datetime) -> str | None:
        if fin is not None:
            return f"the run finished ({fin.reason.value} at step {fin.step}) before the trainer carried it out"
        if a.state is ActionState.ACKED:
            return None  # the trainer has it: done or failed follows from its own ack
        seen = self._last_poll.get(a.run_id, self._started)  # a poll is never older than the daemon
        if now - seen < self._expiry or now - a.created_at < self._expiry:
            return None
        return (f"the run has not asked for commands for {int((now - seen).total_seconds())} s "
                f"(command_expiry_s {int(self._expiry.total_seconds())}): is it still running?")

    # --- alerts ---------------------------------------------------------------------------------

    def notify(self, alert: Alert) -> None:
        """Queue an alert in a transaction of its own (callers outside the executor's ones)."""
        with self._begin() as s:
            self._queue_alert(s, alert)
        self.flush_alerts()

    def silence(self, run_id: str, signal: str, for_s: float, who: str, reason: str) -> dict:
        """Silence `signal` of the run ("*": every signal) for `for_s` seconds: its alerts stop
        paging (issue 37); its findings still act by policy. Audited; returns the silence."""
        if signal != silences_store.EVERY and signal not in {x.value for x in Signal}:
            raise UserError(f"unknown signal {signal!r}: one of {', '.join(sorted(x.value for x in Signal))}, or * "
                            "for every signal of the run")
        try:
            check_number("for_s", for_s, lo=0, lo_open=True, hi=MAX_SILENCE_S)
        except SettingError:
            raise UserError(f"a silence lasts more than 0 and at most {MAX_SILENCE_S / 86400:g} days "
                            f"({MAX_SILENCE_S:g} s), got {for_s!r} s") from None
        with self._begin() as s:
            if runs_store.get_run(s, run_id) is None:
                raise NotFound(f"no run {run_id!r}")
            until = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=for_s)
            sid = silences_store.create(s, run_id, signal, until, who, reason)
            audit_store.audit(s, run_id, who, "silenced", {"silence_id": sid, "signal": signal,
                                                         "until": until.isoformat(), "reason": reason})
            return silences_store.get(s, sid).to_json()

    def unsilence(self, silence_id: int, who: str) -> dict:
        """End a silence early; audited."""
        with self._begin() as s:
            row = silences_store.end(s, silence_id)
            audit_store.audit(s, row.run_id, who, "unsilenced", {"silence_id": silence_id, "signal": row.signal})
            return row.to_json()

    def acknowledge_page(self, run_id: str | None, who: str, *, incident_id: int | None = None,
                         action_id: int | None = None, reason: str = "") -> dict[str, Any]:
        """A person takes a page (issue 37): "I have it". Its story (an incident, or a manual
        action's) gets an acknowledge: the pagers stop escalating it (PagerDuty's acknowledge, the
        webhook's), Slack's thread says who has it, and the escalation job leaves it alone
        (supervisor.app.jobs.escalate). Nothing about the run changes: an approval still waits
        for its answer. Audited; a second acknowledge of the same story answers with the first
        (`already`), sending nothing. `run_id` None: the incident's or action's own run (a Slack
        button names only the story)."""
        if (incident_id is None) == (action_id is None):
            raise UserError("acknowledge names exactly one of an incident or an action")
        in_run = f" in run {run_id!r}" if run_id is not None else ""
        with self._begin() as s:
            if run_id is not None and runs_store.get_run(s, run_id) is None:
                raise NotFound(f"no run {run_id!r}")
            if incident_id is not None:
                inc = incidents_store.get_incident(s, incident_id)
                if inc is None or run_id not in (None, inc.run_id):
                    raise NotFound(f"no incident {incident_id}{in_run}")
                run_id, story, thread, of = inc.run_id, {"incident_id": incident_id}, None, incident_id
            else:
                row = actions_store.get_action(s, action_id)
                if row is None or run_id not in (None, row.run_id):
                    raise NotFound(f"no action {action_id}{in_run}")
                run_id, story, thread, of = row.run_id, {"action_id": action_id}, _thread(action_id, row.incident_id), \
                    row.incident_id
            first = next((e for e in audit_store.events(s, run_id, PAGE_ACKNOWLEDGED, limit=200)
                          if all(e.detail.get(k) == v for k, v in story.items())), None)
            if first is not None:
                return {**story, "run_id": run_id, "who": first.actor, "at": first.at.isoformat(),
                        "reason": first.detail.get("reason", ""), "already": True}
            audit_store.audit(s, run_id, who, PAGE_ACKNOWLEDGED, {**story, "reason": reason})
            what = f"incident {incident_id}" if incident_id is not None else f"action {action_id}"
            self._queue_alert(s, Alert(run_id=run_id, severity=Severity.INFO, incident_id=of, thread=thread,
                                       title=f"{run_id}: {who} acknowledged the page for {what}",
                                       text=reason, status=f"acknowledged by {who}",
                                       story_state=StoryState.ANSWERED))
        self.flush_alerts()
        return {**story, "run_id": run_id, "who": who, "at": dt.datetime.now(dt.timezone.utc).isoformat(),
                "reason": reason, "already": False}

    def _silenced(self, s: Session, alert: Alert) -> Alert:
        """A critical alert of a silenced signal pages no one: it goes out as a warning that says
        who silenced it until when. An approval still asks (its buttons and commands stay)."""
        signal = (alert.fields or {}).get("signal")
        if alert.severity is not Severity.CRITICAL or not signal or alert.approve_action is not None:
            return alert
        hush = silences_store.silencing(s, alert.run_id, str(signal))
        if hush is None:
            return alert
        return dataclasses.replace(alert, severity=Severity.WARN, broadcast=False, fields={
            **alert.fields, "silenced": f"by {hush.who} until {hush.until:%Y-%m-%d %H:%M} UTC (silence {hush.id})"})

    def _queue_alert(self, s: Session, alert: Alert) -> None:
        """Write `alert` to the outbox in the caller's transaction (sent once it commits). An
        incident folded into a flapping signal's thread has every later alert there too, and an
        incident of a divergence episode its first incident's (issue 37: one thread per episode,
        not one per detector and module)."""
        alert = self._silenced(s, alert)
        into = None
        if alert.thread is not None and alert.thread.startswith("incident:"):
            into = int(alert.thread.split(":", 1)[1])  # a fold's: into its episode's thread too
        elif alert.incident_id is not None and alert.thread is None and not alert.fold_count:
            into = flaps.thread_of(s, alert.run_id, int(alert.incident_id)) or int(alert.incident_id)
        if into is not None:
            first = incidents_store.episode(s, into)
            into = first if first is not None else into
            if alert.thread is None and into != int(alert.incident_id) and alert.severity is Severity.CRITICAL:
                # A human must act (an approval, a pause): its own message, never a reply deep in
                # the episode's thread, and the episode's later alerts follow it there.
                incidents_store.start_episode(s, int(alert.incident_id))
            elif alert.thread is not None or into != int(alert.incident_id):
                alert = dataclasses.replace(alert, thread=f"incident:{into}")
        self.outbox.enqueue(s, alert)

    def flush_alerts(self) -> None:
        """Wake the alert sender after a transaction that queued alerts has committed. Never waits."""
        self.outbox.wake()

    def close(self) -> None:
        self.outbox.close()


def _thread(action_id: int, incident_id: int | None) -> str | None:
    """An action's story: its incident's thread, or (a manual command) a thread of its own."""
    return None if incident_id is not None else f"action:{action_id}"


def _done_alert(run_id: str, row: actions_store.ActionRow, ack: Ack, result: dict[str, Any],
                resolved: bool) -> Alert:
    """The reply that says what the trainer really did, from its typed ack (supervisor.act.outcome)."""
    o = outcome(dataclasses.replace(row, state=ActionState.DONE, result=result, ack_step=ack.first_step))
    lines = details(o, first_step=False)  # the title's summary says the first step trained
    if resolved:
        lines.append(f"incident {row.incident_id} resolved")
    return Alert(run_id=run_id, severity=Severity.INFO,
                 title=f"{run_id}: {row.kind} (action {row.id}) done: {summary(o)}",
                 text="\n".join(lines) or (ack.detail or ""),
                 incident_id=row.incident_id, thread=_thread(row.id, row.incident_id),
                 status=f"{'resolved' if resolved else 'done'}: {summary(o)}",
                 # a pause done is a run waiting for a person: its page stays until the incident ends
                 story_state=StoryState.RESOLVED if resolved else None)
