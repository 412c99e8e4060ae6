"""Flap damping: a signal that keeps opening incidents does not page every time.

A detector on a series that hovers at its threshold (an attention logit at the ceiling, a loss
that spikes, settles and spikes again) opens, resolves and re-opens incidents for the same
(run, signal, module). Each is a new thread and, when critical, a page. Here: the first
`max_alerts` incidents of a (run, signal, module) within `window_s` get threads of their own;
from the next one on, the incident's alerts are folded into the thread of the latest one that
had its own, as counted replies ("repeat 5 in 12 min") that do not broadcast, without charts, and
the thread's top message says "flapping (5 times in 12 min)".

The fold is written to the audit trail in the deciding transaction ("alert folded": which
incident, into which thread, the count), so every later alert of a folded incident (its action
done, approved, failed) joins the same thread, after a restart too. Plain Python over the
store; the executor calls it (supervisor.act.executor).
"""

from __future__ import annotations

import datetime as dt
import math
from dataclasses import dataclass

from sqlalchemy.orm import Session

from thermowatch.supervisor.errors import UserError
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store.orm import utcnow

FOLDED = "alert folded"  # the audit event


@dataclass(frozen=True)
class FlapConfig:
    # Three threads an hour apart are three stories; three in half an hour are one signal at its
    # threshold, and the on-call engineer has seen it by then.
    max_alerts: int = 3
    window_s: float = 1800.0

    def __post_init__(self) -> None:
        if isinstance(self.max_alerts, bool) or not isinstance(self.max_alerts, int) or self.max_alerts < 1:
            raise UserError(f"slack.flap_max_alerts={self.max_alerts!r} must be an integer >= 1 (threads of their "
                            "own per signal and module in the window before repeats are folded)")
        if not (isinstance(self.window_s, (int, float)) and math.isfinite(self.window_s) and self.window_s > 0):
            raise UserError(f"slack.flap_window_s={self.window_s!r} must be a number of seconds > 0")


@dataclass(frozen=True)
class Fold:
    """Incident `incident_id`'s alerts go to `into`'s thread: the `count`th incident of its
    signal and module in `minutes` minutes."""

    incident_id: int
    into: int
    count: int
    minutes: int

    @property
    def status(self) -> str:
        return f"flapping ({self.count} times in {self.minutes} min)"


def decide_fold(s: Session, cfg: FlapConfig, run_id: str, signal: str, module: str, incident_id: int,
                now: dt.datetime | None = None) -> Fold | None:
    """For a newly opened incident: fold its alerts into an earlier thread (and audit it), or None."""
    now = now or utcnow()
    recent = incidents_store.opened_since(s, run_id, signal, module, now - dt.timedelta(seconds=cfg.window_s))
    if len(recent) <= cfg.max_alerts or incident_id not in {i for i, _ in recent}:
        return None
    folded = _folded(s, run_id)
    earlier = [i for i, _ in recent if i != incident_id]
    own = [i for i in earlier if i not in folded]
    into = own[-1] if own else folded.get(earlier[-1])
    if into is None:
        return None
    minutes = max(1, math.ceil((now - recent[0][1]).total_seconds() / 60))
    fold = Fold(incident_id, into, len(recent), minutes)
    audit_store.audit(s, run_id, "supervisor", FOLDED, {"incident_id": incident_id, "into": into,
                                                        "count": fold.count, "minutes": minutes,
                                                        "signal": signal, "module": module})
    return fold


def thread_of(s: Session, run_id: str, incident_id: int) -> int | None:
    """The incident whose thread a folded incident's alerts join; None: its own."""
    return _folded(s, run_id).get(int(incident_id))


def _folded(s: Session, run_id: str) -> dict[int, int]:
    return {int(r.detail["incident_id"]): int(r.detail["into"]) for r in audit_store.events(s, run_id, FOLDED)
            if "incident_id" in r.detail and "into" in r.detail}
