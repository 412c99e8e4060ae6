"""HTML pages: the runs list and the run page the Slack alert links to (`/runs/{run_id}?incident=N`).

    GET /                                  runs table
    GET /runs/{run_id}?incident=&step_lo=&step_hi=
                                           charts + incidents, actions, skips, checkpoints, audit
    GET /runs/{run_id}/plot.png?metric=&step_lo=&step_hi=&incident=&logy=
                                           one chart; metric is a full key or a metric prefix
                                           (attn_logit_max = every layer on one chart)

With ?incident=N the page zooms every chart to the steps around that incident (onset, detection
and the rollback target), highlights its row and puts a summary banner above the charts (linking to the row) rather than
scrolling away from the zoomed charts. Charts draw older attempts' re-trained points faded and
dashed (the trajectory a rollback abandoned), with a note saying so. Every string that came from a
run (ids, module names, reasons, audit details) is HTML-escaped. Every page needs the `read`
scope (or `public_read: true`): a bearer token, or the cookie of the sign-in form (web/login.py).
"""

from __future__ import annotations

import datetime as dt
import html
import json
from typing import Any
from urllib.parse import quote, urlencode, urlparse

from fastapi import APIRouter, Depends, HTTPException, Query
from fastapi.responses import HTMLResponse, Response
from sqlalchemy.orm import Session

from supervisor.api.auth import Guard
from supervisor.api.runs import check_window, incidents_with_findings, require_run, resolve_keys, run_summaries
from supervisor.store import actions as actions_store
from supervisor.store import audit as audit_store
from supervisor.store import checkpoints as ckpt_store
from supervisor.store import lr_changes as lr_store
from supervisor.store import runs as runs_store
from supervisor.store import skips as skips_store
from supervisor.store import thermometers

# (metric prefix, chart title, log y) in page order; charts whose metric the run lacks are left out.
CHARTS = [
    ("loss", "loss", False),
    ("grad_norm", "gradient norm (global, before clipping)", True),
    ("lr", "learning rate", False),
    ("attn_logit_max", "max attention logit, every layer", True),
    ("attn_logit_lse", "attention logit log-sum-exp bound, every layer", True),
    ("act_max", "activation max, per module", True),
]
LOG_METRICS = {"grad_norm", "attn_logit_max", "attn_logit_lse", "act_max", "z"}
AUDIT_TAIL = 50
ZOOM_MIN_PAD = 50  # steps shown either side of an incident, at least

CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.2em 2em;color:#222}
h1{font-size:1.4em;margin:.2em 0} h2{font-size:1.1em;margin:1.4em 0 .4em;border-bottom:1px solid #ddd}
table{border-collapse:collapse;margin:.3em 0;font-size:13px} td,th{border:1px solid #ddd;padding:3px 7px;
vertical-align:top;text-align:left} th{background:#f4f4f4} tr.open td:first-child{border-left:4px solid #d33}
tr.selected{background:#fff3c4;outline:2px solid #e0a800} .muted{color:#888} .bad{color:#c00;font-weight:600}
.banner{background:#fff3c4;border:1px solid #e0a800;padding:.5em .8em;margin:.6em 0}
img.plot{display:block;max-width:100%;margin:.3em 0;border:1px solid #eee} img.broken{border:2px solid #c00}
code{font-size:12px;white-space:pre-wrap;word-break:break-all} ul.findings{margin:0;padding-left:1.1em}
"""


def e(value: Any) -> str:
    """HTML-escape anything shown on the page (quotes too: values land in attributes)."""
    return html.escape("" if value is None else str(value), quote=True)


def _ts(t: dt.datetime | None) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ") if t is not None else ""


def _args(obj: Any) -> str:
    return f"<code>{e(json.dumps(obj, sort_keys=True, default=str))}</code>" if obj else ""


def _page(title: str, body: str) -> HTMLResponse:
    return HTMLResponse(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
        f"<meta name='viewport' content='width=device-width'><style>{CSS}</style></head>"
        f"<body>{body}</body></html>")


def _table(headers: list[str], rows: list[str], empty: str) -> str:
    if not rows:
        return f"<p class='muted'>{e(empty)}</p>"
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _cells(*values: str) -> str:
    """Cells already escaped/rendered by the caller."""
    return "".join(f"<td>{v}</td>" for v in values)


def zoom_window(s: Session, run_id: str, incident_id: int, onset: int, detect: int) -> tuple[int, int]:
    """Steps around an incident: from before its onset (or the rollback target, if earlier) to
    after its detection, padded by half the span (at least ZOOM_MIN_PAD steps)."""
    lo, hi = onset, detect
    for a in actions_store.actions(s, run_id, limit=10_000):
        if a.incident_id == incident_id and a.kind == "rollback":
            target = a.ack_step if a.ack_step is not None else a.args.get("to_step")
            if isinstance(target, int):
                lo = min(lo, target)
    pad = max(ZOOM_MIN_PAD, (hi - lo) // 2)
    return max(0, lo - pad), hi + pad


def collect_marks(s: Session, run_id: str, selected: int | None):
    from supervisor.web.plots import IncidentMark, LrMark, Marks, RollbackMark

    incs = {i["id"]: i for i in incidents_with_findings(s, run_id)}
    marks = Marks()
    for i in incs.values():
        label = i["signal"] + (f" {i['module']}" if i["module"] else "")
        marks.incidents.append(IncidentMark(i["id"], label, i["onset_step"], i["detect_step"], i["state"] == "open",
                                            i["id"] == selected))
    for a in actions_store.actions(s, run_id, limit=10_000):
        if a.kind != "rollback" or a.state not in ("acked", "done"):
            continue
        to = a.ack_step if a.ack_step is not None else a.args.get("to_step")
        if not isinstance(to, int):
            continue
        inc = incs.get(a.incident_id) if a.incident_id is not None else None
        marks.rollbacks.append(RollbackMark(f"rollback #{a.id} -> {to}", inc["detect_step"] if inc else None, to))
    for c in lr_store.lr_changes(s, run_id):
        marks.lr_changes.append(LrMark(c.start_step, c.multiplier, c.steps))
    return marks


def make_router(sup, *, guard: Guard, public_url: str = "") -> APIRouter:
    router = APIRouter(tags=["web"], include_in_schema=False,
                       dependencies=[Depends(guard.require("read", cookie=True))])
    # Behind an ingress that serves us under a path (https://host/thermowatch), links carry it.
    base = urlparse(public_url).path.rstrip("/") if public_url else ""

    def run_url(run_id: str, suffix: str = "", **query: Any) -> str:
        q = urlencode({k: v for k, v in query.items() if v is not None})
        return f"{base}/runs/{quote(run_id, safe='')}{suffix}" + (f"?{q}" if q else "")

    @router.get("/", response_class=HTMLResponse)
    def index() -> HTMLResponse:
        with sup.sessions() as s:
            runs = run_summaries(s)
        rows = []
        for r in reversed(runs):  # newest first
            n_open = r["open_incidents"]
            rows.append("<tr>" + _cells(
                f"<a href='{e(run_url(r['run_id']))}'>{e(r['run_id'])}</a>", e(r["created_at"][:19].replace("T", " ") + "Z"),
                e(r["last_step"] if r["last_step"] is not None else "-"), e(r["attempts"]),
                f"<span class='bad'>{n_open}</span>" if n_open else "0") + "</tr>")
        body = (f"<form method='post' action='{e(base)}/logout' style='float:right'>"
                "<button type='submit' id='sign-out'>sign out</button></form>"
                "<h1>thermowatch: runs</h1>"
                + _table(["run", "created (UTC)", "last step", "attempts", "open incidents"], rows,
                         "no runs yet: a run appears when its run controller first reports"))
        return _page("thermowatch: runs", body)

    @router.get("/runs/{run_id}/plot.png")
    def plot(
        run_id: str,
        metric: str = Query(min_length=1, description="a full key (loss) or a metric prefix (attn_logit_max)"),
        step_lo: int | None = Query(None, ge=0),
        step_hi: int | None = Query(None, ge=0),
        incident: int | None = Query(None, description="incident to draw heavier"),
        logy: bool | None = Query(None, description="log y axis (default: by metric)"),
        width: int = Query(1100, ge=200, le=4000),
        height: int = Query(320, ge=120, le=2000),
    ) -> Response:
        from supervisor.web.plots import Chart, render

        check_window(step_lo, step_hi)
        with sup.sessions() as s:
            require_run(s, run_id)
            keys = resolve_keys(s, run_id, metric)
            series, superseded = [], []
            for i, k in enumerate(keys):
                # one read per key: the current line (what history() returns) and what it hides
                (steps, values), old = thermometers.split_superseded(
                    thermometers.history_by_attempt(s, run_id, k, step_lo, step_hi))
                series.append((k.split("/", 1)[1] if "/" in k and len(keys) > 1 else k, steps, values))
                superseded.extend((i, attempt, st, v) for attempt, (st, v) in old.items())
            marks = collect_marks(s, run_id, incident)
        prefix = metric.split("/", 1)[0]
        title = f"{run_id}: {metric}" + (f" ({len(keys)} series)" if len(keys) > 1 else "")
        chart = Chart(title, series, superseded, logy=(prefix in LOG_METRICS) if logy is None else logy,
                      step_lo=step_lo, step_hi=step_hi, width_px=width, height_px=height)
        png = render(chart, marks)
        return Response(png, media_type="image/png", headers={"Cache-Control": "no-store"})

    @router.get("/runs/{run_id}", response_class=HTMLResponse)
    def run_page(
        run_id: str,
        incident: int | None = Query(None, description="the incident to show (the Slack link sets it)"),
        step_lo: int | None = Query(None, ge=0),
        step_hi: int | None = Query(None, ge=0),
    ) -> HTMLResponse:
        check_window(step_lo, step_hi)
        with sup.sessions() as s:
            run = require_run(s, run_id)
            incs = incidents_with_findings(s, run_id)
            selected = None
            if incident is not None:
                selected = next((i for i in incs if i["id"] == incident), None)
                if selected is None:
                    ids = ", ".join(str(i["id"]) for i in incs[-10:]) or "none"
                    raise HTTPException(404, f"run {run_id!r} has no incident {incident}; its incidents: {ids}")
                if step_lo is None and step_hi is None:
                    step_lo, step_hi = zoom_window(s, run_id, incident, selected["onset_step"], selected["detect_step"])
            keys = thermometers.series_keys(s, run_id)
            last_step = thermometers.latest_step(s, run_id)
            attempts = runs_store.attempts(s, run_id)
            acts = actions_store.actions(s, run_id, limit=500)
            ckpts = ckpt_store.checkpoints(s, run_id, include_deleted=True)
            skips = skips_store.skip_ranges(s, run_id)
            lrs = lr_store.lr_changes(s, run_id)
            audit = audit_store.audit_log(s, run_id, limit=AUDIT_TAIL)

        parts = [f"<p><a href='{e(base or '/')}'>&larr; all runs</a></p>",
                 f"<h1>run {e(run.run_id)}</h1>",
                 f"<p>last step <b>{e(last_step if last_step is not None else '-')}</b> &middot; "
                 f"{len(attempts)} attempt(s) &middot; "
                 f"{sum(1 for i in incs if i['state'] == 'open')} open incident(s) &middot; created {_ts(run.created_at)}</p>"]
        if selected is not None:
            parts.append(
                f"<div class='banner'>incident <a href='#incident-{selected['id']}'>#{selected['id']}</a>: "
                f"<b>{e(selected['signal'])}</b> {e(selected['module'])} &middot; onset {selected['onset_step']}, "
                f"detected {selected['detect_step']} &middot; {e(selected['state'])}"
                f"{' &middot; ' + e(selected['resolution']) if selected['resolution'] else ''}</div>")
        if step_lo is not None or step_hi is not None:
            parts.append(f"<p>showing steps {e(step_lo if step_lo is not None else 0)}&ndash;"
                         f"{e(step_hi if step_hi is not None else 'end')} &middot; "
                         f"<a href='{e(run_url(run_id))}'>full history</a></p>")
        parts.append("<h2>thermometers</h2>")
        note_at = len(parts)
        shown = []
        for metric, title, _ in CHARTS:
            if metric in keys or any(k.startswith(metric + "/") for k in keys):
                shown.append(metric)
                src = run_url(run_id, "/plot.png", metric=metric, step_lo=step_lo, step_hi=step_hi, incident=incident)
                parts.append(f"<img class='plot' data-metric='{e(metric)}' alt='{e(title)}' src='{e(src)}' "
                             f"width='1100' height='320' onerror=\"this.classList.add('broken')\">")
        if not shown:
            parts.append("<p class='muted'>no thermometers reported yet</p>")
        elif len(attempts) > 1:  # above the charts: the first thing to read before the lines
            parts.insert(note_at, "<p class='muted' id='superseded-note'>Faded dashed lines: trajectories abandoned by a "
                         "rollback (or a restart from an earlier checkpoint), i.e. an older attempt's points at steps a "
                         "newer attempt re-trained, in the same color as their series. Solid lines: the newest "
                         "attempt at each step.</p>")
        others = sorted({k.split("/", 1)[0] for k in keys} - set(shown))
        if others:
            links = " ".join(f"<a href='{e(run_url(run_id, '/plot.png', metric=m, step_lo=step_lo, step_hi=step_hi))}'>"
                             f"{e(m)}</a>" for m in others)
            parts.append(f"<p>other series: {links}</p>")

        parts.append("<h2>incidents</h2>")
        rows = []
        for i in reversed(incs):
            cls = " ".join(c for c in ("open" if i["state"] == "open" else "", "selected" if i is selected else "") if c)
            finds = "".join(
                f"<li>{e(f['signal'])} {e(f['metric'] or f['module'])} ({e(f['severity'])}) onset {f['onset_step']} "
                f"detect {f['detect_step']} {_args(f['evidence'])}</li>" for f in i["findings"])
            rows.append(f"<tr id='incident-{i['id']}' class='{cls}'>" + _cells(
                f"<a href='{e(run_url(run_id, incident=i['id']))}'>#{i['id']}</a>", e(i["signal"]), e(i["module"]),
                e(i["severity"]), str(i["onset_step"]), str(i["detect_step"]), e(i["state"]), e(i["resolution"]),
                f"<ul class='findings'>{finds}</ul>" if finds else "") + "</tr>")
        parts.append(_table(["id", "signal", "module", "severity", "onset", "detect", "state", "resolution", "findings"],
                            rows, "no incidents"))

        parts.append("<h2>actions</h2>")
        rows = []
        for a in acts:
            cls = "selected" if incident is not None and a.incident_id == incident else ""
            state = e(a.state) + (" <span class='muted'>(awaiting approval)</span>" if a.requires_approval else "")
            if a.error:
                state += f"<br><span class='bad'>{e(a.error)}</span>"
            inc_link = (f"<a href='{e(run_url(run_id, incident=a.incident_id))}'>#{a.incident_id}</a>"
                        if a.incident_id is not None else "")
            rows.append(f"<tr id='action-{a.id}' class='{cls}'>" + _cells(
                str(a.id), e(a.kind), _args(a.args), state, e(a.origin), e(a.who), e(a.reason),
                e(a.ack_step if a.ack_step is not None else ""), inc_link, _ts(a.created_at)) + "</tr>")
        parts.append(_table(["id", "kind", "args", "state", "origin", "who", "reason", "ack step", "incident",
                             "created (UTC)"], rows, "no actions"))

        parts.append("<h2>skip ranges <span class='muted'>(absolute sample indices, [lo, hi))</span></h2>")
        parts.append(_table(["lo", "hi", "samples"], ["<tr>" + _cells(str(lo), str(hi), str(hi - lo)) + "</tr>"
                                                      for lo, hi in skips], "nothing skipped"))
        parts.append("<h2>LR changes</h2>")
        parts.append(_table(["from step", "multiplier", "for steps", "action"], [
            "<tr>" + _cells(str(c.start_step), f"{c.multiplier:g}", e(c.steps if c.steps is not None else "for good"),
                            e(c.action_id if c.action_id is not None else "")) + "</tr>" for c in lrs], "none"))
        parts.append("<h2>checkpoints</h2>")
        parts.append(_table(["step", "attempt", "healthy", "path", "sample cursor", "saved (UTC)"], [
            f"<tr class='{'muted' if c.deleted else ''}'>" + _cells(
                str(c.step), str(c.attempt), "yes" if c.healthy else "<span class='bad'>no</span>",
                e(c.path) + (" (deleted)" if c.deleted else ""), str(c.sample_cursor), _ts(c.created_at)) + "</tr>"
            for c in reversed(ckpts)], "no checkpoints reported"))
        parts.append("<h2>attempts</h2>")
        parts.append(_table(["attempt", "started (UTC)", "start step", "world size"], [
            "<tr>" + _cells(str(a.attempt), _ts(a.started_at), str(a.start_step), str(a.world_size)) + "</tr>"
            for a in reversed(attempts)], "none"))
        parts.append(f"<h2>audit (last {AUDIT_TAIL})</h2>")
        parts.append(_table(["at (UTC)", "actor", "event", "detail"], [
            "<tr>" + _cells(_ts(a.at), e(a.actor), e(a.event), _args(a.detail)) + "</tr>" for a in audit], "empty"))

        return _page(f"{run.run_id}: thermowatch", "".join(parts))

    return router
