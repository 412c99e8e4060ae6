"""The chart of an incident uploaded into its Slack thread (supervisor.notify.chart, the outbox's
upload rows, SlackNotifier.upload) with the real Supervisor, real records from a diverging run,
the real slack-sdk files_upload_v2 and the fake Slack server's upload wire format, on SQLite and
PostgreSQL: the PNG is the finding's metric around its onset with the threshold it fired on, it
lands in the incident's thread, a failing upload is retried and never holds up or loses a text
alert."""

from __future__ import annotations

import io
import struct

import matplotlib.image
import numpy as np
import pytest

from thermowatch.supervisor.notify.base import ChartRequest
from thermowatch.supervisor.charts.plots import figure
from thermowatch.supervisor.notify.chart import HEIGHT_PX, WIDTH_PX, chart_of, render_chart
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store import findings as findings_store
from tests.fakes.slack_server import FakeSlack
from tests.supervisor.notify.test_outbox import RUN, _ack_rollback, _diverge, _rows, make_sup

pytestmark = pytest.mark.timeout(120)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def slack():
    with FakeSlack() as fake:
        yield fake


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR", "not a PNG"
    return struct.unpack(">II", data[16:24])


def test_the_onset_chart_is_uploaded_into_the_incidents_thread(db, tmp_path, slack):
    sup = make_sup(db, tmp_path, slack)
    try:
        act = _diverge(sup, tmp_path)
        assert sup.executor.outbox.drain(60)
        rows = _rows(sup, uploads=True)  # one per incident (an alert on the ceiling came first)
        assert rows and all(r.state == "sent" and r.ok for r in rows)
        with sup.sessions() as s:  # the incidents of one divergence episode share one thread (issue 37)
            key = f"incident:{incidents_store.episode(s, act.incident_id)}"
        assert len(slack.shared_files()) == len(rows) and {r.thread_key for r in rows} == {key}
        assert not _rows(sup, "console", uploads=True)  # the console cannot show a picture
        (row,) = [r for r in rows if r.payload["incident_id"] == act.incident_id]
        top = [r for r in _rows(sup) if r.thread_key == key][0]
        (upload,) = [u for u in slack.shared_files() if u.title == row.text]
        assert upload.thread_ts == top.ts
        # The right metric: the finding that opened the incident, around its onset.
        with sup.sessions() as s:
            finding = findings_store.findings(s, RUN, act.incident_id)[0].finding  # the one that opened it
            req = ChartRequest.from_json(row.payload["chart"])
            assert req.metric == finding.metric and req.metric.startswith("attn_logit")
            assert req.step_lo < finding.onset_step <= finding.detect_step < req.step_hi
            # byte for byte the chart of that metric and window (matplotlib's Agg is deterministic)
            assert upload.data == render_chart(s, RUN, act.incident_id, req)
            chart, marks = chart_of(s, RUN, act.incident_id, req)
            fired = next(f.finding for f in findings_store.findings(s, RUN, act.incident_id)
                         if (f.finding.metric, f.finding.detect_step) == (req.metric, req.detect_step))
            other = render_chart(s, RUN, act.incident_id, ChartRequest("loss", req.step_lo, req.step_hi,
                                                                        req.onset_step, req.detect_step))
        # The ceiling the alert is about (issue 37: the chart left it out): the finding's own threshold,
        # a labelled line, in the legend, inside the y range, drawn where the uploaded PNG shows it.
        level = fired.evidence["threshold"]
        assert [(t.value, t.label) for t in marks.thresholds] == [(level, f"{fired.signal.value} threshold {level:.4g}")]
        fig = figure(chart, marks)
        ax = fig.axes[0]
        assert f"{fired.signal.value} threshold {level:.4g}" in [t.get_text() for t in fig.legends[0].get_texts()]
        assert [ln for ln in ax.lines if list(ln.get_ydata()) == [level, level]]
        lo, hi = ax.get_ylim()
        assert lo < level < hi
        row = HEIGHT_PX - int(round(ax.transData.transform((req.step_lo, level))[1]))
        frame = ax.get_window_extent(fig.canvas.get_renderer())
        band = matplotlib.image.imread(io.BytesIO(upload.data))[row - 1:row + 2, int(frame.x0) + 2:int(frame.x1) - 2, :3]
        assert (band.max(axis=-1) < 0.4).any(axis=0).mean() > 0.5  # a dark dash-dot line across the axes
        assert upload.data != other
        assert _png_size(upload.data) == (WIDTH_PX, HEIGHT_PX) and upload.length == len(upload.data)
        pixels = matplotlib.image.imread(io.BytesIO(upload.data))
        assert pixels.shape[:2] == (HEIGHT_PX, WIDTH_PX) and np.unique(pixels.reshape(-1, pixels.shape[2]),
                                                                        axis=0).shape[0] > 20  # drawn, not blank
        assert req.metric.replace("/", "_") in upload.filename and req.metric in upload.title
        # In the incident's thread: under its first message, in the channel it was posted to.
        assert upload.channel == slack.messages[top.ts]["channel"]
        shares = [m for m in slack.thread(top.ts) if m.get("subtype") == "file_share"]
        assert upload.file_id in [f["id"] for m in shares for f in m["files"]]
        assert len(shares) == len(rows)
        # the wire format files_upload_v2 speaks, in its order
        methods = [r.api_method for r in slack.requests if r.api_method not in ("chat.update", "chat.postMessage")]
        assert methods == ["files.getUploadURLExternal", "upload", "files.completeUploadExternal"] * len(rows)
        assert slack.calls("files.getUploadURLExternal")[-1].body["length"] == str(len(upload.data))
    finally:
        sup.close()


def test_a_failing_upload_is_retried_and_never_holds_up_text(db, tmp_path, slack):
    sup = make_sup(db, tmp_path, slack)
    outbox = sup.executor.outbox
    try:
        slack.fail_uploads(10**6)  # the upload URL answers 500, for good
        outbox.retry_s, outbox.upload_attempts = 1.0, 3  # tries at 0, +1 s, +3 s
        act = _diverge(sup, tmp_path)
        to = _ack_rollback(sup, act)  # the rollback's "done" reply is decided behind the upload
        assert outbox.drain(60)
        uploads = _rows(sup, uploads=True)
        assert uploads and all((r.state, r.attempts) == ("failed", 3) and "HTTP 500" in r.error for r in uploads)
        texts = _rows(sup)
        assert len(texts) >= 2 and all(r.state == "sent" and r.ok for r in texts), "a failed upload lost text"
        assert f"rolled back to checkpoint {to}" in slack.posted()[-1]["text"]
        order = [r.api_method for r in slack.requests if r.api_method in ("chat.postMessage", "upload")]
        # the done reply (the last message) went out while an upload was still failing: not held up
        last_post = len(order) - 1 - order[::-1].index("chat.postMessage")
        assert "upload" in order[last_post:], "the text waited for the uploads to give up"
        assert order.count("upload") == 3 * len(uploads) and not slack.shared_files()
    finally:
        sup.close()


def test_an_upload_that_fails_once_is_delivered_on_its_next_try(db, tmp_path, slack):
    sup = make_sup(db, tmp_path, slack)
    try:
        slack.fail_uploads(1)
        act = _diverge(sup, tmp_path)
        assert sup.executor.outbox.drain(60)
        first, *rest = _rows(sup, uploads=True)
        assert (first.state, first.attempts) == ("sent", 2) and "HTTP 500" in first.error
        assert all((r.state, r.attempts) == ("sent", 1) for r in rest)
        assert [r.status for r in slack.calls("upload")] == [500] + [200] * (1 + len(rest))
        uploads = slack.shared_files()
        assert len(uploads) == 1 + len(rest) and all(u.data[:8] == PNG_MAGIC for u in uploads)
        tops = {}
        for r in _rows(sup):
            if r.thread_key:
                tops.setdefault(r.thread_key, r.ts)  # a thread's first message
        assert sorted(u.thread_ts for u in uploads) == sorted(tops[r.thread_key] for r in [first, *rest])
        with sup.sessions() as s:
            assert f"incident:{incidents_store.episode(s, act.incident_id)}" in tops
    finally:
        sup.close()


def test_a_chart_with_nothing_to_draw_fails_at_once_and_the_text_behind_it_goes_out(db, tmp_path, slack):
    from thermowatch.monitors.contract import Severity
    from thermowatch.supervisor.notify.base import Alert

    sup = make_sup(db, tmp_path, slack)
    try:
        sup.executor.notify(Alert(RUN, Severity.INFO, f"{RUN}: chart", chart=ChartRequest("z/nowhere", 0, 10, 2, 5)))
        sup.executor.notify(Alert(RUN, Severity.INFO, f"{RUN}: after the chart"))
        assert sup.executor.outbox.drain(30)
        (chart,) = _rows(sup, uploads=True)
        assert (chart.state, chart.attempts) == ("failed", 1) and "no series 'z/nowhere'" in chart.error
        assert [m["text"] for m in slack.posted()] == [f"[INFO] {RUN}: after the chart"]
        assert not slack.calls("files.getUploadURLExternal")  # nothing was sent to Slack for it
    finally:
        sup.close()
