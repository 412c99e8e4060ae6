"""The run page (`/runs/{run_id}?incident=N&step_lo=&step_hi=`), the one a Slack link opens.

Top to bottom, in the order an on-call engineer needs it (issue 12): the run's state badge and
"last record N s ago"; what waits for them (open incidents with readable evidence, actions
awaiting approval with Approve / Cancel buttons); the charts; then the full tables (incidents,
actions, skip ranges, LR changes, checkpoints, the newest attempts with a link to older ones,
audit).

The charts are drawn in the browser by static/run.js with the vendored uPlot, from the JSON of
GET /api/runs/{run}/chart (re-bucketed on every zoom) and /events (annotations, thresholds);
the script reads them with the sign-in cookie (supervisor.serve.guard). Each chart keeps its
matplotlib PNG inside <noscript>, so a browser without JavaScript still sees every chart.
Every string that came from a run is HTML-escaped; the only scripts are our two static files,
and the page hands them data through escaped data- attributes, never inline script.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

from fastapi import HTTPException
from fastapi.responses import HTMLResponse

from thermowatch.monitors.contract import THERMOMETER_COST, THERMOMETER_EVERY, ContractError, describe_args
from thermowatch.monitors.commands import ActionState
from thermowatch.supervisor.store.views import incidents_with_findings, require_run, run_status
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import checkpoints as ckpt_store
from thermowatch.supervisor.store import lr_changes as lr_store
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import skips as skips_store
from thermowatch.supervisor.store import story as story_store
from thermowatch.supervisor.store import thermometers
from thermowatch.supervisor.serve.daemon import Daemon
from thermowatch.supervisor.serve.web.readable import ago, pairs

AUDIT_TAIL = 50
# Attempts listed a page: one token opened 10^4 attempts of one run, and the page that listed
# them all took 3.4-9.4 s (issue 34); older ones are a link away (?attempts_before=).
ATTEMPTS_SHOWN = 20
REFRESH_S = 10  # the script polls /status this often, and redraws the charts unless zoomed


def _ts(t: dt.datetime | None) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ") if t is not None else ""


def table(e, name: str, headers: list[str], rows: list[str], empty: str, wide: tuple[str, ...] = ()) -> str:
    """A table that becomes stacked cards on a narrow screen (issue 37: on a phone the incidents
    table was blank rows and a reason wrapped a letter a line). Each cell's label on a card is its
    column's header, given by nth-child rules beside the table rather than a data-label on every
    <td>: the cells stay plain, as scripts and tests read them. `wide` columns (free text, lists)
    take a card's whole width under their label; the others flow along a line, `label value`."""
    if not rows:
        return f"<p class='muted'>{e(empty)}</p>"
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    cls = f"cards t-{name}"
    rules = "".join(f".t-{name} td:nth-child({i})::before{{content:{_css_string(h)}}}"
                    + (f".t-{name} td:nth-child({i}){{flex-basis:100%}}"
                       f".t-{name} td:nth-child({i})::before{{display:block}}" if h in wide else "")
                    for i, h in enumerate(headers, 1))
    return (f"<style>@media (max-width:700px){{{rules}}}</style>"
            f"<div class='scroll'><table class='{cls}'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table></div>")


def _css_string(text: str) -> str:
    """A CSS string literal of our own header text (never run data): quotes, backslashes and
    anything that could close the <style> element are escaped."""
    return '"' + "".join(c if c.isalnum() or c in " ()[],.-_" else f"\\{ord(c):x} " for c in text) + '"'


def _cells(*values: str) -> str:
    return "".join(f"<td>{v}</td>" for v in values)


def _age(seconds: float | None) -> str:
    return "no record yet" if seconds is None else f"last record {ago(seconds)}"


def _body(a):
    try:
        return a.body
    except ContractError:
        return None


def attention(e, run_url: Callable[..., str], base: str, incs: list[dict], acts: list, selected: int | None,
              costs: dict[int, dict[str, str]] | None = None) -> str:
    """What waits for a person: open incidents and actions awaiting approval (also fetched alone
    by the script to refresh it: it is the page's #attention element)."""
    open_incs = [i for i in reversed(incs) if i["state"] == "open"]
    waiting = [a for a in acts if a.requires_approval and a.state is ActionState.PENDING]
    cards = []
    for a in waiting:
        inc = f" for incident <a href='{e(run_url(a.run_id, incident=a.incident_id))}'>#{a.incident_id}</a>" \
            if a.incident_id is not None else ""
        cards.append(
            f"<div class='card approval' id='approval-{a.id}' data-action-id='{a.id}'>"
            f"<div class='what'><b>{e(a.kind)}</b> awaits approval (action {a.id}){inc}</div>"
            f"<div class='args'>{e(describe_args(a.kind, a.args))}</div>"
            + "".join(f"<div class='cost'><b>{e(k)}:</b> {e(v)}</div>" for k, v in (costs or {}).get(a.id, {}).items())
            + f"<div class='why'>{e(a.reason)}</div>"
            f"<div class='buttons'><button class='approve' data-verb='approve' data-action-id='{a.id}'>Approve</button> "
            f"<button class='cancel' data-verb='cancel' data-action-id='{a.id}'>Cancel</button> "
            f"<span class='muted'>or <code>thermowatch approve {a.id}</code></span>"
            f"<span class='result' role='status'></span></div></div>")
    for i in open_incs:
        finds = "".join(f"<li><b>{e(f['signal'])}</b> {e(f['metric'] or f['module'])} ({e(f['severity'])}) "
                        f"onset {f['onset_step']}, detected {f['detect_step']} {pairs(f['evidence'])}</li>"
                        for f in i["findings"][:6])
        more = f"<li class='muted'>… {len(i['findings']) - 6} more findings below</li>" if len(i["findings"]) > 6 else ""
        # a phone shows the first finding only (run.css): the approval and the first chart come first
        rest = (f"<div class='phone-only muted'>+{len(i['findings']) - 1} more finding(s) in "
                f"<a href='#incident-{i['id']}'>the incidents table</a></div>" if len(i["findings"]) > 1 else "")
        sel = " selected" if i["id"] == selected else ""
        cards.append(
            f"<div class='card incident{sel}' id='open-incident-{i['id']}'>"
            f"<div class='what'><a href='{e(run_url(i['run_id'], incident=i['id']))}'>incident #{i['id']}</a> "
            f"<b>{e(i['signal'])}</b> {e(i['module'])} <span class='sev-{e(i['severity'])}'>{e(i['severity'])}</span></div>"
            f"<div>onset step {i['onset_step']} &middot; detected {i['detect_step']}</div>"
            f"<ul class='findings'>{finds}{more}</ul>{rest}</div>")
    ids = " ".join([f"a{a.id}" for a in waiting] + [f"i{i['id']}" for i in open_incs])
    body = "".join(cards) or "<p class='muted calm'>nothing waits for you: no open incident, no action awaiting approval</p>"
    return f"<section id='attention' data-ids='{e(ids)}'>{body}</section>"


def chart_png_url(base: str, run_id: str, **query: Any) -> str:
    """The one PNG route (api/chart.py's GET /api/runs/{run}/chart.png): the page's images too."""
    q = urlencode({k: v for k, v in query.items() if v is not None})
    return f"{base}/api/runs/{quote(run_id, safe='')}/chart.png" + (f"?{q}" if q else "")


def chart_assets(e, base: str) -> tuple[str, str]:
    """(head, scripts) of a page that draws charts in the browser (the run page, compare): uPlot,
    run.css and run.js, served by the daemon itself (web/assets.py)."""
    head = (f"<link rel='stylesheet' href='{e(base)}/static/uplot/uPlot.min.css'>"
            f"<link rel='stylesheet' href='{e(base)}/static/run.css'>")
    scripts = (f"<script src='{e(base)}/static/uplot/uPlot.iife.min.js'></script>"
               f"<script src='{e(base)}/static/run.js'></script>")
    return head, scripts


def render(sup: Daemon, e, page: Callable[[str, str], HTMLResponse], run_url: Callable[..., str], base: str,
           charts: list, zoom_window: Callable, run_id: str, incident: int | None, step_lo: int | None,
           step_hi: int | None, *, only_attention: bool = False, attempts_before: int | None = None) -> HTMLResponse:
    stall_s = sup.cfg.detectors.stall.timeout_s
    with sup.sessions() as s:
        run = require_run(s, run_id)
        incs = incidents_with_findings(s, run_id)
        for i in incs:
            i["run_id"] = run_id
        selected = None
        if incident is not None:
            selected = next((i for i in incs if i["id"] == incident), None)
            if selected is None:
                ids = ", ".join(str(i["id"]) for i in incs[-10:]) or "none"
                raise HTTPException(404, f"run {run_id!r} has no incident {incident}; its incidents: {ids}")
            if step_lo is None and step_hi is None:
                step_lo, step_hi = zoom_window(s, run_id, incident, selected["onset_step"], selected["detect_step"])
        acts = actions_store.actions(s, run_id, limit=500)
        costs = {a.id: story_store.cost(s, run_id, _body(a)) for a in acts
                 if a.requires_approval and a.state is ActionState.PENDING}
        top = attention(e, run_url, base, incs, acts, incident, costs)
        if only_attention:
            return HTMLResponse(top)
        status = run_status(s, run_id, stall_after_s=stall_s)
        keys = thermometers.series_keys(s, run_id)
        cost = thermometers.latest_values(s, run_id, [k for k in keys if k == THERMOMETER_COST
                                                      or k.startswith(THERMOMETER_EVERY + "/")])
        attempts, older = runs_store.attempts_page(s, run_id, ATTEMPTS_SHOWN, attempts_before)
        ckpts = ckpt_store.checkpoints(s, run_id, include_deleted=True)
        skips = skips_store.skip_ranges(s, run_id)
        lrs = lr_store.lr_changes(s, run_id)
        audit = audit_store.audit_log(s, run_id, limit=AUDIT_TAIL)
        told = story_store.story(s, run_id)

    parts = [_header(e, base, run, status, told, told.attempts, cost), top]
    if selected is not None:
        parts.append(_banner(e, selected))
    parts.append(_charts(e, run_url, base, charts, run_id, keys, told.attempts, incident, step_lo, step_hi))
    pages = AttemptPages(told.attempts, older, attempts_before,
                         lambda before: run_url(run_id, incident=incident, step_lo=step_lo, step_hi=step_hi,
                                                attempts_before=before) + "#attempts")
    parts.append(_tables(e, run_url, run_id, incs, acts, selected, incident, skips, lrs, ckpts, attempts, pages, audit))
    head, scripts = chart_assets(e, base)
    return page(f"{run.run_id}: thermowatch", head, "".join(parts) + scripts)


def _cost(e, cost: dict[str, float]) -> str:
    """What the thermometers cost the trainer, as its client measured it (issue 36); nothing when
    the client keeps no budget (it did not measure)."""
    share = cost.get(THERMOMETER_COST)
    if share is None:
        return ""
    every = ", ".join(f"{k.split('/', 1)[1]} every {v:.0f}" for k, v in sorted(cost.items())
                      if k.startswith(THERMOMETER_EVERY + "/"))
    return (f" &middot; <span title='the share of the training step the thermometers took, as the client "
            f"measured it on its device; the groups are read at these cadences'>thermometers "
            f"<b id='thermometer-cost'>{e(f'{100 * share:.1f}%')}</b> of a step"
            + (f" ({e(every)})" if every else "") + "</span>")


def _header(e, base: str, run, status: dict, told, n_attempts: int, cost: dict[str, float] | None = None) -> str:
    """The run's name, state badge, facts and story."""
    state = status["state"]
    # The badge and the story agree: a run that reached its planned steps (or was stopped) without
    # a finish report reads "finished (why)", not "not finished".
    ending = told.ending() if told.finished is not None or state != "finished" else f"finished ({status['why']})"
    return (
        f"<header><p class='nav'><a href='{e(base or '/')}'>&larr; all runs</a> &middot; "
        f"<a href='{e(base)}/docs'>API</a></p>"
        f"<h1>run {e(run.run_id)} <span id='badge' class='badge state-{e(state)}' title='{e(status['why'])}'>"
        f"{e(state)}</span></h1>"
        f"<p class='facts'><span id='age' data-age='{e(status['last_record_age_s'])}'>{e(_age(status['last_record_age_s']))}"
        f"</span> &middot; step <b id='last-step'>{e(status['last_step'] if status['last_step'] is not None else '-')}</b>"
        + (f" of {status['planned_steps']}" if status["planned_steps"] else "")
        # the run's attempt, as status and the runs list show it (runs.newest_attempt); how many were opened on hover
        + f" &middot; <span title='{n_attempts} attempt(s) opened'>attempt <b id='attempt'>"
        f"{e(status['attempt'] if status['attempt'] is not None else '-')}</b></span>"
        + _cost(e, cost or {})
        + f" &middot; created {_ts(run.created_at)}</p>"
        # The story first, in words (issue 23): how it ended and what the supervisor did to it.
        f"<p class='story' id='story'><b>{e(ending)}</b>: {e(told.words())}</p></header>")


def _banner(e, selected: dict) -> str:
    """The incident the link asked for, above the charts."""
    return (f"<div class='banner'>incident <a href='#incident-{selected['id']}'>#{selected['id']}</a>: "
            f"<b>{e(selected['signal'])}</b> {e(selected['module'])} &middot; onset {selected['onset_step']}, "
            f"detected {selected['detect_step']} &middot; {e(selected['state'])}"
            f"{' &middot; ' + e(selected['resolution']) if selected['resolution'] else ''}</div>")


def _charts(e, run_url, base: str, charts: list, run_id: str, keys, n_attempts: int, incident: int | None,
            step_lo: int | None, step_hi: int | None) -> str:
    """The thermometers section: the toolbar, one figure per chart the run has series for (drawn
    by run.js; a PNG from the one PNG route without script), links to the other series."""
    parts = [
        f"<section id='charts' data-run='{e(run_id)}' data-base='{e(base)}' data-refresh='{REFRESH_S}' "
        f"data-lo='{e(step_lo if step_lo is not None else '')}' data-hi='{e(step_hi if step_hi is not None else '')}' "
        f"data-incident='{e(incident if incident is not None else '')}'>"
        "<h2>thermometers</h2>"
        "<div class='toolbar'><span id='window'>"
        + (f"steps {e(step_lo if step_lo is not None else 0)}&ndash;{e(step_hi if step_hi is not None else 'end')} "
           f"&middot; <a href='{e(run_url(run_id))}'>full history</a>" if step_lo is not None or step_hi is not None
           else "the whole run")
        + "</span> <button id='reset' type='button' hidden>reset zoom</button> "
          "<label class='auto'><input type='checkbox' id='auto' checked> auto-refresh</label> "
          "<label>x <select id='xaxis'><option value='step'>step</option><option value='time'>wall clock</option>"
          "</select></label> "
          "<label>smoothing <select id='smooth'><option value='0'>off</option><option value='0.6'>0.6</option>"
          "<option value='0.9'>0.9</option><option value='0.97'>0.97</option></select></label> "
          "<span id='chart-status' class='muted'></span></div>"
          "<p class='muted hint'>Drag across a chart to zoom (the data is fetched again at the finer resolution); "
          "hover for values.</p>"]
    if n_attempts > 1:  # above the charts: the first thing to read before the lines
        parts.append("<p class='muted' id='superseded-note'>Faded dashed lines: trajectories abandoned by a "
                     "rollback (or a restart from an earlier checkpoint), i.e. an older attempt's points at steps a "
                     "newer attempt re-trained, in the same color as their series. Solid lines: the live path, "
                     "the newest attempt at each step.</p>")
    shown = []
    for metric, title, logy in charts:
        if metric in keys or any(k.startswith(metric + "/") for k in keys):
            shown.append(metric)
            src = chart_png_url(base, run_id, metric=metric, step_lo=step_lo, step_hi=step_hi, incident=incident)
            per_layer = metric not in keys
            parts.append(
                f"<figure class='chart' data-metric='{e(metric)}' data-log='{int(logy)}' "
                f"data-layers='{int(per_layer)}'><figcaption>{e(title)}</figcaption><div class='plot-area'></div>"
                "<div class='marks-info muted'></div>"
                + ("<div class='heat'><label class='muted heat-pick' hidden>heatmap of <select class='heat-attempt'>"
                   "<option value=''>the live path</option></select></label>"
                   "<div class='heat-body'><div class='heat-labels'></div><canvas class='heatmap'></canvas></div>"
                   "<div class='heat-info muted'></div></div>"
                   if per_layer else "")
                + f"<noscript><img class='plot' data-metric='{e(metric)}' alt='{e(title)}' src='{e(src)}' "
                  f"width='1100' height='320'></noscript></figure>")
    if not shown:
        parts.append("<p class='muted'>no thermometers reported yet</p>")
    others = sorted({k.split("/", 1)[0] for k in keys} - set(shown))
    if others:
        links = " ".join(f"<a href='{e(chart_png_url(base, run_id, metric=m, step_lo=step_lo, step_hi=step_hi))}'>"
                         f"{e(m)}</a>" for m in others)
        parts.append(f"<p>other series: {links}</p>")
    parts.append("</section>")
    return "".join(parts)


FINDINGS_SHOWN = 3  # per incident in the table; the rest behind a click
INCIDENTS_UNFOLDED = 3  # a phone folds the incidents table of a run with more (the demo's has 9)


@dataclass(frozen=True)
class AttemptPages:
    """Where the attempts table's page sits in the run's attempts, and its links."""

    total: int  # attempts opened
    older: int | None  # attempts_before of the next, older page (None: this page holds the oldest)
    before: int | None  # this page's attempts_before (None: the newest)
    url: Callable[[int | None], str]  # the page of attempts numbered below its argument (None: the newest)

    def heading(self, shown: int) -> str:
        if self.older is None and self.before is None:
            return ""
        which = "the newest" if self.before is None else f"below attempt {self.before}:"
        return f" <span class='muted'>({which} {shown} of {self.total})</span>"

    def links(self, e) -> str:
        out = []
        if self.before is not None:
            out.append(f"<a id='newest-attempts' href='{e(self.url(None))}'>&larr; newest attempts</a>")
        if self.older is not None:
            out.append(f"<a id='older-attempts' href='{e(self.url(self.older))}'>older attempts &rarr;</a>")
        return f"<p class='pager'>{' &middot; '.join(out)}</p>" if out else ""


def _tables(e, run_url, run_id, incs, acts, selected, incident, skips, lrs, ckpts, attempts, pages: AttemptPages,
            audit) -> str:
    # More than a few incidents fold on a phone too (the open ones are at the top, in #attention);
    # a link to one of them (#incident-N) opens the fold (run.js).
    fold = "fold" if len(incs) > INCIDENTS_UNFOLDED else "keep"
    n_open = sum(i["state"] == "open" for i in incs)
    parts = [f"<details class='{fold}' open><summary><h2>incidents <span class='muted'>({len(incs)}, {n_open} open)"
             "</span></h2></summary>"]
    rows = []
    for i in reversed(incs):
        cls = " ".join(c for c in ("open" if i["state"] == "open" else "", "selected" if i is selected else "") if c)
        items = [f"<li>{e(f['signal'])} {e(f['metric'] or f['module'])} ({e(f['severity'])}) onset {f['onset_step']} "
                 f"detect {f['detect_step']} {pairs(f['evidence'])}</li>" for f in i["findings"]]
        finds = "".join(items[:FINDINGS_SHOWN]) + (  # pruned: the first few, the rest one click away
            f"<li><details><summary>{len(items) - FINDINGS_SHOWN} more findings</summary><ul>"
            f"{''.join(items[FINDINGS_SHOWN:])}</ul></details></li>" if len(items) > FINDINGS_SHOWN else "")
        rows.append(f"<tr id='incident-{i['id']}' class='{cls}'>" + _cells(
            f"<a href='{e(run_url(run_id, incident=i['id']))}'>#{i['id']}</a>", e(i["signal"]), e(i["module"]),
            e(i["severity"]), str(i["onset_step"]), str(i["detect_step"]), e(i["state"]), e(i["resolution"]),
            f"<ul class='findings'>{finds}</ul>" if finds else "") + "</tr>")
    parts.append(table(e, "incidents", ["id", "signal", "module", "severity", "onset", "detect", "state", "resolution",
                                        "findings"], rows, "no incidents", wide=("resolution", "findings")))
    parts.append("</details>")
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
            str(a.id), e(a.kind), pairs(a.args), state, e(a.origin), e(a.who), e(a.reason),
            e(a.ack_step if a.ack_step is not None else ""), inc_link, _ts(a.created_at)) + "</tr>")
    parts.append(table(e, "actions", ["id", "kind", "args", "state", "origin", "who", "reason", "ack step", "incident",
                                      "created (UTC)"], rows, "no actions", wide=("args", "reason")))
    parts.append("<h2>skip ranges <span class='muted'>(absolute sample indices, [lo, hi))</span></h2>")
    parts.append(table(e, "skips", ["lo", "hi", "samples"], ["<tr>" + _cells(str(lo), str(hi), str(hi - lo)) + "</tr>"
                                                     for lo, hi in skips], "nothing skipped"))
    parts.append("<h2>LR changes</h2>")
    parts.append(table(e, "lr", ["from step", "multiplier", "for steps", "action"], [
        "<tr>" + _cells(str(c.start_step), f"{c.multiplier:g}", e(c.steps if c.steps is not None else "for good"),
                        e(c.action_id if c.action_id is not None else "")) + "</tr>" for c in lrs], "none"))
    # Pruned: the checkpoints a rollback could still use; the deleted ones (most of them on a long
    # run) are folded away below, still listed for whoever wants the full record.
    head = ["step", "attempt", "healthy", "path", "sample cursor", "saved (UTC)"]

    def ckpt_row(c) -> str:
        return (f"<tr class='{'muted' if c.deleted else ''}'>" + _cells(
            str(c.step), str(c.attempt), "yes" if c.healthy else "<span class='bad'>no</span>",
            e(c.path) + (" (deleted)" if c.deleted else ""), str(c.sample_cursor), _ts(c.created_at)) + "</tr>")

    kept, gone = [c for c in reversed(ckpts) if not c.deleted], [c for c in reversed(ckpts) if c.deleted]
    # The reference tables below fold away on a phone (run.js closes them there; open without a
    # script): fifty audit rows as cards were most of the page's 20k px (issue 37).
    parts.append(f"<details class='fold' open><summary><h2>checkpoints <span class='muted'>({len(kept)})</span>"
                 "</h2></summary>")
    parts.append(table(e, "checkpoints", head, [ckpt_row(c) for c in kept],
                       "no checkpoint on disk" if gone else "no checkpoints reported", wide=("path",)))
    if gone:
        parts.append(f"<details id='deleted-checkpoints'><summary class='muted'>{len(gone)} deleted checkpoint(s)"
                     "</summary>" + table(e, "checkpoints", head, [ckpt_row(c) for c in gone], "", wide=("path",))
                     + "</details>")
    parts.append("</details>")
    parts.append(f"<details class='fold' open><summary><h2 id='attempts'>attempts{pages.heading(len(attempts))}</h2>"
                 "</summary>")
    parts.append(table(e, "attempts", ["attempt", "started (UTC)", "start step", "world size"], [
        "<tr>" + _cells(str(a.attempt), _ts(a.started_at), str(a.start_step), str(a.world_size)) + "</tr>"
        for a in attempts], "none"))  # newest first
    parts.append(pages.links(e))
    parts.append("</details>")
    parts.append(f"<details class='fold' open><summary><h2>audit (last {AUDIT_TAIL})</h2></summary>")
    parts.append(table(e, "audit", ["at (UTC)", "actor", "event", "detail"], [
        "<tr>" + _cells(_ts(a.at), e(a.actor), e(a.event), pairs(a.detail)) + "</tr>" for a in audit], "empty",
        wide=("detail",)))
    parts.append("</details>")
    return "".join(parts)
