"""Pages by email (SMTP, the standard library's smtplib): for a team whose pager is a mailbox, a
mail-to-SMS gateway or an Opsgenie/PagerDuty email integration.

The same alerts page here as on the other paging channels (supervisor.notify.paging): a CRITICAL
is a mail to `email.to`; its escalation (supervisor.app.jobs.escalate) goes to `email.to` and
`email.escalate_to`; the acknowledge and the resolve of a story mailed here follow it. One story
is one conversation in a mail client: every mail of it carries `References` to the story's root
Message-ID (made from its dedup key), and the first page is that root.

One connection and one try per send: the outbox keeps a row pending with its backoff when the
server is unreachable, refuses the login, or answers 4xx (greylisting, a full queue), and marks it
failed when the server refuses the message itself for good (a 5xx to DATA: too large, rejected as
spam). The password comes from an environment variable or a mounted file, never the config file.
"""

from __future__ import annotations

import hashlib
import logging
import smtplib
import ssl
from email.message import EmailMessage
from email.utils import formatdate, make_msgid
from typing import Any, Callable, Mapping, Protocol, Sequence

from thermowatch.monitors.contract import Severity
from thermowatch.supervisor.notify import paging
from thermowatch.supervisor.notify.base import Alert, NotifyConfigError, NotifyError
from thermowatch.supervisor.notify.paging import PageEvent

log = logging.getLogger(__name__)

_SUBJECT_MAX = 200
_DOMAIN = "thermowatch"  # the right-hand side of the Message-IDs it makes


class EmailSettings(Protocol):
    """What from_config reads; supervisor.app.config.EmailConfig has these fields."""

    host: str
    port: int
    security: str
    from_addr: str
    to: Sequence[str]
    escalate_to: Sequence[str]
    username: str
    password_env: str
    password_file: str
    min_severity: Severity
    timeout_s: float


class EmailNotifier:
    """One SMTP server and its recipients; the outbox's channel `email`."""

    channel_name = "email"
    links: paging.RunLinks | None = None  # signed run links (supervisor.app.service.build_notifier)

    def __init__(self, host: str, port: int, from_addr: str, to: Sequence[str], *, escalate_to: Sequence[str] = (),
                 security: str = "starttls", username: str = "", password: str = "",
                 min_severity: Severity = Severity.CRITICAL, web_base_url: str | None = None, timeout_s: float = 10.0,
                 password_source: str = "", connect: Callable[..., smtplib.SMTP] | None = None):
        if not host or not to or not from_addr:
            raise NotifyConfigError("email needs email.host, email.from_addr and at least one address in email.to")
        if security not in ("starttls", "ssl", "none"):
            raise NotifyConfigError(f"email.security must be starttls, ssl or none, got {security!r}")
        self.host, self.port, self.from_addr = host, port, from_addr
        self.to, self.escalate_to = list(to), [a for a in escalate_to if a not in to]
        self.security, self.username, self._password = security, username, password
        self.password_source = password_source
        self.min_severity = min_severity
        self.web_base_url = web_base_url
        self.timeout_s = timeout_s

    @classmethod
    def from_config(cls, cfg: EmailSettings, *, environ: Mapping[str, str] | None = None,
                    web_base_url: str | None = None) -> "EmailNotifier":
        password, source = "", ""
        if cfg.username:
            password, source = paging.resolve_secret("email", "password", "password_env", cfg.password_env,
                                                     "password_file", cfg.password_file,
                                                     "the SMTP password of email.username", environ)
        return cls(cfg.host, cfg.port, cfg.from_addr, cfg.to, escalate_to=cfg.escalate_to, security=cfg.security,
                   username=cfg.username, password=password, min_severity=cfg.min_severity,
                   web_base_url=web_base_url, timeout_s=cfg.timeout_s, password_source=source)

    def wants(self, alert: Alert, paged: Callable[[], bool]) -> bool:
        """The pages (paging.wants), their escalation, and the acknowledge / resolve of a story mailed here."""
        return paging.wants(alert, paged, self.min_severity)

    def message(self, alert: Alert) -> EmailMessage:
        """The mail for `alert`: subject, recipients, the story's threading headers, a plain-text body."""
        event = paging.page_event(alert, self.min_severity) or PageEvent.TRIGGER
        key = paging.dedup_key(alert)
        root = f"<{hashlib.sha256(key.encode()).hexdigest()[:32]}@{_DOMAIN}>"
        word = {PageEvent.ACKNOWLEDGE: "ACKNOWLEDGED", PageEvent.RESOLVE: "RESOLVED"}.get(
            event, "ESCALATED" if alert.escalation else alert.severity.value.upper())
        msg = EmailMessage()
        msg["Subject"] = _cut(f"[thermowatch {word}] {alert.title}", _SUBJECT_MAX)
        msg["From"] = self.from_addr
        msg["To"] = ", ".join(self.to + (self.escalate_to if alert.escalation else []))
        msg["Date"] = formatdate(localtime=False)
        first = event is PageEvent.TRIGGER and not alert.escalation
        msg["Message-ID"] = root if first else make_msgid(domain=_DOMAIN)
        if not first:
            msg["In-Reply-To"] = root
            msg["References"] = root
        msg["X-Thermowatch-Dedup-Key"] = key
        msg["X-Thermowatch-Event"] = event.value
        msg.set_content(self._body(alert, event))
        return msg

    def _body(self, alert: Alert, event: PageEvent) -> str:
        lines = [alert.title, ""]
        if alert.status:
            lines += [f"now: {alert.status}", ""]
        if alert.text:
            lines += [alert.text, ""]
        lines += [f"- {r}" for r in alert.reasons]
        lines += [f"{k}: {v}" for k, v in alert.fields.items()]
        if alert.commands:
            lines += ["", "commands:"] + [f"    {c}" for c in alert.commands]
        url = paging.run_url(self.web_base_url, alert, self.links, self.channel_name)
        if url:
            lines += ["", f"the run: {url}"]
        lines += ["", f"run {alert.run_id}" + (f", incident {alert.incident_id}" if alert.incident_id is not None else "")
                  + f", {event.value}" + (f", escalation {alert.escalation}" if alert.escalation else "")]
        return "\n".join(lines).strip() + "\n"

    def send(self, alert: Alert) -> str | None:
        msg = self.message(alert)
        where = f"{self.host}:{self.port}"
        try:
            with self._connect() as smtp:
                if self.username:
                    smtp.login(self.username, self._password)
                refused = smtp.send_message(msg)
        except smtplib.SMTPAuthenticationError as exc:
            raise NotifyError(f"email: {where} refused the login of {self.username} ({exc.smtp_code}); check "
                              f"email.username and the password from {self.password_source}; the alert is kept") from exc
        except smtplib.SMTPRecipientsRefused as exc:
            raise NotifyError(f"email: {where} refused every recipient ({_codes(exc.recipients)}); fix email.to",
                              retryable=_temporary(exc.recipients)) from exc
        except smtplib.SMTPResponseException as exc:  # MAIL, DATA: the server's answer to this message
            retryable = 400 <= exc.smtp_code < 500
            raise NotifyError(f"email: {where} answered {exc.smtp_code} ({_said(exc.smtp_error)}); "
                              + ("tried again later" if retryable else "this alert is not sent again"),
                              retryable=retryable) from exc
        except (smtplib.SMTPException, OSError) as exc:  # unreachable, dropped, TLS failed
            raise NotifyError(f"email could not reach {where}: {type(exc).__name__}: {exc}; tried again later") from exc
        if refused:  # some recipients took it: it is sent; the others are named in the log
            log.warning("email for run %s: %s refused %s", alert.run_id, where, _codes(refused))
        log.info("email %s %s for run %s", msg["X-Thermowatch-Event"], msg["X-Thermowatch-Dedup-Key"], alert.run_id)
        return paging.message_id(paging.dedup_key(alert))

    def _connect(self) -> smtplib.SMTP:
        if self.security == "ssl":
            return smtplib.SMTP_SSL(self.host, self.port, timeout=self.timeout_s, context=ssl.create_default_context())
        smtp = smtplib.SMTP(self.host, self.port, timeout=self.timeout_s)
        if self.security == "starttls":
            try:
                smtp.starttls(context=ssl.create_default_context())
            except BaseException:
                smtp.close()
                raise
        return smtp

    def check(self) -> dict[str, Any]:
        """No connection at start-up (a server down now must not stop the daemon; the outbox waits).
        Says where mail goes (`/healthz`)."""
        return {"smtp": f"{self.host}:{self.port} ({self.security})", "to": self.to, "escalate_to": self.escalate_to,
                "min_severity": self.min_severity.value}

    def close(self) -> None:
        pass  # one connection per send


def _cut(text: str, limit: int) -> str:
    text = " ".join(text.split())  # a header is one line
    return text if len(text) <= limit else text[: limit - 1] + "\u2026"


def _said(raw: bytes | str) -> str:
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    return " ".join(text.split())[:200]


def _codes(recipients: Mapping[str, tuple[int, bytes]]) -> str:
    return ", ".join(f"{addr}: {code} {_said(said)}" for addr, (code, said) in recipients.items())


def _temporary(recipients: Mapping[str, tuple[int, bytes]]) -> bool:
    return any(400 <= code < 500 for code, _ in recipients.values())
