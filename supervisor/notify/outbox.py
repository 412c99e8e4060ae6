"""The durable alert outbox: nothing on the ingest or command path waits for Slack.

The executor writes each alert as one `pending` row per channel in the same transaction as the
incident or action that causes it (supervisor.store.alerts.enqueue), then wakes this sender. One
background thread delivers rows in id order per channel, so a channel's alerts arrive in the
order they were decided even after an outage. A channel that fails (Slack 429 with a long
Retry-After, 5xx, a dropped connection, a revoked token) keeps its rows `pending` with the error
and the time of the next try (exponential backoff, capped); a daemon restart picks them up from
the database. A message the channel refuses for good (malformed blocks, too long) is marked
`failed` and the channel goes on with the next one. The row tells the truth: `sent` only after
the channel took it.

Threads (issue 12): each row carries its story's key (`Alert.thread_key`: "incident:42"). The
first row of a story in a channel goes top-level and its message id (Slack's ts) is stored on
the row; every later row of the story is sent as a reply to it. Order per channel makes that
safe: a reply is only sent once its parent is `sent` (it has a ts) or `failed` for good, and in
that case the reply goes top-level and says so, becoming the parent of the rest.

Charts (issue 12): an alert with a `chart` is an upload row, written only for channels that can
upload (Slack's `upload`), after the text it illustrates, in the same thread. The sender renders
the PNG when the row's turn comes (supervisor.notify.chart) and uploads it. An upload never holds
up text: one that fails or waits for its next try is stepped over (the text rows behind it go
out), retried with the same backoff up to `upload_attempts` times, then marked failed; the text
it illustrates was sent on its own row before it and is never touched.

Channels are the parts of the notifier (supervisor.notify.base.FanOut), each delivered and
recorded on its own: the console taking an alert never hides that Slack refused it. A
channel with a `wants(alert, paged)` filter (the pagers: PagerDuty, the signed webhook) gets
rows only for the alerts it takes, so its rows say what was really paged.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import threading
import time
from typing import Callable, Sequence

from sqlalchemy.orm import Session, sessionmaker

from thermowatch.monitors.contract import Severity
from thermowatch.supervisor.notify.base import Alert, ChartRequest, FanOut, Notifier, NotifyError, channel_name  # noqa: F401
from thermowatch.supervisor.notify.chart import render_chart
from thermowatch.supervisor.store import alerts as alerts_store

log = logging.getLogger(__name__)

# (session, run id, incident id, what to draw) -> PNG bytes
ChartRenderer = Callable[[Session, str, "int | str | None", ChartRequest], bytes]


def _is_upload(row: alerts_store.AlertRow) -> bool:
    return bool((row.payload or {}).get("chart"))


class Outbox:
    def __init__(self, sessions: sessionmaker, notifier: Notifier, *, retry_s: float = 2.0,
                 max_retry_s: float = 600.0, idle_s: float = 10.0, batch: int = 50, upload_attempts: int = 5,
                 clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.timezone.utc),
                 charts: ChartRenderer | None = None, may_send: Callable[[], bool] | None = None) -> None:
        self._sessions = sessions
        # Several replicas (supervisor.app.lease): asked before each delivery; False (this replica
        # was deposed) leaves the row pending for the leader's sender: nothing is sent twice.
        self._may_send = may_send
        self._charts = charts or render_chart
        self.upload_attempts = upload_attempts
        parts: Sequence[Notifier] = notifier.parts if isinstance(notifier, FanOut) else [notifier]
        self._channels: dict[str, Notifier] = {}
        for part in parts:
            name, n = channel_name(part), 2
            while name in self._channels:  # two consoles, two Slack channels: keep rows apart
                name, n = f"{channel_name(part)}#{n}", n + 1
            self._channels[name] = part
        self.retry_s, self.max_retry_s, self.idle_s, self.batch = retry_s, max_retry_s, idle_s, batch
        self._clock = clock
        # One sender thread per channel: a Slack that hangs must not hold up the console.
        self._wakes = {name: threading.Event() for name in self._channels}
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    @property
    def channels(self) -> list[str]:
        return list(self._channels)

    # --- the decision side (inside the caller's transaction) ------------------------------------

    def enqueue(self, s: Session, alert: Alert) -> None:
        """Write `alert` as pending rows; delivered after the caller commits and calls `wake()`."""
        channels = self.channels
        if alert.chart is not None:  # a chart goes only where it can be uploaded
            channels = [name for name in channels if hasattr(self._channels[name], "upload")]
        channels = [name for name in channels if self._wants(s, name, alert)]
        if channels:
            alerts_store.enqueue(s, alert.run_id, channels, alert.title, alert.to_json(), alert.thread_key)

    def _wants(self, s: Session, name: str, alert: Alert) -> bool:
        """A channel that takes only some alerts (a pager: supervisor.notify.paging) says which;
        it is told lazily whether it holds a row of the alert's story (a resolve means nothing
        to a pager that was never paged for it). Every other channel takes every alert."""
        wants = getattr(self._channels[name], "wants", None)
        if wants is None:
            return True
        key = alert.thread_key
        return bool(wants(alert, lambda: key is not None and alerts_store.in_story(s, name, key)))

    def wake(self) -> None:
        for ev in self._wakes.values():
            ev.set()

    # --- the senders ------------------------------------------------------------------------------

    def start(self) -> "Outbox":
        if not self._threads:
            for name, part in self._channels.items():
                t = threading.Thread(target=self._run, args=(name, part), name=f"thermowatch-alerts-{name}",
                                     daemon=True)
                t.start()
                self._threads.append(t)
            self.wake()  # rows left pending by an earlier process
        return self

    def dead_senders(self) -> list[str]:
        """Channels whose sender thread is not running (none started, or one died): their alerts
        are written and never sent. For /healthz."""
        if self.channels and not self._threads:
            return list(self.channels)
        return [t.name.removeprefix("thermowatch-alerts-") for t in self._threads if not t.is_alive()]

    def close(self, timeout: float = 5.0) -> None:
        """Stop the senders after a last short pass; what is still pending stays in the database."""
        if self._threads:
            self.drain(timeout, due_only=True)
            self._stop.set()
            self.wake()
            for t in self._threads:
                t.join(timeout + 30)
            self._threads = []

    def drain(self, timeout: float = 30.0, *, due_only: bool = False) -> bool:
        """Wait until no row of a configured channel is pending (`due_only`: none is due now,
        i.e. every channel has either caught up or is backing off after a failure)."""
        deadline = time.monotonic() + timeout
        self.wake()
        while True:
            if not self._pending(due_only):
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.02)

    def _run(self, name: str, part: Notifier) -> None:
        wake = self._wakes[name]
        while not self._stop.is_set():
            wake.clear()
            try:
                wait = self._deliver_channel(name, part)
            except Exception:  # noqa: BLE001 - the sender outlives a database hiccup
                log.exception("alert sender %s: a delivery pass failed; trying again shortly", name)
                wait = self.retry_s
            wake.wait(min(self.idle_s, wait) if wait is not None else self.idle_s)

    def _deliver_channel(self, name: str, part: Notifier) -> float | None:
        while True:
            with self._sessions() as s:
                rows = alerts_store.pending(s, name, self.batch)
            if not rows:
                return None
            soonest: float | None = None  # the next try of an upload stepped over
            for row in rows:
                if self._may_send is not None and not self._may_send():
                    log.warning("alert sender %s: this replica no longer leads; its rows are the leader's", name)
                    return self.idle_s
                now = self._clock()
                upload = _is_upload(row)
                if row.next_attempt_at is not None and row.next_attempt_at > now:
                    wait = (row.next_attempt_at - now).total_seconds()
                    if upload:  # a chart never holds up the text behind it
                        soonest = wait if soonest is None else min(soonest, wait)
                        continue
                    # Order per channel: no newer text goes out before this one.
                    return wait if soonest is None else min(soonest, wait)
                if upload:
                    if not self._upload_one(name, part, row):
                        wait = self._backoff(row.attempts + 1)
                        soonest = wait if soonest is None else min(soonest, wait)
                    continue
                if not self._send_one(name, part, row):
                    wait = self._backoff(row.attempts + 1)
                    return wait if soonest is None else min(soonest, wait)
            if len(rows) < self.batch or soonest is not None:
                return soonest

    def _send_one(self, name: str, part: Notifier, row: alerts_store.AlertRow) -> bool:
        """Deliver one row; False when the channel is down (stop it for now, keep the order)."""
        try:
            alert, parent = self._threaded(name, row, Alert.from_json(row.payload or {"run_id": row.run_id,
                                                                                        "title": row.text}))
            ts = part.send(alert)
        except NotifyError as exc:
            if not exc.retryable:
                log.error("alert %s to %s refused for good: %s", row.id, name, exc)
                with self._sessions.begin() as s:
                    alerts_store.mark_failed(s, row.id, str(exc))
                return True
            return self._retry_later(name, row, f"{exc}")
        except Exception as exc:  # noqa: BLE001 - an unknown failure is treated as an outage
            return self._retry_later(name, row, f"{type(exc).__name__}: {exc}")
        # The top message first, then the row: a row is `sent` once all it does is done, so
        # drain() (and a reader of the thread) never sees the reply without its new state.
        if parent is not None and parent.ts and (alert.status or _headline(alert)):
            self._restate(name, part, row, parent, alert.status, keep_buttons=alert.fold_count > 0,
                          headline=alert if _headline(alert) else None)
        with self._sessions.begin() as s:
            alerts_store.mark_sent(s, row.id, ts)
        return True

    def _upload_one(self, name: str, part: Notifier, row: alerts_store.AlertRow) -> bool:
        """Render and upload one chart; False when it is to be tried again later."""
        try:
            alert, _ = self._threaded(name, row, Alert.from_json(row.payload or {}))
            assert alert.chart is not None
            with self._sessions() as s:
                png = self._charts(s, alert.run_id, alert.incident_id, alert.chart)
            file_id = part.upload(alert, png)  # type: ignore[attr-defined] - enqueue() checked it has one
        except Exception as exc:  # noqa: BLE001 - a chart is never worth stopping the channel for
            retryable = not isinstance(exc, NotifyError) or exc.retryable
            if retryable and row.attempts + 1 < self.upload_attempts:
                self._retry_later(name, row, f"{type(exc).__name__}: {exc}")
                return False
            log.error("chart %s to %s not uploaded (attempt %d, giving up): %s", row.id, name, row.attempts + 1, exc)
            with self._sessions.begin() as s:
                alerts_store.mark_failed(s, row.id, f"{type(exc).__name__}: {exc}")
            return True
        log.info("chart %s uploaded to %s as file %s", row.id, name, file_id)
        with self._sessions.begin() as s:
            alerts_store.mark_sent(s, row.id, None)  # a file id is no message to thread under
        return True

    def _restate(self, name: str, part: Notifier, row: alerts_store.AlertRow, parent: alerts_store.ThreadParent,
                 status: str, keep_buttons: bool = False, headline: Alert | None = None) -> None:
        """Best effort: the thread's top message shows the story's state and its headline (the
        latest alert that changed the run or asks a human: `headline`, else the thread's own,
        alerts_store.thread_headline). The reply already says it, so a failed update is logged and
        never holds up the channel."""
        update = getattr(part, "update", None)  # channels without message ids (console) have none
        if update is None or not parent.payload:
            return
        try:
            with self._sessions() as s:
                told = Alert.from_json(alerts_store.thread_headline(s, name, row.thread_key, row.id) or parent.payload)
            top = headline if headline is not None else told
            status = status or told.status
            # Any later state of the story answers the question the buttons asked; a flapping
            # repeat does not, so the buttons stay.
            update(parent.ts, dataclasses.replace(top, status=status, thread_ts=None, broadcast=False,
                                                  approve_action=top.approve_action if keep_buttons else None))
        except Exception as exc:  # noqa: BLE001
            log.warning("alert channel %s: could not update thread %s with %r: %s", name, parent.ts, status, exc)

    def _threaded(self, name: str, row: alerts_store.AlertRow,
                  alert: Alert) -> tuple[Alert, alerts_store.ThreadParent | None]:
        """`alert` as a reply under its story's first delivered message in this channel."""
        if row.thread_key is None or alert.thread_ts:
            return alert, None
        with self._sessions() as s:
            parent = alerts_store.thread_parent(s, name, row.thread_key, row.id)
        if parent is None:
            return alert, None
        if parent.ts:
            return dataclasses.replace(alert, thread_ts=parent.ts), parent
        note = f"(posted on its own: this {row.thread_key.split(':')[0]}'s first message was refused: {parent.lost})"
        return dataclasses.replace(alert, text=f"{alert.text}\n{note}" if alert.text else note), None

    def _retry_later(self, name: str, row: alerts_store.AlertRow, error: str) -> bool:
        wait = self._backoff(row.attempts + 1)
        log.warning("alert %s to %s not delivered (attempt %d): %s; retrying in %.0f s",
                    row.id, name, row.attempts + 1, error, wait)
        with self._sessions.begin() as s:
            alerts_store.mark_retry(s, row.id, error, self._clock() + dt.timedelta(seconds=wait))
        return False

    def _backoff(self, attempts: int) -> float:
        return min(self.max_retry_s, self.retry_s * 2 ** max(0, attempts - 1))

    def _pending(self, due_only: bool) -> bool:
        now = self._clock()
        with self._sessions() as s:
            for name in self._channels:
                rows = alerts_store.pending(s, name, self.batch if due_only else 1)
                if rows and not due_only:
                    return True
                for row in rows:  # as _deliver_channel sees them: uploads waiting are stepped over
                    if row.next_attempt_at is None or row.next_attempt_at <= now:
                        return True
                    if not _is_upload(row):
                        break
        return False


def _headline(alert: Alert) -> bool:
    """An alert that changed the run or asks a human (WARN, CRITICAL) heads its thread's top message."""
    return alert.severity in (Severity.WARN, Severity.CRITICAL) and alert.chart is None and not alert.fold_count
