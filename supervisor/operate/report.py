"""The CLI's read commands for 3 a.m. (issue 12): `thermowatch status RUN`, `incidents RUN`,
`export RUN --out FILE`. Clients of the daemon's read API (supervisor.operate.client), like the
manual commands: an address and a `read` token, no database.

`export` writes the JSONL that `thermowatch replay` reads (monitors.replay; DESIGN.md "Metric
names"): one flat record per step, the newest attempt's value where a rollback re-trained a
step (what the run's history is now), non-finite values as Python json's NaN / Infinity
literals. Replaying it with the daemon's detector settings finds what the daemon found.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
from pathlib import Path
from typing import Any, Callable

from thermowatch.monitors.commands import INT64_MAX
from thermowatch.monitors.names import printable_tree
from thermowatch.monitors.settings import arg_int
from thermowatch.supervisor.errors import UserError
from thermowatch.supervisor.operate.files import replacing, target_of

_NONFINITE = {"NaN": math.nan, "Infinity": math.inf, "-Infinity": -math.inf}


def add_read_commands(sub, add_client_flags: Callable) -> None:
    p = sub.add_parser("status", help="a run's state, last step and record age, open incidents, pending approvals")
    add_client_flags(p)
    p.add_argument("run_id")
    p.add_argument("--json", action="store_true", help="the daemon's answer as one JSON object")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("incidents", help="a run's incidents with their findings")
    add_client_flags(p)
    p.add_argument("run_id")
    p.add_argument("--json", action="store_true", help="one JSON list, findings included")
    p.add_argument("--open", action="store_true", help="only incidents still open")
    p.set_defaults(func=cmd_incidents)

    p = sub.add_parser("export", help="write a run's thermometer history as the JSONL `thermowatch replay` reads")
    add_client_flags(p)
    p.add_argument("run_id")
    p.add_argument("--out", "-o", required=True, help="the file to write (replaced whole, never torn)")
    p.add_argument("--format", choices=("jsonl", "csv"), default=None,
                   help="jsonl (what `thermowatch replay` reads) or csv (a spreadsheet's: one row per record, "
                        "attempt and step first, then one column per series, empty where a record has none); "
                        "default: csv for an --out ending in .csv, else jsonl")
    p.add_argument("--attempts", choices=("newest", "all"), default="all",
                   help="all (default): every attempt's own records in order, each with its `attempt`, so a "
                        "replay sees each divergence a rollback abandoned, as the daemon did; newest: one "
                        "record per step, the newest attempt's (the run's history as it stands)")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("quarantine", help="the samples a rollback skipped and whose skip held: the divergence did "
                                          "not come back on the re-trained path (for the data team)")
    add_client_flags(p)
    p.add_argument("run_id")
    p.add_argument("--json", action="store_true", help="the daemon's answer: every verdict and the quarantine")
    p.add_argument("--ids", action="store_true", help="the quarantined sample ids, one per line")
    p.add_argument("--data", action="store_true", help="the quarantined data indices (id %% dataset_size, for a run "
                   "that gave its dataset_size), one per line: what the data team removes")
    p.add_argument("--horizon", type=arg_int(1, INT64_MAX), default=None,
                   help="steps past the old detection the re-trained path must run clean (default: the daemon's, 100)")
    p.set_defaults(func=cmd_quarantine)


def _client(args: argparse.Namespace):
    from thermowatch.supervisor.operate.client import Client, resolve

    return Client(resolve(args.server, args.token))


def cmd_status(args: argparse.Namespace) -> int:
    from thermowatch.supervisor.operate.client import run_path

    with _client(args) as api:
        st = api.get(f"{run_path(args.run_id)}/status")
    if args.json:
        print(json.dumps(st))
        return 0
    print(render_status(printable_tree(st)))  # reasons and ack details are a client's free text
    return 0


def render_status(st: dict[str, Any]) -> str:
    age = st["last_record_age_s"]
    step = "no step yet" if st["last_step"] is None else f"step {st['last_step']}"
    if st.get("planned_steps"):
        step += f" of {st['planned_steps']}"
    lines = [f"run {st['run_id']}: {st['state'].upper()} ({st['why']})",
             f"  {step}, attempt {st['attempt'] if st['attempt'] is not None else '-'}, last record "
             + (f"{_ago(age)} ago" if age is not None else "never")]
    if st.get("finish_reason"):
        loss = st["final_loss"]
        lines.append(f"  finished: {st['finish_reason']} at step {st['final_step']}, final loss "
                     + ("none measured" if loss is None else f"{loss:.6g}" if isinstance(loss, float) else str(loss)))
    inc = st["open_incidents"]
    lines.append(f"  open incidents: {len(inc) or 'none'}")
    for i in inc:
        lines.append(f"    #{i['id']} {i['severity']:8} {i['signal']} {i['module'] or '-'}  onset step "
                     f"{i['onset_step']}, detected at {i['detect_step']}")
    waiting = st["pending_approvals"]
    lines.append(f"  awaiting your approval: {len(waiting) or 'none'}")
    for a in waiting:
        lines.append(f"    #{a['id']} {a['kind']} {json.dumps(a['args'])}  {a['reason']}".rstrip())
        lines.append(f"        {a['approve']}    or    {a['cancel']}")
    lines.append("  last actions:" + ("" if st["last_actions"] else " none"))
    for a in st["last_actions"]:
        lines.append(f"    #{a['id']} {a['kind']:8} {a['state']:9} {a['origin']:6} by {a['who']}"
                     + (f"  at step {a['ack_step']}" if a["ack_step"] is not None else "")
                     + (f": {a['did']}" if a["did"] else ""))
    return "\n".join(lines)


def _ago(seconds: float) -> str:
    s = int(seconds)
    return f"{s} s" if s < 120 else f"{s // 60} min" if s < 7200 else f"{s // 3600} h {s % 3600 // 60} min"


def cmd_incidents(args: argparse.Namespace) -> int:
    from thermowatch.supervisor.operate.client import run_path

    with _client(args) as api:
        rows = api.get(f"{run_path(args.run_id)}/incidents")["incidents"]
    if args.open:
        rows = [i for i in rows if i["state"] == "open"]
    if args.json:
        print(json.dumps(rows))
        return 0
    for i in printable_tree(rows):
        print(f"#{i['id']} {i['state']:8} {i['severity']:8} {i['signal']} {i['module'] or '-'}  onset step "
              f"{i['onset_step']}, detected at {i['detect_step']}, opened {i['opened_at'][:19]}Z"
              + (f"; {i['resolution']}" if i.get("resolution") else ""))
        for f in i["findings"]:
            print(f"      {f['signal']} {f['metric'] or f['module'] or '-'} onset {f['onset_step']} "
                  f"detect {f['detect_step']} ({f['severity']}, {f.get('outcome', 'alert')})")
    if not rows:
        print("(none)")
    return 0


def cmd_quarantine(args: argparse.Namespace) -> int:
    from thermowatch.supervisor.operate.client import run_path

    with _client(args) as api:
        q = api.get(f"{run_path(args.run_id)}/quarantine", horizon=args.horizon)
    if args.json:
        print(json.dumps(q))
    elif args.ids:
        for lo, hi in q["quarantine"]:
            print("\n".join(str(i) for i in range(lo, hi)))
    elif args.data:
        if q.get("data_indices") is None:
            raise UserError(f"run {args.run_id!r} did not say its dataset_size, or its loader shuffles each pass: "
                            "its sample ids are the only names the daemon has (--ids); "
                            "map them with your loader (thermowatch's WatchedDataset.data_index(ids))")
        for lo, hi in q["data_indices"]:
            print("\n".join(str(i) for i in range(lo, hi)))
    else:
        print(render_quarantine(printable_tree(q)))
    return 0


def render_quarantine(q: dict[str, Any]) -> str:
    ranges = q["quarantine"]
    lines = [f"run {q['run_id']}: {len(q['verdicts'])} rollback(s) with skipped samples; quarantine: "
             f"{q['samples']:,} samples in {len(ranges)} range(s)"]
    for v in q["verdicts"]:
        where = f"{v['signal']} detected at step {v['detect_step']}" if v["signal"] else "manual rollback"
        lines.append(f"  #{v['action_id']} {where}, back to checkpoint {v['checkpoint_step']}, skipped "
                     + ", ".join(f"[{lo}, {hi})" for lo, hi in v["ranges"]) + f" ({v['samples']:,} samples): "
                     + f"{v['status'].upper()}: {v['why']}")
        if v["status"] == "quarantine" and v.get("sure") == "blunt":
            lines.append(f"    how sure: blunt: every sample from the checkpoint to the detection was skipped; the cause "
                         f"is among these {v['samples']:,}, most are likely clean (precise_skip=True narrows them)")
        b = v.get("bisected")
        if b:
            lines.append(f"    precise skip: {v['samples']:,} of {sum(hi - lo for lo, hi in b['suspects']):,} suspect "
                         f"samples ({b['outcome']}), found in {b['probes']} probes, {b['steps']:,} steps re-trained "
                         f"from the checkpoint, {b['seconds']:.1f} s")
    if ranges:
        lines.append("quarantined sample ranges [lo, hi): " + ", ".join(f"[{lo}, {hi})" for lo, hi in ranges))
    if ranges and q.get("data_indices") is not None:
        lines.append(f"as data indices (id % dataset_size {q['dataset_size']:,}; `--data` lists them): "
                     + ", ".join(f"[{lo}, {hi})" for lo, hi in q["data_indices"]))
    return "\n".join(lines)


def cmd_export(args: argparse.Namespace) -> int:
    from thermowatch.supervisor.operate.client import run_path

    out = Path(args.out)
    if out.is_dir():
        raise UserError(f"--out {out} is a directory; give a file name such as {out / (args.run_id + '.jsonl')}")
    target_of(out, "--out")  # a device, fifo or missing folder is refused before asking the daemon
    every = getattr(args, "attempts", "all") == "all"
    # (attempt, step) -> values; attempt None for the newest attempt's point per step
    rows: dict[tuple[int | None, int], dict[str, Any]] = {}
    with _client(args) as api:
        keys = api.get(f"{run_path(args.run_id)}/series")["keys"]
        for key in keys:
            if every:  # each attempt's own points, the history endpoint's attempts=all
                h = api.get(f"{run_path(args.run_id)}/history", key=key, attempts="all")["attempts"]
                parts = [(int(a), p["steps"], p["values"]) for a, p in h.items()]
            else:  # the newest attempt's point per step (the endpoint's default)
                h = api.get(f"{run_path(args.run_id)}/history", key=key)
                parts = [(None, h["steps"], h["values"])]
            for attempt, steps, values in parts:
                for step, value in zip(steps, values):
                    rows.setdefault((attempt, step), {})[key] = (_NONFINITE.get(value, value)
                                                                 if isinstance(value, str) else value)
        fmt = args.format or ("csv" if out.suffix.lower() == ".csv" else "jsonl")
        # what the daemon did between the attempts, with replay triage's cause (issue 39): JSONL only
        done = api.get(f"{run_path(args.run_id)}/actions", limit=10_000)["actions"] if every and fmt == "jsonl" else []
    order = sorted(rows, key=lambda k: (k[0] or 0, k[1]))
    events = _rollback_events(done, order)
    with replacing(out, flag="--out") as fh:  # whole or not at all, and only over a regular file
        if fmt == "csv":
            w = csv.writer(fh)
            w.writerow((["attempt"] if every else []) + ["step", *keys])
            for attempt, step in order:
                vals = rows[(attempt, step)]
                # repr of a float: exact, and NaN / inf as Python and pandas read them back
                w.writerow(([attempt] if every else []) + [step, *(repr(float(vals[k])) if k in vals else "" for k in keys)])
        else:
            for attempt, step in order:
                for event in events.pop((attempt, step), []):  # before the attempt it opened
                    fh.write(json.dumps(event) + "\n")
                head = {"step": step} if attempt is None else {"attempt": attempt, "step": step}
                # allow_nan (the default): NaN / Infinity literals, as the run controller logs them
                fh.write(json.dumps({**head, **rows[(attempt, step)]}) + "\n")
            for event in (e for es in events.values() for e in es):  # nothing trained after them
                fh.write(json.dumps(event) + "\n")
    n_att = len({a for a, _ in rows})
    print(f"wrote {len(rows)} records ({len(keys)} series{f', {n_att} attempts' if every else ''}) of run "
          f"{args.run_id} to {out}" + (f"; `thermowatch replay {out}` runs them through the detectors"
                                        if fmt == "jsonl" else " as CSV"))
    return 0


def _rollback_events(actions: list[dict[str, Any]], order: list[tuple[int | None, int]]) -> dict[tuple, list[dict]]:
    """Each done rollback as an export line of its own, keyed by the (attempt, step) record it
    goes before: the first record of the first attempt after the previous rollback's that starts
    at its first re-trained step. `thermowatch replay` prints it there (monitors/replay.py)."""
    firsts = {}
    for attempt, step in order:  # each attempt's first step, attempts in order
        firsts.setdefault(attempt, step)
    out: dict[tuple, list[dict]] = {}
    later = [a for a in firsts if a is not None]
    for a in sorted(actions, key=lambda x: x["id"]):
        r = a.get("result") or {}
        first = r.get("first_step", r.get("step"))  # "step": an export written before the rename (issue 38)
        if a.get("kind") != "rollback" or a.get("state") != "done" or not isinstance(first, int):
            continue
        bisected = r.get("bisected") or {}
        event = {"event": "rollback", "action": a["id"], "origin": a.get("origin"),
                 "checkpoint_step": r.get("checkpoint_step"), "first_step": first,
                 "skip_ranges": r.get("skip_ranges", r.get("skipped")) or [],
                 "search": bisected.get("outcome"), "cause": bisected.get("cause")}
        at = next((x for x in later if firsts[x] == first), None)
        if at is not None:
            later = later[later.index(at) + 1:]
            event["attempt"] = at
        out.setdefault((at, first) if at is not None else ("end", a["id"]), []).append(event)
    return out
