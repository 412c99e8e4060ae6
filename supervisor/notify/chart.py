"""The PNG uploaded into an incident's Slack thread: the finding's thermometer around its onset.

Called by the outbox's sender thread (supervisor.notify.outbox) when an upload row's turn comes,
so neither the ingest path nor a text alert ever waits for matplotlib. It draws through the web
page's renderer (supervisor.web.plots.render, imported here only: STYLE.md 6), with the same
faded superseded attempts, and marks this incident's onset and detection.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from thermowatch.supervisor.notify.base import ChartRequest, NotifyError
from thermowatch.supervisor.store import thermometers

WIDTH_PX, HEIGHT_PX = 900, 360  # readable on a phone's Slack preview; ~40 KB


def render_chart(s: Session, run_id: str, incident_id: int | str | None, req: ChartRequest) -> bytes:
    """PNG bytes of `req.metric` for steps [step_lo, step_hi]. A metric with no points there is a
    NotifyError that retrying cannot fix (the outbox marks the upload failed, the text is sent)."""
    from thermowatch.supervisor.web.plots import Chart, IncidentMark, Marks, render

    (steps, values), old = thermometers.split_superseded(
        thermometers.history_by_attempt(s, run_id, req.metric, req.step_lo, req.step_hi))
    if len(steps) == 0 and not old:
        raise NotifyError(f"no points of {req.metric!r} in run {run_id!r} between steps {req.step_lo} and "
                          f"{req.step_hi}; nothing to draw", retryable=False)
    superseded = [(0, attempt, st, v) for attempt, (st, v) in old.items()]
    logy = req.metric.split("/", 1)[0] in ("grad_norm", "attn_logit_max", "attn_logit_lse", "act_max", "z")
    ident = int(incident_id) if isinstance(incident_id, int) or str(incident_id or "").isdigit() else 0
    marks = Marks(incidents=[IncidentMark(ident, req.label or req.metric.split("/", 1)[0], req.onset_step, req.detect_step,
                                          open=True, selected=True)])
    title = f"{run_id}: {req.metric}, steps {req.step_lo}-{req.step_hi} (onset {req.onset_step}, " \
            f"detected {req.detect_step})"
    chart = Chart(title, [(req.metric, steps, values)], superseded, logy=logy, step_lo=req.step_lo,
                  step_hi=req.step_hi, width_px=WIDTH_PX, height_px=HEIGHT_PX)
    return render(chart, marks)
