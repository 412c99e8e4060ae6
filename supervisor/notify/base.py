"""The notifier seam: an `Alert`, the `Notifier` Protocol, the null object and the fan-out.

The executor holds one `Notifier` and never asks whether Slack is on (STYLE.md 7): the daemon
builds `FanOut([ConsoleNotifier(), SlackNotifier(...)])` or just the console one. Plain Python,
no Slack import here (STYLE.md 6); the Slack part lives in `thermowatch.supervisor.notify.slack`.
"""

from __future__ import annotations

import enum
import logging
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Mapping, Protocol, Sequence

from thermowatch.monitors.contract import Finding, Severity
from thermowatch.supervisor.errors import UserError

if TYPE_CHECKING:
    from thermowatch.supervisor.decide.policy import Decision

log = logging.getLogger(__name__)


class NotifyError(RuntimeError):
    """A message could not be delivered (after retries). The message says what to check.

    `retryable` False: the channel refused this message itself (malformed, too long), so trying
    it again cannot help; the outbox marks it failed and goes on with the next one."""

    def __init__(self, message: str, *, retryable: bool = True):
        super().__init__(message)
        self.retryable = retryable


class NotifyConfigError(UserError):
    """A notifier that cannot work as configured (missing token, empty channel)."""


@dataclass(frozen=True)
class ChartRequest:
    """A chart to upload into an incident's thread: one metric key, steps [step_lo, step_hi],
    the onset and detection marked. Rendered by the outbox's sender (supervisor.notify.chart)
    when the row's turn comes, never on the ingest path."""

    metric: str
    step_lo: int
    step_hi: int
    onset_step: int
    detect_step: int
    label: str = ""  # what fired (the signal), written beside the detection line

    def __post_init__(self) -> None:
        if not self.metric or not (0 <= self.step_lo <= self.step_hi):
            raise ValueError(f"ChartRequest needs a metric and 0 <= step_lo <= step_hi, got {self!r}")

    @classmethod
    def around(cls, finding: Finding, pad_min: int = 50) -> "ChartRequest":
        """The steps around a finding: as many before the onset as onset-to-detection took, at
        least `pad_min`, and a quarter of that after detection (what came next, if already in)."""
        pad = max(pad_min, finding.detect_step - finding.onset_step)
        lo = max(0, finding.onset_step - pad)
        return cls(finding.metric, lo, max(lo, finding.detect_step + max(10, pad // 4)),
                   finding.onset_step, finding.detect_step, finding.signal.value)

    def to_json(self) -> dict[str, Any]:
        return {"metric": self.metric, "step_lo": self.step_lo, "step_hi": self.step_hi,
                "onset_step": self.onset_step, "detect_step": self.detect_step, "label": self.label}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "ChartRequest":
        return cls(str(obj["metric"]), int(obj["step_lo"]), int(obj["step_hi"]), int(obj["onset_step"]),
                   int(obj["detect_step"]), str(obj.get("label") or ""))


class StoryState(str, enum.Enum):
    """Where an alert leaves its story (`Alert.thread_key`), for the channels that page
    (supervisor.notify.paging): a page must stop when a person has taken it and end when the
    incident does, and the text of `Alert.status` is for people, not to be compared by literal."""

    ANSWERED = "answered"  # a person took the question (approved, acknowledged): the page stops escalating
    RESOLVED = "resolved"  # the story is over (done, declined, superseded, the run ended): the page ends


@dataclass(frozen=True)
class Alert:
    """One message to humans. `fields` are short key/value facts (onset/detect step, target)."""

    run_id: str
    severity: Severity
    title: str
    text: str = ""
    fields: Mapping[str, Any] = field(default_factory=dict)
    incident_id: int | str | None = None
    reasons: Sequence[str] = ()  # the policy's reasons, one bullet each
    thread_ts: str | None = None  # reply in the thread of an earlier message (its id from send)
    # The story this alert belongs to; the outbox threads it under the story's first message.
    # None: the incident's ("incident:42") when there is one, else a message of its own.
    thread: str | None = None
    broadcast: bool = False  # a reply that must also show in the channel (failures, pages)
    commands: Sequence[str] = ()  # exact commands for the reader (approve/cancel), shown as code
    # The story's state after this event ("resolved: rolled back to checkpoint 20"). A reply with
    # a status also updates its thread's top message, so the channel shows where things stand.
    status: str = ""
    # An action awaiting approval: Approve / Cancel buttons where the channel has them (Slack
    # with interactivity configured); the `commands` say the same for everyone else.
    approve_action: int | None = None
    # A repeat of a flapping signal folded into an earlier incident's thread: how many times it
    # fired in the window (supervisor.notify.flap). 0: not folded.
    fold_count: int = 0
    chart: ChartRequest | None = None  # upload this chart into the thread instead of a message
    story_state: StoryState | None = None  # None: the story goes on (most alerts)
    # A page nobody acknowledged within `escalate_after_s`, sent again to the escalation contacts
    # (supervisor.app.jobs.escalate): 1. 0: a first page or any other alert.
    escalation: int = 0

    @property
    def thread_key(self) -> str | None:
        if self.thread:
            return self.thread
        return f"incident:{self.incident_id}" if self.incident_id is not None else None

    def to_json(self) -> dict[str, Any]:
        """Strict JSON (the outbox stores it): values of `fields` that JSON lacks become strings."""
        return {"run_id": self.run_id, "severity": self.severity.value, "title": self.title, "text": self.text,
                "fields": {str(k): _plain(v) for k, v in self.fields.items()},
                "incident_id": self.incident_id, "reasons": list(self.reasons), "thread_ts": self.thread_ts,
                "thread": self.thread, "broadcast": self.broadcast, "commands": list(self.commands),
                "status": self.status, "approve_action": self.approve_action, "fold_count": self.fold_count,
                "chart": self.chart.to_json() if self.chart is not None else None,
                "story_state": self.story_state.value if self.story_state is not None else None,
                "escalation": self.escalation}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> "Alert":
        return cls(run_id=str(obj.get("run_id") or ""), severity=Severity(obj.get("severity", "info")),
                   title=str(obj.get("title", "")), text=str(obj.get("text", "")),
                   fields=dict(obj.get("fields") or {}), incident_id=obj.get("incident_id"),
                   reasons=tuple(obj.get("reasons") or ()), thread_ts=obj.get("thread_ts"),
                   thread=obj.get("thread"), broadcast=bool(obj.get("broadcast", False)),
                   commands=tuple(obj.get("commands") or ()), status=str(obj.get("status") or ""),
                   approve_action=obj.get("approve_action"), fold_count=int(obj.get("fold_count") or 0),
                   chart=ChartRequest.from_json(obj["chart"]) if obj.get("chart") else None,
                   story_state=StoryState(obj["story_state"]) if obj.get("story_state") else None,
                   escalation=int(obj.get("escalation") or 0))

    @classmethod
    def from_decision(cls, run_id: str, finding: Finding, decision: "Decision",
                      incident_id: int | str | None = None, thread_ts: str | None = None,
                      runbook_url: str = "") -> "Alert":
        """The alert the executor sends for a policy decision, with its signal's runbook line
        (supervisor.notify.runbook) and, given `runbook_url`, the link to its row."""
        from thermowatch.monitors.commands import Pause, Rollback, SetLR
        from thermowatch.supervisor.notify.runbook import runbook_link, what_to_do

        cmd = decision.command
        # Severity follows what happened to the run, not how far the series is from its baseline
        # (issue 23: nine alert-only notes read [CRITICAL] and the two real rollbacks [WARN]): a
        # human is needed (a pause, a page, an approval) > the run was changed for them (an act)
        # > nothing changed (alert-only, no action: INFO, never a page).
        if isinstance(cmd, Pause) or decision.page or (decision.requires_approval and decision.acts):
            severity = Severity.CRITICAL
        elif decision.acts:
            severity = Severity.WARN
        else:
            severity = Severity.INFO
        lr = decision.lr
        if isinstance(cmd, Rollback):
            verb = f"rollback to step {cmd.to_step}" + (f" + LR multiplier {lr.multiplier:g}" if lr else "")
        elif isinstance(cmd, SetLR):
            verb = f"LR x{cmd.multiplier:g}"
        elif isinstance(cmd, Pause):
            verb = "paused"
        else:
            verb = "alert" if decision.alert else "no action"
        if decision.requires_approval:
            verb = f"approval needed: {verb}"
        where = finding.module or finding.metric
        title = f"{run_id}: {verb} ({finding.signal.value}{' on ' + where if where else ''})"
        facts: dict[str, Any] = {
            "signal": finding.signal.value,
            "module": finding.module or None,
            "onset step": finding.onset_step,
            "detect step": finding.detect_step,
            "rung": decision.rung or None,
            "target step": cmd.to_step if isinstance(cmd, Rollback) else None,
            "skip steps": f"{decision.skip_steps[0]}-{decision.skip_steps[1]}" if decision.skip_steps else None,
            "LR multiplier": lr.multiplier if lr else None,
            "exclude": (cmd.exclude_node or cmd.exclude_rank) if isinstance(cmd, Rollback) else None,
            "what to do": what_to_do(finding.signal.value),
            "runbook": runbook_link(runbook_url, finding.signal.value) if runbook_url else None,
        }
        return cls(
            run_id=run_id, severity=severity, title=title,
            text=decision.reasons[0] if decision.reasons else "",
            fields={k: v for k, v in facts.items() if v is not None},
            incident_id=incident_id, reasons=tuple(decision.reasons[1:]), thread_ts=thread_ts,
            broadcast=severity is Severity.CRITICAL,  # a page stays visible when it is a reply
        )


def _plain(v: Any) -> Any:
    if isinstance(v, bool) or v is None or isinstance(v, (int, str)):
        return v
    if isinstance(v, float) and math.isfinite(v):
        return v
    return str(v)


class Notifier(Protocol):
    def send(self, alert: Alert) -> str | None:
        """Deliver `alert`; return an id later alerts can thread under (Slack's ts), or None.
        Raise NotifyError when it could not be delivered."""
        ...

    def check(self) -> dict[str, Any]:
        """At start-up: can this channel deliver at all? Raise NotifyConfigError when it never
        will as configured (a refused token), NotifyError when it cannot right now (an outage)."""
        ...

    def close(self) -> None: ...


def channel_name(part: Notifier) -> str:
    """A stable name per notifier: the outbox stores it on each row, so it must survive a restart."""
    name = getattr(part, "channel_name", None)
    return str(name) if name else type(part).__name__.removesuffix("Notifier").lower() or "notifier"


class NullNotifier:
    """Sends nothing. For runs nobody watches and for tests of other parts."""

    def send(self, alert: Alert) -> str | None:
        return None

    def check(self) -> dict[str, Any]:
        return {}

    def close(self) -> None:
        pass


class FanOut:
    """Sends each alert to every part. One failing part is logged and does not stop the others.

    Returns the first thread id a part gave (Slack's ts); raises NotifyError only if every part
    failed, so the executor can mark the notification failed and retry it.
    """

    def __init__(self, parts: Sequence[Notifier]):
        self.parts = list(parts)

    def send(self, alert: Alert) -> str | None:
        first: str | None = None
        failures: list[str] = []
        for part in self.parts:
            try:
                got = part.send(alert)
            except Exception as exc:  # noqa: BLE001 - one broken channel must not silence the others
                log.exception("notifier %s failed for run %s (%r); the other notifiers still get it",
                              type(part).__name__, alert.run_id, alert.title)
                failures.append(f"{type(part).__name__}: {exc}")
                continue
            if first is None and got is not None:
                first = got
        if self.parts and len(failures) == len(self.parts):
            raise NotifyError(f"every notifier failed for {alert.title!r}: " + "; ".join(failures))
        return first

    def check(self) -> dict[str, Any]:
        """Check every part that can be checked: {part name: its answer, or "unreachable: why"}.
        A part that refuses its configuration (NotifyConfigError) stops the start-up."""
        out: dict[str, Any] = {}
        for part in self.parts:
            check = getattr(part, "check", None)  # test doubles may have only send/close
            if check is None:
                continue
            name = channel_name(part)
            try:
                out[name] = check()
            except NotifyConfigError:
                raise
            except NotifyError as exc:
                log.critical("notifier %s cannot deliver now (%s); alerts wait in the outbox until it can",
                             name, exc)
                out[name] = f"unreachable: {exc}"
        return out

    def close(self) -> None:
        for part in self.parts:
            try:
                part.close()
            except Exception:  # noqa: BLE001 - close() survives any one part failing
                log.exception("closing notifier %s failed; closing the others", type(part).__name__)
