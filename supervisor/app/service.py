"""The supervisor, assembled: DB, ingest, detectors, policy, executor, notifier, jobs.

`Supervisor` implements both seams of monitors.contract: it is the run controller's
`RecordSink` and its `CommandChannel`. Embedded mode hands the object itself to the
controller (same process, no HTTP); `thermowatch serve` puts the same object behind the HTTP
API (supervisor.serve.server), so both modes share every line below the transport.

A restart resumes from the DB: open incidents and actions are rows, detector state is saved
after every batch, and pending/sent actions are delivered again on the controller's next poll.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

import numpy as np

from thermowatch.monitors.columns import StepColumns
from thermowatch.monitors.contract import (LOSS, THERMOMETER_COST, THERMOMETER_EVERY, TOKENS_PER_S, Ack,
                                           CheckpointInfo, Command, RunFinished, RunInfo, StepRecord)
from thermowatch.supervisor import db
from thermowatch.supervisor.app import jobs
from thermowatch.supervisor.decide.approvers import HOW_TO_CONFIGURE, Approvers
from thermowatch.supervisor.app.config import SupervisorConfig, judged_with
from thermowatch.supervisor.judge.bank_process import BankProcess
from thermowatch.supervisor.judge.banks import Banks
from thermowatch.supervisor.judge.checkpoint_health import CheckpointFailures
from thermowatch.supervisor.judge.consistency import ConsistencyCheck
from thermowatch.supervisor.act.executor import Executor
from thermowatch.supervisor.ingest.ingestor import Ingestor
from thermowatch.supervisor.judge.judge import Judge
from thermowatch.supervisor.notify.base import FanOut, Notifier, NotifyConfigError
from thermowatch.supervisor.notify.console import ConsoleNotifier
from thermowatch.supervisor.notify.link_grants import LinkGrants
from thermowatch.supervisor.act.respond import Responder
from thermowatch.supervisor.app.scheduler import Job
from thermowatch.supervisor.app.lease import Lease
from thermowatch.supervisor.errors import NotLeader

log = logging.getLogger(__name__)


def check_notifier(notifier: Notifier) -> dict:
    """The start-up check of every channel that has one: {channel: answer or "unreachable: why"}.
    Raises NotifyConfigError (closing the notifier) when a channel refuses its configuration."""
    try:
        return dict(notifier.check()) if hasattr(notifier, "check") else {}
    except NotifyConfigError:
        notifier.close()
        raise


def build_notifier(cfg: SupervisorConfig, environ: Mapping[str, str] | None = None,
                   links: LinkGrants | None = None) -> Notifier:
    """Console always (the journal is the last resort), plus Slack when a channel is set, PagerDuty
    when a routing key source is named, the signed webhook when a URL is and email when an SMTP
    host is. Each is a channel of
    its own in the outbox, so one that is down holds up none of the others. A secret that cannot
    be read stops the start here (NotifyConfigError naming the key), closing what was built."""
    parts: list[Notifier] = [ConsoleNotifier()]
    web = cfg.public_url or None
    try:
        if cfg.slack.channel:
            from thermowatch.supervisor.notify.slack import SlackNotifier

            parts.append(SlackNotifier.from_config(cfg.slack, environ=environ, web_base_url=web))
        if cfg.pagerduty.enabled:
            from thermowatch.supervisor.notify.pagerduty import PagerDutyNotifier

            parts.append(PagerDutyNotifier.from_config(cfg.pagerduty, environ=environ, web_base_url=web))
        if cfg.webhook.url:
            from thermowatch.supervisor.notify.webhook import WebhookNotifier

            parts.append(WebhookNotifier.from_config(cfg.webhook, environ=environ, web_base_url=web))
        if cfg.email.host:
            from thermowatch.supervisor.notify.email import EmailNotifier

            parts.append(EmailNotifier.from_config(cfg.email, environ=environ, web_base_url=web))
    except NotifyConfigError:
        FanOut(parts).close()
        raise
    # `links`: each channel's run link signs its reader in (docs/auth.md). Not without auth or with
    # public_read: the plain page opens without signing in there.
    if links is not None and cfg.auth and not cfg.public_read:
        for part in parts:
            if hasattr(part, "links"):  # the channels that link the run page
                part.links = links  # type: ignore[attr-defined]
    return FanOut(parts)


def build_approvers(cfg: SupervisorConfig, environ: Mapping[str, str] | None = None) -> Approvers:
    """Who may click Approve / Cancel in Slack (supervisor.decide.approvers). Groups are read with the
    bot token; without one the start stops here, naming the token's source."""
    members = None
    if cfg.slack.approver_groups:
        from thermowatch.supervisor.notify.slack import SlackGroupMembers, resolve_token

        try:
            token, _ = resolve_token(cfg.slack.token_env, cfg.slack.token_file, environ)
        except NotifyConfigError as exc:
            raise NotifyConfigError(f"slack.approver_groups are read with the bot token: {exc}") from None
        members = SlackGroupMembers(token, base_url=cfg.slack.base_url)
    return Approvers(cfg.slack.approvers, cfg.slack.approver_groups, members, ttl_s=cfg.slack.approver_groups_ttl_s)


@dataclass(frozen=True, slots=True)
class RunProgress:
    attempt: int
    step: int
    wall_time: float
    loss: float
    step_s: float | None  # seconds per step over the newest batch (or since the batch before)
    tokens_per_s: float | None
    # The thermometers' measured share of the step and each group's cadence, as the client last
    # reported them (issue 36: the watchdog's cost is a figure of the run); None / {} without a budget.
    thermometer_cost: float | None = None
    thermometer_every: Mapping[str, float] = dataclasses.field(default_factory=dict)


class Progress:
    """The newest loss, step time and throughput of each run, from the first and last row of every
    stored batch (O(1) per batch, in the daemon's memory: /metrics reads it with no query; absent
    for a run until its first batch after the daemon starts). Issue 23: Grafana users look for them."""

    def __init__(self) -> None:
        self._runs: dict[str, RunProgress] = {}
        self._lock = threading.Lock()

    def note(self, run_id: str, attempt: int, batch: StepColumns) -> None:
        if not len(batch):
            return
        first, last = (int(batch.steps[0]), float(batch.wall_time[0])), (int(batch.steps[-1]), float(batch.wall_time[-1]))
        tokens, loss, tps = int(batch.tokens[-1]), _last_cell(batch, LOSS), _last_cell(batch, TOKENS_PER_S)
        with self._lock:
            prev = self._runs.get(run_id)
            base = prev if prev is not None and prev.attempt == attempt and prev.step < first[0] else None
            lo_step, lo_wall = (base.step, base.wall_time) if base is not None else first
            step_s = (last[1] - lo_wall) / (last[0] - lo_step) if last[0] > lo_step else (
                prev.step_s if prev is not None else None)
            if step_s is not None and not (math.isfinite(step_s) and step_s > 0):
                step_s = None
            if tps is None and step_s and tokens > 0:
                tps = tokens / step_s
            cost = _last_present(batch, THERMOMETER_COST)
            every = {k.split("/", 1)[1]: v for k in batch.keys if k.startswith(THERMOMETER_EVERY + "/")
                     if (v := _last_present(batch, k)) is not None}
            if prev is not None and prev.attempt == attempt:  # a batch without them keeps the last ones told
                cost = prev.thermometer_cost if cost is None else cost
                every = {**prev.thermometer_every, **every}
            self._runs[run_id] = RunProgress(attempt, last[0], last[1], math.nan if loss is None else float(loss),
                                             step_s, tps, cost, every)

    def get(self, run_id: str) -> RunProgress | None:
        with self._lock:
            return self._runs.get(run_id)


def _last_present(cols: StepColumns, key: str) -> float | None:
    """The value of `key` in the batch's last row that carries it (a budget's figures may be absent
    from some rows); None where no row does."""
    if key not in cols.keys:
        return None
    j = cols.keys.index(key)
    rows = np.flatnonzero(cols.present[:, j]) if cols.present is not None else np.arange(len(cols))
    if not len(rows):
        return None
    v = float(cols.values[rows[-1], j])
    return v if math.isfinite(v) else None


def _last_cell(cols: StepColumns, key: str) -> float | None:
    """The batch's last row's value of `key`; None where it was not sent."""
    if key not in cols.keys:
        return None
    j = cols.keys.index(key)
    if cols.present is not None and not cols.present[-1, j]:
        return None
    return float(cols.values[-1, j])


class Supervisor:
    def __init__(self, cfg: SupervisorConfig, notifier: Notifier | None = None, *, auto_upgrade: bool = True,
                 clock: Callable[[], float] = time.time, judge_inline: bool = True, lease: "Lease | None" = None,
                 standby: bool = False):
        self.cfg = cfg
        # Several replicas on one database (issue 40, supervisor.app.lease): `lease` is this one's,
        # `standby` until it leads (lead()). A standby stores steps and serves reads; judging,
        # deciding, commands and alerts are the leader's. None: the one daemon, always leading.
        self.lease = lease
        self.leading = not standby
        self._catching_up: threading.Thread | None = None
        # Slack's signing secret, for the Approve / Cancel callbacks (supervisor.serve.api.slack); None:
        # no buttons. An unreadable secret file stops the start here, like a refused token.
        from thermowatch.supervisor.notify.slack import resolve_signing_secret

        self.slack_signing_secret = resolve_signing_secret(cfg.slack.signing_secret_env, cfg.slack.signing_secret_file)
        # Who may click (closed by default: nobody). Only with a secret: without one no click is accepted.
        self.slack_approvers = build_approvers(cfg) if self.slack_signing_secret else Approvers()
        if self.slack_signing_secret and not self.slack_approvers.configured:
            log.warning("Slack's signing secret is set but nobody may approve from Slack, so alerts carry no "
                        "Approve / Cancel buttons: %s", HOW_TO_CONFIGURE)
        if notifier is None:  # the daemon: a group Slack refuses to list stops it now (issue 12)
            self.slack_approvers.check()
        # A configured notifier is checked before anything starts (issue 12): Slack refusing the
        # bot token stops the daemon here (NotifyConfigError, a UserError: `serve` exits 2 with
        # the message) instead of at the first real alert. Slack merely unreachable does not stop
        # it (alerts wait in the outbox): that is logged as critical and kept for notifier_status().
        # A notifier handed in (tests, embedded callers) is the caller's to check.
        # The alerts' signed run links (supervisor.notify.link_grants); their key is read from the
        # database, once it is open below, when the first link is made or opened.
        self.link_grants = LinkGrants(cfg.public_url, ttl_s=cfg.link_ttl_s)
        self._notifier_check: dict = {}
        if notifier is None:
            notifier = build_notifier(cfg, links=self.link_grants)
            self._notifier_check = check_notifier(notifier)
        cfg.data_dir.mkdir(parents=True, exist_ok=True)
        self.engine = db.make_engine(cfg.db_url)
        if auto_upgrade:
            db.upgrade(self.engine)
        else:
            db.check_current(self.engine)
        self.sessions = db.make_sessionmaker(self.engine)
        self.link_grants.use(self.sessions)
        if lease is not None:
            lease.use(self.sessions)
        self.coordinator = None  # serve()'s, with a lease (supervisor.app.lease.Coordinator)
        self.notifier = notifier
        policy = self.policy = cfg.policy
        bank_cfg = cfg.detectors
        # The daemon (judge_inline=False) judges in the detectors' own process; the embedded mode
        # waits for each judgement anyway, so it keeps them in its own.
        self.bank_process = BankProcess(bank_cfg) if cfg.judge_process and not judge_inline else None
        # The stages in their order: the judge's banks, the executor (an acked rollback rewinds the
        # banks), the responder (decides on each finding), the judge's thread (hands findings on).
        self.banks = Banks(self.sessions, bank_cfg, process=self.bank_process)
        self.executor = Executor(self.sessions, self.notifier, advise_only=policy.advise_only,
                                 approval_pause_after_steps=policy.approval_pause_after_steps,
                                 runbook_url=cfg.runbook_url,
                                 ack_timeout_s=cfg.ack_timeout_s, ack_retries=cfg.ack_retries,
                                 command_expiry_s=cfg.command_expiry_s, redeliver_s=cfg.redeliver_s,
                                 banks=self.banks, policy=policy, flap=cfg.slack.flap(),
                                 fence=lease.fence if lease is not None else None,
                                 may_send=lease.holds if lease is not None else None, start_outbox=not standby)
        self.responder = Responder(self.sessions, self.executor, policy, self.banks, clock=clock)
        self.consistency = ConsistencyCheck(self.sessions, self.executor)
        self.checkpoint_health = CheckpointFailures(self.sessions, self.executor)
        # Commit, answer, then judge (supervisor.judge.judge). judge_inline: write() returns after the
        # batch is judged (the embedded mode); the daemon answers HTTP at once (serve()).
        self.judge = Judge(self.sessions, self.banks, self.responder.handle)
        if not standby:
            self.judge.start()
        self._judge_inline = judge_inline
        self.progress = Progress()  # the newest loss, step time and tokens/s per run, for /metrics
        self.ingestor = Ingestor(self.sessions, on_records=self._judge_later, check_state=self._check_state,
                                 check_keys=self.consistency.reads + self.checkpoint_health.reads,
                                 limits=cfg.limits, judged_with=judged_with(cfg.detectors))
        self.limits = self.ingestor.limits  # the HTTP router checks a batch's size before parsing it

    # --- roles (supervisor.app.lease) -------------------------------------------------------------

    def lead(self) -> None:
        """This standby now leads: judge what every replica stored since the last judgement (the
        durable markers), send what the outbox holds, answer commands. With a lease, every second
        it also reads back what the standbys stored."""
        if self.leading:
            return
        self.leading = True
        self.judge.start()  # its first turn catches up from the markers
        self.executor.outbox.start()
        log.info("leading: judging from the durable markers, sending the outbox, answering commands")
        self._start_catch_up()

    def _start_catch_up(self) -> None:
        if self.lease is None or self._catching_up is not None:
            return

        def tick() -> None:
            while self.leading and self.lease is not None and self.lease.token is not None:
                self.judge.request_catch_up()
                time.sleep(1.0)

        self._catching_up = threading.Thread(target=tick, name="thermowatch-catch-up", daemon=True)
        self._catching_up.start()

    def _judge_later(self, run_id: str, attempt: int, batch) -> None:
        """An ingested batch: judged here when this replica leads; a standby's is read back from
        the database by the leader (Judge.request_catch_up)."""
        if self.leading:
            self.judge.submit(run_id, attempt, batch)

    def _leader_only(self, what: str) -> None:
        if not self.leading:
            raise NotLeader(f"this replica is a standby: {what} is the leader's ({self.leader_name() or 'none yet'}); "
                            "send it there, or retry: a standby leads within seconds of the leader's loss")

    def leader_name(self) -> str | None:
        """The replica that leads (its lease's holder), None without a lease row or a lease."""
        if self.lease is None:
            return None
        try:
            st = self.lease.state()
        except Exception:  # noqa: BLE001 - for a message only
            return None
        return st.holder if st is not None and st.live else None

    # --- RecordSink ---------------------------------------------------------------------------

    def open_run(self, info: RunInfo, actor: str = "run-controller",
                 authorize: Callable[[str, str], None] | None = None) -> None:
        self.ingestor.open_run(info, actor, authorize)
        self.banks.note_attempt(info.run_id, info.attempt)

    def write(self, run_id: str, attempt: int, records: Sequence[StepRecord]) -> int:
        """A batch as StepRecords (the in-process sink, the JSON body): converted to columns at the
        edge, then write_columns, the one path."""
        return self.write_columns(run_id, attempt, self.ingestor.to_columns(run_id, attempt, records))

    def write_columns(self, run_id: str, attempt: int, cols: StepColumns) -> int:
        """Store a batch (monitors.columns; the HTTP sink's form), then judge it."""
        n = self.ingestor.write_columns(run_id, attempt, cols)
        self.progress.note(run_id, attempt, cols)
        if self._judge_inline:
            self.judge.wait()
        return n

    def checkpoint_saved(self, run_id: str, attempt: int, ckpt: CheckpointInfo) -> None:
        self._leader_only("a checkpoint's health (it is judged against the detectors' state)")
        # The trainer reports a checkpoint after the steps before it, so one saved at or after a
        # divergence's onset can arrive after the finding: it was saved while unhealthy. The steps
        # before it are judged first (they were sent first), so a finding among them counts.
        self.judge.wait(timeout=30.0)
        if ckpt.healthy:
            onset = self.responder.diverging_since(run_id)
            if onset is not None and ckpt.step >= onset:
                ckpt = dataclasses.replace(ckpt, healthy=False)
        self.ingestor.checkpoint_saved(run_id, attempt, ckpt)

    def checkpoints_deleted(self, run_id: str, attempt: int, steps: Sequence[int], reason: str,
                            actor: str = "run-controller") -> None:
        self.ingestor.checkpoints_deleted(run_id, attempt, steps, reason, actor)

    def finish_run(self, run_id: str, attempt: int, finished: RunFinished, actor: str = "run-controller") -> None:
        self._leader_only("a run's finish (it closes its actions and incidents)")
        self.ingestor.finish_run(run_id, attempt, finished, actor)
        self.executor.run_finished(run_id)  # what is still open for it can never be carried out

    def drain(self, timeout: float | None = None) -> bool:
        """Nothing waits here: each call above has stored what it was given before it returns."""
        return True

    # --- CommandChannel -----------------------------------------------------------------------

    def poll(self, run_id: str) -> list[Command]:
        self._leader_only("answering a command poll")
        return self.executor.deliver(run_id)

    def ack(self, run_id: str, ack: Ack, actor: str = "trainer") -> None:
        self._leader_only("booking a command's acknowledgement")
        self.executor.acknowledge(run_id, ack, actor)

    # --- internals ------------------------------------------------------------------------------

    def _check_state(self, run_id: str, attempt: int, records: Sequence[StepRecord]) -> None:
        """After each committed batch: the trainer's state against the supervisor's record, and
        whether it still saves checkpoints. Each pages on its own; one failing skips no other."""
        if not self.leading:  # a standby stores; the checks alert, which is the leader's
            return
        for check in (self.consistency, self.checkpoint_health):
            try:
                check(run_id, attempt, records)
            except Exception:  # the batch is committed; a failing check must not bounce it
                log.exception("%s failed for run %s attempt %s", type(check).__name__, run_id, attempt)

    def notifier_status(self) -> dict:
        """For /healthz (the ops side): per channel, "ok" or why it could not be reached at
        start-up, e.g. {"slack:#alerts": "ok", "console": "ok"}; ok is False when any is not."""
        channels = {name: ("ok" if not (isinstance(v, str) and v.startswith("unreachable")) else v)
                    for name, v in self._notifier_check.items()}
        return {"ok": all(v == "ok" for v in channels.values()), "channels": channels}

    def jobs(self) -> list[Job]:
        """The daemon's periodic work (supervisor.app.jobs holds the longer ones)."""
        return jobs.default_jobs(self)

    def close(self) -> None:
        """Survives any one part failing (STYLE.md rule 9)."""
        for name, closer in (("judge", self.judge.close), ("detector state", self.banks.save_states),
                             ("detectors' process", self.bank_process.close if self.bank_process else lambda: None),
                             ("ingestor", self.ingestor.close),
                             ("alert outbox", self.executor.close), ("notifier", self.notifier.close),
                             ("engine", self.engine.dispose)):
            try:
                closer()
            except Exception:  # noqa: BLE001
                log.exception("closing %s failed", name)
