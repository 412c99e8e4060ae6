"""Alerts to humans (Slack, console): the durable outbox's rows.

One row per alert per channel. `enqueue` writes them `pending` inside the caller's transaction
(the one that decided the incident or action), so an alert exists exactly when its cause does;
the sender (supervisor.notify.outbox) delivers them in id order per channel and records what
really happened: `sent`, still `pending` with the last error and the next try, or `failed` when
the channel refused that message for good.
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any, Sequence

from sqlalchemy import insert, select, update
from sqlalchemy.orm import Session

from thermowatch.supervisor.store.orm import Alert, utcnow


@dataclass(slots=True)
class AlertRow:
    id: int
    run_id: str | None
    channel: str
    text: str
    sent_at: dt.datetime | None
    ok: bool
    error: str
    state: str = "sent"
    attempts: int = 0
    next_attempt_at: dt.datetime | None = None
    created_at: dt.datetime | None = None
    payload: dict[str, Any] | None = None
    thread_key: str | None = None  # the story it belongs to ("incident:42"); None: on its own
    ts: str | None = None  # the channel's id for the delivered message (Slack's ts)


@dataclass(frozen=True, slots=True)
class ThreadParent:
    """Where a reply goes: `ts` of the thread's first delivered message in this channel, or None
    with `lost` set when the earlier messages of the thread were all refused for good."""

    ts: str | None
    lost: str = ""  # the refusal of the thread's first message, when it never got a ts
    payload: dict[str, Any] | None = None  # the parent's Alert, to rewrite it with a new status


def _row(r: Alert) -> AlertRow:
    return AlertRow(r.id, r.run_id, r.channel, r.text, r.sent_at, r.ok, r.error, r.state, r.attempts,
                    r.next_attempt_at, r.created_at, r.payload, r.thread_key, r.ts)


def enqueue(session: Session, run_id: str | None, channels: Sequence[str], title: str,
            payload: dict[str, Any], thread_key: str | None = None) -> None:
    """One pending row per channel, in the caller's transaction (never commits)."""
    now = utcnow()
    session.execute(insert(Alert), [
        {"run_id": run_id, "channel": ch, "text": title, "created_at": now, "sent_at": None, "ok": False,
         "error": "", "state": "pending", "attempts": 0, "next_attempt_at": None, "payload": payload,
         "thread_key": thread_key, "ts": None}
        for ch in channels])


def thread_parent(session: Session, channel: str, thread_key: str, before_id: int) -> ThreadParent | None:
    """The message a row of `thread_key` replies to in `channel`: the oldest earlier row of the
    thread that got a ts. None when the row is the thread's first (or the channel gives no ids,
    like the console). The outbox sends a channel's rows in id order, so every earlier row is
    already `sent` or `failed` here."""
    earlier = (select(Alert.state, Alert.ts, Alert.error, Alert.payload)
               .where(Alert.channel == channel, Alert.thread_key == thread_key, Alert.id < before_id)
               .order_by(Alert.id))
    lost = ""
    for state, ts, error, payload in session.execute(earlier):
        if ts:
            return ThreadParent(ts, payload=payload)
        if state == "failed" and not lost:
            lost = error or "refused"
    return ThreadParent(None, lost) if lost else None


def thread_headline(session: Session, channel: str, thread_key: str, before_id: int) -> dict[str, Any] | None:
    """The Alert payload that heads the thread's top message: its latest earlier row that changed
    the run or asks a human (warn, critical; not a chart), else its first (issue 37: the top message
    says the consequence, not the first detector's note). Read newest first, stopping at the first
    match: only when the top message is rewritten, not for every reply."""
    earlier = (select(Alert.payload)
               .where(Alert.channel == channel, Alert.thread_key == thread_key, Alert.id < before_id)
               .order_by(Alert.id.desc()))
    first = None
    for (payload,) in session.execute(earlier):
        if not payload:
            continue
        if payload.get("severity") in _HEADLINE and not payload.get("chart"):
            return payload
        first = payload
    return first


_HEADLINE = ("warn", "critical")  # Severity values: what the run's story is about


def in_story(session: Session, channel: str, thread_key: str) -> bool:
    """Whether `channel` holds a row of the story `thread_key` not refused for good (pending or
    sent): a pager was paged, or is about to be, for it."""
    q = (select(Alert.id).where(Alert.channel == channel, Alert.thread_key == thread_key, Alert.state != "failed")
         .limit(1))
    return session.execute(q).first() is not None


def pending(session: Session, channel: str, limit: int = 50) -> list[AlertRow]:
    """The channel's undelivered alerts, oldest first (due or not: order is kept per channel)."""
    q = (select(Alert).where(Alert.state == "pending", Alert.channel == channel)
         .order_by(Alert.id).limit(limit))
    return [_row(r) for r in session.execute(q).scalars()]


def pending_channels(session: Session) -> list[str]:
    q = select(Alert.channel).where(Alert.state == "pending").distinct()
    return list(session.execute(q).scalars())


def mark_sent(session: Session, alert_id: int, ts: str | None = None) -> None:
    session.execute(update(Alert).where(Alert.id == alert_id).values(
        state="sent", ok=True, sent_at=utcnow(), attempts=Alert.attempts + 1, next_attempt_at=None, ts=ts))


def mark_retry(session: Session, alert_id: int, error: str, next_attempt_at: dt.datetime) -> None:
    session.execute(update(Alert).where(Alert.id == alert_id).values(
        error=error, attempts=Alert.attempts + 1, next_attempt_at=next_attempt_at))


def mark_failed(session: Session, alert_id: int, error: str) -> None:
    session.execute(update(Alert).where(Alert.id == alert_id).values(
        state="failed", ok=False, error=error, attempts=Alert.attempts + 1, next_attempt_at=None))


def alerts(session: Session, run_id: str | None = None, limit: int = 200) -> list[AlertRow]:
    q = select(Alert)
    if run_id is not None:
        q = q.where(Alert.run_id == run_id)
    rows = session.execute(q.order_by(Alert.id.desc()).limit(limit)).scalars()
    return [_row(r) for r in rows]


@dataclass(frozen=True, slots=True)
class OpenPage:
    """A story whose page nobody has answered: its first page since it was last answered or
    resolved (`payload`, the Alert), when that was written, and whether it was escalated since."""

    thread_key: str
    run_id: str | None
    paged_at: dt.datetime
    payload: dict[str, Any]
    escalated: bool


def open_pages(session: Session, since: dt.datetime, limit: int = 20_000) -> list[OpenPage]:
    """Stories with a page (a CRITICAL that asks a person: no acknowledge, resolve, chart or fold)
    written since `since` and not answered (approved, acknowledged) or resolved after it, oldest
    page first (supervisor.app.jobs.escalate). One channel's rows are enough (every channel gets
    the same alert), but a pager takes only some, so every row is read: a few hundred a day."""
    q = (select(Alert.thread_key, Alert.run_id, Alert.created_at, Alert.payload)
         .where(Alert.thread_key.is_not(None), Alert.created_at >= since).order_by(Alert.id).limit(limit))
    opened: dict[str, OpenPage] = {}
    for key, run_id, at, payload in session.execute(q):
        p = payload or {}
        if p.get("story_state") in ("answered", "resolved"):
            opened.pop(key, None)
        elif p.get("escalation"):
            if key in opened:
                opened[key] = OpenPage(key, run_id, opened[key].paged_at, opened[key].payload, True)
        elif (key not in opened and p.get("severity") == "critical" and not p.get("story_state")
              and not p.get("chart") and not p.get("fold_count")):
            opened[key] = OpenPage(key, run_id, at, p, False)
    return sorted(opened.values(), key=lambda o: o.paged_at)
