"""Pages through PagerDuty's Events API v2 (developer.pagerduty.com/docs/events-api-v2/trigger-events):
`POST {base_url}/v2/enqueue` with the service integration's routing key.

An alert that needs a person (supervisor.notify.paging: CRITICAL) is a `trigger`; a person
approving is an `acknowledge`; the incident resolved, declined, superseded or closed with the run
is a `resolve`. Every event of one story carries the same `dedup_key` (run + incident), so the
outbox re-sending a page after an outage, or the pause re-page, joins the open PagerDuty incident
instead of opening a second. One try per send: the outbox keeps a 429 / 5xx / unreachable row
pending with its backoff and marks a 400 (an event PagerDuty calls invalid) failed.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable, Mapping, Protocol

import httpx

from thermowatch.monitors.contract import Severity
from thermowatch.supervisor.notify import paging
from thermowatch.supervisor.notify.base import Alert, NotifyConfigError, NotifyError
from thermowatch.supervisor.notify.paging import PageEvent

log = logging.getLogger(__name__)

DEFAULT_BASE_URL = "https://events.pagerduty.com"  # EU service region: https://events.eu.pagerduty.com
_SEVERITY = {Severity.CRITICAL: "critical", Severity.WARN: "warning", Severity.INFO: "info"}
_SUMMARY_MAX = 1024  # PagerDuty truncates payload.summary here


class PagerDutySettings(Protocol):
    """What from_config reads; supervisor.app.config.PagerDutyConfig has these fields."""

    routing_key_env: str
    routing_key_file: str
    base_url: str
    timeout_s: float


class PagerDutyNotifier:
    """One PagerDuty service (its Events API v2 integration); the outbox's channel `pagerduty`."""

    channel_name = "pagerduty"  # stored on each outbox row: stable across restarts
    links: paging.RunLinks | None = None  # signed run links (supervisor.app.service.build_notifier)

    def __init__(self, routing_key: str, *, base_url: str = DEFAULT_BASE_URL, web_base_url: str | None = None,
                 timeout_s: float = 10.0, key_source: str = "the routing_key argument"):
        if not routing_key:
            raise NotifyConfigError(f"PagerDuty needs a routing key; none came from {key_source}")
        self.routing_key = routing_key
        self.key_source = key_source
        self.url = f"{base_url.rstrip('/')}/v2/enqueue"
        self.web_base_url = web_base_url
        self.client = httpx.Client(timeout=timeout_s)

    @classmethod
    def from_config(cls, cfg: PagerDutySettings, *, environ: Mapping[str, str] | None = None,
                    web_base_url: str | None = None) -> "PagerDutyNotifier":
        key, source = paging.resolve_secret(
            "pagerduty", "routing key", "routing_key_env", cfg.routing_key_env, "routing_key_file",
            cfg.routing_key_file, "the service's Events API v2 integration key", environ)
        return cls(key, base_url=cfg.base_url, web_base_url=web_base_url, timeout_s=cfg.timeout_s, key_source=source)

    def wants(self, alert: Alert, paged: Callable[[], bool]) -> bool:
        """The outbox's filter: critical alerts, and the acknowledge / resolve of a story paged here.
        Not thermowatch's escalation (supervisor.app.jobs.escalate): the service's escalation
        policy escalates its incident until it is acknowledged, and a second trigger of the same
        dedup key would only be folded into it."""
        return paging.wants(alert, paged, escalations=False)

    def event(self, alert: Alert) -> dict[str, Any]:
        """The Events API v2 body for `alert` (an acknowledge or resolve carries the key alone)."""
        action = paging.page_event(alert) or PageEvent.TRIGGER
        body: dict[str, Any] = {"routing_key": self.routing_key, "event_action": action.value,
                                "dedup_key": paging.dedup_key(alert)}
        if action is not PageEvent.TRIGGER:
            return body
        fields = dict(alert.fields)
        details = {"run": alert.run_id, "incident": alert.incident_id,
                   "step": fields.pop("detect step", None) or fields.pop("step", None),
                   "attempt": fields.pop("attempt", None), "signal": fields.pop("signal", None),
                   **fields, "what happened": alert.text or None, "why": list(alert.reasons) or None,
                   "commands": list(alert.commands) or None, "status": alert.status or None}
        payload: dict[str, Any] = {
            "summary": _cut(alert.title, _SUMMARY_MAX), "source": alert.run_id, "severity": _SEVERITY[alert.severity],
            "custom_details": {k: v for k, v in details.items() if v is not None}}
        if details.get("signal"):
            payload["class"] = str(details["signal"])
        if fields.get("module"):
            payload["component"] = str(fields["module"])
        body.update(payload=payload, client="thermowatch")
        url = paging.run_url(self.web_base_url, alert, self.links, self.channel_name)
        if url:
            body.update(client_url=url, links=[{"href": url, "text": f"run {alert.run_id} in thermowatch"}])
        return body

    def send(self, alert: Alert) -> str | None:
        """Post the event; returns the story's message id for the outbox (paging.message_id)."""
        body = self.event(alert)
        resp = paging.post_json(self.client, "PagerDuty", self.url, json.dumps(body).encode())
        try:
            answer = resp.json()
        except ValueError:
            answer = {}
        if isinstance(answer, dict) and answer.get("status") not in (None, "success"):
            raise NotifyError(f"PagerDuty answered {resp.status_code} but not success: {answer}")
        log.info("PagerDuty %s %s for run %s", body["event_action"], body["dedup_key"], alert.run_id)
        return paging.message_id(body["dedup_key"])

    def check(self) -> dict[str, Any]:
        """No call at start-up: the Events API has no way to test a routing key without opening an
        incident. Says where events go and where the key came from (`/healthz`)."""
        return {"events_url": self.url, "routing_key": f"from {self.key_source}"}

    def close(self) -> None:
        self.client.close()


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"
