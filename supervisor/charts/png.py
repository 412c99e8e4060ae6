"""A chart as PNG bytes, read through the rollups (supervisor/store/chart.py) and drawn by
matplotlib (supervisor/charts/plots.py): the web page's no-script images, `GET
/api/runs/{run}/chart.png` (what `thermowatch plot` saves) and the chart the Slack code uploads
into an incident's thread all come from `chart_png`.

Each bucket is drawn as its min and its max at the bucket's first step, so the line is the
min/max envelope the rollups keep (a one-step spike shows at any zoom); the live path of a key
is one line across attempts, the abandoned parts are faded beneath it. The thresholds drawn are
the ones the run's findings on the chart's keys fired on (their evidence's "threshold"), read
from the findings store: the daemon's configured ceilings are not known here, only what fired.
"""

from __future__ import annotations

import math

import numpy as np
from sqlalchemy.orm import Session

from thermowatch.monitors.commands import ActionState, CommandKind
from thermowatch.monitors.contract import Finding, Reduce, reduction
from thermowatch.supervisor.charts.plots import (LOG_METRICS, Chart, IncidentMark, LrMark, Marks, RollbackMark,
                                                 ThresholdMark, render)
from thermowatch.supervisor.errors import NotFound
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import chart as chart_store
from thermowatch.supervisor.store import findings as findings_store
from thermowatch.supervisor.store import lr_changes as lr_store
from thermowatch.supervisor.store.views import incidents_with_findings

MAX_LINES = 8  # more keys than this: the hottest as lines, all of them as a band
MAX_THRESHOLDS = 3  # one line per signal that fired in the window, at most this many


def _envelope(s: chart_store.ChartSeries) -> tuple[np.ndarray, np.ndarray]:
    steps = np.repeat(s.step, 2)
    values = np.empty(2 * len(s.step))
    values[0::2], values[1::2] = s.min, s.max
    return steps, values


def _rank(data: chart_store.ChartData, keys: list[str]) -> list[str]:
    """Keys hottest first: a non-finite point first (the most alarming), then by peak (max-reduced
    and other metrics) or by lowest value (min-reduced: act_min), over every attempt's points."""
    score: dict[str, float] = {k: -np.inf for k in keys}
    for s in data.series:
        if not len(s.step):
            continue
        if not (np.isfinite(s.min).all() and np.isfinite(s.max).all()):
            score[s.key] = np.inf
            continue
        peak = -float(s.min.min()) if reduction(s.key) is Reduce.MIN else float(s.max.max())
        score[s.key] = max(score[s.key], peak)
    return sorted(keys, key=lambda k: -score[k])


def _band(data: chart_store.ChartData) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per bucket step, the lowest min and highest max over every series and attempt (finite
    values; a NaN has no place on a band, and its series is ranked first anyway)."""
    step = np.concatenate([s.step for s in data.series])
    lo = np.concatenate([np.where(np.isnan(s.min), np.inf, s.min) for s in data.series])
    hi = np.concatenate([np.where(np.isnan(s.max), -np.inf, s.max) for s in data.series])
    order = np.argsort(step, kind="stable")
    step, lo, hi = step[order], lo[order], hi[order]
    starts = np.flatnonzero(np.r_[True, np.diff(step) != 0])
    lo, hi = np.minimum.reduceat(lo, starts), np.maximum.reduceat(hi, starts)
    return step[starts], np.where(np.isfinite(lo), lo, np.nan), np.where(np.isfinite(hi), hi, np.nan)


def to_chart(data: chart_store.ChartData, *, title: str | None = None, logy: bool | None = None,
             onset: int | None = None, width_px: int = 1100, height_px: int = 320,
             window: tuple[int | None, int | None] = (None, None)) -> Chart:
    """The rollup buckets as a plots.Chart. Beyond MAX_LINES keys (a 100-layer family is a solid
    block of colour, and each noisy line costs ~10-60 ms of Agg stroking), the hottest MAX_LINES
    are lines and every key, every attempt, is a gray min-max band beneath them, so a spike in
    any layer still shows."""
    all_keys = sorted({s.key for s in data.series})
    keys = _rank(data, all_keys)[:MAX_LINES] if len(all_keys) > MAX_LINES else all_keys
    band = None
    if len(all_keys) > MAX_LINES:
        keys = sorted(keys)
        band = (f"all {len(all_keys)} series (min-max)", *_band(data))
    many = len(all_keys) > 1
    index = {k: i for i, k in enumerate(keys)}
    live: dict[str, list] = {k: [] for k in keys}
    superseded = []
    for s in data.series:
        if s.key not in index:
            continue
        st, v = _envelope(s)
        if s.current:
            live[s.key].append((st, v))
        else:
            superseded.append((index[s.key], s.attempt, st, v))
    series = []
    for k in keys:
        parts = live[k]
        st = np.concatenate([p[0] for p in parts]) if parts else np.empty(0, np.int64)
        v = np.concatenate([p[1] for p in parts]) if parts else np.empty(0)
        order = np.argsort(st, kind="stable")
        series.append((k.split("/", 1)[1] if many and "/" in k else k, st[order], v[order]))
    prefix = data.metric.split("/", 1)[0]
    shown = f" ({len(all_keys)} series" + (f"; the {MAX_LINES} hottest as lines)" if band else ")") if many else ""
    title = title or f"{data.run_id}: {data.metric}{shown}"
    return Chart(title, series, superseded, logy=(prefix in LOG_METRICS) if logy is None else logy,
                 step_lo=window[0], step_hi=window[1], width_px=width_px, height_px=height_px, onset=onset,
                 band=band)


def chart_png(session: Session, run_id: str, metric: str, step_lo: int | None = None, step_hi: int | None = None,
              *, onset: int | None = None, marks: Marks | None = None, logy: bool | None = None,
              width_px: int = 1100, height_px: int = 320, attempts: str = "all", title: str | None = None,
              empty_ok: bool = True, thresholds: list[ThresholdMark] | None = None) -> bytes:
    """PNG of `metric` (a full key or a family prefix) of one run over [step_lo, step_hi] (default:
    the whole run), with an optional onset line and incident/rollback/LR marks. Raises
    supervisor.errors.NotFound (unknown metric, or no point in the window with `empty_ok=False`)
    or UserError (bad window). One bucket per pixel column, read from the rollups: ~100-200 ms for
    100 series x 10^6 steps (BENCHMARKS.md). See prepare() for `thresholds`."""
    chart, marks = prepare(session, run_id, metric, step_lo, step_hi, onset=onset, marks=marks, logy=logy,
                           width_px=width_px, height_px=height_px, attempts=attempts, title=title,
                           empty_ok=empty_ok, thresholds=thresholds)
    return render(chart, marks)


def prepare(session: Session, run_id: str, metric: str, step_lo: int | None = None, step_hi: int | None = None,
            *, onset: int | None = None, marks: Marks | None = None, logy: bool | None = None,
            width_px: int = 1100, height_px: int = 320, attempts: str = "all", title: str | None = None,
            empty_ok: bool = True, thresholds: list[ThresholdMark] | None = None) -> tuple[Chart, Marks]:
    """What chart_png draws, before it is drawn (plots.figure takes it, as tests do). `thresholds`
    None: the ones the run's findings on the chart's keys fired on in the window (thresholds_for;
    the selected incident's first); a list: exactly those (Slack's chart: its finding's)."""
    buckets = min(chart_store.MAX_BUCKETS, max(chart_store.MIN_BUCKETS, width_px))
    data = chart_store.chart(session, run_id, metric, step_lo, step_hi, buckets, attempts)
    if not empty_ok and not any(len(x.step) for x in data.series):
        raise NotFound(f"no points of {metric!r} in run {run_id!r} between steps {step_lo} and {step_hi}")
    chart = to_chart(data, title=title, logy=logy, onset=onset, width_px=width_px, height_px=height_px,
                     window=(step_lo, step_hi))
    marks = Marks(list(marks.incidents), list(marks.rollbacks), list(marks.lr_changes)) if marks else Marks()
    if thresholds is None:
        selected = next((i.id for i in marks.incidents if i.selected), None)
        keys = {s.key for s in data.series}
        thresholds = thresholds_for(session, run_id, keys, step_lo, step_hi, selected=selected,
                                    name_module=len(keys) > 1) if keys else []
    marks.thresholds = list(thresholds)
    return chart, marks


def threshold_of(finding: Finding) -> float | None:
    """The level a finding fired on, in its metric's units, from its evidence's "threshold" (every
    detector that compares against a level writes it: monitors/detectors); None where it has none
    (a NaN, a stall). A bar on a magnitude (act_overflow's fraction of the dtype's max) is drawn on
    the side of zero the value was on: act_min's overflow is below zero."""
    raw = finding.evidence.get("threshold")
    if isinstance(raw, bool) or not isinstance(raw, (int, float)) or not math.isfinite(raw):
        return None
    value = finding.evidence.get("value")
    if isinstance(value, (int, float)) and math.isfinite(value) and value < 0 < raw:
        return -float(raw)
    return float(raw)


def thresholds_for(session: Session, run_id: str, keys: set[str], step_lo: int | None, step_hi: int | None, *,
                   selected: int | None = None, signal: str | None = None,
                   name_module: bool = False) -> list[ThresholdMark]:
    """One threshold per signal that fired on these keys with its detection in the window (at
    most MAX_THRESHOLDS, earliest signal first): the `selected` incident's finding where it has
    one, else the signal's earliest. `signal`: that signal's only. A per-module bar (the growth
    detector's, relative to each layer's own baseline) names its module when `name_module`."""
    chosen: dict[str, tuple[Finding, float, bool]] = {}  # signal -> (finding, level, the selected incident's)
    for stored in findings_store.findings_on(session, run_id, keys, step_lo, step_hi):
        f = stored.finding
        value = threshold_of(f)
        if value is None or (signal is not None and f.signal.value != signal):
            continue
        mine = selected is not None and stored.incident_id == selected
        have = chosen.get(f.signal.value)
        if (have is None and len(chosen) < MAX_THRESHOLDS) or (have is not None and mine and not have[2]):
            chosen[f.signal.value] = (f, value, mine)
    out = []
    for name, (f, value, _) in chosen.items():
        where = f" ({f.module})" if name_module and f.module else ""
        out.append(ThresholdMark(value, f"{name} threshold {value:.4g}{where}"))
    return out


def marks_for(s: Session, run_id: str, selected: int | None) -> Marks:
    """A run's incidents (`selected` drawn heavier), its acknowledged rollbacks and its LR changes,
    as the marks every chart of the run draws (the page's images and `GET .../chart.png`)."""
    incs = {i["id"]: i for i in incidents_with_findings(s, run_id)}
    marks = Marks()
    for i in incs.values():
        label = i["signal"] + (f" {i['module']}" if i["module"] else "")
        marks.incidents.append(IncidentMark(i["id"], label, i["onset_step"], i["detect_step"], i["state"] == "open",
                                            i["id"] == selected))
    for a in actions_store.actions(s, run_id, limit=10_000):
        if a.kind is not CommandKind.ROLLBACK or a.state not in (ActionState.ACKED, ActionState.DONE):
            continue
        to = a.checkpoint_step
        if to is None:
            continue
        inc = incs.get(a.incident_id) if a.incident_id is not None else None
        marks.rollbacks.append(RollbackMark(f"rollback #{a.id} to checkpoint {to}", inc["detect_step"] if inc else None,
                                            to))
    for c in lr_store.lr_changes(s, run_id):
        marks.lr_changes.append(LrMark(c.start_step, c.multiplier, c.steps))
    return marks
