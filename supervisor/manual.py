"""Manual commands: `thermowatch rollback|skip|lr|pause|resume|stop|profile|approve|cancel|runs|actions`.

They write the same action rows as the automatic policy (origin `manual`, with who and why),
so the run controller, the executor and the audit trail treat both alike. They work against
the database directly (`--db`, or the data dir's SQLite), so they need no running daemon.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from typing import Any, Callable

from supervisor.errors import UserError


def _int(name: str, v: Any, lo: int = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise UserError(f"{name} must be an integer >= {lo}, got {v!r}")
    return v


def validate_args(kind: str, args: dict[str, Any]) -> dict[str, Any]:
    """The one check for manual command arguments (CLI and HTTP API alike)."""
    out = dict(args)
    if kind == "rollback":
        if "to_step" not in out and "checkpoint" not in out:
            raise UserError("rollback needs to_step (a checkpoint's step) or checkpoint (its path)")
        if "to_step" in out:
            _int("to_step", out["to_step"])
    if kind in ("rollback", "skip"):
        ranges = out.get("skip_ranges", [])
        if kind == "skip" and not ranges:
            raise UserError("skip needs skip_ranges: [[lo, hi], ...] absolute sample indices, lo < hi")
        for r in ranges:
            if not (isinstance(r, (list, tuple)) and len(r) == 2):
                raise UserError(f"each skip range must be [lo, hi], got {r!r}")
            lo, hi = _int("skip range lo", r[0]), _int("skip range hi", r[1])
            if lo >= hi:
                raise UserError(f"skip range [{lo}, {hi}) is empty; lo must be < hi")
    if kind == "set_lr" or "lr_multiplier" in out:
        m = out.get("lr_multiplier")
        if isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m <= 10:
            raise UserError(f"lr_multiplier must be a number in (0, 10], got {m!r}")
        if out.get("lr_steps") is not None:
            _int("lr_steps", out["lr_steps"], 1)
    if kind == "profile":
        _int("steps", out.setdefault("steps", 5), 1)
    return out


def _parse_range(text: str) -> list[int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise UserError(f"--skip takes LO:HI (absolute sample indices), got {text!r}") from None
    return [lo, hi]


def add_manual_commands(sub, add_db_flags: Callable, handler: Callable) -> None:
    def cmd(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        add_db_flags(p)
        p.set_defaults(func=handler, manual=name)
        return p

    for name, help in (("rollback", "roll a run back to a checkpoint (optionally skip samples, lower LR)"),
                       ("skip", "skip absolute sample ranges from now on"),
                       ("lr", "set the LR multiplier on the schedule"),
                       ("pause", "pause a run between steps"), ("resume", "resume a paused run"),
                       ("stop", "stop a run after its current step"),
                       ("profile", "trace the next steps with torch.profiler")):
        p = cmd(name, help)
        p.add_argument("run_id")
        p.add_argument("--who", default=None, help="your name for the audit trail (default: login name)")
        p.add_argument("--reason", default="", help="why, for the audit trail and the alert")
        if name == "rollback":
            p.add_argument("--to-step", type=int, required=True)
        if name in ("rollback", "skip"):
            p.add_argument("--skip", action="append", default=[], metavar="LO:HI",
                           help="absolute sample index range to skip (repeatable)")
        if name in ("rollback", "lr"):
            p.add_argument("--multiplier", type=float, required=name == "lr")
            p.add_argument("--for-steps", type=int, default=None, help="only for this many steps")
        if name == "profile":
            p.add_argument("--steps", type=int, default=5)
    for name in ("approve", "cancel"):
        p = cmd(name, f"{name} a pending action (advise-only mode)")
        p.add_argument("action_id", type=int)
        p.add_argument("--who", default=None)
    p = cmd("runs", "list runs with their last step and open incidents")
    p.add_argument("--json", action="store_true")
    p = cmd("actions", "list a run's actions with their states")
    p.add_argument("run_id")
    p.add_argument("--json", action="store_true")


def run_manual(args: argparse.Namespace, cfg) -> int:
    from supervisor import db
    from supervisor.executor import Executor
    from supervisor.notify.console import ConsoleNotifier
    from supervisor.store import actions as actions_store
    from supervisor.store import incidents as incidents_store
    from supervisor.store import runs as runs_store
    from supervisor.store import thermometers as thermo_store

    engine = db.make_engine(cfg.db_url)
    ex = None
    try:
        try:
            db.check_current(engine)
        except db.DatabaseError as exc:
            print(f"thermowatch: {exc}", file=sys.stderr)
            return 1
        sessions = db.make_sessionmaker(engine)
        who = getattr(args, "who", None) or getpass.getuser()
        ex = Executor(sessions, ConsoleNotifier(sys.stderr))
        name = args.manual
        if name == "runs":
            with sessions() as s:
                rows = [{"run_id": r.run_id, "last_step": thermo_store.latest_step(s, r.run_id),
                         "open_incidents": len(incidents_store.open_incidents(s, r.run_id))}
                        for r in runs_store.list_runs(s)]
            _print(rows, args.json, "{run_id}  last step {last_step}  open incidents {open_incidents}")
            return 0
        if name == "actions":
            with sessions() as s:
                if runs_store.get_run(s, args.run_id) is None:
                    raise UserError(f"no run {args.run_id!r}; `thermowatch runs` lists the known runs")
                rows = [{"id": a.id, "kind": a.kind, "state": a.state, "origin": a.origin, "who": a.who,
                         "ack_step": a.ack_step, "args": a.args, "reason": a.reason}
                        for a in actions_store.actions(s, args.run_id)]
            _print(rows, args.json, "#{id} {kind:8} {state:9} {origin:6} by {who}  ack step {ack_step}  {args}")
            return 0
        if name in ("approve", "cancel"):
            (ex.approve if name == "approve" else ex.cancel)(args.action_id, who)
            print(f"action {args.action_id} {({'approve': 'approved', 'cancel': 'cancelled'})[name]} by {who}")
            return 0
        kind, payload = _command(name, args)
        action_id = ex.submit(args.run_id, kind, validate_args(kind, payload), who, args.reason)
        print(f"action {action_id}: {kind} {json.dumps(payload)} queued for run {args.run_id}; "
              f"the run controller applies it between steps")
        return 0
    finally:
        if ex is not None:
            ex.close()  # delivers this command's alert before the process exits
        engine.dispose()


def _command(name: str, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    payload: dict[str, Any] = {}
    if name == "rollback":
        payload["to_step"] = args.to_step
    if name in ("rollback", "skip") and args.skip:
        payload["skip_ranges"] = [_parse_range(t) for t in args.skip]
    if name in ("rollback", "lr") and args.multiplier is not None:
        payload["lr_multiplier"] = args.multiplier
        payload["lr_steps"] = args.for_steps
    if name == "profile":
        payload["steps"] = args.steps
    return {"lr": "set_lr"}.get(name, name), payload


def _print(rows: list[dict], as_json: bool, fmt: str) -> None:
    if as_json:
        print(json.dumps(rows, default=str))
        return
    for r in rows:
        print(fmt.format(**r))
    if not rows:
        print("(none)")
