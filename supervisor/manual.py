"""Manual commands: `thermowatch rollback|skip|lr|pause|resume|stop|profile|approve|cancel|runs|actions`.

They write the same action rows as the automatic policy (origin `manual`, with who and why),
so the run controller, the executor and the audit trail treat both alike. They work against
the database directly (`--db`, or the data dir's SQLite), so they need no running daemon.

What is valid is decided once: the contract's command types and the run's limits
(supervisor.feasibility), through Executor.submit; a refusal exits 2 naming the value and the
limit. `--wait` blocks until the trainer acknowledges and prints what it actually did (from the
action row and its typed ack: supervisor.outcome), exiting 1 if it failed; `--json` prints the
same as one object.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
import time
from typing import Any, Callable

from supervisor.errors import UserError
from supervisor.outcome import outcome, render


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
        p.add_argument("--wait", action="store_true",
                       help="block until the trainer acknowledges; print what it did; exit 1 if it failed")
        p.add_argument("--timeout", type=float, default=600.0, help="--wait gives up after this many seconds")
        p.add_argument("--json", action="store_true", help="print the outcome as one JSON object")
        if name == "rollback":
            p.add_argument("--to-step", type=int, required=True,
                           help="load the newest healthy checkpoint at or before this step")
            p.add_argument("--exact", action="store_true", help="refuse unless the checkpoint at --to-step itself exists")
        if name in ("rollback", "skip"):
            p.add_argument("--skip", action="append", default=[], metavar="LO:HI",
                           help="absolute sample index range to skip (repeatable)")
        if name in ("rollback", "lr"):
            g = p.add_mutually_exclusive_group(required=name == "lr")
            g.add_argument("--multiplier", type=float, help="the LR multiplier on the schedule (absolute: 0.5 = half "
                                                            "the schedule, whatever was set before)")
            g.add_argument("--factor", type=float, help="relative: multiply the multiplier in force now (0.5 halves it)")
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
                         "ack_step": a.ack_step, "args": a.args, "reason": a.reason,
                         "did": (a.result or {}).get("detail") or a.error, "ack": a.result}
                        for a in actions_store.actions(s, args.run_id)]
            _print(rows, args.json, "#{id} {kind:8} {state:9} {origin:6} by {who}  ack step {ack_step}  {args}"
                                    "\n      {did}")
            return 0
        if name in ("approve", "cancel"):
            (ex.approve if name == "approve" else ex.cancel)(args.action_id, who)
            print(f"action {args.action_id} {({'approve': 'approved', 'cancel': 'cancelled'})[name]} by {who}")
            return 0
        kind, payload = _command(name, args)
        action_id = ex.submit(args.run_id, kind, payload, who, args.reason)
        if not args.wait:
            with sessions() as s:
                out = outcome(actions_store.get_action(s, action_id))
            if args.json:
                print(json.dumps(out))
            else:
                print(f"action {action_id}: {kind} {json.dumps(out['args'])} queued for run {args.run_id}; "
                      f"the run controller applies it between steps (--wait to see what it did)")
            return 0
        row = _wait(sessions, actions_store, action_id, args.timeout)
        out = outcome(row)
        print(json.dumps(out) if args.json else render(out))
        return 0 if out["state"] == "done" else 1
    finally:
        if ex is not None:
            ex.close()  # delivers this command's alert before the process exits
        engine.dispose()


def _command(name: str, args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    payload: dict[str, Any] = {}
    if name == "rollback":
        payload["to_step"] = args.to_step
        if args.exact:
            payload["exact"] = True
    if name in ("rollback", "skip") and args.skip:
        payload["skip_ranges"] = [_parse_range(t) for t in args.skip]
    if name in ("rollback", "lr") and (args.multiplier is not None or args.factor is not None):
        payload["lr_multiplier" if args.multiplier is not None else "lr_factor"] = (
            args.multiplier if args.multiplier is not None else args.factor)
        payload["lr_steps"] = args.for_steps
    if name == "profile":
        payload["steps"] = args.steps
    return {"lr": "set_lr"}.get(name, name), payload


def _wait(sessions, actions_store, action_id: int, timeout_s: float):
    """Poll the action row until it is final (done, failed, cancelled) or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        with sessions() as s:
            row = actions_store.get_action(s, action_id)
        if row.state in ("done", "failed", "cancelled") or time.monotonic() >= deadline:
            return row
        time.sleep(0.5)


def _print(rows: list[dict], as_json: bool, fmt: str) -> None:
    if as_json:
        print(json.dumps(rows, default=str))
        return
    for r in rows:
        print(fmt.format(**r))
    if not rows:
        print("(none)")
