"""The pages on a phone (issue 37, items 6 and 7) at 390 x 844, in real headless Chromium against
the real daemon app, and the runs index's sort and filter over HTTP. One daemon and one browser
for the module (tests/supervisor/phone.py builds the runs). Screenshots go to
$THERMOWATCH_SCREENSHOTS when set (bench/phone_screens.py writes docs/screenshots/)."""

from __future__ import annotations

import html
import os
import re
import shutil
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from thermowatch.supervisor.serve.server import build_app
from thermowatch.supervisor.serve.web import pages
from tests.live_server import running
from tests.supervisor.auth_helpers import AUTH
from tests.supervisor.phone import DEMO, HEIGHT, JUMP, WIDTH, open_page, phone_daemon, sign_in
from tests.supervisor.serve.test_runs_api import RUN as SEEDED

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    r = phone_daemon(tmp_path_factory.mktemp("phone"))
    yield r
    r.sup.close()


@pytest.fixture(scope="module")
def phone(runs, tmp_path_factory):
    """(browser, base URL) at 390 x 844, signed in."""
    from tests.supervisor.cdp import Browser

    if not os.path.exists(CHROMIUM) and not os.environ.get("CI"):
        pytest.skip("chromium is not installed (apt-get install -y chromium); CI installs it")
    with running(build_app(runs.sup)) as base:
        b = Browser(CHROMIUM, tmp_path_factory.mktemp("profile"), "--disable-quic")
        try:
            b.page("Runtime.enable")
            sign_in(b, base)
            yield b, base
        finally:
            b.close()
    errors = [ev for ev in b.events if ev["method"] == "Runtime.exceptionThrown"
              or (ev["method"] == "Runtime.consoleAPICalled" and ev["params"]["type"] == "error")]
    assert not errors, errors


def _shot(b, name: str) -> None:
    import base64

    out = os.environ.get("THERMOWATCH_SCREENSHOTS")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / name).write_bytes(base64.b64decode(b.page("Page.captureScreenshot", format="png")["data"]))


# --- the index's sort and filter, over HTTP ---------------------------------------------------------------


def _listed(page: str) -> list[str]:
    return [html.unescape(r) for r in re.findall(r"<tr class='run-row' data-run='([^']*)'>", page)]


def test_index_sorts_and_filters_its_page(runs, monkeypatch):
    with TestClient(build_app(runs.sup), headers=AUTH) as c:
        newest = _listed(c.get("/").text)
        assert len(newest) == 4 and newest[-1] == JUMP  # the store's order: newest first
        assert _listed(c.get("/", params={"sort": "run"}).text) == sorted(newest, key=str.casefold)
        by_step = _listed(c.get("/", params={"sort": "step"}).text)
        assert by_step[:3] == [JUMP, SEEDED, DEMO]  # 400, 260, 200 steps; the 5-step run last
        evil = newest[0]  # seeded last: no step recorded, "starting"
        # the seeded runs never reported to this daemon: stalled; jump-qkln reported just now
        assert _listed(c.get("/", params={"state": "stalled"}).text) == [SEEDED, DEMO]
        assert _listed(c.get("/", params={"state": "starting"}).text) == [evil]
        assert _listed(c.get("/", params={"sort": "state"}).text) == [SEEDED, DEMO, evil, JUMP]
        assert _listed(c.get("/", params={"q": "QKLN"}).text) == [JUMP]
        page = c.get("/", params={"q": "nothing-like-it"}).text
        assert _listed(page) == [] and "none of this page&#x27;s 4 runs match" in page
        assert "<option value='step' selected>" in c.get("/", params={"sort": "step"}).text
        r = c.get("/", params={"sort": "loss"})
        assert r.status_code == 422 and "sort='loss' is not one of created, run, state, step, updated" in r.text
        assert c.get("/", params={"state": "happy"}).status_code == 422
        # pages of runs: the view rides along on the cursor's links, and the next page is sorted too
        monkeypatch.setattr(pages, "INDEX_PAGE", 3)
        first = c.get("/", params={"sort": "run", "q": "-"}).text
        (older,) = re.findall(r"<a href='(/\?[^']+)' id='older'>", first)
        assert "sort=run" in older and "q=-" in older and "cursor=" in older
        second = c.get(html.unescape(older)).text
        assert _listed(second) == [JUMP] and "id='newest'" in second
        assert "sorted and filtered within this page of 1 run(s)" in second


# --- the browser at 390 x 844 --------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_pages_fit_a_phone(runs, phone):
    b, base = phone
    tw = "window.thermowatch"

    # the run with an approval waiting: the story, the approval with its commands and the first
    # chart's top on the first screen; nothing wider than the screen
    run = open_page(b, f"{base}/runs/{JUMP}")
    assert run["scrollWidth"] <= WIDTH, run["wide"]
    assert run["errors"] == []
    assert run["story"] < run["approve"] < run["approval"] < run["chart"] < run["plot"] < HEIGHT, run
    assert b.js("document.querySelector('.card.approval').textContent").count(f"thermowatch approve {runs.approval}") == 1
    assert run["height"] < 4000, run
    _shot(b, "phone-run.png")

    # the demo-like run: 9 incidents, 60 audit rows, 40 checkpoints, 15 long module names
    demo = open_page(b, f"{base}/runs/{DEMO}")
    assert demo["scrollWidth"] <= WIDTH, demo["wide"]
    assert demo["height"] < 6000, demo  # 20-26k px before issue 37
    # tables are cards: a cell sits under its header's label, nothing is a blank row
    card = b.js("(() => { const td = document.querySelector('.t-actions tbody tr td:nth-child(7)');"
                "const r = td.getBoundingClientRect(); return [getComputedStyle(td, '::before').content, r.width, r.height,"
                "getComputedStyle(td.closest('tr')).display]; })()")
    assert card[0] == '"reason"' and card[1] > 300 and card[3] == "flex", card  # the reason: the card's width
    assert b.js("[...document.querySelectorAll('details.fold')].every((d) => !d.open)")  # folded on a phone
    b.js("location.hash = '#' + document.querySelector('tr[id^=incident-]').id")
    b.wait_for("document.querySelector('tr[id^=incident-]').closest('details').open")  # a link opens its fold
    # heatmap: every row label whole (the label element holds its text) and left of the plot area,
    # a step axis under it; the 15 long names shortened the same way to distinct labels
    b.wait_for(f"{tw}.charts.act_max && {tw}.charts.act_max.heatmap")
    heat = b.js(f"{tw}.charts.act_max.heatmap")
    labels = b.js("[...document.querySelectorAll(\"figure[data-metric='act_max'] .heat-label\")]"
                  ".map((el) => [el.textContent, el.scrollWidth, el.clientWidth, el.getBoundingClientRect().right])")
    assert len(labels) >= 8 and all(sw <= cw for _, sw, cw, _ in labels), labels
    left = b.js("document.querySelector(\"figure[data-metric='act_max'] canvas.heatmap\").getBoundingClientRect().left")
    assert all(right <= left + heat["plotLeft"] for *_, right in labels), (labels, heat)
    titles = b.js("[...document.querySelectorAll(\"figure[data-metric='act_max'] .heat-label\")].map((el) => el.title)")
    assert len(set(heat["labels"])) == 15, heat["labels"]  # shortened, still one name per row
    for lab, title in zip(heat["labels"], b.js(f"{tw}.charts.act_max.keys")):
        module = title.split("/", 1)[1]
        assert lab.split(".")[-1] == module.split(".")[-1] and re.findall(r"\d+", lab) == re.findall(r"\d+", module)
    assert set(titles) <= {k.split("/", 1)[1] for k in b.js(f"{tw}.charts.act_max.keys")}  # the whole name on hover
    assert heat["ticks"] >= 2, heat

    # the index: cards, the sort and filter form, the refresh
    index = open_page(b, f"{base}/?sort=state")
    assert index["scrollWidth"] <= WIDTH, index["wide"]
    assert b.js("getComputedStyle(document.querySelector('tr.run-row')).display") == "flex"
    assert b.js("document.getElementById('sort').value") == "state"
    before = b.js("document.getElementById('updated').textContent")
    b.js("document.querySelector(\"input[name=run]\").click()")  # a ticked run survives the refresh
    ticked = b.js("document.querySelector(\"input[name=run]:checked\").value")
    b.js("window.thermowatchIndex.tick()")
    b.wait_for("window.thermowatchIndex.refreshes === 1")
    assert b.js("window.thermowatchIndex.errors") == []
    assert b.js(f"document.querySelector(\"input[name=run][value='{ticked}']\").checked")
    assert b.js("document.getElementById('updated').textContent").startswith("updated ") and before
    _shot(b, "phone-index.png")

    # compare: fits, and draws both runs' events (incidents at detection, rollbacks) in their colours
    cmp = open_page(b, f"{base}/compare?run={DEMO}&run={SEEDED}")
    assert cmp["scrollWidth"] <= WIDTH, cmp["wide"]
    assert cmp["errors"] == [] and cmp["plot"] < HEIGHT
    marks = b.wait_for(f"{tw}.charts.compare && {tw}.charts.compare.marks")
    said = {r: [m["text"] for m in marks["lines"] if m["run"] == r] for r in (DEMO, SEEDED)}
    assert sorted(t for t in said[DEMO] if t.startswith("rollback")) == ["rollback to 10"] * 2, said
    assert sum(bool(re.fullmatch(r"#\d+ attn_logit_ceiling", t)) for t in said[DEMO]) == 9, said
    assert "rollback to 100" in said[SEEDED] and any(re.fullmatch(r"#\d+ attn_logit_growth", t) for t in said[SEEDED])
    spans = sorted((m["row"], m["x"], m["x"] + m["w"]) for m in marks["labels"])
    assert all(a[2] <= b_[1] for a, b_ in zip(spans, spans[1:]) if a[0] == b_[0]), spans  # never overprinted
    _shot(b, "phone-compare.png")
