"""The action queue: every command (automatic or manual) is written here before it is carried out.

States: pending -> sent -> acked -> done | failed (failed is reachable from any open state;
pending may also be cancelled). `expired` is reachable from any open state too: the run ended
(its newest attempt finished) or stopped asking for commands before the trainer carried it out,
so no trainer ever will (supervisor.act.executor.Executor.expire); its `error` says which. An action with requires_approval stays pending and is not
handed to the run controller until approve_action() clears the flag (advise-only mode).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any, Sequence

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from thermowatch.monitors.commands import (OPEN_STATES, ActionOrigin, ActionState, Command, CommandBody, CommandKind,
                                           json_safe, parse_command)
from thermowatch.supervisor.store.orm import Action, utcnow

# The commands that move a loop between training, waiting and ending (thermowatch.protocol's
# Directive): a pause, and what ends one, a resume, a rollback (issue 35) or a stop. A run is
# paused while the newest of them the trainer carried out is a pause.
DIRECTING = (CommandKind.PAUSE, CommandKind.RESUME, CommandKind.ROLLBACK, CommandKind.STOP)


class ActionStateError(ValueError):
    """An illegal state transition or an unknown action; the message says which."""


@dataclass(slots=True)
class ActionRow:
    id: int
    run_id: str
    kind: CommandKind
    args: dict[str, Any]
    state: ActionState
    origin: ActionOrigin
    who: str
    reason: str
    created_at: dt.datetime
    updated_at: dt.datetime
    ack_step: int | None = None
    attempts: int = 0
    error: str = ""
    incident_id: int | None = None
    requires_approval: bool = False
    extra: dict[str, Any] = field(default_factory=dict)
    result: dict[str, Any] | None = None  # the trainer's ack (contract.Ack JSON)

    @property
    def command(self) -> Command:
        """The typed command the row holds (monitors.commands), as the executor wrote it; every
        reader (deliver, approve, the ack's booking, the run page) reads it here. ContractError
        for a row the contract no longer reads (written by an older version)."""
        return Command(id=self.id, body=self.body)

    @property
    def body(self) -> CommandBody:
        return parse_command(self.kind, self.args)

    @property
    def checkpoint_step(self) -> int | None:
        """A rollback's checkpoint: the one the trainer loaded (its ack's `checkpoint_step`), else
        the step asked (`args.to_step`). Never `ack_step`, the first step re-trained (checkpoint + 1):
        a rollback to checkpoint 1000 was labelled "-> 1001" where the two were mixed (issue 22)."""
        if self.kind is not CommandKind.ROLLBACK:
            return None
        loaded = (self.result or {}).get("checkpoint_step")
        to = loaded if isinstance(loaded, int) else self.args.get("to_step")
        return to if isinstance(to, int) and not isinstance(to, bool) else None


def _row(a: Action) -> ActionRow:
    return ActionRow(a.id, a.run_id, a.kind, dict(a.args or {}), a.state, a.origin, a.who, a.reason, a.created_at,
                     a.updated_at, a.ack_step, a.attempts, a.error, a.incident_id, a.requires_approval,
                     result=dict(a.result) if a.result is not None else None)


def enqueue_action(session: Session, run_id: str, kind: CommandKind | str, args: dict[str, Any], reason: str,
                   origin: ActionOrigin | str, who: str, incident_id: int | None = None,
                   requires_approval: bool = False) -> int:
    """Write a pending action; returns its id (the command id the run controller acks)."""
    a = Action(run_id=run_id, kind=_word(CommandKind, "kind", kind), args=json_safe(dict(args)),
               state=ActionState.PENDING, origin=_word(ActionOrigin, "origin", origin), who=who, reason=reason,
               incident_id=incident_id, requires_approval=requires_approval)
    session.add(a)
    session.flush()
    return a.id


def get_action(session: Session, action_id: int) -> ActionRow | None:
    a = session.get(Action, action_id)
    return _row(a) if a is not None else None


def _word(words: type, what: str, value: Any) -> Any:
    try:
        return words(value)
    except ValueError:
        raise ActionStateError(f"unknown action {what} {value!r}; expected one of "
                               f"{', '.join(w.value for w in words)}") from None


def set_action_state(session: Session, action_id: int, state: ActionState | str, *, ack_step: int | None = None,
                     error: str | None = None, result: dict[str, Any] | None = None) -> ActionRow:
    """Move an action along its state machine; raises ActionStateError on an illegal move.
    Moving to `sent` counts a delivery attempt. Uses a compare-and-set on the old state, so two
    writers cannot both move the same action."""
    state = _word(ActionState, "state", state)
    cur = session.execute(select(Action.state, Action.attempts).where(Action.id == action_id)).first()
    if cur is None:
        raise ActionStateError(f"no action with id {action_id}")
    old, attempts = cur
    if state not in old.next_states:
        allowed = ", ".join(sorted(w.value for w in old.next_states)) or "none, it is final"
        raise ActionStateError(f"action {action_id}: cannot go from '{old}' to '{state}' (allowed: {allowed})")
    values: dict[str, Any] = {"state": state, "updated_at": utcnow()}
    if state is ActionState.SENT:
        values["attempts"] = attempts + 1
    if ack_step is not None:
        values["ack_step"] = ack_step
    if error is not None:
        values["error"] = error
    if result is not None:
        values["result"] = json_safe(result)
    res = session.execute(update(Action).where(Action.id == action_id, Action.state == old).values(**values))
    if res.rowcount != 1:
        raise ActionStateError(f"action {action_id} changed state concurrently (was '{old}')")
    return get_action(session, action_id)  # type: ignore[return-value]


def approve_action(session: Session, action_id: int, who: str) -> None:
    res = session.execute(
        update(Action).where(Action.id == action_id, Action.state == ActionState.PENDING,
                             Action.requires_approval.is_(True))
        .values(requires_approval=False, who=who, updated_at=utcnow())
    )
    if res.rowcount != 1:
        raise ActionStateError(f"action {action_id} is not a pending action awaiting approval")


def pending_actions(session: Session, run_id: str, *, include_unapproved: bool = False) -> list[ActionRow]:
    """Pending actions in creation order; those awaiting approval only if asked for."""
    q = select(Action).where(Action.run_id == run_id, Action.state == ActionState.PENDING)
    if not include_unapproved:
        q = q.where(Action.requires_approval.is_(False))
    return [_row(a) for a in session.execute(q.order_by(Action.id)).scalars()]


def open_actions(session: Session, run_id: str | None = None) -> list[ActionRow]:
    """Actions not yet final (what a restarted supervisor must resume)."""
    q = select(Action).where(Action.state.in_(OPEN_STATES))
    if run_id is not None:
        q = q.where(Action.run_id == run_id)
    return [_row(a) for a in session.execute(q.order_by(Action.id)).scalars()]


def actions(session: Session, run_id: str, limit: int = 200) -> list[ActionRow]:
    q = select(Action).where(Action.run_id == run_id).order_by(Action.id.desc()).limit(limit)
    return [_row(a) for a in session.execute(q).scalars()]


def last_done(session: Session, run_id: str, kinds: Sequence[CommandKind | str]) -> ActionRow | None:
    """The newest action of these kinds the trainer carried out (what a run's state follows:
    the last done pause or resume, a done stop)."""
    q = (select(Action).where(Action.run_id == run_id, Action.state == ActionState.DONE, Action.kind.in_(list(kinds)))
         .order_by(Action.id.desc()).limit(1))
    row = session.execute(q).scalars().first()
    return _row(row) if row is not None else None


def paused_runs(session: Session) -> list[ActionRow]:
    """The pause each paused run waits on (its row: who, why, when it was acknowledged): every run
    whose newest acknowledged pause, resume, rollback or stop (DIRECTING) is a pause, in one query."""
    newest = (select(func.max(Action.id).label("id"))
              .where(Action.state.in_((ActionState.ACKED, ActionState.DONE)), Action.kind.in_(DIRECTING))
              .group_by(Action.run_id).subquery())
    q = select(Action).join(newest, Action.id == newest.c.id).where(Action.kind == CommandKind.PAUSE).order_by(Action.id)
    return [_row(a) for a in session.execute(q).scalars()]
