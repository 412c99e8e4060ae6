"""HTML pages: the runs list and the run page the Slack alert links to (`/runs/{run_id}?incident=N`,
rendered by run_page.py); its charts as PNGs come from the API's one PNG route.

    GET /?cursor=&sort=&state=&q=          runs table, newest first, a page at a time; the page sorted
                                           (run, state, last step, last update) and filtered (state, a
                                           text in the run id) as asked; refreshed by static/runs.js
    GET /runs/{run_id}?incident=&step_lo=&step_hi=&attempts_before=
                                           state, what waits (incidents, approvals), charts, tables;
                                           the newest 20 attempts, attempts_before= pages to older ones
    GET /runs/{run_id}/attention?incident= the page's open incidents and approvals alone (its refresh)
    GET /runs/{run_id}/plot.png?...        moved (307) to GET /api/runs/{run_id}/chart.png (same query):
                                           the <noscript> charts' one PNG route (api/chart.py)

With ?incident=N the page zooms every chart to the steps around that incident (onset, detection
and the rollback target), highlights its row and puts a summary banner above the charts.
Every string that came from a run (ids, module names, reasons, audit details) is HTML-escaped.
Every page needs the `read` scope (or `public_read: true`): a bearer token, or the cookie of the
sign-in form (web/login.py).
"""

from __future__ import annotations

import datetime as dt
import html
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode, urlparse

from fastapi import APIRouter, Depends, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, RedirectResponse
from sqlalchemy.orm import Session

from thermowatch.supervisor.serve.guard import Guard
from thermowatch.supervisor.serve.daemon import Daemon
from thermowatch.supervisor.store.views import (
    check_window,
    require_run,
    runs_page,
)
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import metrics as metrics_store
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.charts.plots import LOG_METRICS
from thermowatch.supervisor.serve.web.readable import ago
from thermowatch.supervisor.serve.web.run_page import chart_assets, chart_png_url, table

# (metric prefix, chart title, log y) in page order; charts whose metric the run lacks are left out.
CHARTS = [
    ("loss", "loss", False),
    ("grad_norm", "gradient norm (global, before clipping)", True),
    ("lr", "learning rate", False),
    ("attn_logit_max", "max attention logit, every layer", True),
    ("attn_logit_lse", "attention logit log-sum-exp bound, every layer", True),
    ("act_max", "activation max, per module", True),
    ("act_min", "activation min, per module (layers ranked by their lowest value)", False),
]
AUDIT_TAIL = 50
INDEX_PAGE = 100  # runs on one page of the index (the API's default page)
COMPARE_MAX = 8  # runs on one comparison chart: the palette's colours, and a bounded page
ZOOM_MIN_PAD = 50  # steps shown either side of an incident, at least

# Light and dark (the reader's system preference): every colour below is a variable, and
# run.js reads --ink / --grid / --empty for what it draws on canvases.
CSS = """
:root{color-scheme:light dark;--bg:#fff;--ink:#222;--line:#ddd;--head:#f4f4f4;--card:#fff;--warnbg:#fff3c4;
--grid:rgba(0,0,0,.07);--empty:#f3f3f3;--link:#0645ad}
@media (prefers-color-scheme:dark){:root{--bg:#15181d;--ink:#d8dde3;--line:#3a4048;--head:#22272e;--card:#1c2128;
--warnbg:#3a3114;--grid:rgba(255,255,255,.08);--empty:#22272e;--link:#6cb6ff}}
body{font:14px/1.4 system-ui,sans-serif;margin:1.2em 2em;color:var(--ink);background:var(--bg)} a{color:var(--link)}
h1{font-size:1.4em;margin:.2em 0} h2{font-size:1.1em;margin:1.4em 0 .4em;border-bottom:1px solid var(--line)}
table{border-collapse:collapse;margin:.3em 0;font-size:13px} td,th{border:1px solid var(--line);padding:3px 7px;
vertical-align:top;text-align:left} th{background:var(--head)} tr.open td:first-child{border-left:4px solid #d33}
tr.selected{background:var(--warnbg);outline:2px solid #e0a800} .muted{color:#888} .bad{color:#e5534b;font-weight:600}
.state{font-weight:600} .state-running{color:#1a7f37} .state-stalled{color:#e5534b} .state-finished{color:#888}
.banner{background:var(--warnbg);border:1px solid #e0a800;padding:.5em .8em;margin:.6em 0}
img.plot{display:block;max-width:100%;margin:.3em 0;border:1px solid #eee} img.broken{border:2px solid #c00}
code{font-size:12px;white-space:pre-wrap;word-break:break-all} ul.findings{margin:0;padding-left:1.1em}
.phone-only{display:none}
@media (max-width:700px){
body{margin:.6em .7em} .phone-only{display:block}
table.cards,table.cards tbody{display:block}
table.cards thead{position:absolute;width:1px;height:1px;overflow:hidden;clip-path:inset(50%)}
table.cards tr{display:flex;flex-wrap:wrap;gap:0 .8em;border:1px solid var(--line);border-radius:4px;margin:0 0 .5em;
padding:.3em .5em;background:var(--card)}
table.cards td{display:block;border:0;padding:1px 0;flex:0 1 auto;min-width:0;overflow-wrap:anywhere}
table.cards td::before{margin-right:.35em;font-size:11px;color:#888}
table.cards td:empty{display:none} table.cards tr.open{border-left:4px solid #d33}
table.cards tr.open td:first-child{border-left:0} .scroll{overflow-x:visible}
}
"""


def e(value: Any) -> str:
    """HTML-escape anything shown on the page (quotes too: values land in attributes)."""
    return html.escape("" if value is None else str(value), quote=True)


def _ts(t: dt.datetime | None) -> str:
    return t.astimezone(dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ") if t is not None else ""


def _args(obj: Any) -> str:
    return f"<code>{e(json.dumps(obj, sort_keys=True, default=str))}</code>" if obj else ""


def _page(title: str, body: str, head_or_body: str | None = None) -> HTMLResponse:
    """_page(title, body) or _page(title, extra head elements, body)."""
    head, body = (body, head_or_body) if head_or_body is not None else ("", body)
    return HTMLResponse(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(title)}</title>"
        f"<meta name='viewport' content='width=device-width, initial-scale=1'><link rel='icon' href='data:,'>"
        f"<style>{CSS}</style>{head}</head>"
        f"<body>{body}</body></html>")


def _cells(*values: str) -> str:
    """Cells already escaped/rendered by the caller."""
    return "".join(f"<td>{v}</td>" for v in values)


def zoom_window(s: Session, run_id: str, incident_id: int, onset: int, detect: int) -> tuple[int, int]:
    """Steps around an incident: from before its onset (or the rollback target, if earlier) to
    after its detection, padded by half the span (at least ZOOM_MIN_PAD steps)."""
    lo, hi = onset, detect
    for a in actions_store.actions(s, run_id, limit=10_000):
        if a.incident_id == incident_id and a.kind == "rollback":
            if a.checkpoint_step is not None:
                lo = min(lo, a.checkpoint_step)
    pad = max(ZOOM_MIN_PAD, (hi - lo) // 2)
    return max(0, lo - pad), hi + pad


# The index's orders (?sort= key: its label); "created" is the store's own order, newest first.
# By state, the runs that need a look come first: stalled, then starting, running, paused, finished.
SORTS = {"created": "newest first", "run": "run", "state": "state", "step": "last step", "updated": "last update"}
STATE_ORDER = ("stalled", "starting", "running", "paused", "finished")
INDEX_REFRESH_S = 15  # runs.js fetches the page again this often while auto-refresh is ticked


@dataclass(frozen=True)
class IndexView:
    """What the index shows of its page of runs: the sort, the state filter and the text filter,
    all in the address (links and the no-script form keep them)."""

    sort: str = "created"
    state: str = ""  # "" = every state
    q: str = ""  # a case-insensitive substring of the run id

    def __post_init__(self) -> None:
        if self.sort not in SORTS:
            raise HTTPException(422, f"sort={self.sort!r} is not one of {', '.join(SORTS)}")
        if self.state and self.state not in STATE_ORDER:
            raise HTTPException(422, f"state={self.state!r} is not one of {', '.join(STATE_ORDER)} (or empty: all)")

    def query(self, **more: Any) -> dict[str, Any]:
        """The view's query parameters (defaults left out), plus `more`."""
        q = {"sort": self.sort if self.sort != "created" else None, "state": self.state or None, "q": self.q or None}
        return {k: v for k, v in {**q, **more}.items() if v is not None}

    def keep(self, row: dict) -> bool:
        return (not self.state or row["state"] == self.state) and self.q.casefold() in row["run_id"].casefold()

    def order(self, rows: list[dict]) -> list[dict]:
        """Rows of the store's page (newest first) in the view's order; ties keep that order."""
        if self.sort == "run":
            return sorted(rows, key=lambda r: r["run_id"].casefold())
        if self.sort == "state":
            return sorted(rows, key=lambda r: STATE_ORDER.index(r["state"]))
        if self.sort == "step":  # furthest first; runs with no step last
            return sorted(rows, key=lambda r: (r["last_step"] is None, -(r["last_step"] or 0)))
        if self.sort == "updated":  # most recently heard from first; never heard from last
            return sorted(rows, key=lambda r: (r["age"] is None, r["age"] or 0.0))
        return rows


def _index_rows(sup: Daemon, cursor: str | None) -> tuple[list[dict], str | None]:
    """A page of runs (the store's order: newest first) with what the index shows of each."""
    # What W&B's and Grafana's users look for first (issue 23): per run its state, where it is,
    # its loss, what is open and when it last reported; a page of runs in three statements.
    stall_s = sup.cfg.detectors.stall.timeout_s
    now = dt.datetime.now(dt.timezone.utc)
    with sup.sessions() as s:
        page = runs_page(s, INDEX_PAGE, cursor)
        ids = [r["run_id"] for r in page["runs"]]
        seen = {g.run_id: g.last_record_at for g in metrics_store.run_gauges(s, ids)}
        ends = runs_store.newest_finishes(s, ids)
    rows = []
    for r in page["runs"]:
        rid = r["run_id"]
        end, at = ends.get(rid), seen.get(rid)
        age = (now - at).total_seconds() if at is not None else None
        prog = sup.progress.get(rid)
        if end is not None:
            state, loss = "finished", end.final_loss
        else:
            state = ("starting" if r["last_step"] is None else "stalled" if age is None or age > stall_s
                     else "running")
            loss = prog.loss if prog is not None else None
        rows.append({**r, "state": state, "loss": loss, "age": age})
    return rows, page["next_cursor"]


def index_page(sup: Daemon, base: str, run_url, cursor: str | None, view: IndexView = IndexView()) -> HTMLResponse:
    """`GET /`: a page of runs (newest first, or as `view` sorts them), filtered by `view`."""
    all_rows, next_cursor = _index_rows(sup, cursor)
    rows = []
    for r in view.order([r for r in all_rows if view.keep(r)]):
        n_open, rid, loss, age, state = r["open_incidents"], r["run_id"], r["loss"], r["age"], r["state"]
        rows.append(f"<tr class='run-row' data-run='{e(rid)}'>" + _cells(
            f"<input type='checkbox' name='run' value='{e(rid)}' form='compare' aria-label='compare {e(rid)}'> "
            f"<a href='{e(run_url(rid))}'>{e(rid)}</a>", f"<span class='state state-{state}'>{state}</span>",
            e(r["last_step"] if r["last_step"] is not None else "-"),
            e(f"{loss:.4g}" if loss is not None else "-"),
            f"<span class='bad'>{n_open}</span>" if n_open else "0",
            e(ago(age) if age is not None else "-"), e(r["attempt"] if r["attempt"] is not None else "-"),
            e(r["created_at"][:19].replace("T", " ") + "Z")) + "</tr>")
    links = []
    if cursor:
        q = urlencode(view.query())
        links.append(f"<a href='{e(base)}/{'?' + q if q else ''}' id='newest'>newest runs</a>")
    if next_cursor:
        links.append(f"<a href='{e(base)}/?{urlencode(view.query(cursor=next_cursor))}' id='older'>older runs</a>")
    if not all_rows:
        empty = "no older runs" if cursor else "no runs yet: a run appears when its run controller first reports"
    else:
        empty = f"none of this page's {len(all_rows)} runs match"
    sorts = "".join(f"<option value='{k}'{' selected' if k == view.sort else ''}>{e(t)}</option>"
                    for k, t in SORTS.items())
    states = "<option value=''>every state</option>" + "".join(
        f"<option value='{k}'{' selected' if k == view.state else ''}>{k}</option>" for k in STATE_ORDER)
    now = dt.datetime.now(dt.timezone.utc)
    scope = (f"sorted and filtered within this page of {len(all_rows)} run(s) (pages run newest first)"
             if next_cursor or cursor else "")
    body = (f"<form method='post' action='{e(base)}/logout' style='float:right'>"
            "<button type='submit' id='sign-out'>sign out</button></form>"
            "<h1>thermowatch: runs</h1>"
            f"<form id='view' class='toolbar' method='get' action='{e(base)}/'>"
            + (f"<input type='hidden' name='cursor' value='{e(cursor)}'>" if cursor else "")
            + f"<label>sort <select name='sort' id='sort' onchange='this.form.submit()'>{sorts}</select></label> "
            f"<label>state <select name='state' id='state-filter' onchange='this.form.submit()'>{states}</select></label> "
            f"<input type='search' name='q' id='q' value='{e(view.q)}' placeholder='run name contains' "
            "aria-label='run name contains' size='16'> <button type='submit'>filter</button></form>"
            f"<p class='toolbar muted'><span id='updated' data-at='{now.isoformat()}'>updated "
            f"{now.strftime('%H:%M:%SZ')}</span> <label><input type='checkbox' id='auto' checked> auto-refresh every "
            f"{INDEX_REFRESH_S} s</label>" + (f" <span>{e(scope)}</span>" if scope else "") + "</p>"
            f"<form id='compare' method='get' action='{e(base)}/compare'><button type='submit'>compare the "
            f"ticked runs</button> <span class='muted'>(up to {COMPARE_MAX}, on one chart)</span></form>"
            f"<div id='runs-list' data-refresh='{INDEX_REFRESH_S}'>"
            + table(e, "runs", ["run", "state", "step", "loss", "open incidents", "last seen", "attempt",
                                "created (UTC)"], rows, empty, wide=("run",))
            + (f"<p>{' | '.join(links)}</p>" if links else "") + "</div>"
            f"<script src='{e(base)}/static/runs.js'></script>")
    return _page("thermowatch: runs", body)


def compare_page(sup: Daemon, base: str, run_url, run: list[str], metric: str, step_lo: int | None,
                 step_hi: int | None) -> HTMLResponse:
    """`GET /compare`: runs on one chart, each run's live path of `metric`."""
    ids = list(dict.fromkeys(r for r in run if r))
    if not 1 <= len(ids) <= COMPARE_MAX:
        raise HTTPException(422, f"compare takes 1 to {COMPARE_MAX} runs (?run=a&run=b), got {len(ids)}")
    check_window(step_lo, step_hi)
    with sup.sessions() as s:
        for rid in ids:
            require_run(s, rid)
    opts = "".join(f"<option value='{e(m)}'{' selected' if m == metric else ''}>{e(t)}</option>"
                   for m, t, _ in CHARTS)
    if metric not in {m for m, _, _ in CHARTS}:
        opts += f"<option value='{e(metric)}' selected>{e(metric)}</option>"
    hidden = "".join(f"<input type='hidden' name='run' value='{e(r)}'>" for r in ids)
    logy = metric.split("/", 1)[0] in LOG_METRICS
    body = (f"<p class='nav'><a href='{e(base or '/')}'>&larr; all runs</a></p>"
            f"<h1>compare {len(ids)} run(s)</h1>"
            f"<form method='get' action='{e(base)}/compare' class='toolbar'>{hidden}"
            f"<label>thermometer <select name='metric' id='metric' onchange='this.form.submit()'>{opts}</select></label>"
            "<noscript><button type='submit'>show</button></noscript></form>"
            f"<section id='compare' data-runs='{e(json.dumps(ids))}' data-metric='{e(metric)}' "
            f"data-log='{int(logy)}' data-base='{e(base)}' "
            f"data-lo='{e(step_lo if step_lo is not None else '')}' data-hi='{e(step_hi if step_hi is not None else '')}'>"
            "<p class='toolbar'><span id='window'></span> <button id='reset' type='button' hidden>reset zoom</button> "
            "<span id='chart-status' class='muted'></span></p>"
            f"<figure class='chart'><figcaption>{e(metric)}</figcaption><div class='plot-area'></div></figure>"
            "<p class='muted hint'>Each run's live path (the newest attempt at each step); a per-layer thermometer "
            "is drawn as its worst layer per bucket; each run's incidents (solid, at their detection step) and "
            "rollbacks (dotted, at the checkpoint they loaded) in its colour. Drag to zoom.</p>"
            "<ul id='runs'>" + "".join(f"<li><a href='{e(run_url(r))}'>{e(r)}</a></li>" for r in ids) + "</ul>"
            "</section>")
    head, scripts = chart_assets(e, base)
    return _page(f"compare: {', '.join(ids)}", head, body + scripts)


def make_router(sup: Daemon, *, guard: Guard, public_url: str = "") -> APIRouter:
    router = APIRouter(tags=["web"], include_in_schema=False,
                       dependencies=[Depends(guard.require("read", cookie=True))])
    # Behind an ingress that serves us under a path (https://host/thermowatch), links carry it.
    base = urlparse(public_url).path.rstrip("/") if public_url else ""

    def run_url(run_id: str, suffix: str = "", **query: Any) -> str:
        q = urlencode({k: v for k, v in query.items() if v is not None})
        return f"{base}/runs/{quote(run_id, safe='')}{suffix}" + (f"?{q}" if q else "")

    @router.get("/", response_class=HTMLResponse)
    def index(cursor: str | None = Query(None, max_length=1000, description="the page after this one's runs"),
              sort: str = Query("created", description=f"the page's order: {', '.join(SORTS)}"),
              state: str = Query("", description=f"only runs in this state: {', '.join(STATE_ORDER)}"),
              q: str = Query("", max_length=200, description="only runs whose id contains this (any case)"),
              ) -> HTMLResponse:
        return index_page(sup, base, run_url, cursor, IndexView(sort, state, q.strip()))

    @router.get("/compare", response_class=HTMLResponse)
    def compare(
        run: list[str] = Query([], description=f"the runs to overlay (1 to {COMPARE_MAX}; repeat the parameter)"),
        metric: str = Query("loss", max_length=200, pattern=r"^[A-Za-z0-9_.:/-]+$",
                            description="the thermometer; a per-layer one is drawn as its worst layer per bucket"),
        step_lo: int | None = Query(None, ge=0),
        step_hi: int | None = Query(None, ge=0),
    ) -> HTMLResponse:
        """Runs on one chart (issue 23: W&B's first habit): each run's live path of `metric`."""
        return compare_page(sup, base, run_url, run, metric, step_lo, step_hi)

    @router.get("/runs/{run_id}/plot.png")
    def plot(run_id: str, request: Request) -> RedirectResponse:
        """Moved: the page's images are GET /api/runs/{run}/chart.png (the one PNG route, with the
        same parameters). Links from before (bookmarks, old Slack messages) are sent there."""
        q = request.url.query
        return RedirectResponse(chart_png_url(base, run_id) + (f"?{q}" if q else ""), status_code=307)

    @router.get("/runs/{run_id}", response_class=HTMLResponse)
    def run_page(
        run_id: str,
        incident: int | None = Query(None, description="the incident to show (the Slack link sets it)"),
        step_lo: int | None = Query(None, ge=0),
        step_hi: int | None = Query(None, ge=0),
        attempts_before: int | None = Query(None, ge=0, description="list the attempts numbered below this one "
                                            "(the attempts table's link to older ones sets it)"),
    ) -> HTMLResponse:
        from thermowatch.supervisor.serve.web import run_page as rp

        check_window(step_lo, step_hi)
        return rp.render(sup, e, _page, run_url, base, CHARTS, zoom_window, run_id, incident, step_lo, step_hi,
                         attempts_before=attempts_before)

    @router.get("/runs/{run_id}/attention", response_class=HTMLResponse)
    def attention(run_id: str, incident: int | None = Query(None)) -> HTMLResponse:
        """The page's #attention section alone (open incidents, approvals): the script swaps it in
        when /status says what waits has changed."""
        from thermowatch.supervisor.serve.web import run_page as rp

        return rp.render(sup, e, _page, run_url, base, CHARTS, zoom_window, run_id, incident, None, None,
                         only_attention=True)

    return router
