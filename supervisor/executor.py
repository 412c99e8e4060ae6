"""Carries decisions out: action rows first, then commands, alerts and the audit trail.

Order matters (STYLE.md rule 2, Ray Train's "bookkeeping before side effects"): a decision is
written as a `pending` action row inside the caller's transaction; the run controller picks it
up on its next poll (`deliver`: pending -> sent), and acknowledges it with the step at which it
took effect (`acknowledge`: sent -> acked -> done, or failed). A supervisor that dies anywhere
in between finds the row in its state on restart: pending rows are delivered again, sent rows
are re-sent after the ack timeout (the controller ignores a command id it already applied and
acknowledges it again), so no action is lost or applied twice.

Manual commands (CLI, HTTP API, web) call `submit`, which writes the same rows.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
from typing import Any, Callable

from sqlalchemy.orm import Session, sessionmaker

from monitors.contract import Ack, Command, CommandKind, Finding, Severity
from supervisor.errors import Conflict, NotFound, UserError
from supervisor.notify.base import Alert, Notifier
from supervisor.notify.outbox import Outbox
from supervisor.policy import Decision, DecisionKind
from supervisor.store import actions as actions_store
from supervisor.store import audit as audit_store
from supervisor.store import checkpoints as ckpt_store
from supervisor.store import incidents as incidents_store
from supervisor.store import lr_changes as lr_store
from supervisor.store import runs as runs_store
from supervisor.store import skips as skips_store
from supervisor.store import steps as steps_store

log = logging.getLogger(__name__)

# What a manual command may carry, per kind (the CLI and the API validate against this).
MANUAL_KINDS = {k.value for k in CommandKind}


class Executor:
    def __init__(self, session_factory: sessionmaker, notifier: Notifier, *, advise_only: bool = False,
                 ack_timeout_s: float = 120.0, ack_retries: int = 2,
                 on_rollback_done: Callable[[str, int], None] | None = None):
        self._session = session_factory
        self._notifier = notifier
        self._advise_only = advise_only
        self._ack_timeout = dt.timedelta(seconds=ack_timeout_s)
        self._ack_retries = ack_retries
        self._on_rollback_done = on_rollback_done or (lambda run_id, step: None)
        # Alerts are rows written in the deciding transaction and sent by a background thread, so
        # no ingest or command request waits for Slack (DESIGN.md, "Nothing blocks training").
        self.outbox = Outbox(session_factory, notifier).start()

    # --- decisions -> rows ---------------------------------------------------------------------

    def carry_out(self, s: Session, run_id: str, incident_id: int, finding: Finding, decision: Decision) -> list[int]:
        """Write what `decision` asks for as action rows (in the caller's transaction)."""
        reason = "; ".join(decision.reasons)
        needs_ok = decision.requires_approval or self._advise_only
        ids: list[int] = []
        if decision.kind is DecisionKind.ROLLBACK:
            args: dict[str, Any] = {"to_step": decision.target_step}
            if decision.target_path:
                args["checkpoint"] = decision.target_path
            if decision.skip_steps is not None:
                rng = steps_store.sample_range(s, run_id, decision.skip_steps[0], decision.skip_steps[1])
                if rng is not None:
                    args["skip_ranges"] = [[int(rng[0]), int(rng[1])]]
            if decision.lr_multiplier is not None:
                args.update(lr_multiplier=decision.lr_multiplier, lr_steps=decision.lr_steps,
                            rewarmup_steps=decision.rewarmup_steps)
            if decision.exclude_rank is not None or decision.exclude_node:
                args.update(exclude_rank=decision.exclude_rank, exclude_node=decision.exclude_node)
            ids.append(self._enqueue(s, run_id, CommandKind.ROLLBACK, args, reason, "auto", "policy",
                                     incident_id, needs_ok))
        elif decision.kind is DecisionKind.LOWER_LR:
            args = {"lr_multiplier": decision.lr_multiplier, "lr_steps": decision.lr_steps,
                    "rewarmup_steps": decision.rewarmup_steps}
            ids.append(self._enqueue(s, run_id, CommandKind.SET_LR, args, reason, "auto", "policy",
                                     incident_id, needs_ok))
        elif decision.kind is DecisionKind.PAUSE:
            ids.append(self._enqueue(s, run_id, CommandKind.PAUSE, {}, reason, "auto", "policy",
                                     incident_id, needs_ok))
        audit_store.audit(s, run_id, "policy", "decision", {
            "incident_id": incident_id, "finding": finding.to_json(), "decision": decision.kind.value,
            "rung": decision.rung, "reasons": decision.reasons, "actions": ids,
            "requires_approval": needs_ok})
        if decision.kind is not DecisionKind.NOOP:
            alert = Alert.from_decision(run_id, finding, decision, incident_id)
            if needs_ok and not decision.requires_approval:
                alert = dataclasses.replace(alert, title=f"approval needed: {alert.title}")
            self._queue_alert(s, alert)
        return ids

    def submit(self, run_id: str, kind: str, args: dict[str, Any], who: str, reason: str) -> int:
        """A manual command (CLI, API, web): same rows, same executor, never needs approval."""
        if kind not in MANUAL_KINDS:
            raise UserError(f"unknown command {kind!r}; expected one of {sorted(MANUAL_KINDS)}")
        if not who:
            raise UserError("a manual command needs a `who` (your name), for the audit trail")
        with self._session.begin() as s:
            if runs_store.get_run(s, run_id) is None:
                raise NotFound(f"no run {run_id!r}; `thermowatch runs` lists the known runs")
            action_id = self._enqueue(s, run_id, CommandKind(kind), args, reason or "manual", "manual", who, None, False)
            self._queue_alert(s, Alert(run_id=run_id, severity=Severity.INFO,
                                       title=f"{run_id}: {who} asked for {kind} {args or ''}".strip(), text=reason))
        self.flush_alerts()
        return action_id

    def approve(self, action_id: int, who: str) -> None:
        """Advise-only mode: a human lets a pending action go to the trainer."""
        self._human_decides(action_id, who, "approved", lambda s: actions_store.approve_action(s, action_id, who))

    def cancel(self, action_id: int, who: str) -> None:
        self._human_decides(action_id, who, "cancelled",
                            lambda s: actions_store.set_action_state(s, action_id, "cancelled"))

    def _human_decides(self, action_id: int, who: str, event: str, change: Callable[[Session], Any]) -> None:
        with self._session.begin() as s:
            row = actions_store.get_action(s, action_id)
            if row is None:
                raise NotFound(f"no action {action_id}")
            try:
                change(s)
            except actions_store.ActionStateError as exc:
                raise Conflict(str(exc)) from exc
            audit_store.audit(s, row.run_id, who, event, {"action_id": action_id})

    def _enqueue(self, s: Session, run_id: str, kind: CommandKind, args: dict[str, Any], reason: str, origin: str,
                 who: str, incident_id: int | None, needs_ok: bool) -> int:
        action_id = actions_store.enqueue_action(s, run_id, kind.value, args, reason, origin, who,
                                                 incident_id=incident_id, requires_approval=needs_ok)
        audit_store.audit(s, run_id, who, "enqueued", {"action_id": action_id, "kind": kind.value, "args": args})
        return action_id

    # --- the command channel ------------------------------------------------------------------

    def deliver(self, run_id: str) -> list[Command]:
        """Pending (approved) actions for the run controller; they become `sent`."""
        with self._session.begin() as s:
            if runs_store.get_run(s, run_id) is None:
                raise NotFound(f"no run {run_id!r}: open it first (POST /api/runs) or check the run id")
            out = []
            for a in actions_store.pending_actions(s, run_id):
                actions_store.set_action_state(s, a.id, "sent")
                out.append(Command(id=a.id, kind=CommandKind(a.kind), args=dict(a.args)))
            return out

    def acknowledge(self, run_id: str, ack: Ack) -> None:
        """The run controller says the command took effect before training `ack.step` (or failed)."""
        rollback_to = None
        with self._session.begin() as s:
            row = actions_store.get_action(s, ack.command_id)
            if row is None or row.run_id != run_id:
                raise NotFound(f"run {run_id!r} has no action {ack.command_id}")
            if row.state in ("done", "failed", "cancelled"):
                log.info("action %s already %s; duplicate ack ignored", row.id, row.state)
                return
            if row.requires_approval:
                raise Conflict(f"action {row.id} awaits a human's approval and was never sent; "
                               f"an acknowledgement for it cannot be right")
            if not ack.ok:
                actions_store.set_action_state(s, row.id, "failed", error=ack.detail or "the trainer refused it")
                audit_store.audit(s, run_id, "trainer", "failed", {"action_id": row.id, "detail": ack.detail})
                self._queue_alert(s, Alert(run_id=run_id, severity=Severity.CRITICAL,
                                        title=f"{run_id}: {row.kind} (action {row.id}) FAILED",
                                        text=ack.detail or "the run controller refused the command",
                                        incident_id=row.incident_id))
            else:
                if row.state == "pending":  # acked before we saw our own `sent` commit (in-process race)
                    actions_store.set_action_state(s, row.id, "sent")
                actions_store.set_action_state(s, row.id, "acked", ack_step=ack.step)
                rollback_to = self._book(s, run_id, row, ack)
                actions_store.set_action_state(s, row.id, "done")
                audit_store.audit(s, run_id, "trainer", "done", {"action_id": row.id, "step": ack.step,
                                                                 "detail": ack.detail})
        if rollback_to is not None:
            self._on_rollback_done(run_id, rollback_to)
        self.flush_alerts()

    def _book(self, s: Session, run_id: str, row: actions_store.ActionRow, ack: Ack) -> int | None:
        """The lasting effects of an acknowledged command: skip ledger, LR changes, incident."""
        args = row.args
        for lo, hi in args.get("skip_ranges") or []:
            skips_store.add_skip_range(s, run_id, int(lo), int(hi), action_id=row.id)
        if args.get("lr_multiplier") is not None:
            lr_store.add_lr_change(s, run_id, float(args["lr_multiplier"]), ack.step, args.get("lr_steps"),
                                   action_id=row.id)
        if row.incident_id is not None and row.kind in ("rollback", "set_lr", "skip"):
            incidents_store.resolve_incident(s, row.incident_id, f"{row.kind} done at step {ack.step}")
        if row.kind == "rollback":
            # The trainer abandoned every checkpoint after the one it went back to (step ack - 1):
            # they belong to the trajectory left behind and are never a target again.
            ckpt_store.distrust_from(s, run_id, ack.step)
            return ack.step
        return None

    def expire(self, now: dt.datetime | None = None) -> list[int]:
        """Scheduler job: sent actions with no ack after the timeout are re-sent, then failed."""
        now = now or dt.datetime.now(dt.timezone.utc)
        failed = []
        with self._session.begin() as s:
            for a in actions_store.open_actions(s):
                if a.state != "sent" or a.updated_at + self._ack_timeout > now:
                    continue
                if a.attempts <= self._ack_retries:
                    actions_store.set_action_state(s, a.id, "pending")
                    audit_store.audit(s, a.run_id, "supervisor", "redeliver", {"action_id": a.id,
                                                                               "attempts": a.attempts})
                else:
                    actions_store.set_action_state(s, a.id, "failed", error="no acknowledgement from the trainer")
                    failed.append(a.id)
                    self._queue_alert(s, Alert(run_id=a.run_id, severity=Severity.CRITICAL,
                                            title=f"{a.run_id}: {a.kind} (action {a.id}) was never acknowledged",
                                            text=f"sent {a.attempts} times; is the run controller alive?",
                                            incident_id=a.incident_id))
        self.flush_alerts()
        return failed

    # --- alerts ---------------------------------------------------------------------------------

    def _queue_alert(self, s: Session, alert: Alert) -> None:
        """Write `alert` to the outbox in the caller's transaction (sent once it commits)."""
        self.outbox.enqueue(s, alert)

    def flush_alerts(self) -> None:
        """Wake the alert sender after a transaction that queued alerts has committed. Never waits."""
        self.outbox.wake()

    def close(self) -> None:
        self.outbox.close()
