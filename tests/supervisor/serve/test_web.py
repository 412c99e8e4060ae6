"""The web page and its charts on real SQLite and PostgreSQL, and once end to end in real headless
Chromium against a real uvicorn server. Needs /usr/bin/chromium (CI installs it in .ci/run)."""

from __future__ import annotations

import html
import json
import io
import os
import re
import shutil
import socket
import threading
import time
from urllib.parse import quote

import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.testclient import TestClient

from thermowatch.monitors.columns import StepColumns
from thermowatch.monitors.contract import StepRecord
from thermowatch.supervisor.serve.api import install_error_handlers
from thermowatch.supervisor.serve.api import chart as chart_api
from thermowatch.supervisor.serve.api import events as events_api
from thermowatch.supervisor.serve.api import runs as runs_api
from thermowatch.supervisor.serve.web import assets, login, pages
from tests.supervisor.auth_helpers import AUTH, bearer, guard, make_token
from tests.supervisor.serve.test_runs_api import RUN, Sup, _bulk_runs, seed

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


def _app(db, requests: list | None = None, public_url: str = "") -> FastAPI:
    sup = Sup(db.sessions)
    g = guard(db.sessions)
    app = FastAPI(docs_url=None, redoc_url=None)
    install_error_handlers(app)  # the store's NotFound -> 404, as the daemon's app
    app.include_router(runs_api.make_router(sup, guard=g))
    app.include_router(chart_api.make_router(sup, guard=g))
    app.include_router(events_api.make_router(sup, guard=g))
    app.include_router(pages.make_router(sup, guard=g, public_url=public_url))
    login.install(app, g, public_url=public_url)
    assets.install(app, public_url=public_url)
    if requests is not None:
        @app.middleware("http")
        async def log_requests(request: Request, call_next):
            response = await call_next(request)
            requests.append((request.url.path, str(request.url.query), response.status_code))
            return response
    return app


@pytest.fixture
def seeded(db):
    return seed(db)


@pytest.fixture
def client(db):
    with TestClient(_app(db), headers=AUTH) as c:
        yield c


def _png(r) -> bytes:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/png"
    assert r.content[:8] == PNG_SIGNATURE
    return r.content


def _pixels(png: bytes) -> np.ndarray:
    from matplotlib.image import imread

    return imread(io.BytesIO(png), format="png")


def test_plot_png_draws_the_metric(client, seeded):
    attn = _png(client.get(f"/runs/{RUN}/plot.png", params={"metric": "attn_logit_max"}))
    loss = _png(client.get(f"/runs/{RUN}/plot.png", params={"metric": "loss"}))
    one = _png(client.get(f"/runs/{RUN}/plot.png", params={"metric": "attn_logit_max/blocks.2.attn"}))
    assert len(attn) > 10_000 and len(loss) > 10_000
    assert len({attn, loss, one}) == 3
    px = _pixels(attn)
    assert px.shape[:2] == (320, 1100)
    assert len(np.unique(px.reshape(-1, px.shape[-1]), axis=0)) > 20  # lines, text, bands: not a blank canvas
    zoomed = _png(client.get(f"/runs/{RUN}/plot.png", params={"metric": "loss", "step_lo": 150, "step_hi": 230}))
    assert zoomed != loss


def test_plot_shows_the_selected_incident_and_nonfinite_points(client, seeded):
    base = {"metric": "grad_norm", "step_lo": 150, "step_hi": 260}
    plain = _pixels(_png(client.get(f"/runs/{RUN}/plot.png", params=base)))
    selected = _pixels(_png(client.get(f"/runs/{RUN}/plot.png", params={**base, "incident": seeded.incident})))
    assert not np.array_equal(plain, selected)  # the selected incident's lines are drawn heavier


def _pure_red(px: np.ndarray) -> int:
    return int(((px[..., 0] > 0.95) & (px[..., 1] < 0.1) & (px[..., 2] < 0.1)).sum())


def test_plot_marks_nonfinite_points(db, client):
    from thermowatch.monitors.contract import RunInfo, StepRecord
    from thermowatch.supervisor.store import runs, thermometers

    with db.sessions.begin() as s:
        for run_id, bad in (("finite", 1.0), ("nan", float("nan"))):
            runs.open_attempt(s, RunInfo(run_id, 0, world_size=1))
            thermometers.append(s, run_id, 0, [StepRecord(step=i, values={"loss": bad if i == 40 else 1.0 + i / 100})
                                               for i in range(100)])
    ok = _pixels(_png(client.get("/runs/finite/plot.png", params={"metric": "loss"})))
    nan = _pixels(_png(client.get("/runs/nan/plot.png", params={"metric": "loss"})))
    assert _pure_red(ok) == 0 and _pure_red(nan) > 20  # the red tick (and its legend entry)


def _bluish(px: np.ndarray) -> np.ndarray:
    """Pixels tinted toward C0 (tab:blue), faded or not: blue well above red."""
    return px[..., 2] - px[..., 0] > 0.15


def test_plot_draws_the_trajectory_a_rollback_abandoned(db, client):
    import sqlalchemy as sa

    from thermowatch.monitors.contract import RunInfo, StepRecord
    from thermowatch.supervisor.store import runs, thermometers
    from thermowatch.supervisor.store.orm import ThermometerChunk

    def loss(step: int, attempt: int) -> float:
        if step == 10:
            return 100.0  # before the rollback, in both renders: the y axis is the same in both
        return 1.0 + (9 * (step - 150) if attempt == 0 and 150 <= step <= 160 else 0.0)  # attempt 0 spikes to 91

    def recs(lo: int, hi: int, attempt: int) -> list[StepRecord]:
        return [StepRecord(step=i, values={"loss": loss(i, attempt)}) for i in range(lo, hi)]

    with db.sessions.begin() as s:
        runs.open_attempt(s, RunInfo("forked", 0, world_size=1))
        thermometers.append(s, "forked", 0, recs(0, 140, 0))
        thermometers.append(s, "forked", 0, recs(140, 201, 0))  # diverges, rolled back to 140
        runs.open_attempt(s, RunInfo("forked", 1, world_size=1, start_step=140))
        thermometers.append(s, "forked", 1, recs(140, 201, 1))
    params = {"metric": "loss", "logy": "false"}
    with_old = _pixels(_png(client.get("/runs/forked/plot.png", params=params)))
    with db.sessions.begin() as s:  # the same run without the superseded points
        s.execute(sa.delete(ThermometerChunk).where(ThermometerChunk.attempt == 0, ThermometerChunk.first_step == 140))
    without = _pixels(_png(client.get("/runs/forked/plot.png", params=params)))
    assert with_old.shape == without.shape
    # the faded spike: blue pixels where the newest attempt drew none, over a tall span of rows
    extra = _bluish(with_old) & ~_bluish(without)
    rows = np.flatnonzero(extra.any(axis=1))
    assert len(rows) > 100, len(rows)
    # faded, not solid: no fully saturated C0 among them (solid tab:blue is (0.12, 0.47, 0.71))
    assert (with_old[extra][:, 0] > 0.3).mean() > 0.5


def test_run_page_explains_faded_lines_only_after_a_new_attempt(client, seeded):
    page = client.get(f"/runs/{RUN}").text  # two attempts
    note = re.search(r"<p class='muted' id='superseded-note'>(.*?)</p>", page, re.DOTALL)
    assert note and "rollback" in note.group(1) and "Faded dashed lines" in note.group(1)
    assert page.index("superseded-note") < page.index("<img class='plot'")  # read before the charts
    one = client.get(f"/runs/{quote(seeded.evil_run, safe='')}").text  # one attempt: nothing to explain
    assert "superseded-note" not in one


def test_plot_bad_input(client, seeded):
    """plot.png is the API's chart.png now (one PNG route): its answers to bad input."""
    r = client.get(f"/runs/{RUN}/plot.png", params={"metric": "attn_logit_mx"})
    assert r.status_code == 404 and "attn_logit_max" in r.json()["detail"]
    r = client.get("/runs/nope/plot.png", params={"metric": "loss"})
    assert r.status_code == 404 and "no run 'nope'" in r.json()["detail"]
    assert client.get(f"/runs/{RUN}/plot.png").status_code == 422  # no metric
    # swapped bounds: the API's empty window (store/views.check_window), an empty chart
    r = client.get(f"/runs/{RUN}/plot.png", params={"metric": "loss", "step_lo": 9, "step_hi": 3})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"


def test_plot_png_moved_to_the_one_png_route_with_its_query(client, seeded):
    r = client.get(f"/runs/{RUN}/plot.png", params={"metric": "loss", "step_lo": 5, "incident": 1},
                   follow_redirects=False)
    assert r.status_code == 307
    assert r.headers["location"] == f"/api/runs/{RUN}/chart.png?metric=loss&step_lo=5&incident=1"
    direct = client.get(r.headers["location"])
    assert direct.status_code == 200 and direct.content == client.get(f"/runs/{RUN}/plot.png", params={
        "metric": "loss", "step_lo": 5, "incident": 1}).content


def test_index_lists_runs_with_links(client, seeded):
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert f"href='/runs/{RUN}'" in r.text
    assert html.escape(seeded.evil_run, quote=True) in r.text
    assert seeded.evil_run not in r.text  # never raw


def test_index_says_each_runs_state_step_loss_and_last_report(db, seeded):
    """Issue 23: the runs index reads like W&B's: state, step, loss, open incidents, last seen."""
    from thermowatch.monitors.contract import FinishReason, RunFinished
    from thermowatch.supervisor.store import judged
    from thermowatch.supervisor.store import runs as runs_store

    sup = Sup(db.sessions)
    with db.sessions.begin() as s:
        runs_store.finish_attempt(s, seeded.evil_run, 0, RunFinished(step=7, final_loss=2.375,
                                                                     reason=FinishReason.COMPLETED))
        judged.mark(s, RUN, 1, 260)  # the daemon judged RUN's attempt 1 through step 260 just now
    sup.progress.note(RUN, 1, StepColumns.from_records([StepRecord(step=260, values={"loss": 3.25}, wall_time=time.time())]))
    app = FastAPI()
    install_error_handlers(app)  # the store's NotFound -> 404, as the daemon's app
    app.include_router(pages.make_router(sup, guard=guard(db.sessions)))
    with TestClient(app, headers=AUTH) as c:
        page = c.get("/").text
    rows = {m[0]: m[1] for m in re.findall(r"<tr class='run-row' data-run='([^']*)'>(.*?)</tr>", page)}
    cells = {k: [re.sub(r"<[^>]+>", "", c) for c in re.findall(r"<td>(.*?)</td>", v)] for k, v in rows.items()}
    assert cells[RUN][1:6] == ["running", "260", "3.25", "0", "0 s ago"], cells[RUN]
    evil = cells[html.escape(seeded.evil_run, quote=True)]
    assert evil[1] == "finished" and evil[3] == "2.375" and evil[5] == "-", evil
    assert "<th>state</th><th>step</th><th>loss</th><th>open incidents</th><th>last seen</th>" in page


def test_compare_page_takes_one_to_eight_known_runs(client, seeded):
    r = client.get("/compare", params=[("run", RUN), ("run", seeded.evil_run), ("metric", "attn_logit_max")])
    assert r.status_code == 200 and "compare 2 run(s)" in r.text
    assert html.escape(json.dumps([RUN, seeded.evil_run]), quote=True) in r.text  # data-runs, escaped
    assert seeded.evil_run not in r.text
    assert "<option value='attn_logit_max' selected>" in r.text and "data-log='1'" in r.text
    r = client.get("/compare")
    assert r.status_code == 422 and "1 to 8 runs" in r.json()["detail"]
    r = client.get("/compare", params=[("run", f"r{i}") for i in range(9)])
    assert r.status_code == 422 and "got 9" in r.json()["detail"]
    r = client.get("/compare", params=[("run", RUN), ("run", "nope")])
    assert r.status_code == 404 and "nope" in r.json()["detail"]
    assert client.get("/compare", params={"run": RUN, "metric": "<x>"}).status_code == 422
    index = client.get("/").text
    assert f"<input type='checkbox' name='run' value='{RUN}' form='compare'" in index
    assert "<form id='compare' method='get' action='/compare'>" in index


def test_index_shows_the_newest_page_and_links_the_next(db, client):
    """At 10^5 runs the page lists 100 and links the rest (issue 21, item 4), newest first."""
    newest_first = _bulk_runs(db, 130)
    first = client.get("/")
    assert first.status_code == 200
    shown = re.findall(r"<a href='/runs/(bulk-\d+)'>", first.text)
    assert shown == newest_first[:100]
    (older,) = re.findall(r"<a href='(/\?cursor=[^']+)' id='older'>older runs</a>", first.text)
    assert "id='newest'" not in first.text
    second = client.get(html.unescape(older))
    assert re.findall(r"<a href='/runs/(bulk-\d+)'>", second.text) == newest_first[100:]
    assert "id='older'" not in second.text and "<a href='/' id='newest'>newest runs</a>" in second.text
    assert client.get("/", params={"cursor": "junk"}).status_code == 422


def test_run_page_has_plots_incidents_and_actions(client, seeded):
    r = client.get(f"/runs/{RUN}")
    assert r.status_code == 200
    page = r.text
    metrics = re.findall(r"<img class='plot' data-metric='([^']+)'", page)
    assert metrics == ["loss", "grad_norm", "lr", "attn_logit_max", "act_max"]
    # the PNGs are the no-script fallback; the script draws into each figure's plot area
    assert re.findall(r"<noscript><img class='plot' data-metric='([^']+)'", page) == metrics
    assert re.findall(r"<figure class='chart' data-metric='([^']+)'", page) == metrics
    for src in re.findall(r"<img class='plot'[^>]* src='([^']+)'", page):
        _png(client.get(html.unescape(src)))
    row = re.search(rf"<tr id='incident-{seeded.incident}'.*?</tr>", page, re.S).group(0)
    for text in ("attn_logit_growth", "blocks.2.attn", "185", "205", "resolved", "rollback done at step 100",
                 "non_finite"):
        assert text in row
    rb = re.search(rf"<tr id='action-{seeded.rollback}'.*?</tr>", page, re.S).group(0)
    for text in ("rollback", "done", "auto", "policy", "grew 18%/step", "<td>100</td>", "skip_ranges"):
        assert text in rb
    lr = re.search(rf"<tr id='action-{seeded.set_lr}'.*?</tr>", page, re.S).group(0)
    assert "alice" in lr and "pending" in lr
    assert "<td>1440</td><td>1648</td>" in page  # skip range
    assert "/ckpt/200" in page and "/ckpt/100" in page
    assert "enqueued" in page  # audit tail
    # the story first, in words (issue 23): what the supervisor did and what it cost
    story = re.search(r"<p class='story' id='story'>(.*?)</p>", page).group(1)
    for words in ("not finished, last step 260", "1 automatic rollback,", "208 samples skipped", "1 incident, 0 open",
                  "2 attempts"):
        assert words in story, (words, story)


def test_incident_link_zooms_and_highlights(client, seeded):
    page = client.get(f"/runs/{RUN}", params={"incident": seeded.incident}).text
    assert re.search(rf"<tr id='incident-{seeded.incident}' class='selected'", page)
    assert "class='banner'" in page
    srcs = [html.unescape(s) for s in re.findall(r"<img class='plot'[^>]* src='([^']+)'", page)]
    assert srcs and all(f"incident={seeded.incident}" in s for s in srcs)
    # window: rollback target 100 .. detect 205, padded by half the span (52)
    assert all("step_lo=48" in s and "step_hi=257" in s for s in srcs)
    r = client.get(f"/runs/{RUN}", params={"incident": 999})
    assert r.status_code == 404 and "no incident 999" in r.json()["detail"]
    assert client.get(f"/runs/{RUN}", params={"incident": "one"}).status_code == 422
    assert client.get("/runs/nope").status_code == 404


def test_user_strings_are_escaped(client, seeded):
    page = client.get(f"/runs/{quote(seeded.evil_run, safe='')}", params={"incident": seeded.evil_incident}).text
    for raw in ("<img src=x onerror=alert(1)>", "<b>bold</b>", "mallory<script>", "<img src=x onerror=alert('run')>"):
        assert raw not in page
        assert html.escape(raw, quote=True) in page
    # the only scripts are our two static files; run data reaches them through escaped attributes
    assert re.findall(r"<script[^>]*>", page.lower()) == ["<script src='/static/uplot/uplot.iife.min.js'>",
                                                          "<script src='/static/run.js'>"]
    assert "onerror=" not in page.replace("onerror=alert", "")  # no inline handlers of ours either


def test_public_url_prefixes_links(db, seeded):
    with TestClient(_app(db, public_url="https://ops.example/thermowatch/"), headers=AUTH) as c:
        page = c.get(f"/runs/{RUN}").text
    assert f"src='/thermowatch/api/runs/{RUN}/chart.png?" in page
    assert "href='/thermowatch'" in page


# --- end to end: real browser, real server ----------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server(db, seeded):
    import uvicorn

    requests: list = []
    port = _free_port()
    srv = uvicorn.Server(uvicorn.Config(_app(db, requests), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", requests
    srv.should_exit = True
    t.join(10)


def test_browser_signs_in_and_opens_the_slack_link(db, tmp_path, server, seeded):
    """The Slack link in real Chromium: first the sign-in page (no cookie yet), then the form
    with a read-only token, then the incident's page with every chart loaded by the cookie."""
    from tests.supervisor.cdp import Browser

    base, requests = server
    if not os.path.exists(CHROMIUM) and not os.environ.get("CI"):
        pytest.skip("chromium is not installed (apt-get install -y chromium); CI installs it")
    alice = make_token(db.sessions, "alice", "read")
    path = f"/runs/{RUN}?incident={seeded.incident}"
    b = Browser(CHROMIUM, tmp_path / "chromium-profile", "--disable-quic")
    try:
        b.goto(base + path)
        assert b.js("document.title") == "thermowatch: sign in"
        assert (f"/runs/{RUN}", f"incident={seeded.incident}", 401) in requests
        b.js(f"document.getElementById('token').value = {json.dumps(alice)};"
             "document.getElementById('sign-in').click()")
        b.wait_for(f"location.pathname === '/runs/{RUN}' && document.readyState === 'complete' && "
                   "!!document.querySelector('tr.selected')")
        assert b.js("location.search") == f"?incident={seeded.incident}"
        assert b.js("document.cookie") == ""  # HttpOnly: no script on the page can read the token
        b.wait_for("!!window.thermowatch && thermowatch.loads >= 1")
        text = b.js("document.documentElement.outerHTML")
        assert re.search(rf"<tr id=\"incident-{seeded.incident}\" class=\"selected\"", text), text[:2000]
        # the charts are drawn by the page's script from the chart JSON, read with the cookie, zoomed
        # to the incident's window (rollback target 100 .. detect 205, padded)
        assert sorted(b.js("Object.keys(thermowatch.charts)")) == sorted(["loss", "grad_norm", "lr", "attn_logit_max",
                                                                          "act_max"])
        charts = [(q, code) for p, q, code in requests if p == f"/api/runs/{RUN}/chart"]
        assert len(charts) >= 5 and all(code == 200 for _, code in charts)
        assert all("step_lo=48" in q and "step_hi=257" in q for q, _ in charts), charts
        assert not [p for p, _, _ in requests if p.endswith("/plot.png")]  # the PNGs are the <noscript> fallback
        png = b.screenshot(1280, 1600)
    finally:
        b.close()
    assert png[:8] == PNG_SIGNATURE and len(png) > 20_000
    px = _pixels(png)
    assert px.shape[:2] == (1600, 1280)
    assert len(np.unique(px.reshape(-1, px.shape[-1])[::7], axis=0)) > 50  # charts, not a blank page


SAME_ORIGIN = {"origin": "http://testserver"}


def test_sign_in_sets_a_strict_httponly_cookie_that_opens_the_pages(db, seeded):
    alice = make_token(db.sessions, "alice", "read")
    trainer = make_token(db.sessions, "trainer", "ingest")
    with TestClient(_app(db), follow_redirects=False) as c:
        r = c.get(f"/runs/{RUN}")
        assert r.status_code == 401 and "sign in" in r.text and "`read` scope" in r.text
        r = c.post("/login", data={"token": alice, "next": f"/runs/{RUN}"}, headers=SAME_ORIGIN)
        assert r.status_code == 303 and r.headers["location"] == f"/runs/{RUN}"
        cookie = r.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=strict" in cookie and "Path=/" in cookie and "Secure" not in cookie
        assert c.get(f"/runs/{RUN}").status_code == 200
        assert c.get(f"/api/runs/{RUN}/chart.png", params={"metric": "loss"}).status_code == 200  # its images
        # The cookie opens the page and the API's reads (GET: the page's script fetches its charts);
        # a route that changes anything takes a bearer token (approve/cancel: test_web_page.py).
        assert c.get("/api/runs").status_code == 200
        r = c.post("/logout", headers=SAME_ORIGIN)
        assert r.status_code == 303 and 'thermowatch_token=""' in r.headers["set-cookie"]
        c.cookies.clear()
        assert c.get("/").status_code == 401
        # behind an https ingress the cookie is Secure; an off-site `next` is not followed
        r = c.post("/login", data={"token": alice, "next": "//evil.example/x"},
                   headers={**SAME_ORIGIN, "x-forwarded-proto": "https"})
        assert r.status_code == 303 and r.headers["location"] == "/" and "Secure" in r.headers["set-cookie"]
        c.cookies.clear()
        for token, status, words in (("tw_nope", 401, "unknown or revoked"), (trainer, 403, "lacks the `read` scope")):
            r = c.post("/login", data={"token": token, "next": "/"}, headers=SAME_ORIGIN)
            assert r.status_code == status and words in r.text and "set-cookie" not in r.headers


@pytest.mark.parametrize("headers", [{}, {"origin": "https://evil.example"}, {"origin": "null"},
                                     {"sec-fetch-site": "cross-site", "origin": "http://testserver"},
                                     {"sec-fetch-site": "same-site"}])
def test_sign_in_and_out_forms_refuse_cross_site_posts(db, headers):
    alice = make_token(db.sessions, "alice", "read")
    with TestClient(_app(db), follow_redirects=False) as c:
        r = c.post("/login", data={"token": alice, "next": "/"}, headers=headers)
        assert r.status_code == 403 and "another site" in r.text and "set-cookie" not in r.headers
        r = c.post("/logout", headers=headers)
        assert r.status_code == 403 and "set-cookie" not in r.headers
    with TestClient(_app(db), follow_redirects=False) as c:
        r = c.post("/login", data={"token": alice, "next": "/"}, headers={"sec-fetch-site": "same-origin"})
        assert r.status_code == 303


def test_pages_with_a_bearer_token_and_public_read(db, seeded):
    reader = make_token(db.sessions, "reader", "read")
    with TestClient(_app(db)) as c:
        assert c.get("/", headers=bearer(reader)).status_code == 200
    sup = Sup(db.sessions)
    g = guard(db.sessions, public_read=True)
    app = FastAPI()
    install_error_handlers(app)  # the store's NotFound -> 404, as the daemon's app
    app.include_router(runs_api.make_router(sup, guard=g))
    app.include_router(pages.make_router(sup, guard=g))
    with TestClient(app) as c:
        assert c.get("/").status_code == 200 and c.get(f"/api/runs/{RUN}").status_code == 200
        assert c.get("/", headers={"authorization": "Bearer tw_wrong"}).status_code == 401
