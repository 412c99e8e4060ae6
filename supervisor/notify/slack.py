"""Alerts to Slack with slack-sdk's WebClient (chat.postMessage, chat.update, files_upload_v2,
Block Kit built with slack_sdk.models.blocks).

With supervisor.serve.api.slack (the interactivity endpoint), the only module that imports slack_sdk
(STYLE.md 6); SlackGroupMembers here reads the user groups of `slack.approver_groups` for
supervisor.decide.approvers. The bot token comes from an environment variable or a mounted secret
file, never from a config file. Rate limits (HTTP 429 +
Retry-After), 5xx answers and dropped connections are retried with slack-sdk's RetryHandlers;
after the last retry a NotifyError says what to check.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import time
from typing import Any, Mapping, Protocol, Sequence
from urllib.error import HTTPError

from slack_sdk import WebClient
from slack_sdk.errors import SlackApiError, SlackRequestError
from slack_sdk.http_retry import ConnectionErrorRetryHandler, RetryHandler
from slack_sdk.http_retry.builtin_handlers import ServerErrorRetryHandler
from slack_sdk.http_retry.builtin_interval_calculators import BackoffRetryIntervalCalculator
from slack_sdk.models.blocks import (
    ActionsBlock,
    Block,
    ButtonElement,
    ConfirmObject,
    ContextBlock,
    HeaderBlock,
    MarkdownTextObject,
    PlainTextObject,
    SectionBlock,
)

from thermowatch.monitors.contract import Severity
from thermowatch.supervisor.notify.base import Alert, NotifyConfigError, NotifyError
from thermowatch.supervisor.notify.paging import RunLinks, read_secret_file, resolve_secret, run_url

log = logging.getLogger(__name__)

_EMOJI = {Severity.INFO: ":information_source:", Severity.WARN: ":warning:", Severity.CRITICAL: ":rotating_light:"}
_AUTH_ERRORS = {"invalid_auth", "not_authed", "token_revoked", "token_expired", "account_inactive"}
_CHANNEL_ERRORS = {"channel_not_found", "not_in_channel", "is_archived"}
# Errors about the message itself: sending it again cannot succeed (the outbox marks it failed).
_MESSAGE_ERRORS = {"invalid_blocks", "invalid_blocks_format", "msg_too_long", "no_text", "invalid_arguments",
                   "too_many_attachments", "invalid_attachments"}
# The buttons' action ids: what the interactivity endpoint (supervisor.serve.api.slack) accepts.
APPROVE, CANCEL, ACK = "thermowatch_approve", "thermowatch_cancel", "thermowatch_ack"
# Block Kit limits: header text 150 chars, section text 3000, 10 fields of 2000 each.
_HEADER_MAX, _SECTION_MAX, _FIELDS_MAX = 150, 3000, 10


class SlackSettings(Protocol):
    """What from_config reads; supervisor.app.config.SlackConfig has these fields."""

    channel: str
    token_env: str
    token_file: str
    base_url: str | None


def resolve_token(token_env: str | None, token_file: str | None,
                  environ: Mapping[str, str] | None = None) -> tuple[str, str]:
    """Return (token, where it came from). A token file, when set, wins over the env var."""
    return resolve_secret("slack", "token", "token_env", token_env or "", "token_file", token_file or "",
                          "the bot token (xoxb-...)", environ)


def resolve_signing_secret(secret_env: str | None, secret_file: str | None,
                           environ: Mapping[str, str] | None = None) -> str | None:
    """Slack's signing secret for the interactivity endpoint, or None: not configured (no buttons,
    the endpoint answers 404). A file, when set, wins and must be readable and non-empty."""
    environ = os.environ if environ is None else environ
    if secret_file:
        return read_secret_file("slack", "signing secret", "signing_secret_file", secret_file,
                                "the app's signing secret")
    if secret_env:
        return environ.get(secret_env, "").strip() or None
    return None


class _RateLimitRetry(RetryHandler):
    """Retry HTTP 429 after Retry-After seconds, capped, so one alert never blocks for minutes.

    slack-sdk's own RateLimitErrorRetryHandler sleeps Retry-After + up to 1 s of jitter with no cap.
    """

    def __init__(self, max_retry_count: int, max_wait_s: float):
        super().__init__(max_retry_count=max_retry_count)
        self.max_wait_s = max_wait_s

    def _can_retry(self, *, state, request, response=None, error=None) -> bool:
        return response is not None and response.status_code == 429

    def prepare_for_next_attempt(self, *, state, request, response=None, error=None) -> None:
        wait = 1.0  # Slack always sends Retry-After; this is for proxies that drop it
        for key, values in (response.headers if response is not None else {}).items():
            if key.lower() == "retry-after" and values:
                try:
                    wait = float(values[0] if isinstance(values, list) else values)
                except ValueError:
                    pass
        wait = max(0.0, min(wait, self.max_wait_s))
        log.warning("Slack rate-limited the request; retrying in %.2fs (retry %d of %d)",
                    wait, state.current_attempt + 1, self.max_retry_count)
        state.next_attempt_requested = True
        time.sleep(wait)
        state.increment_current_attempt()


class SlackNotifier:
    """Posts alerts to one channel; `send` returns the message ts so later alerts can thread."""

    # The daemon's signed run links (supervisor.app.service.build_notifier sets them when auth is on).
    links: RunLinks | None = None

    def __init__(self, token: str, channel: str, base_url: str | None = None, retries: int = 3,
                 *, max_retry_wait_s: float = 30.0, timeout_s: float = 10.0,
                 web_base_url: str | None = None, token_source: str = "the token argument",
                 interactive: bool = False, oncall: Sequence[str] = (), escalate_to: Sequence[str] = ()):
        if not token:
            raise NotifyConfigError(f"SlackNotifier needs a bot token; none came from {token_source}")
        if not channel:
            raise NotifyConfigError("SlackNotifier needs a channel (e.g. '#training-alerts' or a channel id)")
        if retries < 0:
            raise NotifyConfigError(f"retries={retries} must be >= 0")
        if base_url and not base_url.endswith("/api/"):
            raise NotifyConfigError(f"Slack base_url={base_url!r} must end with '/api/' (slack-sdk appends the "
                                    "method name to it), e.g. 'http://127.0.0.1:8080/api/'")
        self.channel = channel
        self._channel_id: str | None = None  # chat.update takes the id chat.postMessage answers with
        self.channel_name = f"slack:{channel}"  # the outbox's channel key (supervisor.notify.outbox)
        self.retries = retries
        self.web_base_url = web_base_url.rstrip("/") if web_base_url else None
        self.token_source = token_source
        # Buttons only where a click can be verified and acted on: a signing secret is configured
        # (supervisor.serve.api.slack); without one the commands in the message are the way to answer.
        self.interactive = interactive
        # Who a page is for (issue 37: a CRITICAL approval @-mentioned no one): member ids (U...,
        # W...) and user-group ids (S...), mentioned on every page; an escalation (nobody
        # acknowledged, supervisor.app.jobs.escalate) mentions `escalate_to` as well.
        self.oncall, self.escalate_to = list(oncall), list(escalate_to)
        backoff = BackoffRetryIntervalCalculator(backoff_factor=0.5)
        handlers = [
            ConnectionErrorRetryHandler(max_retry_count=retries, interval_calculator=backoff),
            _RateLimitRetry(max_retry_count=retries, max_wait_s=max_retry_wait_s),
            ServerErrorRetryHandler(max_retry_count=retries, interval_calculator=backoff),
        ]
        kwargs: dict[str, Any] = {"token": token, "timeout": int(max(1, timeout_s)), "retry_handlers": handlers}
        if base_url:
            kwargs["base_url"] = base_url
        self.client = WebClient(**kwargs)

    @classmethod
    def from_config(cls, cfg: SlackSettings, *, environ: Mapping[str, str] | None = None,
                    web_base_url: str | None = None, retries: int = 3) -> "SlackNotifier":
        token, source = resolve_token(cfg.token_env, cfg.token_file, environ)
        secret = resolve_signing_secret(getattr(cfg, "signing_secret_env", ""), getattr(cfg, "signing_secret_file", ""),
                                        environ)
        # Buttons only where someone may click them (supervisor.decide.approvers: closed by default).
        approvers = bool(getattr(cfg, "approvers", None) or getattr(cfg, "approver_groups", None))
        return cls(token, cfg.channel, base_url=cfg.base_url, retries=retries,
                   web_base_url=web_base_url, token_source=source, interactive=secret is not None and approvers,
                   oncall=getattr(cfg, "oncall", ()), escalate_to=getattr(cfg, "escalate_to", ()))

    def check(self) -> dict[str, Any]:
        """auth.test at start-up: who the bot is. A refused token raises NotifyConfigError (the
        daemon must not start and discover it at the first real alert, issue 12); an outage
        raises NotifyError (the daemon may start: alerts wait in the outbox).

        The channel is not checked here: conversations.info takes a channel id, not the
        '#name' a config usually holds, and needs the channels:read scope a bot that only posts
        lacks; a channel the bot is not in is named by the first post's error instead."""
        try:
            return dict(self._call("auth.test", self.client.auth_test).data)
        except NotifyError as exc:
            error = _slack_error(exc)
            if error in _AUTH_ERRORS:
                raise NotifyConfigError(f"Slack refused the bot token at start-up (auth.test: {error}); the token "
                                        f"came from {self.token_source}: put a valid bot token (xoxb-...) there, "
                                        "or empty slack.channel to run without Slack") from exc
            raise

    def send(self, alert: Alert) -> str | None:
        try:
            return self._post(alert)
        except NotifyError as exc:
            if not alert.thread_ts or _slack_error(exc) != "thread_not_found":
                raise
            # The parent was deleted in Slack: retrying cannot help, and the story must not stop.
            log.warning("Slack thread %s is gone; posting %r on its own", alert.thread_ts, alert.title)
            note = "(posted on its own: the thread it belongs to was deleted in Slack)"
            return self._post(dataclasses.replace(alert, thread_ts=None,
                                                  text=f"{alert.text}\n{note}" if alert.text else note))

    def update(self, ts: str, alert: Alert) -> None:
        """Rewrite the message `ts` (a thread's top message) as `alert`, e.g. with its new status.
        chat.update needs the channel's id, which the last chat.postMessage answered with."""
        self._call("chat.update", self.client.chat_update, channel=self._channel_id or self.channel, ts=ts,
                   text=_fallback_text(alert), blocks=self.blocks(alert, mention=False))

    def upload(self, alert: Alert, png: bytes) -> str | None:
        """files_upload_v2 into the alert's thread: files.getUploadURLExternal, the bytes POSTed
        to the URL it answers, then files.completeUploadExternal with channel_id and thread_ts.
        Returns the file's id. completeUploadExternal takes a channel id, which the last
        chat.postMessage answered with (after a restart, before any post: slack.channel, so
        configure the channel by id if charts must survive restarts)."""
        metric = alert.chart.metric if alert.chart is not None else "chart"
        name = f"{alert.run_id}-{metric.replace('/', '_')}.png"
        resp = self._call("files.upload_v2", self.client.files_upload_v2, channel=self._channel_id or self.channel,
                          thread_ts=alert.thread_ts, file=png, filename=name, title=_cut(alert.title, 250),
                          alt_txt=_cut(alert.title, 1000))
        files = resp.get("files") or []
        return files[0].get("id") if files else None

    def _post(self, alert: Alert) -> str | None:
        # reply_broadcast: a failure or a page in a thread is also shown in the channel.
        who = self.mentions(alert)
        resp = self._call("chat.postMessage", self.client.chat_postMessage, channel=self.channel,
                          text=(who + " " if who else "") + _fallback_text(alert), blocks=self.blocks(alert),
                          thread_ts=alert.thread_ts,
                          reply_broadcast=True if alert.thread_ts and alert.broadcast else None,
                          # Slack's unfurler would fetch the run link, and a signed link opens once.
                          unfurl_links=False, unfurl_media=False)
        self._channel_id = resp.get("channel") or self._channel_id
        return resp.get("ts")

    def close(self) -> None:
        pass  # WebClient opens one connection per request; nothing to release

    def _call(self, method: str, fn, **kwargs: Any):
        try:
            return fn(**{k: v for k, v in kwargs.items() if v is not None})
        except SlackApiError as exc:
            error = exc.response.get("error") if isinstance(exc.response.data, dict) else None
            raise NotifyError(self._explain(method, exc), retryable=error not in _MESSAGE_ERRORS) from exc
        except SlackRequestError as exc:  # files_upload_v2: the upload URL answered other than 200
            raise NotifyError(f"Slack {method} failed: {exc}") from exc
        except HTTPError as exc:  # files_upload_v2 POSTs the bytes with urllib, outside the retry handlers
            raise NotifyError(f"Slack {method}: the upload URL answered HTTP {exc.code}; the upload is "
                              "tried again later") from exc
        except OSError as exc:  # URLError, ConnectionError, timeouts: after the retries ran out
            raise NotifyError(f"Slack {method} could not reach {self.client.base_url} after {self.retries} "
                              f"retries: {exc}; check the network or slack.base_url") from exc

    def _explain(self, method: str, exc: SlackApiError) -> str:
        status = exc.response.status_code
        error = exc.response.get("error") if isinstance(exc.response.data, dict) else None
        if status == 429 or error == "ratelimited":
            return (f"Slack {method} is still rate limited (HTTP 429) after {self.retries} retries; the alert "
                    "was not delivered; retry later or send fewer messages")
        if error in _AUTH_ERRORS:
            return (f"Slack rejected the bot token ({error}) from {self.token_source}; put a valid bot token "
                    "(xoxb-...) there")
        if error in _CHANNEL_ERRORS:
            return (f"Slack cannot post to {self.channel} ({error}); invite the bot to the channel "
                    "(/invite @thermowatch) or fix slack.channel")
        return f"Slack {method} failed: HTTP {status}, error {error or exc}"

    def mentions(self, alert: Alert) -> str:
        """Slack's mention syntax for who a page is for: the on-call on a page (a CRITICAL that
        asks a person: not its acknowledge or resolve, not a chart), and the escalation contacts
        too on an escalation. "" for every other alert: a rollback done by itself wakes nobody."""
        if alert.severity is not Severity.CRITICAL or alert.story_state is not None or alert.chart is not None:
            return ""
        ids = self.oncall + [i for i in self.escalate_to if i not in self.oncall] if alert.escalation else self.oncall
        return " ".join(f"<!subteam^{i}>" if i.startswith("S") else f"<@{i}>" for i in ids)

    def blocks(self, alert: Alert, *, mention: bool = True) -> list[dict[str, Any]]:
        """Block Kit (slack_sdk.models.blocks): header, who it is for (`mention`: a page's
        on-call; not when the top message is rewritten), the story's state, finding, reasons,
        fields, the exact commands, Approve / Cancel buttons when interactivity is configured,
        and a context line with the run, incident and a link to the plot."""
        blocks: list[Block] = [HeaderBlock(text=PlainTextObject(
            text=_cut(f"{_EMOJI[alert.severity]} {alert.title}", _HEADER_MAX), emoji=True))]
        who = self.mentions(alert) if mention else ""
        if who:  # ids checked by the config (U..., W..., S...): nothing to escape
            blocks.append(_section(f"for {who}" + (" (escalated: nobody acknowledged)" if alert.escalation else "")))
        if alert.status and not alert.thread_ts:  # a reply says it in its own words
            blocks.append(_section(f"*now:* {_esc(alert.status)}"))
        if alert.text:
            blocks.append(_section(_esc(alert.text)))
        if alert.reasons:
            blocks.append(_section("\n".join(f"\u2022 {_esc(r)}" for r in alert.reasons)))
        fields = [MarkdownTextObject(text=_cut(f"*{_esc(str(k))}*\n{_esc(str(v))}", 2000))
                  for k, v in list(alert.fields.items())[:_FIELDS_MAX]]
        if fields:
            blocks.append(SectionBlock(fields=fields))
        if alert.commands:  # the exact commands, copyable from a phone
            blocks.append(_section("\n".join(f"`{_esc(c)}`" for c in alert.commands)))
        if self.interactive:
            story = alert.thread_key if mention and self.mentions(alert) else None
            buttons = page_buttons(alert.approve_action, story if story and STORY.fullmatch(story) else None)
            if buttons is not None:
                blocks.append(buttons)
        context = [f"run `{_esc(alert.run_id)}`", f"severity {alert.severity.value}"]
        if alert.incident_id is not None:
            context.append(f"incident {alert.incident_id}")
        if alert.fold_count:
            context.append(f"repeat {alert.fold_count} of a flapping signal")
        url = self.plot_url(alert)
        if url:
            context.append(f"<{url}|thermometer plot>")
        blocks.append(ContextBlock(elements=[MarkdownTextObject(text=" \u00b7 ".join(context))]))
        return [b.to_dict() for b in blocks]

    def plot_url(self, alert: Alert) -> str | None:
        return run_url(self.web_base_url, alert, self.links, self.channel_name)


class SlackGroupMembers:
    """thermowatch.supervisor.decide.approvers.GroupMembers over usergroups.users.list (bot scope usergroups:read).
    One try with a short timeout and no retries: Slack waits 3 s for the answer to a click, and
    a group that cannot be read refuses the click (closed), which the clicker may simply repeat."""

    def __init__(self, token: str, base_url: str | None = None, *, timeout_s: int = 2):
        kwargs: dict[str, Any] = {"token": token, "timeout": timeout_s, "retry_handlers": []}
        if base_url:
            kwargs["base_url"] = base_url
        self.client = WebClient(**kwargs)

    def __call__(self, group_id: str) -> list[str]:
        try:
            resp = self.client.usergroups_users_list(usergroup=group_id)
        except SlackApiError as exc:
            error = exc.response.get("error") if isinstance(exc.response.data, dict) else None
            if exc.response.status_code == 200 and error != "ratelimited":  # Slack's answer about the question
                raise NotifyConfigError(f"Slack refused to list the user group {group_id} ({error}); check the id "
                                        "(S...) and that the bot has the usergroups:read scope") from exc
            raise NotifyError(f"Slack usergroups.users.list {group_id}: HTTP {exc.response.status_code}, "
                              f"error {error}") from exc
        except OSError as exc:
            raise NotifyError(f"Slack usergroups.users.list {group_id} could not reach {self.client.base_url}: "
                              f"{exc}") from exc
        users = resp.get("users")
        if not isinstance(users, list) or not all(isinstance(u, str) for u in users):
            raise NotifyError(f"Slack usergroups.users.list {group_id} answered no list of user ids")
        return users


def _slack_error(exc: NotifyError) -> str | None:
    """Slack's error code behind a NotifyError from `_call` ("invalid_auth"), if Slack answered."""
    cause = exc.__cause__
    if isinstance(cause, SlackApiError) and isinstance(cause.response.data, dict):
        return cause.response.get("error")
    return None


def _fallback_text(alert: Alert) -> str:
    # Shown in notifications and by clients that cannot render blocks. Slack parses it like
    # mrkdwn, so it is escaped as the blocks are: a run id `<!channel>` paged a whole channel
    # from here while the blocks showed it as text (issue 34).
    return _esc(f"[{alert.severity.value.upper()}] {alert.title}" + (f": {alert.text}" if alert.text else ""))


def _section(text: str) -> SectionBlock:
    return SectionBlock(text=MarkdownTextObject(text=_cut(text, _SECTION_MAX)))


# A story a person can acknowledge (Executor.acknowledge_page): an incident's or an action's.
STORY = re.compile(r"(incident|action):[0-9]{1,9}")


def page_buttons(action_id: int | None, story: str | None) -> ActionsBlock | None:
    """Approve / Cancel for an action awaiting approval, and Acknowledge for a page (`story`:
    "incident:42"), which stops its escalation. Slack posts a click to the interactivity URL
    (supervisor.serve.api.slack), which checks the signature and acts as the Slack user."""
    elements = approval_buttons(action_id).elements if action_id is not None else []
    if story is not None:
        elements.append(ButtonElement(text="Acknowledge", action_id=ACK, value=story))
    if not elements:
        return None
    return ActionsBlock(block_id=f"page:{action_id or ''}:{story or ''}", elements=elements)


def approval_buttons(action_id: int) -> ActionsBlock:
    """Approve / Cancel for one action."""
    return ActionsBlock(block_id=f"approval:{action_id}", elements=[
        ButtonElement(text="Approve", action_id=APPROVE, value=str(action_id), style="primary",
                      confirm=ConfirmObject(title="Approve?", text=f"Send action {action_id} to the trainer.",
                                            confirm="Approve", deny="Back")),
        ButtonElement(text="Cancel", action_id=CANCEL, value=str(action_id), style="danger",
                      confirm=ConfirmObject(title="Cancel?", text=f"Cancel action {action_id}; the trainer "
                                            "never gets it.", confirm="Cancel it", deny="Back")),
    ])


def _esc(text: str) -> str:
    # Slack mrkdwn control characters (api.slack.com/reference/surfaces/formatting#escaping).
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"
