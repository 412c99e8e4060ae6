"""What an action did, from its row and the trainer's typed ack: the one shape the CLI's
`--wait`/`--json` print (and the HTTP API can serve unchanged when the CLI becomes its client).

Fields: action_id, kind, state (pending, sent, acked, done, failed, cancelled, expired), args (as asked),
checkpoint_step and checkpoint_path (what a rollback loaded), first_step (the first step trained
after it), effective_lr_multiplier (in force at first_step), lr_change, skip_ranges (what the
trainer added to its ledger, [lo, hi) sample ids; `skipped_ranges`, its old name, is written too
until the next release), ledger_digest, bisected (a precise skip's search, with replay
triage's `cause`: data, hardware or optimizer, its evidence and cost), detail (the trainer's
words), error.
"""

from __future__ import annotations

from typing import Any

from thermowatch.monitors.commands import ActionState, CommandKind
from thermowatch.monitors.contract import Ack, Cause, ContractError

# The final states that did not do what was asked: their error says why.
_NOT_DONE = (ActionState.FAILED, ActionState.EXPIRED, ActionState.CANCELLED)


def outcome(row) -> dict[str, Any]:
    ack = None
    if row.result:
        try:
            ack = Ack.from_json(row.result)
        except ContractError:
            ack = None
    args = dict(row.args)
    skip = [r.to_json() for r in ack.skip_ranges] if ack else []
    return {
        "action_id": row.id, "kind": CommandKind(row.kind), "state": ActionState(row.state), "args": args,
        "checkpoint_step": ack.checkpoint_step if ack else None,
        "checkpoint_path": ack.checkpoint_path if ack else None,
        "first_step": ack.first_step if ack else row.ack_step,
        "effective_lr_multiplier": ack.lr_multiplier if ack else None,
        "lr_change": ack.lr_change.to_json() if ack and ack.lr_change else None,
        "requested_lr": _requested_lr(args),
        "skip_ranges": skip,
        "skipped_ranges": skip,  # deprecated: skip_ranges; written until the next release
        "ledger_digest": ack.ledger_digest if ack else "",
        "bisected": ack.bisected.to_json() if ack and ack.bisected else None,
        "detail": ack.detail if ack else "",
        "error": row.error or "",
    }


def _requested_lr(args: dict[str, Any]) -> str | None:
    m = args.get("lr_multiplier")
    if m is None:
        return None
    if args.get("lr_factor") is not None and args.get("lr_base") is not None:
        return f"x{m:g} (= x{args['lr_base']:g} in force, times {args['lr_factor']:g})"
    return f"x{m:g}"


def render(o: dict[str, Any]) -> str:
    """Human lines for one outcome."""
    state = ActionState(o["state"])
    head = f"action {o['action_id']}: {o['kind']} {state}"
    if not state.is_final:
        return head + " (no acknowledgement yet; `thermowatch actions RUN` shows it later)"
    lines = [head + (f": {o['detail']}" if o["detail"] else "")]
    if state in _NOT_DONE:  # (a cancelled action was shown as "no acknowledgement yet", issue 38)
        lines.append(f"  error: {o['error'] or o['detail'] or 'no reason given'}")
        return "\n".join(lines)
    return "\n".join(lines + [f"  {line}" for line in details(o)])


def details(o: dict[str, Any], *, first_step: bool = True) -> list[str]:
    """A done outcome's facts, a line each. `first_step=False` leaves out the first step trained,
    for a message whose title already says it (summary())."""
    lines = []
    if o["checkpoint_step"] is not None:
        lines.append(f"checkpoint loaded: step {o['checkpoint_step']} ({o['checkpoint_path']})")
    if first_step and o["first_step"] is not None and o["kind"] != CommandKind.STOP:
        lines.append(f"first step trained: {o['first_step']}")
    if o["effective_lr_multiplier"] is not None:
        asked = f" (asked {o['requested_lr']})" if o["requested_lr"] else ""
        lines.append(f"effective LR multiplier: x{o['effective_lr_multiplier']:g}{asked}")
    if o["skip_ranges"]:
        lines.append("ranges skipped: " + ", ".join(f"[{lo}, {hi})" for lo, hi in o["skip_ranges"]))
    b = o.get("bisected")
    if b:
        lines.append(f"precise skip ({b['outcome']}): {b['probes']} probes, {b['steps']:,} steps re-trained, "
                     f"{b['seconds']:.1f} s, over {sum(hi - lo for lo, hi in b['suspects']):,} suspect samples")
        c = _cause(o)
        if c is not None:
            lines.append(f"cause: {c.words()}; the replays took {c.steps:,} steps, {c.seconds:.1f} s"
                         + ("; nothing skipped" if c.label != "data" else ""))
    return lines


def _cause(o: dict[str, Any]) -> Cause | None:
    """Replay triage's verdict in an outcome (issue 39), typed; None without one."""
    c = (o.get("bisected") or {}).get("cause")
    return Cause.from_json(c) if c else None


_CAUSE_SHORT = {"hardware": "the replay of the same samples ran clean",
                "optimizer": "it diverged again without the suspect samples",
                "data": "it diverged with the suspect samples and not without them"}


def summary(o: dict[str, Any]) -> str:
    """One line of what the trainer really did, for a Slack reply or a status line:
    "rolled back to checkpoint 20, first step trained 21, LR x0.5, skipped [1280, 1344)"."""
    if ActionState(o["state"]) in _NOT_DONE:
        return f"{o['kind']} {o['state']}: {o['error'] or o['detail'] or 'no reason given'}"
    parts = []
    if o["checkpoint_step"] is not None:
        parts.append(f"rolled back to checkpoint {o['checkpoint_step']}")
    elif o["kind"] != CommandKind.ROLLBACK:
        parts.append(o["kind"].replace("_", " ") + " applied")
    if o["first_step"] is not None and o["kind"] != CommandKind.STOP:
        parts.append(f"first step trained {o['first_step']}")
    if o["effective_lr_multiplier"] is not None:
        parts.append(f"LR x{o['effective_lr_multiplier']:g}")
    if o["skip_ranges"]:
        parts.append("skipped " + ", ".join(f"[{lo}, {hi})" for lo, hi in o["skip_ranges"]))
    c = _cause(o)
    if c is not None:
        parts.append(("" if c.label == "data" else "skipped nothing, ") + f"cause: {c.label} ({_CAUSE_SHORT[c.label]})")
    return ", ".join(parts) or f"{o['kind']} done"
