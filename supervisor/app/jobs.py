"""The daemon's periodic jobs (run by supervisor.app.scheduler; each one logs and carries on per item).

ack watchdog      sent commands with no acknowledgement are re-sent, then failed loudly
stall check       no step for detectors.stall.timeout_s -> stall finding -> policy (page)
retention         thin old thermometers so a 10^6-step run stays bounded
checkpoint scan   recorded checkpoints whose files vanished are marked deleted, broken ones distrusted
                  (a backstop: the trainer reports its own retention deletes as it makes them)
daily digest      one message a day: steps, incidents, actions per run active that day
peer envelope     a run active today (of the 200 newest) whose loss is behind the runs of its
                  model config that trained with no more LR (monitors/envelope.py) -> loss_behind_peers -> page
pause re-page     a run paused for longer than pause_repage_s -> a CRITICAL page again, once per interval
escalate          a page nobody acknowledged within escalate_after_s -> once more, to the escalation contacts

Each job costs what there is to do, not what was ever stored (issue 21, item 4: an ingest token
made 10^5 runs): retention reads the runs a page at a time with their last steps, the scan
pages through live checkpoints, the digest covers the runs active in the last 24 h.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import logging
import shlex
from pathlib import Path
from typing import Any, Protocol

from sqlalchemy.orm import sessionmaker

from thermowatch.monitors.contract import Finding, Severity
from thermowatch.monitors.envelope import Curve, EnvelopeConfig, behind_peers
from thermowatch.monitors.manifest import MANIFEST, files_problem
from thermowatch.monitors.names import printable
from thermowatch.supervisor.notify.base import Alert
from thermowatch.supervisor.app.scheduler import Job
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import alerts as alerts_store
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import checkpoints as ckpt_store
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store import peers as peers_store
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import thermometers as thermo_store


class Daemon(Protocol):
    """What the jobs need of the daemon (supervisor.app.service.Supervisor provides it). A Protocol,
    not an import: service builds the jobs, so jobs must not import service back."""

    cfg: Any
    sessions: sessionmaker
    executor: Any
    responder: Any
    notifier: Any

log = logging.getLogger(__name__)

# Keep full resolution for the newest 100k steps; thin older points to one in 10 (max/min kept
# by the store's per-metric reduction, so a spike never disappears from the plot).
RETENTION_FULL_STEPS = 100_000
RETENTION_EVERY = 10


def default_jobs(sup: Daemon) -> list[Job]:
    return [
        Job("ack_watchdog", lambda: sup.executor.expire(), every_s=min(30.0, sup.cfg.ack_timeout_s / 2)),
        Job("stall_check", lambda: sup.responder.check_stalls(), every_s=30.0),
        Job("retention", lambda: retention(sup), every_s=3600.0, jitter=60.0),
        Job("checkpoint_scan", lambda: checkpoint_scan(sup), every_s=900.0, jitter=30.0),
        Job("daily_digest", lambda: daily_digest(sup), every_s=86400.0),
        Job("peer_envelope", lambda: peer_envelope(sup), every_s=300.0, jitter=30.0),
        Job("pause_repage", lambda: pause_repage(sup), every_s=min(60.0, sup.cfg.pause_repage_s / 2), jitter=5.0),
        *([Job("escalate", lambda: escalate(sup), every_s=min(30.0, sup.cfg.escalate_after_s / 4), jitter=2.0)]
          if sup.cfg.escalate_after_s else []),
    ]


def retention(sup: Daemon, full_steps: int = RETENTION_FULL_STEPS, every: int = RETENTION_EVERY) -> int:
    thinned = 0
    for page in runs_store.each_page(sup.sessions):
        # Only runs longer than what is kept in full get a transaction: a page's last steps came
        # with it, so 10^5 short runs cost 100 page reads.
        for run in page:
            if run.last_step is None or run.last_step <= full_steps:
                continue
            try:
                with sup.sessions.begin() as s:
                    last = thermo_store.latest_step(s, run.run_id)
                    if last is not None and last > full_steps:
                        thinned += thermo_store.downsample(s, run.run_id, last - full_steps, every)
            except Exception:  # noqa: BLE001 - one bad run must not stop the others
                log.exception("retention for run %s failed", run.run_id)
    return thinned


def checkpoint_problem(path: str) -> str | None:
    """Why a recorded checkpoint cannot be a rollback target any more, or None. The file check
    is the trainer's own (monitors.manifest), so both sides agree on what "intact" means."""
    p = Path(path)
    if not p.is_dir():
        return f"directory {path} is gone"
    manifest = p / MANIFEST
    try:
        data = json.loads(manifest.read_text())
        return files_problem(p, data)
    except FileNotFoundError:
        return f"{manifest} is missing (half-written checkpoint)"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"{manifest} is unreadable or malformed: {type(exc).__name__}: {exc}"


def checkpoint_scan(sup: Daemon) -> list[tuple[str, int, str]]:
    """Marks checkpoints whose files are gone or broken unhealthy, so the policy never picks them."""
    bad = []
    after = 0
    while True:
        with sup.sessions() as s:
            page = ckpt_store.live_checkpoints(s, after)
        if not page:
            return bad
        after = page[-1].id
        bad += _scan(sup, page)


def _scan(sup: Daemon, rows: list[ckpt_store.CheckpointPath]) -> list[tuple[str, int, str]]:
    bad = []
    for c in rows:
        try:
            problem = checkpoint_problem(c.path)
        except Exception as exc:  # noqa: BLE001
            problem = f"scan failed: {exc}"
        if problem and (c.healthy or not Path(c.path).is_dir()):
            with sup.sessions.begin() as s:
                # Gone from disk: deleted (the page and the policy stop offering it); there but
                # broken: kept in the list, distrusted.
                ckpt_store.mark_checkpoint(s, c.id, healthy=False, deleted=not Path(c.path).is_dir() or None)
            # the path is the trainer's text: printable, so a newline in it cannot forge a log line
            log.warning("run %s checkpoint step %d distrusted: %s", c.run_id, c.step, printable(problem))
            bad.append((c.run_id, c.step, problem))
    return bad


def daily_digest(sup: Daemon, now: dt.datetime | None = None) -> list[Alert]:
    now = now or dt.datetime.now(dt.timezone.utc)
    since = now - runs_store.ACTIVE_WINDOW
    sent = []
    with sup.sessions() as s:
        for run_id in runs_store.active_since(s, since):
            incs = [i for i in incidents_store.incidents(s, run_id) if i.opened_at >= since]
            acts = [a for a in actions_store.actions(s, run_id) if a.created_at >= since]
            last = thermo_store.latest_step(s, run_id)
            text = (f"last step {last}; {len(incs)} incident(s), {len(acts)} action(s) in the last 24 h"
                    + "".join(f"\n- {i.signal} on {i.module or '-'} onset {i.onset_step} ({i.state})" for i in incs[:10]))
            sent.append(Alert(run_id=run_id, severity=Severity.INFO, title=f"{run_id}: daily digest", text=text))
    with sup.sessions.begin() as s:  # through the outbox: in order, retried, recorded
        for alert in sent:
            sup.executor.outbox.enqueue(s, alert)
    sup.executor.flush_alerts()
    return sent


def peer_envelope(sup: Daemon, now: dt.datetime | None = None, cfg: EnvelopeConfig | None = None
                  ) -> list[tuple[str, Finding]]:
    """Judge each run active in the last day against its comparable runs; hand a finding to the
    responder, which records it once per attempt (a later tick finds the same stretch again and
    is not decided twice) and alerts."""
    now = now or dt.datetime.now(dt.timezone.utc)
    cfg = cfg or sup.cfg.envelope  # the daemon's `envelope:` section
    found: list[tuple[str, Finding, int | None]] = []
    with sup.sessions() as s:
        # Bounded whatever the database holds (an ingest token can make 10^5 runs: issue 21):
        # the newest PEER_RUNS runs are the candidates, the active ones among them are judged.
        newest = runs_store.newest_run_ids(s, peers_store.PEER_RUNS)
        active = sorted(set(runs_store.active_since(s, now - runs_store.ACTIVE_WINDOW)) & set(newest))
        if not active:
            return []
        keys = peers_store.model_keys(s, newest)
        curves: dict[str, Curve] = {}
        for rid in active:
            peers = peers_store.comparable(keys, rid)
            if not peers:
                continue
            for r in (rid, *peers):
                if r not in curves:
                    curves[r] = peers_store.curve(s, r)
            finding = behind_peers(curves[rid], [curves[p] for p in peers], cfg)
            if finding is not None:
                att = runs_store.latest_attempt(s, rid)
                found.append((rid, finding, att.attempt if att is not None else None))
    for rid, finding, attempt in found:
        sup.responder.handle(rid, finding, attempt)
    return [(rid, f) for rid, f, _ in found]


REPAGED = "repaged"  # the audit event of a re-page: its pause's action id and when (the job's clock)


def pause_repage(sup: Daemon, now: dt.datetime | None = None) -> list[Alert]:
    """Page again for each run paused (by the policy or a person) for longer than `pause_repage_s`,
    at most once per that interval per pause, with the reason and the commands that end it (issue
    35: a paused run waited 9 minutes until someone happened to look; the pause's first page is
    easy to miss). Not a run that was resumed, rolled back or stopped since (it is not paused:
    actions_store.paused_runs), whose newest attempt said it finished, or that was relaunched since
    the pause (a new attempt: a loop does not keep a pause across a restart). Each re-page is an
    audit row, so a restarted daemon keeps the interval."""
    now = now or dt.datetime.now(dt.timezone.utc)
    every = dt.timedelta(seconds=sup.cfg.pause_repage_s)
    with sup.sessions() as s:
        waiting = [p for p in actions_store.paused_runs(s) if now - p.updated_at >= every]
    sent = []
    for pause in waiting:
        try:
            with sup.sessions.begin() as s:
                newest = runs_store.latest_attempt(s, pause.run_id)
                if newest is None or newest.finished is not None or newest.started_at > pause.updated_at:
                    continue
                last = next((e for e in audit_store.events(s, pause.run_id, REPAGED, limit=100)
                             if e.detail.get("action_id") == pause.id), None)
                if last is not None and now - dt.datetime.fromisoformat(last.detail["at"]) < every:
                    continue
                alert = _repage(pause, now - pause.updated_at)
                sup.executor.outbox.enqueue(s, alert)  # in order, retried, recorded, like every alert
                audit_store.audit(s, pause.run_id, "scheduler", REPAGED, {
                    "action_id": pause.id, "at": now.isoformat(),
                    "paused_s": round((now - pause.updated_at).total_seconds())})
            sent.append(alert)
        except Exception:  # noqa: BLE001 - one bad run must not stop the others
            log.exception("re-paging the pause of run %s failed", pause.run_id)
    if sent:
        sup.executor.flush_alerts()
    return sent


def _repage(pause: actions_store.ActionRow, waited: dt.timedelta) -> Alert:
    run = shlex.quote(pause.run_id)
    minutes = int(waited.total_seconds() // 60)
    took = f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min"
    why = pause.args.get("reason") or pause.reason or "(no reason given)"
    return Alert(
        run_id=pause.run_id, severity=Severity.CRITICAL, broadcast=True,
        title=f"{printable(pause.run_id)}: still paused after {took}, waiting for a person (action {pause.id})",
        text=f"paused before step {pause.ack_step} by {printable(pause.who)}: {printable(why)}",
        fields={"paused before step": pause.ack_step, "paused for": took, "paused by": pause.who},
        incident_id=pause.incident_id, thread=None if pause.incident_id is not None else f"action:{pause.id}",
        commands=(f"thermowatch resume {run}", f"thermowatch rollback {run} --to-step N", f"thermowatch stop {run}"),
        status=f"paused for {took}: waiting for a person")


ESCALATED = "escalated"  # the audit event of an escalation: the story and how long its page waited
ESCALATION_LOOKBACK = dt.timedelta(days=2)  # pages older than this unanswered are the re-page's, not ours


def escalate(sup: Daemon, now: dt.datetime | None = None) -> list[Alert]:
    """Escalate each page nobody acknowledged within `escalate_after_s` (issue 37: a CRITICAL
    approval was never repeated while the run trained into the divergence), once per page: the
    page again, broadcast, for the on-call and `slack.escalate_to`, saying how long it waited.
    A page is answered by an approval, a cancel, `thermowatch ack` (Executor.acknowledge_page)
    or the story's end; a story whose incident is closed, whose action is final or whose run
    has finished is not escalated. The escalation is written to the outbox like every alert (in
    order, retried, recorded); the outbox row is what marks it done, so a restart never repeats it."""
    if not sup.cfg.escalate_after_s:
        return []
    now = now or dt.datetime.now(dt.timezone.utc)
    after = dt.timedelta(seconds=sup.cfg.escalate_after_s)
    with sup.sessions() as s:
        due = [p for p in alerts_store.open_pages(s, now - after - ESCALATION_LOOKBACK)
               if not p.escalated and p.paged_at <= now - after]
    sent = []
    for page in due:
        try:
            with sup.sessions.begin() as s:
                if not _still_open(s, page):
                    continue
                alert = _escalation(page, now - page.paged_at)
                sup.executor.outbox.enqueue(s, alert)
                audit_store.audit(s, page.run_id, "scheduler", ESCALATED, {
                    "thread": page.thread_key, "waited_s": round((now - page.paged_at).total_seconds())})
            sent.append(alert)
        except Exception:  # noqa: BLE001 - one bad story must not stop the others
            log.exception("escalating the page of %s (run %s) failed", page.thread_key, page.run_id)
    if sent:
        sup.executor.flush_alerts()
    return sent


def _still_open(s, page: alerts_store.OpenPage) -> bool:
    """The story's cause is still waiting for a person: its incident open, its action not final,
    its run not finished."""
    from thermowatch.monitors.commands import FINAL_STATES

    if page.run_id is None:
        return False
    newest = runs_store.latest_attempt(s, page.run_id)
    if newest is not None and newest.finished is not None:
        return False
    kind, _, ident = page.thread_key.partition(":")
    if not ident.isdigit():
        return True
    if kind == "incident":
        inc = incidents_store.get_incident(s, int(ident))
        return inc is not None and inc.state == "open"
    if kind == "action":
        row = actions_store.get_action(s, int(ident))
        return row is not None and row.state not in FINAL_STATES
    return True


def _escalation(page: alerts_store.OpenPage, waited: dt.timedelta) -> Alert:
    first = Alert.from_json(page.payload)
    secs = int(waited.total_seconds())
    took = f"{secs // 60} min" if secs >= 60 else f"{secs} s"
    return dataclasses.replace(
        first, escalation=1, broadcast=True, thread=page.thread_key, thread_ts=None,
        title=f"escalated, not acknowledged for {took}: {first.title}",
        status=f"escalated: nobody acknowledged the page for {took}",
        commands=(*first.commands, *_ack_commands(first, page.thread_key)))


def _ack_commands(alert: Alert, thread_key: str) -> tuple[str, ...]:
    """The command that takes the page, beside the ones that answer it."""
    kind, _, ident = thread_key.partition(":")
    if kind not in ("incident", "action") or not ident.isdigit():
        return ()
    return (f"thermowatch ack {shlex.quote(alert.run_id)} --{kind} {ident}",)
