"""The PNG uploaded into an incident's Slack thread: the finding's thermometer around its onset.

Called by the outbox's sender thread (supervisor.notify.outbox) when an upload row's turn comes,
so neither the ingest path nor a text alert ever waits for matplotlib. It draws through the one
chart path (supervisor.charts.png.chart_png: the rollups' min/max buckets, the same faded superseded
attempts as the web page; matplotlib imported here only, STYLE.md 6), and marks this incident's
onset and detection and the threshold its finding fired on (the attention-logit ceiling, the loss
spike's bar: the finding's evidence, read back from the findings store by metric, detection step,
signal and incident), so the reader sees how far over the line the run went (issue 37).
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from thermowatch.supervisor.notify.base import ChartRequest, NotifyError
from thermowatch.supervisor.errors import UserError

WIDTH_PX, HEIGHT_PX = 900, 360  # readable on a phone's Slack preview; ~40 KB


def render_chart(s: Session, run_id: str, incident_id: int | str | None, req: ChartRequest) -> bytes:
    """PNG bytes of `req.metric` for steps [step_lo, step_hi]. A metric with no points there is a
    NotifyError that retrying cannot fix (the outbox marks the upload failed, the text is sent)."""
    from thermowatch.supervisor.charts.plots import render

    return render(*chart_of(s, run_id, incident_id, req))


def chart_of(s: Session, run_id: str, incident_id: int | str | None, req: ChartRequest):
    """What render_chart draws, before it is drawn: (plots.Chart, plots.Marks)."""
    from thermowatch.supervisor.charts.plots import IncidentMark, Marks
    from thermowatch.supervisor.charts.png import prepare, thresholds_for

    ident = int(incident_id) if isinstance(incident_id, int) or str(incident_id or "").isdigit() else 0
    marks = Marks(incidents=[IncidentMark(ident, req.label or req.metric.split("/", 1)[0], req.onset_step, req.detect_step,
                                          open=True, selected=True)])
    title = f"{run_id}: {req.metric}, steps {req.step_lo}-{req.step_hi} (onset {req.onset_step}, " \
            f"detected {req.detect_step})"
    # the finding this chart was asked for (ChartRequest.around): its metric, detection step and signal
    thresholds = thresholds_for(s, run_id, {req.metric}, req.detect_step, req.detect_step, selected=ident,
                                signal=req.label or None)[:1]
    try:
        return prepare(s, run_id, req.metric, req.step_lo, req.step_hi, marks=marks, width_px=WIDTH_PX,
                       height_px=HEIGHT_PX, title=title, empty_ok=False, thresholds=thresholds)
    except UserError as exc:  # NotFound included: an unknown metric, or no point in the window
        raise NotifyError(f"{exc}; nothing to draw", retryable=False) from None
