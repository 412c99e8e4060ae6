"""What the paging channels share (PagerDuty, supervisor.notify.pagerduty; the signed webhook,
supervisor.notify.webhook): which alerts page, the key that keeps one incident one page, the
event an alert is, the run page's link, the secret a channel is configured with, and one JSON
POST whose failure says whether trying again can help.

A page is for an alert that needs a person (Severity.CRITICAL: an approval pending, a pause, an
action that failed); what the daemon did by itself (INFO, WARN) never pages. A page ends when its
story does (`StoryState.RESOLVED`) and stops escalating when a person took it
(`StoryState.ANSWERED`); those follow-ups are written only for stories the channel paged, so a
rollback the daemon did on its own sends nothing there (`wants`).
"""

from __future__ import annotations

import enum
import hashlib
import os
from pathlib import Path
from typing import Any, Callable, Mapping, Protocol
from urllib.parse import quote, urlsplit

import httpx

from thermowatch.monitors.contract import Severity
from thermowatch.supervisor.notify.base import Alert, NotifyConfigError, NotifyError, StoryState

_RANK = {Severity.INFO: 0, Severity.WARN: 1, Severity.CRITICAL: 2}
# HTTP answers about the configuration, not the message (a wrong key or secret, a receiver not
# deployed yet): the row stays pending and goes out once it is fixed, as with a revoked Slack token.
_CONFIG_STATUSES = {401, 403, 404}
_DEDUP_MAX = 255  # PagerDuty's limit on dedup_key


class PageEvent(str, enum.Enum):
    """One name on both wires: PagerDuty's `event_action` and the webhook's `event`."""

    TRIGGER = "trigger"
    ACKNOWLEDGE = "acknowledge"
    RESOLVE = "resolve"


def page_event(alert: Alert, min_severity: Severity = Severity.CRITICAL) -> PageEvent | None:
    """What `alert` is to a paging channel; None: nothing (it does not page)."""
    if alert.story_state is StoryState.RESOLVED:
        return PageEvent.RESOLVE
    if alert.story_state is StoryState.ANSWERED:
        return PageEvent.ACKNOWLEDGE
    return PageEvent.TRIGGER if _RANK[alert.severity] >= _RANK[min_severity] else None


def wants(alert: Alert, paged: Callable[[], bool], min_severity: Severity = Severity.CRITICAL, *,
          escalations: bool = True) -> bool:
    """Whether a paging channel takes `alert` (the outbox writes its row only then). `paged`: has
    the channel taken a row of this alert's story before; asked only for an acknowledge or a
    resolve, which mean nothing to a receiver that never saw the trigger. `escalations` False: a
    receiver that escalates by itself (PagerDuty's escalation policy) is not sent ours."""
    event = page_event(alert, min_severity)
    if event is None or alert.chart is not None or (alert.escalation and not escalations):
        return False
    return event is PageEvent.TRIGGER or (alert.thread_key is not None and paged())


def dedup_key(alert: Alert) -> str:
    """The same key for every alert of one story (run + incident, or run + manual action), so a
    re-sent or repeated page joins the open one instead of opening a second. An alert of no story
    (checkpoint saves failing, a state mismatch) is keyed by its title, which names what failed."""
    story = alert.thread_key or "alert:" + hashlib.sha256(alert.title.encode()).hexdigest()[:16]
    key = f"thermowatch/{alert.run_id}/{story}"
    if len(key) > _DEDUP_MAX:  # a long run id: still stable, still unique
        key = key[:_DEDUP_MAX - 17] + "/" + hashlib.sha256(key.encode()).hexdigest()[:16]
    return key


def message_id(key: str) -> str:
    """What a pager's send() returns for the outbox's `ts` column (at most 64 characters): the
    dedup key itself, or its digest when longer. Nothing threads under it; it marks the story
    as delivered to this channel."""
    return key if len(key) <= 64 else "dedup:" + hashlib.sha256(key.encode()).hexdigest()[:58]


class RunLinks(Protocol):
    """Signed links that sign their reader in to one run, to read it (supervisor.notify.link_grants)."""

    def url(self, run_id: str, incident_id: Any = None, channel: str = "") -> str | None: ...


def run_url(web_base_url: str | None, alert: Alert, links: RunLinks | None = None, channel: str = "") -> str | None:
    """The run page (the incident's place on it), as every channel links it; None without
    `public_url`. With `links` (the daemon's, auth on): a signed link to it that signs its reader
    in, read-only, once (docs/auth.md). Made here, at delivery, so it lasts its whole `link_ttl_s`;
    the plain page when no signed one can be made (its reader signs in with a token)."""
    if not web_base_url:
        return None
    signed = links.url(alert.run_id, alert.incident_id, channel) if links is not None else None
    if signed:
        return signed
    url = f"{web_base_url.rstrip('/')}/runs/{quote(alert.run_id, safe='')}"
    return url + (f"?incident={quote(str(alert.incident_id))}" if alert.incident_id is not None else "")


def check_url(key: str, url: str) -> str:
    """An http(s) URL with a host, or ValueError naming `key` (the config's check)."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{key} must be an http:// or https:// URL with a host, got {url!r}")
    return url


def shown_url(url: str) -> str:
    """`url` for logs and the outbox's error column: a receiver's URL may carry a key in its query
    (an Opsgenie-style integration) or user:password, neither of which belongs there."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    return f"{parts.scheme}://{host}{':' + str(parts.port) if parts.port else ''}{parts.path}"


def read_secret_file(section: str, what: str, file_key: str, file: str, put: str) -> str:
    """The secret in a mounted file: readable and non-empty, or a NotifyConfigError saying what to do."""
    path = Path(file)
    try:
        secret = path.read_text().strip()
    except OSError as exc:
        raise NotifyConfigError(f"{section}.{file_key}: the {what} file {path} cannot be read ({exc.strerror}); "
                                f"mount the secret there or fix the path") from None
    if not secret:
        raise NotifyConfigError(f"{section}.{file_key}: the {what} file {path} is empty; put {put} in it")
    return secret


def resolve_secret(section: str, what: str, env_key: str, env_name: str, file_key: str, file: str, put: str,
                   environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """(secret, where it came from) for `section` (the config's name for it): a file, when set,
    wins over the environment variable. Never from the config file itself."""
    environ = os.environ if environ is None else environ
    if file:
        return read_secret_file(section, what, file_key, file, put), f"file {Path(file)}"
    if env_name:
        secret = environ.get(env_name, "").strip()
        if not secret:
            raise NotifyConfigError(f"{section}.{env_key}: environment variable {env_name} is unset or empty; export "
                                    f"{put} there, or set {section}.{file_key} to a secret file holding it")
        return secret, f"environment variable {env_name}"
    raise NotifyConfigError(f"{section} is configured without a {what}; set {section}.{env_key} or {section}.{file_key}")


def post_json(client: httpx.Client, what: str, url: str, body: bytes,
              headers: Mapping[str, str] | None = None) -> httpx.Response:
    """POST `body`; a 2xx answer is returned. Otherwise NotifyError, retryable (the outbox backs
    off and tries again) for a connection error, 408, 429, 5xx and the configuration's answers
    (401, 403, 404); not retryable for any other 4xx: the receiver refused this message itself
    (a 400 from PagerDuty: the event is invalid), so the outbox marks it failed and goes on."""
    shown = shown_url(url)
    try:
        resp = client.post(url, content=body, headers={"Content-Type": "application/json", **(headers or {})})
    except httpx.HTTPError as exc:  # connect, read timeout, a dropped connection
        raise NotifyError(f"{what} could not reach {shown}: {type(exc).__name__}: {exc}; tried again later") from exc
    if 200 <= resp.status_code < 300:
        return resp
    code = resp.status_code
    said = resp.text.strip().replace("\n", " ")[:300]
    retryable = code in (408, 429) or code >= 500 or code in _CONFIG_STATUSES
    hint = ("check the key or secret and the URL; the alert is kept and sent once they are right"
            if code in _CONFIG_STATUSES else "tried again later" if retryable else "this alert is not sent again")
    raise NotifyError(f"{what}: {shown} answered HTTP {code} ({said or 'no body'}); {hint}", retryable=retryable)
