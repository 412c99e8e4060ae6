"""Pages as signed JSON to any receiver (Alertmanager-style or Opsgenie-style bridges, a chat
relay, an in-house pager): `POST {url}` with the alert, its event (`trigger`, `acknowledge`,
`resolve`) and the story's dedup key, as supervisor.notify.paging decides them for PagerDuty.

The body is signed so a receiver can tell it came from this daemon and was not replayed:

    X-Thermowatch-Timestamp: 1718000000                 (unix seconds when it was sent)
    X-Thermowatch-Signature: sha256=<hex HMAC-SHA256(secret, "<timestamp>." + body)>

The timestamp is inside the signed text, so an old body cannot be sent again under a new time;
a receiver refuses a timestamp older than a few minutes (`verify`, 300 s) and compares in
constant time. The scheme is Stripe's and Slack's (a version-less prefix, one secret), so the
usual receiver code fits. The secret comes from an environment variable or a mounted file.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import time
from typing import Any, Callable, Mapping, Protocol

import httpx

from thermowatch.monitors.contract import Severity
from thermowatch.supervisor.notify import paging
from thermowatch.supervisor.notify.base import Alert, NotifyConfigError
from thermowatch.supervisor.notify.paging import PageEvent

log = logging.getLogger(__name__)

TIMESTAMP_HEADER = "X-Thermowatch-Timestamp"
SIGNATURE_HEADER = "X-Thermowatch-Signature"
TOLERANCE_S = 300.0  # how old a timestamp a receiver accepts (clock skew + the outbox's first retries)
VERSION = 1  # the body's shape; a receiver can refuse one it does not know


class WebhookSettings(Protocol):
    """What from_config reads; supervisor.app.config.WebhookConfig has these fields."""

    url: str
    secret_env: str
    secret_file: str
    min_severity: Severity
    timeout_s: float


def sign(secret: str | bytes, timestamp: str, body: bytes) -> str:
    """The signature header's value for `body` sent at `timestamp`."""
    key = secret.encode() if isinstance(secret, str) else secret
    return "sha256=" + hmac.new(key, timestamp.encode() + b"." + body, hashlib.sha256).hexdigest()


def verify(secret: str | bytes, body: bytes, timestamp: str | None, signature: str | None, *,
           now: float | None = None, tolerance_s: float = TOLERANCE_S) -> bool:
    """A receiver's check (also what the tests hold the sender to): the signature is this
    secret's over this body and timestamp, and the timestamp is within `tolerance_s` of now."""
    if not timestamp or not signature:
        return False
    try:
        sent = int(timestamp)
    except ValueError:
        return False
    if abs((time.time() if now is None else now) - sent) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), signature)


class WebhookNotifier:
    """One receiver URL; the outbox's channel `webhook`. One try per send, the outbox's backoff
    after a 429 / 5xx / unreachable receiver, a 400 marked failed (supervisor.notify.paging.post_json)."""

    channel_name = "webhook"  # stored on each outbox row: stable across restarts
    links: paging.RunLinks | None = None  # signed run links (supervisor.app.service.build_notifier)

    def __init__(self, url: str, secret: str, *, min_severity: Severity = Severity.CRITICAL,
                 web_base_url: str | None = None, timeout_s: float = 10.0,
                 clock: Callable[[], float] = time.time, secret_source: str = "the secret argument"):
        if not secret:
            raise NotifyConfigError(f"the webhook needs a signing secret; none came from {secret_source}")
        try:
            self.url = paging.check_url("webhook.url", url)
        except ValueError as exc:
            raise NotifyConfigError(str(exc)) from None
        self._secret = secret.encode()
        self.secret_source = secret_source
        self.min_severity = Severity(min_severity)
        self.web_base_url = web_base_url
        self._clock = clock
        self.client = httpx.Client(timeout=timeout_s)

    @classmethod
    def from_config(cls, cfg: WebhookSettings, *, environ: Mapping[str, str] | None = None,
                    web_base_url: str | None = None) -> "WebhookNotifier":
        secret, source = paging.resolve_secret(
            "webhook", "signing secret", "secret_env", cfg.secret_env, "secret_file", cfg.secret_file,
            "a long random string the receiver also holds", environ)
        return cls(cfg.url, secret, min_severity=cfg.min_severity, web_base_url=web_base_url,
                   timeout_s=cfg.timeout_s, secret_source=source)

    def wants(self, alert: Alert, paged: Callable[[], bool]) -> bool:
        return paging.wants(alert, paged, self.min_severity)

    def body(self, alert: Alert) -> dict[str, Any]:
        """What the receiver gets: the alert as the daemon holds it, with the event and the key."""
        event = paging.page_event(alert, self.min_severity) or PageEvent.TRIGGER
        url = paging.run_url(self.web_base_url, alert, self.links, self.channel_name)
        return {"version": VERSION, "source": "thermowatch", "event": event.value, "dedup_key": paging.dedup_key(alert),
                "run_id": alert.run_id, "incident_id": alert.incident_id, "severity": alert.severity.value,
                "title": alert.title, "text": alert.text, "reasons": list(alert.reasons),
                "fields": alert.to_json()["fields"], "commands": list(alert.commands), "status": alert.status,
                "escalation": alert.escalation,
                "links": [{"href": url, "text": f"run {alert.run_id} in thermowatch"}] if url else []}

    def send(self, alert: Alert) -> str | None:
        """Post the signed body; returns the story's message id for the outbox (paging.message_id)."""
        payload = self.body(alert)
        raw = json.dumps(payload, separators=(",", ":")).encode()
        ts = str(int(self._clock()))
        paging.post_json(self.client, "webhook", self.url, raw,
                         {TIMESTAMP_HEADER: ts, SIGNATURE_HEADER: sign(self._secret, ts, raw)})
        log.info("webhook %s %s for run %s", payload["event"], payload["dedup_key"], alert.run_id)
        return paging.message_id(payload["dedup_key"])

    def check(self) -> dict[str, Any]:
        """No call at start-up (a receiver may page on any POST): where alerts go and the secret's source."""
        return {"url": paging.shown_url(self.url), "secret": f"from {self.secret_source}", "min_severity": self.min_severity.value}

    def close(self) -> None:
        self.client.close()
