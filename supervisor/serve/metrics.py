"""`GET /metrics`: the daemon in the Prometheus text exposition format (issue 12, "Nothing for
Grafana"). The only module that imports prometheus_client (STYLE.md 6; it comes with
ray[default] already).

Two kinds of figures:

- **counted** by this process (they restart at 0 with it, as Prometheus counters may):
  ingest batches / records / values, ingest refusals (4xx), HTTP requests by route template and
  status class. `Counters` is a few integers behind a lock: the request path adds to them and
  never touches Prometheus objects.
- **read at scrape time** from the database and the daemon's own parts (`DaemonCollector`):
  per active run (last step, last record age, open incidents, attempts, actions by kind and
  state), counts over all runs (stored, active, listed, open incidents, actions by kind and
  state), the judge (backlog, dropped batches, thread alive), the alert outbox per channel
  (pending, failed, oldest pending age), the scheduler's jobs (last run, last success,
  failures). The database reads are eight statements (supervisor.store.metrics), so a scrape
  costs the same for ten incidents as for ten thousand, and for ten runs as for 10^5.

A run is active with anything new in the last day (the daily digest's window), an open incident
or an action not final; at most `limits.max_runs_in_metrics` of them get per-run series, those
waiting on someone first (issue 21: with series for every run, a scrape at 10^5 runs takes 13.5 s).

Label cardinality stays bounded: run ids (active runs only, at most max_runs_in_metrics), routes by their
template (`/api/runs/{run_id}/history`, never the raw path; "unmatched" for 404s), status by
class (2xx, 4xx, 5xx).
"""

from __future__ import annotations

import datetime as dt
import threading
from collections import Counter
from typing import TYPE_CHECKING, Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

from thermowatch.supervisor.store import metrics as metrics_store
from thermowatch.supervisor.store import runs as runs_store

if TYPE_CHECKING:
    from thermowatch.supervisor.app.scheduler import Scheduler
    from thermowatch.supervisor.app.service import Supervisor

# The classic text format, which every Prometheus reads (our names need none of 1.0.0's escaping).
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4
UNMATCHED = "unmatched"  # a path no route matched: one label value, whatever was asked


class Counters:
    """What this process counted since it started (thread-safe; a few integer additions)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ingest_batches = 0
        self.ingest_records = 0
        self.ingest_values = 0
        self.ingest_refused: Counter[str] = Counter()  # by status code ("413")
        self.http: Counter[tuple[str, str, str]] = Counter()  # (method, route template, "2xx")

    def batch(self, records: int, values: int) -> None:
        with self._lock:
            self.ingest_batches += 1
            self.ingest_records += records
            self.ingest_values += values

    def request(self, method: str, route: str, status: int, ingest: bool) -> None:
        with self._lock:
            self.http[(method, route, f"{status // 100}xx")] += 1
            if ingest and 400 <= status < 500:
                self.ingest_refused[str(status)] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {"batches": self.ingest_batches, "records": self.ingest_records, "values": self.ingest_values,
                    "refused": dict(self.ingest_refused), "http": dict(self.http)}


class HttpMetrics:
    """ASGI middleware: one count per request by method, route template and status class. Pure
    ASGI (no BaseHTTPMiddleware: that would buffer streaming bodies and cost a task per request)."""

    def __init__(self, app, counters: Counters) -> None:
        self.app = app
        self.counters = counters

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = 500  # an exception before the response started is answered 500 further out

        async def tracked(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            route = scope.get("route")  # set by the router on the scope it was given (FastAPI/Starlette)
            template = getattr(route, "path", None) or UNMATCHED
            self.counters.request(scope["method"], template, status, "ingest" in (getattr(route, "tags", None) or ()))


class DaemonCollector:
    """Everything read at scrape time. Registered on a registry of the app's own (no global)."""

    def __init__(self, sup: "Supervisor", counters: Counters, scheduler: "Scheduler | None",
                 clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.timezone.utc)) -> None:
        self.sup, self.counters, self.scheduler, self.clock = sup, counters, scheduler, clock

    def collect(self) -> Iterator[Metric]:
        now = self.clock()
        yield from self._counted()
        yield from self._judge()
        yield from self._scheduler()
        # Eight statements whatever the number of runs: per-run series for at most
        # limits.max_runs_in_metrics active runs, counts over all of them.
        with self.sup.sessions() as s:
            listed, active = metrics_store.active_runs(s, now - runs_store.ACTIVE_WINDOW,
                                                       self.sup.ingestor.limits.max_runs_in_metrics)
            runs = metrics_store.run_gauges(s, listed)
            actions = metrics_store.actions_by_state(s, listed)
            totals = metrics_store.totals(s)
            all_actions = metrics_store.actions_by_state(s)
            alerts = metrics_store.alerts_by_state(s)
        yield from self._totals(totals, active, len(listed), all_actions)
        yield from self._runs(runs, actions, now)
        yield from self._outbox(alerts, now)

    def _counted(self) -> Iterator[Metric]:
        c = self.counters.snapshot()
        for name, doc, value in (("ingest_batches", "Step batches stored by POST .../steps.", c["batches"]),
                                 ("ingest_records", "Step records stored.", c["records"]),
                                 ("ingest_values", "Thermometer values stored.", c["values"])):
            yield CounterMetricFamily(f"thermowatch_{name}", doc, value=value)
        refused = CounterMetricFamily("thermowatch_ingest_refused", "Ingest requests answered 4xx, by status.",
                                      labels=["status"])
        for status, n in sorted(c["refused"].items()):
            refused.add_metric([status], n)
        yield refused
        http = CounterMetricFamily("thermowatch_http_requests", "HTTP requests by method, route template and "
                                   "status class.", labels=["method", "route", "status"])
        for (method, route, klass), n in sorted(c["http"].items()):
            http.add_metric([method, route, klass], n)
        yield http

    def _judge(self) -> Iterator[Metric]:
        judge = self.sup.judge
        yield GaugeMetricFamily("thermowatch_judge_backlog", "Committed batches not judged yet.", value=judge.backlog)
        yield CounterMetricFamily("thermowatch_judge_dropped_batches", "Batches left to the judge's catch-up "
                                  "because its queue was full.", value=judge.dropped)
        yield GaugeMetricFamily("thermowatch_judge_up", "1 while the judge thread is alive.",
                                value=int(judge.alive))
        # Several replicas on one database (supervisor.app.lease, issue 40): which one leads, and
        # how long since it last renewed its lease (absent on a standby and without a lease).
        yield GaugeMetricFamily("thermowatch_leader", "1 on the replica that leads (judges, acts, notifies), "
                                "0 on a standby.", value=int(bool(getattr(self.sup, "leading", True))))
        coord = getattr(self.sup, "coordinator", None)
        age = coord.lease_age_s() if coord is not None else None
        if age is not None:
            yield GaugeMetricFamily("thermowatch_lease_age_seconds", "Seconds since the leader last renewed its "
                                    "lease (a standby takes over past the lease's ttl).", value=age)
        if getattr(self.sup, "bank_process", None) is not None:
            yield CounterMetricFamily("thermowatch_detectors_process_restarts", "Times the detectors' process died "
                                      "and a new one took over from the saved state.",
                                      value=self.sup.bank_process.restarts)

    def _scheduler(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("thermowatch_scheduler_up", "1 while the scheduler is running (absent: no "
                               "scheduler in this process).")
        last_run = GaugeMetricFamily("thermowatch_job_last_run_timestamp_seconds", "When each job last finished.",
                                     labels=["job"])
        last_ok = GaugeMetricFamily("thermowatch_job_last_success_timestamp_seconds",
                                    "When each job last finished without an error.", labels=["job"])
        runs = CounterMetricFamily("thermowatch_job_runs", "Runs of each job.", labels=["job"])
        failures = CounterMetricFamily("thermowatch_job_failures", "Runs of each job that raised.", labels=["job"])
        if self.scheduler is not None:
            up.add_metric([], int(self.scheduler.running))
            for name, st in sorted(self.scheduler.status().items()):
                if st.last_end is not None:
                    last_run.add_metric([name], st.last_end)
                if st.last_ok_at is not None:
                    last_ok.add_metric([name], st.last_ok_at)
                runs.add_metric([name], st.runs)
                failures.add_metric([name], st.failures)
        yield from (up, last_run, last_ok, runs, failures)

    def _totals(self, totals: metrics_store.Totals, active: int, listed: int, actions) -> Iterator[Metric]:
        yield GaugeMetricFamily("thermowatch_runs", "Runs stored.", value=totals.runs)
        yield GaugeMetricFamily("thermowatch_runs_active", "Runs with anything new in the last day, an open "
                                "incident or an action not final.", value=active)
        yield GaugeMetricFamily("thermowatch_runs_listed", "Active runs with thermowatch_run_* series in this "
                                "scrape (below thermowatch_runs_active past limits.max_runs_in_metrics).",
                                value=listed)
        yield GaugeMetricFamily("thermowatch_open_incidents", "Open incidents of all runs.",
                                value=totals.open_incidents)
        by_state = GaugeMetricFamily("thermowatch_actions", "Actions of all runs by kind and state.",
                                     labels=["kind", "state"])
        for _, kind, state, n in sorted(actions):
            by_state.add_metric([kind, state], n)
        yield by_state

    def _runs(self, runs: list[metrics_store.RunGauges], actions, now: dt.datetime) -> Iterator[Metric]:
        last_step = GaugeMetricFamily("thermowatch_run_last_step", "Newest judged step of the run's newest attempt.",
                                      labels=["run_id"])
        age = GaugeMetricFamily("thermowatch_run_last_record_age_seconds",
                                "Seconds since the daemon last judged a batch of the run (its own clock).",
                                labels=["run_id"])
        incidents = GaugeMetricFamily("thermowatch_run_open_incidents", "Open incidents.", labels=["run_id"])
        attempts = GaugeMetricFamily("thermowatch_run_attempts", "Attempts opened (restarts + 1).", labels=["run_id"])
        for r in runs:
            if r.last_step is not None:
                last_step.add_metric([r.run_id], r.last_step)
            if r.last_record_at is not None:
                age.add_metric([r.run_id], max(0.0, (now - r.last_record_at).total_seconds()))
            incidents.add_metric([r.run_id], r.open_incidents)
            attempts.add_metric([r.run_id], r.attempts)
        loss = GaugeMetricFamily("thermowatch_run_loss", "The loss of the newest step stored (absent until the "
                                 "run's first batch since the daemon started).", labels=["run_id"])
        step_s = GaugeMetricFamily("thermowatch_run_step_seconds", "Wall seconds per step over the newest batch "
                                   "(the trainer's clock).", labels=["run_id"])
        tps = GaugeMetricFamily("thermowatch_run_tokens_per_second", "Tokens per second of the newest step: the "
                                "trainer's tokens_per_s, else tokens / step seconds.", labels=["run_id"])
        cost = GaugeMetricFamily("thermowatch_run_thermometer_cost", "The share of the trainer's step its "
                                 "thermometers took, as the client measured it (a fraction; absent without a "
                                 "cost budget).", labels=["run_id"])
        every = GaugeMetricFamily("thermowatch_run_thermometer_every", "Steps between reads of each thermometer "
                                  "group, as the client's cost budget set them.", labels=["run_id", "group"])
        for r in runs:
            p = self.sup.progress.get(r.run_id)
            if p is None:
                continue
            if p.thermometer_cost is not None:
                cost.add_metric([r.run_id], p.thermometer_cost)
            for group, n in sorted(p.thermometer_every.items()):
                every.add_metric([r.run_id, group], n)
            loss.add_metric([r.run_id], p.loss)
            if p.step_s is not None:
                step_s.add_metric([r.run_id], p.step_s)
            if p.tokens_per_s is not None:
                tps.add_metric([r.run_id], p.tokens_per_s)
        yield from (loss, step_s, tps, cost, every)
        by_state = GaugeMetricFamily("thermowatch_run_actions", "Actions of an active run by kind and state.",
                                     labels=["run_id", "kind", "state"])
        for run_id, kind, state, n in sorted(actions):
            by_state.add_metric([run_id, kind, state], n)
        yield from (last_step, age, incidents, attempts, by_state)

    def _outbox(self, alerts, now: dt.datetime) -> Iterator[Metric]:
        count = GaugeMetricFamily("thermowatch_outbox_alerts", "Alert rows by channel and state "
                                  "(pending: not delivered yet; failed: refused for good).",
                                  labels=["channel", "state"])
        oldest = GaugeMetricFamily("thermowatch_outbox_oldest_pending_age_seconds",
                                   "Age of the oldest undelivered alert per channel.", labels=["channel"])
        channels = set(self.sup.executor.outbox.channels)
        seen = set()
        for channel, state, n, first in sorted(alerts, key=lambda a: (a[0], a[1])):
            count.add_metric([channel, state], n)
            seen.add((channel, state))
            if state == "pending" and first is not None:
                oldest.add_metric([channel], max(0.0, (now - first).total_seconds()))
        for channel in sorted(channels):  # a configured channel shows 0, not nothing, when all is well
            for state in ("pending", "failed"):
                if (channel, state) not in seen:
                    count.add_metric([channel, state], 0)
        yield from (count, oldest)


def build_registry(sup: "Supervisor", counters: Counters, scheduler: "Scheduler | None") -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DaemonCollector(sup, counters, scheduler))
    return registry


def render(registry: CollectorRegistry) -> bytes:
    return generate_latest(registry)
