"""Charts that tell the truth (issue 37 item 7; supervisor/charts/plots.py, layout.py, png.py): the
legend sits beside the axes and never over the data, names the hottest MAX_LEGEND series and
counts the rest ("+M more"), one row per kind of mark; the marks' words never overprint; the
threshold a finding fired on is a labelled line inside the y range. Measured on the figure that
render() saves (the boxes Agg draws), and through `GET .../chart.png` (what `thermowatch plot`
saves) on SQLite and PostgreSQL with a real detector's finding."""

from __future__ import annotations

import io
import itertools

import numpy as np
import pytest
from matplotlib.image import imread

from thermowatch.monitors.detectors.attn_logit import AttnLogitCeilingDetector, AttnLogitConfig
from thermowatch.supervisor.charts import png as charts_png
from thermowatch.supervisor.charts.plots import (MAX_LEGEND, Chart, IncidentMark, LrMark, Marks, RollbackMark,
                                                 ThresholdMark, figure, render)
from thermowatch.supervisor.store import findings as findings_store
from thermowatch.supervisor.store import incidents as incidents_store
from tests.supervisor.charts.test_chart import RUN, client, seeded  # noqa: F401  (fixtures: a run with a rollback)

STEPS = np.arange(0, 1000)


def _layers(n: int) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """n layers, layer i peaking at 5 + 0.3 i (+1 for the sine): the hottest are the last ones."""
    return [(f"blocks.{i}.attn", STEPS, 5 + 0.3 * i + np.sin(STEPS / 50 + i)) for i in range(n)]


def _crowded_marks() -> Marks:
    """What one divergence leaves: four layers over the ceiling within three steps, a loss spike and
    a grad spike detected 15 steps apart, two rollbacks whose spans overlap, an LR cut, a ceiling."""
    incidents = [IncidentMark(k, f"attn_logit_ceiling blocks.{k}.attn", 600, 640 + k % 3, True, k == 3)
                 for k in range(1, 5)]
    incidents += [IncidentMark(9, "loss_spike", 300, 320, False), IncidentMark(10, "grad_spike", 305, 322, False)]
    return Marks(incidents=incidents,
                 rollbacks=[RollbackMark("rollback #7 to checkpoint 500", 642, 500),
                            RollbackMark("rollback #8 to checkpoint 550", 700, 550)],
                 lr_changes=[LrMark(645, 0.2, 100)], thresholds=[ThresholdMark(50.0, "attn_logit_ceiling threshold 50")])


def _boxes(fig):
    renderer = fig.canvas.get_renderer()
    (ax,) = fig.axes
    (legend,) = fig.legends
    return renderer, ax, legend, ax.get_window_extent(renderer), legend.get_window_extent(renderer)


@pytest.mark.parametrize("width, height", [(1100, 320), (900, 360), (390, 320)])
@pytest.mark.parametrize("with_marks", [False, True])
def test_a_crowded_legend_names_the_hottest_beside_the_axes_and_counts_the_rest(width, height, with_marks):
    marks = _crowded_marks() if with_marks else None
    fig = figure(Chart("r: attn_logit_max (30 series)", _layers(30), logy=True, width_px=width, height_px=height), marks)
    renderer, ax, legend, frame, box = _boxes(fig)
    texts = [t.get_text() for t in legend.get_texts()]
    more = [t for t in texts if t.startswith("+")]
    (more,) = more
    named = texts[:texts.index(more)]
    assert more == f"+{30 - len(named)} more" + (" (lower peaks)" if width >= 600 else "")
    # the hottest first: blocks.29, .28, ... (whatever the legend had room for, never a cooler one)
    assert named == [f"blocks.{i}.attn" for i in range(29, 29 - len(named), -1)]
    if not with_marks:  # N named + 1: the legend had room for MAX_LEGEND
        assert len(texts) == MAX_LEGEND + 1 and len(named) == MAX_LEGEND
    else:  # one row per kind of mark, not per mark (the old legend listed 2 per incident)
        want = ["LR x0.2 @ 645", "re-trained (2 rollbacks)", "incidents' onsets", "incidents' detections",
                "attn_logit_ceiling threshold 50"]
        got = texts[len(named) + 1:]
        assert len(got) == len(want)  # on a narrow chart, shortened: "re-trained (2 …"
        assert all(g == w or (g.endswith("…") and w.startswith(g[:-1])) for g, w in zip(got, want)), got
        assert width < 600 or got == want
    assert not box.overlaps(frame), (box, frame)  # beside the axes, never over the data
    assert box.x0 > frame.x1 and fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)
    # no taller than the axes; at most about a third of the width (a phone's 390 px: labels shortened)
    assert box.height <= frame.height + 1 and frame.width >= 0.6 * width - 58
    assert legend.get_title().get_text() == ""  # no "top 8 of 4 by peak"


def test_few_series_under_many_marks_are_all_named_and_nothing_is_miscounted():
    """Issue 37: four series under six incidents' lines read "top 8 of 4 by peak" (the marks were
    counted as series) and 4 of the 16 rows named lines."""
    fig = figure(Chart("r: attn_logit_max (4 series)", _layers(4), logy=True), _crowded_marks())
    _, _, legend, frame, box = _boxes(fig)
    texts = [t.get_text() for t in legend.get_texts()]
    assert texts[:4] == [f"blocks.{i}.attn" for i in range(4)]  # every series, in its own order
    assert not any(t.startswith("+") or "top" in t for t in texts) and len(texts) == 9
    assert not box.overlaps(frame)


def test_the_words_of_close_marks_are_merged_or_staggered_never_overprinted():
    fig = figure(Chart("r: attn_logit_max", _layers(3), logy=True), _crowded_marks())
    renderer, ax, *_ = _boxes(fig)
    words = [t for t in ax.texts if t.get_text().strip()]
    boxes = [t.get_window_extent(renderer) for t in words]
    for (a, ta), (b, tb) in itertools.combinations(zip(boxes, words), 2):
        assert not a.overlaps(b), (ta.get_text(), tb.get_text())
    said = " ".join(t.get_text() for t in words)
    # four ceiling incidents on three adjacent steps: one label naming them all and their layers
    # (shortened where it would reach the rollbacks' words: "... blocks.1.att…")
    assert said.count("attn_logit_ceiling") == 1 and " #1-#4 attn_logit_ceiling blocks.1" in said
    assert "#9 #10 loss_spike; grad_spike" in said  # two steps apart: merged; each signal said once
    assert "rollback #7 to checkpoint 500" in said and "rollback #8 to checkpoint 550" in said
    rb7, rb8 = (next(b for b, t in zip(boxes, words) if t.get_text().startswith(f"rollback #{k}")) for k in (7, 8))
    assert rb8.y1 <= rb7.y0  # the second rollback's words a row under the first's, not on them
    frame = ax.get_window_extent(renderer)
    assert all(frame.x0 - 1 <= b.x0 and b.x1 <= frame.x1 + 1 and b.y1 <= frame.y1 + 1 for b in boxes)


@pytest.mark.parametrize("logy", [False, True])
def test_a_threshold_above_the_data_is_a_labelled_line_inside_the_y_range(logy):
    series = [("loss", STEPS, 2.0 + np.sin(STEPS / 30))]  # peaks at 3, the bar at 12
    chart = Chart("r: loss", series, logy=logy, width_px=900, height_px=360)
    marks = Marks(thresholds=[ThresholdMark(12.0, "loss_spike threshold 12")])
    fig = figure(chart, marks)
    renderer, ax, legend, frame, _ = _boxes(fig)
    (line,) = [ln for ln in ax.lines if list(ln.get_ydata()) == [12.0, 12.0]]
    assert "loss_spike threshold 12" in [t.get_text() for t in legend.get_texts()]
    lo, hi = ax.get_ylim()
    f = np.log if logy else (lambda x: x)
    assert 0.05 <= (f(12.0) - f(lo)) / (f(hi) - f(lo)) <= 0.8 + 1e-9  # in sight, under the marks' top band
    # and drawn where it says: the pixel row of y = 12 in the saved PNG is dark across the axes
    y_px = ax.transData.transform((500, 12.0))[1]
    pixels = imread(io.BytesIO(render(chart, marks)))
    row = int(round(chart.height_px - y_px))
    cols = slice(int(frame.x0) + 2, int(frame.x1) - 2)
    dark = (pixels[row - 1:row + 2, cols, :3].max(axis=-1) < 0.4).any(axis=0)
    assert dark.mean() > 0.5, dark.mean()
    far = (pixels[row + 12:row + 15, cols, :3].max(axis=-1) < 0.4).any(axis=0)
    assert far.mean() < 0.1  # a line there, not a dark chart


def _ceiling_finding(db, ceiling: float) -> tuple[int, float]:
    """The real ceiling detector over the seeded run's blocks.1 logits (11 + step/100), its first
    finding stored as the supervisor stores one: an incident and the finding in it."""
    key = "attn_logit_max/blocks.1.attn"
    det = AttnLogitCeilingDetector(key, AttnLogitConfig(ceiling=ceiling))
    finding = next(f for s in range(0, 2200) if (f := det.update(s, 11.0 + s / 100)) is not None)
    with db.sessions.begin() as s:
        inc = incidents_store.open_incident(s, RUN, finding.signal.value, finding.module, finding.onset_step,
                                            finding.detect_step, "critical")
        findings_store.add_finding(s, RUN, finding, inc, attempt=0)
    return inc, finding.evidence["threshold"]


def test_plot_draws_the_ceiling_a_finding_fired_on(seeded, client):  # noqa: F811
    inc, threshold = _ceiling_finding(seeded, 30.0)
    assert threshold == 30.0
    params = {"metric": "attn_logit_max", "step_lo": 1500, "step_hi": 2500, "incident": inc}
    with seeded.sessions() as s:
        chart, marks = charts_png.prepare(s, RUN, "attn_logit_max", 1500, 2500, marks=charts_png.marks_for(s, RUN, inc))
        outside = charts_png.prepare(s, RUN, "attn_logit_max", 0, 1800)[1]  # detected at 1900: not in this window
        loss = charts_png.prepare(s, RUN, "loss", 1500, 2500)[1]
    assert [(t.value, t.label) for t in marks.thresholds] == [(30.0, "attn_logit_ceiling threshold 30 (blocks.1.attn)")]
    assert outside.thresholds == [] and loss.thresholds == []  # another window, another metric: no line
    fig = figure(chart, marks)
    (ax,) = fig.axes
    assert [list(ln.get_ydata()) for ln in ax.lines if list(ln.get_ydata()) == [30.0, 30.0]] == [[30.0, 30.0]]
    assert "attn_logit_ceiling threshold 30 (blocks.1.attn)" in [t.get_text() for t in fig.legends[0].get_texts()]
    # what `thermowatch plot` saves (GET .../chart.png) is this very chart, byte for byte
    r = client.get(f"/api/runs/{RUN}/chart.png", params=params)
    assert r.status_code == 200 and r.content == render(chart, marks)
