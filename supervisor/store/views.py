"""The read model (issue 25): what the API's routers and the web pages both read, so that
`api/` and `web/` never import each other. Plain functions over a session, like the rest of
store/: they return JSON-ready values and raise supervisor.errors (NotFound -> 404, UserError ->
422, mapped once in supervisor.serve.api's exception handlers), never an HTTP type.

- the JSON codec for read answers: `to_wire` (rows, datetimes, non-finite floats as "NaN",
  "Infinity", "-Infinity"), `values_json` (an array);
- `envelope`: the min/max-per-bucket downsampler of raw history;
- `require_run`, `resolve_keys`, `check_window`, the runs list's cursor and page, `run_detail`,
  `run_status` (the on-call engineer's first question), `incidents_with_findings`.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import datetime as dt
import difflib
import json
import math
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from thermowatch.supervisor.errors import NotFound, UserError
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import checkpoints as ckpt_store
from thermowatch.supervisor.store import findings as findings_store
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store import lr_changes as lr_store
from thermowatch.supervisor.store import metrics as metrics_store
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import skips as skips_store
from thermowatch.supervisor.store import thermometers

NONFINITE = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


# --- encoding --------------------------------------------------------------------------------


def to_wire(obj: Any) -> Any:
    """Rows (dataclasses), datetimes and non-finite floats -> plain JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else NONFINITE[repr(obj)]
    if isinstance(obj, dt.datetime):
        return obj.isoformat()
    if isinstance(obj, dict):
        return {str(k): to_wire(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_wire(v) for v in obj]
    if hasattr(obj, "value") and hasattr(obj, "name"):  # enums (Signal, Severity)
        return obj.value
    return obj


def values_json(values: np.ndarray) -> list:
    """float64 array -> JSON list; only the non-finite entries are touched in Python."""
    out = values.tolist()
    for i in np.flatnonzero(~np.isfinite(values)).tolist():
        out[i] = NONFINITE[repr(out[i])]
    return out


# --- downsampling ------------------------------------------------------------------------------


def envelope(steps: np.ndarray, values: np.ndarray, max_points: int,
             step_lo: int | None = None, step_hi: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """At most `max_points` points that keep every bucket's min and max (and its first NaN).

    The step range is cut into equal buckets (one per plot pixel column when max_points is
    twice the width), so a one-step spike survives at any zoom. Steps must be ascending.
    O(n) numpy: reduceat over the contiguous buckets.
    """
    if max_points < 3:
        raise ValueError(f"max_points must be >= 3 (a bucket keeps its min, max and first NaN), got {max_points}")
    n = len(steps)
    if n <= max_points:
        return steps, values
    nan = np.isnan(values)
    per_bucket = 3 if nan.any() else 2  # min, max, and the first NaN where there is one
    nb = max(1, max_points // per_bucket)
    lo = int(steps[0]) if step_lo is None else min(int(step_lo), int(steps[0]))
    hi = int(steps[-1]) if step_hi is None else max(int(step_hi), int(steps[-1]))
    span = hi - lo + 1
    bucket = ((steps - lo).astype(np.float64) * nb / span).astype(np.int64)
    np.clip(bucket, 0, nb - 1, out=bucket)
    starts = np.flatnonzero(np.r_[True, bucket[1:] != bucket[:-1]])
    counts = np.diff(np.r_[starts, n])
    idx = np.arange(n)
    picked = []
    for fill, reduce in ((-np.inf, np.fmax), (np.inf, np.fmin)):
        v = np.where(nan, fill, values)
        best = reduce.reduceat(v, starts)
        hit = v == np.repeat(best, counts)
        picked.append(np.minimum.reduceat(np.where(hit, idx, n), starts))
    if per_bucket == 3:
        first_nan = np.minimum.reduceat(np.where(nan, idx, n), starts)
        picked.append(first_nan[first_nan < n])
    keep = np.unique(np.concatenate(picked))
    return steps[keep], values[keep]


def points_json(steps: np.ndarray, values: np.ndarray, max_points: int | None,
                 step_lo: int | None, step_hi: int | None) -> dict[str, Any]:
    total = len(steps)
    if max_points is not None:
        steps, values = envelope(steps, values, max_points, step_lo, step_hi)
    return {"points": total, "downsampled": len(steps) < total, "steps": steps.tolist(), "values": values_json(values)}


# --- reads: the API's routers and the web pages ----------------------------------------------------------


def require_run(s: Session, run_id: str) -> runs_store.RunRow:
    run = runs_store.get_run(s, run_id)
    if run is None:
        # The 10 newest, not every run: a 404 must cost the same at 10^5 runs as at 10.
        known = runs_store.newest_run_ids(s, 10)
        hint = (f"; the newest runs: {', '.join(known)} (GET /api/runs lists them all)" if known
                else "; no runs are stored yet")
        raise NotFound(f"no run {run_id!r}{hint}")
    return run


def resolve_keys(s: Session, run_id: str, metric: str) -> list[str]:
    """A full key ("loss", "act_max/blocks.0") or a metric prefix ("act_max": all its modules).
    404 naming the metric and listing close matches when the run has neither."""
    keys = thermometers.series_keys(s, run_id)
    if metric in keys:
        return [metric]
    prefixed = [k for k in keys if k.startswith(metric + "/")]
    if prefixed:
        return prefixed
    raise NotFound(unknown_key_message(run_id, metric, keys))


def unknown_key_message(run_id: str, key: str, keys: list[str]) -> str:
    if not keys:
        return f"run {run_id!r} has no series {key!r}: it has reported no thermometers yet"
    metrics = sorted({k.split("/", 1)[0] for k in keys})
    close = difflib.get_close_matches(key, keys + metrics, n=5, cutoff=0.5)
    shown = close or (metrics + [k for k in keys if k not in metrics])[:8]
    return (f"run {run_id!r} has no series {key!r}; {'close matches' if close else 'some known keys'}: "
            f"{', '.join(shown)} ({len(keys)} keys in all: GET /api/runs/{run_id}/series)")


def check_window(step_lo: int | None, step_hi: int | None) -> None:
    """The web pages' window: swapped bounds there are a typo in a URL a person edits. The API
    answers an empty window (step_lo > step_hi) with no points instead, as a REST client expects
    of a range that matches nothing (issue 21: the OpenAPI cannot say step_lo <= step_hi)."""
    if step_lo is not None and step_hi is not None and step_lo > step_hi:
        raise UserError(f"step_lo={step_lo} is after step_hi={step_hi}; swap them")


PAGE_DEFAULT, PAGE_MAX = 100, 1000  # runs per page of the list


def encode_cursor(key: runs_store.RunKey) -> str:
    """A page's next_cursor: the last run's (created_at, run_id), opaque to clients (URL-safe)."""
    raw = json.dumps([key.created_at.isoformat(), key.run_id], separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str) -> runs_store.RunKey:
    """UserError (422) for anything encode_cursor did not make."""
    try:
        created_at, run_id = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        at = dt.datetime.fromisoformat(created_at)
        if not isinstance(run_id, str) or at.tzinfo is None:
            raise ValueError("not a cursor")
    except (ValueError, TypeError, binascii.Error, UnicodeDecodeError, RecursionError):
        raise UserError(f"cursor {cursor[:60]!r} is not one this daemon gave out: pass a page's "
                        "next_cursor as it came, or leave cursor out for the newest runs") from None
    return runs_store.RunKey(at, run_id)


def runs_page(s: Session, limit: int = PAGE_DEFAULT, cursor: str | None = None) -> dict[str, Any]:
    """One page of the runs list, newest first, with each run's summary (supervisor.store.runs:
    one statement, whatever the number of runs)."""
    page, after = runs_store.runs_page(s, limit, decode_cursor(cursor) if cursor else None)
    return {
        "runs": [{"run_id": r.run_id, "created_at": r.created_at.isoformat(), "last_step": r.last_step,
                  "attempt": r.attempt, "attempts": r.attempts, "open_incidents": r.open_incidents} for r in page],
        "next_cursor": encode_cursor(after) if after is not None else None,
    }


ATTEMPTS_DEFAULT, ATTEMPTS_MAX = 100, 1000  # attempts per page of a run's read (issue 34: 10^4 of one run)


def run_detail(s: Session, run_id: str, attempts_limit: int = ATTEMPTS_DEFAULT,
               attempts_before: int | None = None) -> dict[str, Any]:
    """The run and a page of its attempts: the newest `attempts_limit` numbered below
    `attempts_before` (None: the newest), oldest first as they always were; `attempts_total`
    counts them all and `next_attempts_before` is the `attempts_before` of the older page (None:
    none left). One token opened 10^4 attempts of a run, and listing them all cost 0.8-1.4 s and
    1.8 MB a read (issue 34)."""
    run = require_run(s, run_id)
    page, older = runs_store.attempts_page(s, run_id, attempts_limit, attempts_before)
    return {
        "run_id": run.run_id, "created_at": run.created_at.isoformat(), "config": to_wire(run.config),
        "last_step": thermometers.latest_step(s, run_id),
        "attempt": runs_store.newest_attempt(s, run_id),
        "attempts": to_wire(page[::-1]),
        "attempts_total": runs_store.attempt_count(s, run_id),
        "next_attempts_before": older,
        "checkpoints": to_wire(ckpt_store.checkpoints(s, run_id)),
        "skip_ranges": [[lo, hi] for lo, hi in skips_store.skip_ranges(s, run_id)],
        "lr_changes": to_wire(lr_store.lr_changes(s, run_id)),
    }


RUN_STATES = ("starting", "running", "paused", "stalled", "finished")


def run_status(s: Session, run_id: str, *, stall_after_s: float, now: dt.datetime | None = None,
               last_actions: int = 5) -> dict[str, Any]:
    """What the on-call engineer asks first (issue 12): is it running, where is it, what waits
    for me. The state follows what the daemon knows, in this order: the newest attempt said it
    finished (contract.RunFinished, issue 22 item 9), a done `stop`, or the configured step count
    reached -> finished; the last done pause, resume or rollback a pause -> paused; an
    open stall incident, or no record for `stall_after_s` (the stall detector's timeout) ->
    stalled; no step yet -> starting; else running."""
    run = require_run(s, run_id)
    now = now or dt.datetime.now(dt.timezone.utc)
    gauges = next(iter(metrics_store.run_gauges(s, [run_id])), None)
    last_step = thermometers.latest_step(s, run_id)
    seen = gauges.last_record_at if gauges else None
    age = (now - seen).total_seconds() if seen is not None else None
    open_inc = incidents_store.open_incidents(s, run_id)
    waiting = [a for a in actions_store.pending_actions(s, run_id, include_unapproved=True) if a.requires_approval]
    planned = run.config.get("steps") if isinstance(run.config, dict) else None
    stop = actions_store.last_done(s, run_id, ["stop"])
    toggle = actions_store.last_done(s, run_id, actions_store.DIRECTING)  # a rollback ends a pause too
    newest = runs_store.latest_attempt(s, run_id)
    finished = newest.finished if newest is not None else None
    if finished is not None:
        state, why = "finished", f"{finished.reason.value} at step {finished.step} (attempt {newest.attempt})"
    elif stop is not None:
        state, why = "finished", f"stopped by action {stop.id} at step {stop.ack_step}"
    elif isinstance(planned, int) and last_step is not None and last_step >= planned:
        state, why = "finished", f"step {last_step} of {planned} reached"
    elif toggle is not None and toggle.kind == "pause" and (newest is None or newest.started_at <= toggle.updated_at):
        # (a relaunch since the pause trains: a loop does not keep a pause across a restart)
        state, why = "paused", f"paused by action {toggle.id} ({toggle.who}) at step {toggle.ack_step}"
    elif any(i.signal == "stall" for i in open_inc):
        state, why = "stalled", "an open stall incident"
    elif age is not None and age > stall_after_s:
        state, why = "stalled", f"no record for {age:.0f} s (stall timeout {stall_after_s:g} s)"
    elif last_step is None:
        state, why = "starting", "no step recorded yet"
    else:
        state, why = "running", f"last record {age:.0f} s ago" if age is not None else "records arriving"
    return {
        "run_id": run_id, "state": state, "why": why, "last_step": last_step,
        "attempt": newest.attempt if newest is not None else None,  # the run's attempt (runs.newest_attempt)
        "planned_steps": planned if isinstance(planned, int) else None,
        # What the newest attempt said when it ended (null: it has not): reason, step, final loss.
        "finish_reason": finished.reason.value if finished else None,
        "final_step": finished.step if finished else None,
        "final_loss": to_wire(finished.final_loss) if finished else None,
        "last_record_at": seen.isoformat() if seen else None,
        "last_record_age_s": round(age, 3) if age is not None else None,
        "open_incidents": [{k: v for k, v in to_wire(i).items() if k not in ("closed_at", "resolution", "run_id")}
                           for i in open_inc],
        "pending_approvals": [{"id": a.id, "kind": a.kind, "args": to_wire(a.args), "reason": a.reason,
                               "created_at": a.created_at.isoformat(),
                               "approve": f"thermowatch approve {a.id}", "cancel": f"thermowatch cancel {a.id}"}
                              for a in waiting],
        "last_actions": [{"id": a.id, "kind": a.kind, "state": a.state, "origin": a.origin, "who": a.who,
                          "updated_at": a.updated_at.isoformat(), "ack_step": a.ack_step,
                          "did": (a.result or {}).get("detail") or a.error or None}
                         for a in actions_store.actions(s, run_id, last_actions)],
    }


def incidents_with_findings(s: Session, run_id: str) -> list[dict[str, Any]]:
    by_incident: dict[int | None, list] = {}
    for f in findings_store.findings(s, run_id):
        by_incident.setdefault(f.incident_id, []).append(
            {"id": f.id, "created_at": f.created_at.isoformat() if f.created_at else None, **to_wire(f.finding.to_json())})
    out = []
    for inc in incidents_store.incidents(s, run_id):
        out.append({**to_wire(inc), "findings": by_incident.get(inc.id, [])})
    return out
