"""Thermometer charts as PNG bytes (matplotlib, Agg), for the run page's images and the charts
uploaded to Slack. With charts/layout.py (where the legend and the labels go), the only module
that imports matplotlib.

Figures are built with the object API (Figure + FigureCanvasAgg), never pyplot: pyplot keeps
global state, and the web server renders several charts at once in its threadpool.

A figure is a web of reference cycles (figure <-> canvas <-> axes <-> artists), so reference
counting never frees one; it lives until a full garbage collection, which in a daemon holding
~150k objects comes rarely: without one, a 100-series chart of 10^6 steps adds ~5.5 MB of RSS
per PNG (measured: 168 -> 209 MB over 15 charts). So each render ends with gc.collect(): ~13 ms
in the daemon, whose start-up heap `thermowatch serve` freezes (server.settle_heap: a collection
then scans only what came after), ~60 ms in a process that froze nothing; RSS stays flat.

What a chart shows, for the engineer who opens it at 8 a.m.:
  - every series of the metric (one line per module), as charts/png.py hands it over: one min/max
    pair per pixel column from the rollups, so a one-step spike is never averaged away;
  - under each series, faded and dashed in its color, the points of older attempts that a newer
    attempt re-trained: the trajectory a rollback abandoned (usually the spike that caused it),
    which the current line alone no longer shows;
  - non-finite points as red ticks along the top edge (a NaN cannot sit on a y axis);
  - incidents: onset dashed, detection solid (the selected incident drawn heavier);
  - rollbacks: an arrow from the detection step back to the step training resumed from, over
    a shaded band of the steps that were re-trained;
  - LR changes: a dotted line where the multiplier took effect, shaded while it lasts;
  - the threshold a finding fired on (the attention-logit ceiling, the loss spike's bar), a
    labelled horizontal line kept inside the y range (issue 37);
  - a legend beside the axes, never over the data: the series hottest first, at most MAX_LEGEND
    of them and "+M more", one entry per kind of mark (layout.place_legend); the marks' words
    merged or shortened where they would overprint (layout.place_labels).
"""

from __future__ import annotations

import gc
import io
from dataclasses import dataclass, field

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import LogFormatter
from matplotlib.transforms import blended_transform_factory

from thermowatch.supervisor.charts.layout import Entry, Label, cluster, place_labels, place_legend

_MARGIN_PX = (58, 14, 24, 40)  # left, right (before the legend takes its own), top, bottom
# Metrics drawn on a log axis by default (they grow by orders of magnitude when a run diverges).
LOG_METRICS = frozenset({"grad_norm", "attn_logit_max", "attn_logit_lse", "act_max", "z"})
MAX_LEGEND = 8  # more lines than this: the legend names the ones with the highest peaks, then "+M more"
THRESHOLD_STYLE = {"color": "0.15", "ls": "-.", "lw": 1.3}


@dataclass(slots=True)
class IncidentMark:
    id: int
    label: str
    onset: int
    detect: int
    open: bool
    selected: bool = False


@dataclass(slots=True)
class RollbackMark:
    label: str
    from_step: int | None  # detection step (None for a manual rollback without an incident)
    to_step: int


@dataclass(slots=True)
class LrMark:
    step: int
    multiplier: float
    steps: int | None


@dataclass(slots=True)
class ThresholdMark:
    """The level a finding fired on, in the metric's own units: a horizontal line."""
    value: float
    label: str  # "attn_logit_ceiling threshold 50"


@dataclass(slots=True)
class Marks:
    incidents: list[IncidentMark] = field(default_factory=list)
    rollbacks: list[RollbackMark] = field(default_factory=list)
    lr_changes: list[LrMark] = field(default_factory=list)
    thresholds: list[ThresholdMark] = field(default_factory=list)


@dataclass(slots=True)
class Chart:
    title: str
    series: list[tuple[str, np.ndarray, np.ndarray]]  # (label, steps, values)
    # (index into series, attempt, steps, values): points a newer attempt re-trained
    superseded: list[tuple[int, int, np.ndarray, np.ndarray]] = field(default_factory=list)
    logy: bool = False
    step_lo: int | None = None
    step_hi: int | None = None
    width_px: int = 1100
    height_px: int = 320
    onset: int | None = None  # a finding's onset, drawn as a labelled line (the Slack thread's chart)
    # (label, steps, low, high): a gray min-max band beneath the lines, e.g. every layer of a
    # 100-layer family while only the hottest few are drawn as lines
    band: tuple[str, np.ndarray, np.ndarray, np.ndarray] | None = None


def _visible(lo: float, hi: float, *steps: int | None) -> bool:
    return any(s is not None and lo <= s <= hi for s in steps)


def render(chart: Chart, marks: Marks | None = None) -> bytes:
    png = _png(figure(chart, marks))
    gc.collect()  # the figure just drawn, unreachable now that its frame is gone (module docstring)
    return png


def _png(fig: Figure) -> bytes:
    buf = io.BytesIO()
    # zlib level 1: ~30 ms less per chart than the default 6 for a somewhat larger file (a
    # chart is drawn per request and not stored; bench/plot.py)
    fig.savefig(buf, format="png", pil_kwargs={"compress_level": 1})
    return buf.getvalue()


def figure(chart: Chart, marks: Marks | None = None) -> Figure:
    """The chart as a Figure on an Agg canvas, laid out and ready to save: what render() writes,
    and what tests measure (where the legend and the labels landed)."""
    marks = marks or Marks()
    dpi = 100
    fig = Figure(figsize=(chart.width_px / dpi, chart.height_px / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    # fixed margins in pixels, not layout="constrained": that measured every tick label's text
    # on each render, ~40% of a chart's time (an empty log-axis figure: ~350 vs ~130 ms at load
    # ~10; bench/plot.py). These fit 7-character tick labels at 8 pt, the title and "step"; the
    # legend's margin is measured once it is known (layout.place_legend).
    w, h = chart.width_px, chart.height_px
    fig.subplots_adjust(left=_MARGIN_PX[0] / w, right=1 - _MARGIN_PX[1] / w, top=1 - _MARGIN_PX[2] / h,
                        bottom=_MARGIN_PX[3] / h)
    ax = fig.add_subplot()
    ax.set_title(chart.title, fontsize=10, loc="left")
    ax.grid(True, alpha=0.25)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=8)
    if chart.logy:
        ax.set_yscale("log", nonpositive="clip")
        # plain-text labels: the default's mathtext (10^{4}) is re-parsed on every render, a
        # third of a chart's time (measured: ~0.15 s per figure; bench/plot.py)
        ax.yaxis.set_major_formatter(LogFormatter())
        ax.yaxis.set_minor_formatter(LogFormatter(minor_thresholds=(2, 0.5)))

    fixed: list[Entry] = []  # the legend's rows besides the series, in this order
    if chart.band is not None and len(chart.band[1]):
        label, bs, blo, bhi = chart.band
        band = ax.fill_between(bs, blo, bhi, color="0.82", lw=0, step="post", zorder=1.5)
        fixed.append(Entry(band, label))
    n = len(chart.series)
    cmap = matplotlib.colormaps["viridis"]
    top = blended_transform_factory(ax.transData, ax.transAxes)
    colors = [f"C{i}" if n <= 10 else cmap(i / max(1, n - 1) * 0.9) for i in range(n)]
    ranked: list[tuple[float, Entry]] = []
    nonfinite = False
    for i, (label, steps, values) in enumerate(chart.series):
        if len(steps) == 0:
            continue
        s, v = steps, values  # already one min/max pair per pixel column (charts/png.py, the rollups)
        # zorder 3: data above the incident/rollback lines, so a spike at the detection step shows
        (line,) = ax.plot(s, np.where(np.isfinite(v), v, np.nan), lw=0.9, color=colors[i], zorder=3)
        finite = v[np.isfinite(v)]
        ranked.append((float(finite.max()) if len(finite) == len(v) else np.inf, Entry(line, label)))
        bad = ~np.isfinite(v)
        if bad.any():
            ax.plot(s[bad], np.full(bad.sum(), 0.985), "|", color="red", ms=10, mew=1.5, transform=top,
                    clip_on=False, zorder=4)
            nonfinite = True
    if nonfinite:
        fixed.append(Entry(Line2D([], [], ls="none", marker="|", color="red", ms=8, mew=1.5), "NaN / Inf"))
    superseded = _draw_superseded(ax, top, chart, colors, fixed)
    if not (ranked or superseded or (chart.band is not None and len(chart.band[1]) > 0)):
        ax.text(0.5, 0.5, "no points in this window", ha="center", va="center", transform=ax.transAxes, color="gray")

    if chart.step_lo is not None or chart.step_hi is not None:
        cur_lo, cur_hi = ax.get_xlim()
        ax.set_xlim(chart.step_lo if chart.step_lo is not None else cur_lo,
                    chart.step_hi if chart.step_hi is not None else cur_hi)
    lo, hi = ax.get_xlim()
    rollback_labels, incidents = _annotate(ax, marks, lo, hi, fixed)
    if chart.onset is not None and lo <= chart.onset <= hi:
        line = ax.axvline(chart.onset, color="tab:red", ls="--", lw=1.6, zorder=3.5)
        fixed.append(Entry(line, f"onset {chart.onset}"))
    ax.set_xlim(lo, hi)
    _thresholds(ax, marks.thresholds, chart.logy, fixed)

    # many modules: the legend names the hottest (a NaN is the hottest) and counts the rest
    place_legend(fig, fixed, ranked, named=MAX_LEGEND, margins_px=_MARGIN_PX)
    place_labels(ax, rollback_labels, _incident_labels(ax, incidents), obstacles=[t for t in ax.texts if t.get_text()])
    return fig


def _draw_superseded(ax, top, chart: Chart, colors: list, fixed: list[Entry]) -> bool:
    """Faded dashed lines (zorder 2.5: over the bands and incident lines, under the current
    trajectory at 3) and faded non-finite ticks. One legend row names every attempt drawn; with
    several series its swatch is gray, as the lines take their series' colors. True if anything
    was drawn."""
    attempts: list[int] = []
    for i, attempt, steps, values in chart.superseded:
        if len(steps) == 0:
            continue
        if attempt not in attempts:
            attempts.append(attempt)
        s, v = steps, values
        ax.plot(s, np.where(np.isfinite(v), v, np.nan), color=colors[i], **_FADED, zorder=2.5)
        bad = ~np.isfinite(v)
        if bad.any():  # often the very NaN that triggered the rollback
            ax.plot(s[bad], np.full(bad.sum(), 0.985), "|", color="red", alpha=0.35, ms=10, mew=1.5,
                    transform=top, clip_on=False, zorder=2.5)
    if attempts:
        color = colors[chart.superseded[0][0]] if len(chart.series) == 1 else "gray"
        words = (f"superseded attempt {attempts[0]}" if len(attempts) == 1 else
                 f"superseded attempts {', '.join(map(str, sorted(attempts)))}" if len(attempts) <= 4 else
                 f"{len(attempts)} superseded attempts")
        fixed.append(Entry(Line2D([], [], color=color, **_FADED), words))
    return bool(attempts)


_FADED = {"lw": 1.0, "ls": (0, (4, 2)), "alpha": 0.55}  # visible over the re-trained band, clearly not current


def _annotate(ax, marks: Marks, lo: float, hi: float, fixed: list[Entry]) -> tuple[list[Label], list[IncidentMark]]:
    """The marks' lines and bands, one legend row per kind (the lines' own words go beside them:
    place_labels). Returns the rollbacks' labels and the incidents in the window."""
    lrs = []
    for lr in marks.lr_changes:
        end = lr.step + lr.steps if lr.steps is not None else hi
        if lr.step > hi or end < lo:
            continue
        ax.axvline(lr.step, color="tab:purple", ls=":", lw=1.2)
        ax.axvspan(lr.step, end, color="tab:purple", alpha=0.06)
        lrs.append(lr)
    if lrs:
        words = f"LR x{lrs[0].multiplier:g} @ {lrs[0].step}" if len(lrs) == 1 else f"{len(lrs)} LR changes"
        fixed.append(Entry(Line2D([], [], color="tab:purple", ls=":", lw=1.2), words))
    labels: list[Label] = []
    spans, targets = [], []
    for rb in marks.rollbacks:
        if not _visible(lo, hi, rb.from_step, rb.to_step):
            continue
        if rb.from_step is not None and rb.from_step > rb.to_step:
            ax.axvspan(rb.to_step, rb.from_step, color="tab:orange", alpha=0.12)
            # the arrow from the detection back to the checkpoint goes under its words (place_labels)
            labels.append(Label((rb.to_step + rb.from_step) / 2, rb.label, "tab:orange", 0.92,
                                arrow=(rb.from_step, rb.to_step)))
            spans.append(rb)
        else:
            ax.axvline(rb.to_step, color="tab:orange", lw=1.2)
            targets.append(rb)
    if spans:
        words = f"re-trained ({spans[0].label})" if len(spans) == 1 else f"re-trained ({len(spans)} rollbacks)"
        fixed.append(Entry(Patch(color="tab:orange", alpha=0.12 * 2.5, lw=0), words))
    if targets:
        words = targets[0].label if len(targets) == 1 else f"{len(targets)} rollbacks without an incident"
        fixed.append(Entry(Line2D([], [], color="tab:orange", lw=1.2), words))
    shown = []
    for inc in marks.incidents:
        if not _visible(lo, hi, inc.onset, inc.detect):
            continue
        color = "tab:red" if inc.open else "dimgray"
        lw = 2.0 if inc.selected else 1.0
        alpha = 1.0 if inc.selected else 0.7
        ax.axvline(inc.onset, color=color, ls="--", lw=lw, alpha=alpha)
        ax.axvline(inc.detect, color=color, ls="-", lw=lw, alpha=alpha)
        shown.append(inc)
    if shown:
        color = "tab:red" if any(i.open for i in shown) else "dimgray"
        one = shown[0] if len(shown) == 1 else None
        fixed.append(Entry(Line2D([], [], color=color, ls="--", lw=1.2),
                           f"#{one.id} onset {one.onset}" if one else "incidents' onsets"))
        fixed.append(Entry(Line2D([], [], color=color, ls="-", lw=1.2),
                           f"#{one.id} detected {one.detect}" if one else "incidents' detections"))
    return labels, shown


def _thresholds(ax, thresholds: list[ThresholdMark], logy: bool, fixed: list[Entry]) -> None:
    """Each threshold a horizontal line with its legend row, and the y range widened to hold it
    (a line at 50 over data that stays under 20 would otherwise fall outside the chart)."""
    colors = [THRESHOLD_STYLE["color"], "tab:brown", "tab:pink"]
    values = []
    for k, th in enumerate(thresholds):
        if not np.isfinite(th.value) or (logy and th.value <= 0):
            continue
        line = ax.axhline(th.value, **{**THRESHOLD_STYLE, "color": colors[k % len(colors)]}, zorder=3.2)
        fixed.append(Entry(line, th.label))
        values.append(th.value)
    if not values:
        return
    _hold(ax, min(values), max(values), logy)


def _hold(ax, vlo: float, vhi: float, logy: bool, low: float = 0.05, high: float = 0.8) -> None:
    """Widen the y range so that [vlo, vhi] lies between `low` and `high` of the axes' height: in
    sight, and under the band at the top where rollbacks' arrows and NaN ticks go."""
    f = np.log if logy else (lambda x: x)
    g = np.exp if logy else (lambda x: x)
    lo, hi = (f(v) for v in ax.get_ylim())
    a, b = f(vlo), f(vhi)
    for _ in range(2):  # widening one end moves the other's fraction: twice settles it
        if b > lo + high * (hi - lo):
            hi = lo + (b - lo) / high
        if a < lo + low * (hi - lo):
            lo = (a - low * hi) / (1 - low)
    ax.set_ylim(g(lo), g(hi))


_LABEL_PX = 13  # a vertical 7-pt label's width at 100 dpi, and a little air


def _incident_labels(ax, incidents: list[IncidentMark]) -> list[Label]:
    """One vertical label per group of incidents whose detection lines are closer than a label is
    wide (a divergence fires in four layers at once: four labels on one line), naming them all,
    left of the group's first line (so the next group's label, a label's width on, cannot reach it)."""
    incs = sorted(incidents, key=lambda i: (i.detect, i.id))
    xs = [float(ax.transData.transform((i.detect, 0))[0]) for i in incs]
    out = []
    for group in cluster(xs, _LABEL_PX):
        members = [incs[j] for j in group]
        color = "tab:red" if any(m.open for m in members) else "dimgray"
        out.append(Label(members[0].detect, f" {_ids(sorted(m.id for m in members))} {_words(members)}", color, 0.02))
    return out


def _words(members: list[IncidentMark]) -> str:
    """The group's labels, the signal said once: "attn_logit_ceiling blocks.0, blocks.1; loss_spike"."""
    by_signal: dict[str, list[str]] = {}
    for m in sorted(members, key=lambda m: m.id):
        signal, _, module = m.label.partition(" ")
        modules = by_signal.setdefault(signal, [])
        if module and module not in modules:
            modules.append(module)
    return "; ".join(f"{s} {', '.join(ms)}" if ms else s for s, ms in by_signal.items())


def _ids(ids: list[int]) -> str:
    """#3, or #3-#6 for a consecutive run, or #3 #5 #9."""
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"#{ids[0]}-#{ids[-1]}"
    return " ".join(f"#{i}" for i in ids)
