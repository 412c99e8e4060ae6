"""Manual commands: `thermowatch rollback|skip|lr|pause|resume|stop|profile|approve|cancel|ack|silence|
silences|unsilence|runs|actions`.

They are clients of the daemon's HTTP API (supervisor.operate.client: address and token from flags,
the environment or `thermowatch login`; no database access), and the daemon writes the same
action rows as the automatic policy (origin `manual`, with who and why), so the run
controller, the executor and the audit trail treat both alike.

What is valid is decided once: the contract's command types and the run's limits
(supervisor.decide.feasibility), through Executor.submit in the daemon; its 422 exits 2 naming the
value and the limit. `--wait` blocks until the trainer acknowledges and prints what it actually did (from the
action row and its typed ack: supervisor.act.outcome), exiting 1 if it failed; `--json` prints the
same as one object.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
import time
from typing import Any, Callable

from thermowatch.monitors.contract import describe_args
from thermowatch.supervisor.errors import UserError
from thermowatch.supervisor.act.outcome import render
from thermowatch.monitors.commands import FINAL_STATES, INT32_MAX, INT64_MAX, MAX_LR_MULTIPLIER, ActionState
from thermowatch.monitors.names import printable_tree
from thermowatch.monitors.settings import arg_float, arg_int


def _parse_range(text: str) -> list[int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise UserError(f"--skip takes LO:HI (absolute sample indices), got {text!r}") from None
    return [lo, hi]


_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> float:
    """'90s', '30m', '2h', '1d' or plain seconds -> seconds (argparse: a bad one is exit 2, named)."""
    t = text.strip().lower()
    try:
        secs = float(t[:-1]) * _UNITS[t[-1]] if t and t[-1] in _UNITS else float(t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a duration is like 90s, 30m, 2h or 1d, got {text!r}") from None
    if not (secs > 0 and secs <= 7 * 86400):
        raise argparse.ArgumentTypeError(f"a silence lasts more than 0 and at most 7 days, got {text!r}")
    return secs


def add_manual_commands(sub, add_client_flags: Callable, handler: Callable) -> None:
    # Every number a flag takes is checked here (monitors.settings, issue 34): `--multiplier nan`
    # ended in a traceback; now it is argparse's one-line usage error, exit 2. The daemon checks
    # the run's own limits (feasibility) on top.
    lr = arg_float(0, MAX_LR_MULTIPLIER, lo_open=True)

    def cmd(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help)
        add_client_flags(p)
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
        p.add_argument("--timeout", type=arg_float(0, lo_open=True), default=600.0,
                       help="--wait gives up after this many seconds")
        p.add_argument("--json", action="store_true", help="print the outcome as one JSON object")
        if name == "rollback":
            p.add_argument("--to-step", type=arg_int(0, INT64_MAX), required=True,
                           help="load the newest healthy checkpoint at or before this step")
            p.add_argument("--exact", action="store_true", help="refuse unless the checkpoint at --to-step itself exists")
        if name in ("rollback", "skip"):
            p.add_argument("--skip", action="append", default=[], metavar="LO:HI",
                           help="absolute sample index range to skip (repeatable)")
        if name in ("rollback", "lr"):
            g = p.add_mutually_exclusive_group(required=name == "lr")
            g.add_argument("--multiplier", type=lr, help="the LR multiplier on the schedule (absolute: 0.5 = half "
                                                            "the schedule, whatever was set before)")
            g.add_argument("--factor", type=lr, help="relative: multiply the multiplier in force now (0.5 halves it)")
            p.add_argument("--for-steps", type=arg_int(1, INT64_MAX), default=None, help="only for this many steps")
        if name == "profile":
            p.add_argument("--steps", type=arg_int(1, INT32_MAX), default=5)
    for name in ("approve", "cancel"):
        p = cmd(name, f"{name} a pending action (advise-only mode)")
        p.add_argument("action_id", type=arg_int(1, INT32_MAX))
        p.add_argument("--who", default=None)
    p = cmd("ack", "take a page: its escalation stops (an approval it asks for still waits for its answer)")
    p.add_argument("run_id")
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--incident", type=arg_int(1, INT32_MAX), help="the incident whose page you take (the alert names it)")
    g.add_argument("--action", type=arg_int(1, INT32_MAX), help="or the action whose page you take (a manual pause's)")
    p.add_argument("--who", default=None)
    p.add_argument("--reason", default="", help="what you are doing about it, for the thread and the audit trail")
    p = cmd("silence", "stop a run's signal from paging for a while (its findings still act)")
    p.add_argument("run_id")
    p.add_argument("--signal", required=True, help="the signal (loss_spike, attn_logit_growth, stall, ...) or '*' for all")
    p.add_argument("--for", dest="for_", required=True, type=_duration, metavar="DURATION",
                   help="how long: 90s, 30m, 2h or 1d (at most a week)")
    p.add_argument("--who", default=None)
    p.add_argument("--reason", default="", help="why, for the audit trail and the alerts it quiets")
    p = cmd("silences", "list a run's silences (in force or not)")
    p.add_argument("run_id")
    p.add_argument("--json", action="store_true")
    p = cmd("unsilence", "end a silence now")
    p.add_argument("silence_id", type=arg_int(1, INT32_MAX))
    p.add_argument("--who", default=None)
    p = cmd("runs", "list runs with their last step and open incidents, newest first")
    p.add_argument("--limit", type=arg_int(1, 1000), default=100, help="runs to list (1-1000; default 100)")
    p.add_argument("--cursor", help="list the runs after a previous listing's last one (it prints the cursor)")
    p.add_argument("--json", action="store_true")
    p = cmd("actions", "list a run's actions with their states")
    p.add_argument("run_id")
    p.add_argument("--json", action="store_true")


def run_manual(args: argparse.Namespace) -> int:
    from thermowatch.supervisor.operate.client import Client, resolve, run_path

    with Client(resolve(args.server, args.token)) as api:
        who = getattr(args, "who", None) or getpass.getuser()
        name = args.manual
        if name == "runs":
            page = api.get("/api/runs", limit=args.limit, cursor=args.cursor)
            _print(page["runs"], args.json,
                   "{run_id}  last step {last_step}  attempt {attempt}  open incidents {open_incidents}")
            if page.get("next_cursor"):  # on stderr: --json's stdout stays one JSON list
                print(f"more runs: thermowatch runs --limit {args.limit} --cursor {page['next_cursor']}", file=sys.stderr)
            return 0
        if name == "actions":
            rows = [{**a, "did": (a.get("result") or {}).get("detail") or a.get("error")}
                    for a in api.get(f"{run_path(args.run_id)}/actions")["actions"]]
            _print(rows, args.json, "#{id} {kind:8} {state:9} {origin:6} by {who}  ack step {ack_step}  {args}"
                                    "\n      {did}")
            return 0
        if name == "silence":
            got = api.post(f"{run_path(args.run_id)}/silences", {"signal": args.signal, "for_s": args.for_,
                                                                 "who": who, "reason": args.reason})
            print(f"silence {got['id']}: {got['signal']} of run {got['run_id']} pages no one until {got['until']} "
                  f"(its findings still act); end it with `thermowatch unsilence {got['id']}`")
            return 0
        if name == "ack":
            got = api.post(f"{run_path(args.run_id)}/acknowledge", {"incident": args.incident, "action": args.action,
                                                                    "who": who, "reason": args.reason})
            what = f"incident {args.incident}" if args.incident is not None else f"action {args.action}"
            if got["already"]:
                print(f"the page for {what} was already acknowledged by {got['who']} at {got['at']}; nothing sent")
            else:
                print(f"you have the page for {what} of run {args.run_id}: its escalation stopped")
            return 0
        if name == "silences":
            _print(api.get(f"{run_path(args.run_id)}/silences")["silences"], args.json,
                   "#{id} {signal:18} until {until}  active {active}  by {who}  {reason}")
            return 0
        if name == "unsilence":
            got = api.post(f"/api/silences/{args.silence_id}/end", {"who": who})
            print(f"silence {got['id']} ({got['signal']} of run {got['run_id']}) ended")
            return 0
        if name in ("approve", "cancel"):
            api.post(f"/api/actions/{args.action_id}/{name}", {"who": who})
            print(f"action {args.action_id} {({'approve': 'approved', 'cancel': 'cancelled'})[name]} by {who}")
            return 0
        kind, payload = _command(name, args)
        action_id = api.post(f"{run_path(args.run_id)}/actions",
                             {"kind": kind, "args": payload, "who": who, "reason": args.reason})["action_id"]
        out = api.get(f"/api/actions/{action_id}")
        if not args.wait:
            if args.json:
                print(json.dumps(out))
            else:
                print(f"action {action_id} queued for run {args.run_id}: {describe_args(kind, out['args'])}; "
                      f"the trainer carries it out between two steps (--wait to see what it did)")
            return 0
        out = _wait(api, action_id, args.timeout)
        print(json.dumps(out) if args.json else render(printable_tree(out)))
        return 0 if out["state"] == ActionState.DONE else 1


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


def _wait(api, action_id: int, timeout_s: float) -> dict[str, Any]:
    """Poll the action until it is final (done, failed, cancelled, expired: a finished or silent
    run's actions expire on their own, Executor.expire) or the timeout passes."""
    deadline = time.monotonic() + timeout_s
    while True:
        out = api.get(f"/api/actions/{action_id}")
        if out["state"] in FINAL_STATES or time.monotonic() >= deadline:
            return out
        time.sleep(0.5)


def _print(rows: list[dict], as_json: bool, fmt: str) -> None:
    if as_json:
        print(json.dumps(rows, default=str))
        return
    for r in printable_tree(rows):  # who, reasons and ack details are free text from clients
        print(fmt.format(**r))
    if not rows:
        print("(none)")
