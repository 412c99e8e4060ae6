"""Thermometer charts as PNG bytes (matplotlib, Agg). The only module that imports matplotlib.

Figures are built with the object API (Figure + FigureCanvasAgg), never pyplot: pyplot keeps
global state, and the web server renders several charts at once in its threadpool.

A figure is a web of reference cycles (figure <-> canvas <-> axes <-> artists), so reference
counting never frees one; it lives until a full garbage collection, which in a daemon holding
~150k objects comes rarely. Measured on a 100-series chart of 10^6 steps: the daemon's RSS grew
~5.5 MB per PNG (168 -> 209 MB over 15 charts). So each render ends with gc.collect(): ~13 ms
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
  - LR changes: a dotted line where the multiplier took effect, shaded while it lasts.
"""

from __future__ import annotations

import gc
import io
from dataclasses import dataclass, field

import matplotlib
import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import LogFormatter
from matplotlib.transforms import blended_transform_factory


_MARGIN_PX = (58, 14, 24, 40)  # left, right, top, bottom
# Metrics drawn on a log axis by default (they grow by orders of magnitude when a run diverges).
LOG_METRICS = frozenset({"grad_norm", "attn_logit_max", "attn_logit_lse", "act_max", "z"})
MAX_LEGEND = 8  # more lines than this: the legend names the ones with the highest peaks


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
class Marks:
    incidents: list[IncidentMark] = field(default_factory=list)
    rollbacks: list[RollbackMark] = field(default_factory=list)
    lr_changes: list[LrMark] = field(default_factory=list)


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
    png = _draw(chart, marks or Marks())
    gc.collect()  # the figure _draw built, unreachable now that its frame is gone (module docstring)
    return png


def _draw(chart: Chart, marks: Marks) -> bytes:
    dpi = 100
    fig = Figure(figsize=(chart.width_px / dpi, chart.height_px / dpi), dpi=dpi)
    FigureCanvasAgg(fig)
    # fixed margins in pixels, not layout="constrained": that measured every tick label's text
    # on each render, ~40% of a chart's time (an empty log-axis figure: ~350 vs ~130 ms at load
    # ~10; bench/plot.py). These fit 7-character tick labels at 8 pt, the title and "step".
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

    if chart.band is not None and len(chart.band[1]):
        label, bs, blo, bhi = chart.band
        ax.fill_between(bs, blo, bhi, color="0.82", lw=0, step="post", label=label, zorder=1.5)
    n = len(chart.series)
    cmap = matplotlib.colormaps["viridis"]
    peaks = []
    top = blended_transform_factory(ax.transData, ax.transAxes)
    nonfinite_labelled = False
    colors = [f"C{i}" if n <= 10 else cmap(i / max(1, n - 1) * 0.9) for i in range(n)]
    any_points = False
    for i, (label, steps, values) in enumerate(chart.series):
        if len(steps) == 0:
            peaks.append(-np.inf)
            continue
        any_points = True
        s, v = steps, values  # already one min/max pair per pixel column (charts/png.py, the rollups)
        color = colors[i]
        # zorder 3: data above the incident/rollback lines, so a spike at the detection step shows
        ax.plot(s, np.where(np.isfinite(v), v, np.nan), lw=0.9, color=color, label=label, zorder=3)
        finite = v[np.isfinite(v)]
        peaks.append(float(finite.max()) if len(finite) else np.inf)
        bad = ~np.isfinite(v)
        if bad.any():
            ax.plot(s[bad], np.full(bad.sum(), 0.985), "|", color="red", ms=10, mew=1.5, transform=top,
                    label=None if nonfinite_labelled else "NaN / Inf", clip_on=False, zorder=4)
            nonfinite_labelled = True
    # drawn after the current lines so the legend lists those first; zorder keeps them beneath
    any_points = _draw_superseded(ax, top, chart, colors) or any_points
    any_points = any_points or (chart.band is not None and len(chart.band[1]) > 0)
    if not any_points:
        ax.text(0.5, 0.5, "no points in this window", ha="center", va="center", transform=ax.transAxes, color="gray")

    if chart.step_lo is not None or chart.step_hi is not None:
        cur_lo, cur_hi = ax.get_xlim()
        ax.set_xlim(chart.step_lo if chart.step_lo is not None else cur_lo,
                    chart.step_hi if chart.step_hi is not None else cur_hi)
    lo, hi = ax.get_xlim()
    _annotate(ax, top, marks, lo, hi)
    if chart.onset is not None and lo <= chart.onset <= hi:
        ax.axvline(chart.onset, color="tab:red", ls="--", lw=1.6, label=f"onset {chart.onset}", zorder=3.5)
    ax.set_xlim(lo, hi)

    handles, labels = ax.get_legend_handles_labels()
    if len(handles) > MAX_LEGEND + 3:  # many modules: name the hottest ones
        order = np.argsort(peaks)[::-1][:MAX_LEGEND]
        wanted = {chart.series[j][0] for j in order} | {"NaN / Inf"}
        pairs = [(h, l) for h, l in zip(handles, labels) if l in wanted or not any(l == s[0] for s in chart.series)]
        handles, labels = [p[0] for p in pairs], [p[1] for p in pairs]
        title = f"top {MAX_LEGEND} of {n} by peak"
    else:
        title = None
    if handles:
        ax.legend(handles, labels, fontsize=7, loc="upper left", title=title, title_fontsize=7,
                  framealpha=0.8, ncols=2 if len(handles) > 6 else 1)

    buf = io.BytesIO()
    # zlib level 1: ~30 ms less per chart than the default 6 for a somewhat larger file (a
    # chart is drawn per request and not stored; bench/plot.py)
    fig.savefig(buf, format="png", pil_kwargs={"compress_level": 1})
    return buf.getvalue()


def _draw_superseded(ax, top, chart: Chart, colors: list) -> bool:
    """Faded dashed lines (zorder 2.5: over the bands and incident lines, under the current
    trajectory at 3) and faded non-finite ticks. The legend names each attempt once; with several
    series its swatch is gray, as the lines take their series' colors. True if anything was drawn."""
    labelled: set[int] = set()
    drawn = False
    for i, attempt, steps, values in chart.superseded:
        if len(steps) == 0:
            continue
        drawn = True
        s, v = steps, values
        label = None
        if attempt not in labelled:
            labelled.add(attempt)
            label = f"superseded attempt {attempt}"
            if len(chart.series) > 1:  # a neutral legend swatch, drawn nowhere
                ax.plot([], [], color="gray", **_FADED, label=label)
                label = None
        ax.plot(s, np.where(np.isfinite(v), v, np.nan), color=colors[i], **_FADED, label=label, zorder=2.5)
        bad = ~np.isfinite(v)
        if bad.any():  # often the very NaN that triggered the rollback
            ax.plot(s[bad], np.full(bad.sum(), 0.985), "|", color="red", alpha=0.35, ms=10, mew=1.5,
                    transform=top, clip_on=False, zorder=2.5)
    return drawn


_FADED = {"lw": 1.0, "ls": (0, (4, 2)), "alpha": 0.55}  # visible over the re-trained band, clearly not current


def _annotate(ax, top, marks: Marks, lo: float, hi: float) -> None:
    for lr in marks.lr_changes:
        end = lr.step + lr.steps if lr.steps is not None else hi
        if lr.step > hi or end < lo:
            continue
        ax.axvline(lr.step, color="tab:purple", ls=":", lw=1.2, label=f"LR x{lr.multiplier:g} @ {lr.step}")
        ax.axvspan(lr.step, end, color="tab:purple", alpha=0.06)
    for rb in marks.rollbacks:
        if not _visible(lo, hi, rb.from_step, rb.to_step):
            continue
        if rb.from_step is not None and rb.from_step > rb.to_step:
            ax.axvspan(rb.to_step, rb.from_step, color="tab:orange", alpha=0.12, label=f"re-trained ({rb.label})")
            ax.annotate("", xy=(rb.to_step, 0.9), xytext=(rb.from_step, 0.9), xycoords=top, textcoords=top,
                        arrowprops={"arrowstyle": "->", "color": "tab:orange", "lw": 1.6})
            ax.text((rb.to_step + rb.from_step) / 2, 0.92, rb.label, transform=top, ha="center", va="bottom",
                    fontsize=7, color="tab:orange")
        else:
            ax.axvline(rb.to_step, color="tab:orange", lw=1.2, label=rb.label)
    for inc in marks.incidents:
        if not _visible(lo, hi, inc.onset, inc.detect):
            continue
        color = "tab:red" if inc.open else "dimgray"
        lw = 2.0 if inc.selected else 1.0
        alpha = 1.0 if inc.selected else 0.7
        ax.axvline(inc.onset, color=color, ls="--", lw=lw, alpha=alpha, label=f"#{inc.id} onset {inc.onset}")
        ax.axvline(inc.detect, color=color, ls="-", lw=lw, alpha=alpha, label=f"#{inc.id} detect {inc.detect}")
        ax.text(inc.detect, 0.02, f" #{inc.id} {inc.label}", transform=top, fontsize=7, color=color,
                rotation=90, va="bottom", ha="right")
