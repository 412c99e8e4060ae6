"""`GET /healthz`: can this daemon do its job right now? (issue 12: it used to say ok always.)
`GET /readyz`: the same, plus the database schema at the revision this code needs.

Open on purpose (systemd's watchdog and a Kubernetes probe hold no token), so the answer says
nothing about any run: only each part's state and, when it fails, why.

    200 {"ok": true,  "checks": {"database": {"ok": true}, ...}, "warnings": [...], "judge_backlog": 0}
    503 {"ok": false, "checks": {"judge": {"ok": false, "why": "the judge thread is not running ..."}, ...}}

A check fails (503) when the daemon cannot do its job: the database does not answer `SELECT 1`
within `db_timeout_s`; the judge thread is dead, or its backlog is beyond `max_judge_backlog`
(findings would come too late to act on); an alert sender thread is dead (alerts would pile up
unseen); the scheduler is stopped (no stall checks, no ack timeouts). Degraded but working is a
200 with a warning: a channel that keeps failing (Slack down: alerts wait in the outbox and go
out when it is back) is something to look at, not a reason for Kubernetes to restart the pod.
"""

from __future__ import annotations

import concurrent.futures
import datetime as dt
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from thermowatch.supervisor.store import metrics as metrics_store

if TYPE_CHECKING:
    from thermowatch.supervisor.app.scheduler import Scheduler
    from thermowatch.supervisor.app.service import Supervisor


@dataclass(frozen=True)
class HealthConfig:
    # 2 s: a probe's own timeout is typically 1-5 s; a database slower than this is an outage to us.
    db_timeout_s: float = 2.0
    # Batches waiting to be judged: a few seconds of ingest at the daemon's usual rate. Beyond
    # this, findings trail the run by minutes (the queue itself holds 1000, then catches up).
    max_judge_backlog: int = 500
    # An undelivered alert older than this is worth a warning (the outbox retries on its own).
    alert_warn_age_s: float = 120.0


class Health:
    def __init__(self, sup: "Supervisor", scheduler: "Scheduler | None" = None,
                 cfg: HealthConfig = HealthConfig()) -> None:
        self.sup, self.scheduler, self.cfg = sup, scheduler, cfg
        # At most one ping at a time, on a daemon thread: a hung database holds one thread (the
        # next probe sees it still busy instead of starting another) and never holds up exit.
        self._inflight: concurrent.futures.Future | None = None
        self._lock = threading.Lock()
        self._head: str | None = None  # the migration head this code needs, read once

    def readiness(self) -> dict[str, Any]:
        """`/readyz`: the liveness checks, plus the schema at the revision this code needs (a
        database migrated by a newer daemon, or rolled back, must not take this one's traffic)."""
        out = self.report()
        if not out["checks"]["database"]["ok"]:
            out["checks"]["schema"] = {"ok": False, "why": "the database does not answer (see database)"}
        else:
            out["checks"]["schema"] = self._schema()
        out["ok"] = all(c["ok"] for c in out["checks"].values())
        return out

    def _schema(self) -> dict[str, Any]:
        from thermowatch.supervisor import db

        if self._head is None:
            self._head = db.head_revision()
        try:
            cur = db.current_revision(self.sup.engine)
        except Exception as exc:  # noqa: BLE001 - an unreadable version table is the finding
            return {"ok": False, "why": f"cannot read the schema revision: {type(exc).__name__}"}
        if cur != self._head:
            return {"ok": False, "why": f"the database schema is at revision {cur}, this daemon needs {self._head} "
                                        "(`thermowatch db upgrade`, or run the daemon version that matches it)"}
        return {"ok": True}

    def report(self) -> dict[str, Any]:
        if self.sup.leading:
            checks = {"database": self._database(), "judge": self._judge(), "alert_senders": self._senders(),
                      "scheduler": self._scheduler()}
        else:  # a standby (supervisor.app.lease) judges, sends and schedules nothing until it leads
            checks = {"database": self._database(),
                      **{part: {"ok": True, "why": "standby: the leader's"}
                         for part in ("judge", "alert_senders", "scheduler")}}
        warnings = self._warnings() if checks["database"]["ok"] else []
        return {"ok": all(c["ok"] for c in checks.values()), "checks": checks, "warnings": warnings,
                "judge_backlog": self.sup.judge.backlog, **self.role()}

    def role(self) -> dict[str, Any]:
        """{"role": "leader" | "standby", "lease": {holder, token, age_s} | None} (issue 40): which
        replica this is, and how long since its lease was last renewed (the leader's)."""
        coord = getattr(self.sup, "coordinator", None)
        if coord is None:
            return {"role": "leader", "lease": None}  # the one daemon, no lease to keep
        age = coord.lease_age_s()
        return {"role": "leader" if self.sup.leading else "standby",
                "lease": {"holder": coord.lease.holder, "token": coord.lease.token,
                          "age_s": round(age, 3) if age is not None else None}}

    # --- the checks --------------------------------------------------------------------------

    def _database(self) -> dict[str, Any]:
        with self._lock:
            if self._inflight is not None and not self._inflight.done():
                return {"ok": False, "why": "an earlier SELECT 1 is still waiting for the database"}
            fut = self._inflight = concurrent.futures.Future()
            threading.Thread(target=self._ping_into, args=(fut,), name="thermowatch-health-ping", daemon=True).start()
        try:
            fut.result(timeout=self.cfg.db_timeout_s)
        except concurrent.futures.TimeoutError:
            return {"ok": False, "why": f"SELECT 1 did not answer within {self.cfg.db_timeout_s:g} s"}
        except Exception as exc:  # noqa: BLE001 - any failure to answer is the finding itself
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            return {"ok": False, "why": f"SELECT 1 failed: {type(exc).__name__}: {first}"}
        return {"ok": True}

    def _ping_into(self, fut: concurrent.futures.Future) -> None:
        try:
            self._ping()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting probe
            fut.set_exception(exc)
        else:
            fut.set_result(None)

    def _ping(self) -> None:
        with self.sup.sessions() as s:
            metrics_store.ping(s)

    def _judge(self) -> dict[str, Any]:
        judge = self.sup.judge
        if not judge.alive:
            return {"ok": False, "why": "the judge thread is not running: stored steps are not being judged"}
        if judge.backlog > self.cfg.max_judge_backlog:
            return {"ok": False, "why": f"{judge.backlog} batches wait to be judged (more than "
                                        f"{self.cfg.max_judge_backlog}): findings trail the runs"}
        return {"ok": True}

    def _senders(self) -> dict[str, Any]:
        dead = self.sup.executor.outbox.dead_senders()
        if dead:
            return {"ok": False, "why": f"alert sender thread(s) not running for {', '.join(dead)}: "
                                        "alerts are written but never sent"}
        return {"ok": True}

    def _scheduler(self) -> dict[str, Any]:
        if self.scheduler is None:
            return {"ok": True, "why": "no scheduler in this process (an embedded or test app)"}
        if not self.scheduler.running:
            return {"ok": False, "why": "the scheduler is stopped: no stall checks, ack timeouts or retention"}
        return {"ok": True}

    def _warnings(self) -> list[str]:
        now = dt.datetime.now(dt.timezone.utc)
        out = [f"alert channel {name} was not reachable at start-up ({why}); alerts wait in the outbox"
               for name, why in self.sup.notifier_status()["channels"].items() if why != "ok"]
        try:
            with self.sup.sessions() as s:
                rows = metrics_store.alerts_by_state(s)
        except Exception:  # noqa: BLE001 - the database check above already speaks for it
            return out
        for channel, state, n, oldest in sorted(rows, key=lambda r: (r[0], r[1])):
            age = (now - oldest).total_seconds() if oldest is not None else 0.0
            if state == "pending" and age > self.cfg.alert_warn_age_s:
                out.append(f"{n} alert(s) to {channel} undelivered, the oldest for {age:.0f} s "
                           "(the outbox keeps retrying)")
        return out
