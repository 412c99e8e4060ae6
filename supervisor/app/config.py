"""The daemon's configuration: one dataclass, read from a YAML file and the environment.

A YAML file lists only what differs from these defaults. Environment variables win over the
file (`THERMOWATCH_DB_URL`, `THERMOWATCH_DATA_DIR`, `THERMOWATCH_HOST`, `THERMOWATCH_PORT`,
`THERMOWATCH_SLACK_CHANNEL`, `THERMOWATCH_ADVISE_ONLY`, `THERMOWATCH_API_TOKEN`,
`THERMOWATCH_API_TOKEN_FILE`, `THERMOWATCH_DB_URL_FILE`, `THERMOWATCH_SLACK_TOKEN_FILE`,
`THERMOWATCH_SLACK_SIGNING_SECRET_FILE`, `THERMOWATCH_PAGERDUTY_ROUTING_KEY_FILE`,
`THERMOWATCH_WEBHOOK_SECRET_FILE`, `THERMOWATCH_SMTP_PASSWORD_FILE`), so a systemd unit or a Kubernetes
secret can override one field without a file.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from thermowatch.monitors.config_tree import ConfigTreeError, check_tree
from thermowatch.monitors.contract import Severity
from thermowatch.monitors.detectors import BankConfig
from thermowatch.monitors.envelope import EnvelopeConfig
from thermowatch.monitors.settings import SettingError, check_number, parse_bool, parse_number
from thermowatch.supervisor.decide.policy import PolicyConfig
from thermowatch.supervisor.errors import UserError
from thermowatch.supervisor.limits import Limits

if TYPE_CHECKING:
    from thermowatch.supervisor.notify.flap import FlapConfig


# The environment's booleans, read by monitors.settings.parse_bool (its accepted words are in
# docs/configuration.md's settings table): field -> variable.
_BOOLEAN_ENV = {"advise_only": "THERMOWATCH_ADVISE_ONLY"}
# The top-level numbers and their ranges (monitors.settings.check_number); the sections' numbers
# are checked by their own classes, every float of them finite by the config tree walk.
_NUMBERS: dict[str, dict[str, Any]] = {
    "port": dict(lo=1, hi=65535, integer=True),
    "ack_timeout_s": dict(lo=0, lo_open=True),  # seconds before an unacknowledged command is retried
    "ack_retries": dict(lo=0, hi=100, integer=True),  # 0: fail at the first timeout
    "command_expiry_s": dict(lo=0, lo_open=True),
    "redeliver_s": dict(lo=0, lo_open=True),  # seconds before a sent, unacknowledged command goes out again
    "max_body_bytes": dict(lo=1, integer=True),  # an ingest body; 413 above it
    "pause_repage_s": dict(lo=0, lo_open=True),  # seconds a run waits paused before it pages again
    "link_ttl_s": dict(lo=0, lo_open=True, hi=86400),  # an alert's signed link; a day at most: it sits in a channel
    "escalate_after_s": dict(lo=0),  # a page nobody acknowledged by then escalates; 0: never
    "lease_ttl_s": dict(lo=1, hi=300),  # the leader's lease (supervisor.app.lease); standbys take over past it
}


class ConfigError(UserError):
    """A configuration value that cannot work. The message names the field and the fix."""


@dataclass
class SlackConfig:
    channel: str = ""  # empty: no Slack, console alerts only (the embedded default)
    token_env: str = "SLACK_BOT_TOKEN"  # a bot token never lives in a config file
    token_file: str = ""  # or a mounted secret file (Kubernetes)
    base_url: str | None = None  # only tests point this at a local fake of the Slack API
    # Interactivity (Approve / Cancel buttons): the Slack app's signing secret, from the
    # environment or a mounted file; unset means no buttons and POST /api/slack/interactions 404s.
    signing_secret_env: str = "SLACK_SIGNING_SECRET"
    signing_secret_file: str = ""
    # Who may click them (supervisor.decide.approvers; issue 21: Slack's signature admits any workspace
    # member). Closed by default: none listed, no buttons, and a click is refused with 403.
    approvers: list[str] = field(default_factory=list)  # Slack member ids, U... (ids: names change)
    approver_groups: list[str] = field(default_factory=list)  # user-group ids, S...; bot scope usergroups:read
    approver_groups_ttl_s: float = 60.0  # a member removed from a group may still approve for this long
    # Who a page is for (issue 37): mentioned on every CRITICAL; `escalate_to` as well when a page
    # escalates (nobody acknowledged it within escalate_after_s). Member ids (U..., W...) and
    # user-group ids (S...: the on-call rotation's group).
    oncall: list[str] = field(default_factory=list)
    escalate_to: list[str] = field(default_factory=list)
    # Flap damping (supervisor.notify.flap), for every channel: after this many threads for one
    # (run, signal, module) within flap_window_s, later incidents of it are counted replies there.
    flap_max_alerts: int = 3
    flap_window_s: float = 1800.0

    def __post_init__(self) -> None:
        from thermowatch.supervisor.decide.approvers import GROUP_ID, USER_ID

        anyone = re.compile(f"{USER_ID.pattern}|{GROUP_ID.pattern}")
        for name, pattern, what in (("approvers", USER_ID, "a Slack member id (U... or W...; a profile's "
                                                             "\u22ee menu, 'Copy member ID'), not a name"),
                                    ("approver_groups", GROUP_ID, "a Slack user-group id (S...; the group's "
                                                                  "page in Slack, or usergroups.list)"),
                                    ("oncall", anyone, "a Slack member id (U..., W...) or user-group id (S...), "
                                                       "not a name"),
                                    ("escalate_to", anyone, "a Slack member id (U..., W...) or user-group id "
                                                            "(S...), not a name")):
            ids = getattr(self, name)
            if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)):
                raise ConfigError(f"slack.{name} must be a list of ids, got {ids!r}")
            for i, v in enumerate(ids):
                if not isinstance(v, str) or not pattern.fullmatch(v):
                    raise ConfigError(f"slack.{name}[{i}]: {v!r} is not {what}")
            setattr(self, name, list(ids))
        ttl = self.approver_groups_ttl_s
        if isinstance(ttl, bool) or not isinstance(ttl, (int, float)) or not 0 < ttl <= 3600:
            raise ConfigError(f"slack.approver_groups_ttl_s must be in (0, 3600] seconds, got {ttl!r}")

    def flap(self) -> "FlapConfig":
        from thermowatch.supervisor.notify.flap import FlapConfig

        return FlapConfig(self.flap_max_alerts, self.flap_window_s)


def _check_timeout(section: str, value: Any) -> None:
    # A receiver that hangs holds up only its own channel's sender (supervisor.notify.outbox), but
    # for this long per try; two minutes is longer than any pager answers.
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 120:
        raise ConfigError(f"{section}.timeout_s must be in (0, 120] seconds, got {value!r}")


def _check_url(key: str, url: Any) -> None:
    from thermowatch.supervisor.notify.paging import check_url

    try:
        check_url(key, url)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


@dataclass
class PagerDutyConfig:
    """Pages through PagerDuty's Events API v2 (supervisor.notify.pagerduty): critical alerts
    trigger, an approval acknowledges, the incident's end resolves. On when a routing key source
    is named; the key itself never lives in a config file."""

    routing_key_env: str = ""  # e.g. PAGERDUTY_ROUTING_KEY; empty with routing_key_file empty: off
    routing_key_file: str = ""  # or a mounted secret file (wins over the variable)
    base_url: str = "https://events.pagerduty.com"  # EU service region: https://events.eu.pagerduty.com
    timeout_s: float = 10.0  # one try; the outbox retries with its backoff

    def __post_init__(self) -> None:
        _check_url("pagerduty.base_url", self.base_url)
        _check_timeout("pagerduty", self.timeout_s)

    @property
    def enabled(self) -> bool:
        return bool(self.routing_key_env or self.routing_key_file)


@dataclass
class WebhookConfig:
    """A signed JSON POST per page to any receiver (supervisor.notify.webhook)."""

    url: str = ""  # empty: no webhook
    secret_env: str = "THERMOWATCH_WEBHOOK_SECRET"  # the HMAC key; never in a config file
    secret_file: str = ""  # or a mounted secret file (wins over the variable)
    # The least severity that triggers: critical pages only for what needs a person, as PagerDuty.
    min_severity: Severity = Severity.CRITICAL
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        if self.url:
            _check_url("webhook.url", self.url)
        try:
            self.min_severity = Severity(self.min_severity)
        except ValueError:
            raise ConfigError(f"webhook.min_severity must be one of {', '.join(s.value for s in Severity)}, "
                              f"got {self.min_severity!r}") from None
        _check_timeout("webhook", self.timeout_s)


@dataclass
class EmailConfig:
    """Pages by email over SMTP (supervisor.notify.email): what pages on PagerDuty is mailed to
    `to`; an escalation to `escalate_to` as well. On when `host` is set."""

    host: str = ""  # empty: no email
    port: int = 587
    security: str = "starttls"  # starttls (587), ssl (SMTPS, 465) or none (a relay on loopback)
    from_addr: str = ""  # e.g. thermowatch@example.com
    to: list[str] = field(default_factory=list)  # the on-call's addresses (a list, a mail-to-SMS gateway)
    escalate_to: list[str] = field(default_factory=list)
    username: str = ""  # empty: no login (a relay that trusts the host)
    password_env: str = "THERMOWATCH_SMTP_PASSWORD"  # never in a config file
    password_file: str = ""  # or a mounted secret file (wins over the variable)
    min_severity: Severity = Severity.CRITICAL
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        try:
            check_number("email.port", self.port, lo=1, hi=65535, integer=True)
        except SettingError as exc:
            raise ConfigError(str(exc)) from None
        _check_timeout("email", self.timeout_s)
        if not self.host:
            return
        if self.security not in ("starttls", "ssl", "none"):
            raise ConfigError(f"email.security must be starttls, ssl or none, got {self.security!r}")
        for name in ("to", "escalate_to"):
            addrs = getattr(self, name)
            if isinstance(addrs, (str, bytes)) or not isinstance(addrs, (list, tuple)):
                raise ConfigError(f"email.{name} must be a list of addresses, got {addrs!r}")
            for i, a in enumerate(addrs):
                if not isinstance(a, str) or not _ADDRESS.fullmatch(a):
                    raise ConfigError(f"email.{name}[{i}]: {a!r} is not an email address (name@host)")
            setattr(self, name, list(addrs))
        if not self.to:
            raise ConfigError("email.to: list at least one address to page (email.host is set)")
        if not isinstance(self.from_addr, str) or not _ADDRESS.fullmatch(self.from_addr):
            raise ConfigError(f"email.from_addr must be the sender's address (name@host), got {self.from_addr!r}")
        try:
            self.min_severity = Severity(self.min_severity)
        except ValueError:
            raise ConfigError(f"email.min_severity must be one of {', '.join(s.value for s in Severity)}, "
                              f"got {self.min_severity!r}") from None


_ADDRESS = re.compile(r"[^@\s<>,;\"]+@[^@\s<>,;\"]+")  # one plain address: no display name, no list


@dataclass
class SupervisorConfig:
    data_dir: Path = Path(".thermowatch")
    # SQLite in the data dir is the embedded default; PostgreSQL by URL at scale.
    db_url: str = ""
    host: str = "127.0.0.1"  # never listen on all interfaces by default: the API can roll runs back
    port: int = 8765
    # Auth is on by default (supervisor.serve.auth): every route but /healthz needs a scoped token.
    # `auth: false` is a loopback-only escape hatch for a laptop; serve refuses it on any other host.
    auth: bool = True
    public_read: bool = False  # true: read routes and the web page need no token (operate/ingest still do)
    # An admin token provided up front (scripts, tests, a Kubernetes secret), accepted as the actor
    # "config-admin" and never stored. Prefer the file (systemd LoadCredential=) over the env var.
    api_token: str = ""
    api_token_file: str = ""
    public_url: str = ""  # where the web page is reachable, for links in alerts
    # With `public_url` and auth on, an alert's link signs its reader in to that run's page, to read
    # it only, once, for this long (supervisor.notify.link_grants; issue 37: a phone got the sign-in
    # page and a 46-character token to paste). An hour: the first responder to a page opens it within
    # minutes, and an escalation round or a phone left on silent still finds it valid; a link read
    # later in the channel's history has gone stale, and a token signs in then.
    link_ttl_s: float = 3600.0
    # The team's copy of docs/operations.md: every alert about a signal links its row there
    # (`<runbook_url>#<signal>`), beside the row's "what to do" it always carries (issue 37).
    runbook_url: str = ""
    advise_only: bool = False  # every action waits for a human's approval
    ack_timeout_s: float = 120.0  # a command not acknowledged by then is retried, then failed
    ack_retries: int = 2
    # A command sent and not acknowledged is in the run's poll answers again this long after it
    # last went out (the answer may have been lost); the trainer carries it out once.
    redeliver_s: float = 5.0
    # An open command of a run that has not polled for this long expires (it could never be
    # carried out; `--wait` returns); a finished run's commands expire at once.
    command_expiry_s: float = 900.0
    # A run paused (by the policy or a person) for this long pages again, then once per this long
    # until it is resumed, rolled back, stopped or finished (supervisor.app.jobs.pause_repage; issue
    # 35: a paused run waited 9 minutes until someone happened to look). Half an hour: whoever is
    # already on it is not paged over and over; whoever missed the first page hears again while
    # the idle cluster has cost little.
    pause_repage_s: float = 1800.0
    # A page (a CRITICAL: an approval, a pause, a failure) nobody acknowledged (`thermowatch ack`,
    # approve, the Slack button) within this long escalates once: Slack mentions
    # slack.escalate_to, the webhook and email say escalation 1 (supervisor.app.jobs.escalate).
    # PagerDuty escalates by its own escalation policy until it gets the acknowledge. 0: never.
    escalate_after_s: float = 900.0
    # Several replicas on one PostgreSQL database (supervisor.app.lease, issue 40): the leader
    # renews its lease every quarter of this; a standby leads once it has run out. Shorter: a
    # faster takeover, more renewals (one small UPDATE each); a leader that cannot renew for
    # three quarters of it steps down by itself.
    lease_ttl_s: float = 6.0
    max_body_bytes: int = 64 << 20  # ingest batches above this are refused with 413
    # The daemon's detectors run in a process of their own (supervisor.judge.bank_process), so judging
    # never competes with storing for the interpreter lock; false: a thread in the daemon's process.
    judge_process: bool = True
    slack: SlackConfig = field(default_factory=SlackConfig)
    pagerduty: PagerDutyConfig = field(default_factory=PagerDutyConfig)  # paging beside Slack (issue 37)
    webhook: WebhookConfig = field(default_factory=WebhookConfig)
    email: EmailConfig = field(default_factory=EmailConfig)  # pages by SMTP (issue 37)
    # The sections below are typed; a YAML file (or a caller) gives each as a mapping of the fields
    # that differ, checked key by key (config_tree) and built once at load, so a value out of range
    # stops `serve` at start-up, naming the section.
    policy: PolicyConfig = field(default_factory=PolicyConfig)  # `advise_only` above folded in
    detectors: BankConfig = field(default_factory=BankConfig)
    limits: Limits = field(default_factory=Limits)  # supervisor.limits
    # The peer envelope (loss_behind_peers; supervisor/app/jobs.py and the run page)
    envelope: EnvelopeConfig = field(default_factory=EnvelopeConfig)

    def __post_init__(self) -> None:
        # The sections a person writes by hand: one message naming the dotted path of a typo
        # anywhere under them (issue 12), before any class below sees the value.
        for name in ("slack", "pagerduty", "webhook", "email", "policy", "detectors", "limits", "envelope"):
            try:
                check_tree(type(self), {name: getattr(self, name)})
            except ConfigTreeError as exc:
                raise ConfigError(str(exc)) from None
        self.data_dir = Path(self.data_dir)
        if not self.db_url:
            self.db_url = f"sqlite:///{(self.data_dir / 'thermowatch.db').resolve()}"
        # Every number at the top level, with one check (monitors.settings): finite, of its kind,
        # in range. Before issue 34, max_body_bytes: -1 and ack_retries: -3 passed, as did
        # ack_timeout_s: .inf (a command never retried).
        try:
            for name, kw in _NUMBERS.items():
                check_number(name, getattr(self, name), **kw)
        except SettingError as exc:
            raise ConfigError(str(exc)) from None
        if self.api_token_file and not self.api_token:
            try:
                self.api_token = Path(self.api_token_file).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"api_token_file: cannot read {self.api_token_file} ({exc.strerror}); check the path "
                                  f"and that the daemon's user may read it") from None
            if not self.api_token:
                raise ConfigError(f"api_token_file: {self.api_token_file} is empty; write the admin token into it")
        for name in ("auth", "public_read", "judge_process"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if isinstance(self.slack, Mapping):
            self.slack = SlackConfig(**self.slack)
        if isinstance(self.pagerduty, Mapping):
            self.pagerduty = PagerDutyConfig(**self.pagerduty)
        if isinstance(self.webhook, Mapping):
            self.webhook = WebhookConfig(**self.webhook)
        if isinstance(self.email, Mapping):
            self.email = EmailConfig(**self.email)
        try:
            self.slack.flap()
        except UserError as exc:
            raise ConfigError(str(exc)) from None
        self._build_sections()

    def _build_sections(self) -> None:
        """Each typed section from the mapping given for it (its fields that differ), once; a
        section given built is taken as it is."""
        built_policy = isinstance(self.policy, PolicyConfig)
        for name, cls, build in (
                ("limits", Limits, Limits.from_dict), ("detectors", BankConfig, BankConfig.from_dict),
                # a mapping's own advise_only wins over the top level's
                ("policy", PolicyConfig, lambda d: PolicyConfig(**{"advise_only": self.advise_only, **d})),
                ("envelope", EnvelopeConfig, lambda d: EnvelopeConfig(**d))):
            value = getattr(self, name)
            if not isinstance(value, cls):
                try:
                    setattr(self, name, build(value))
                except (TypeError, ValueError, UserError) as exc:
                    raise ConfigError(f"{name}: {exc}") from None
        if built_policy and self.advise_only and not self.policy.advise_only:
            self.policy = dataclasses.replace(self.policy, advise_only=True)

    @classmethod
    def load(cls, path: str | Path | None = None, env: Mapping[str, str] | None = None, **overrides: Any) -> "SupervisorConfig":
        """Defaults <- YAML file <- environment <- explicit overrides (CLI flags)."""
        values: dict[str, Any] = {}
        if path:
            values.update(read_mapping(Path(path)))
        env = os.environ if env is None else env
        for name, key in (("db_url", "THERMOWATCH_DB_URL"), ("data_dir", "THERMOWATCH_DATA_DIR"),
                          ("host", "THERMOWATCH_HOST"),
                          ("api_token", "THERMOWATCH_API_TOKEN"), ("api_token_file", "THERMOWATCH_API_TOKEN_FILE")):
            if env.get(key):
                values[name] = env[key]
        if env.get("THERMOWATCH_DB_URL_FILE") and not env.get("THERMOWATCH_DB_URL"):
            # A URL with a password is a secret: systemd's LoadCredential= hands it over as a file.
            path = env["THERMOWATCH_DB_URL_FILE"]
            try:
                values["db_url"] = Path(path).read_text().strip()
            except OSError as exc:
                raise ConfigError(f"THERMOWATCH_DB_URL_FILE: cannot read {path} ({exc.strerror})") from None
        try:
            for name, key in _BOOLEAN_ENV.items():
                if env.get(key):  # set but empty: not set, as for the other variables
                    values[name] = parse_bool(key, env[key])  # "enabled" is refused, never read as false
            if env.get("THERMOWATCH_PORT"):
                values["port"] = parse_number("THERMOWATCH_PORT", env["THERMOWATCH_PORT"], **_NUMBERS["port"])
        except SettingError as exc:
            raise ConfigError(str(exc)) from None
        for slack_key, env_key in (("channel", "THERMOWATCH_SLACK_CHANNEL"), ("token_file", "THERMOWATCH_SLACK_TOKEN_FILE"),
                                   ("signing_secret_file", "THERMOWATCH_SLACK_SIGNING_SECRET_FILE")):
            if env.get(env_key):  # the token file: systemd's LoadCredential= (deploy/thermowatch.service)
                values["slack"] = {**dict(values.get("slack") or {}), slack_key: env[env_key]}
        for section, key, env_key in (("pagerduty", "routing_key_file", "THERMOWATCH_PAGERDUTY_ROUTING_KEY_FILE"),
                                      ("webhook", "secret_file", "THERMOWATCH_WEBHOOK_SECRET_FILE"),
                                      ("email", "password_file", "THERMOWATCH_SMTP_PASSWORD_FILE")):
            if env.get(env_key):  # systemd's LoadCredential=, a Kubernetes secret mounted as a file
                values[section] = {**dict(values.get(section) or {}), key: env[env_key]}
        values.update({k: v for k, v in overrides.items() if v is not None})
        try:
            check_tree(cls, values)
        except ConfigTreeError as exc:
            where = f"{path}: " if path else ""
            raise ConfigError(f"{where}{exc}") from None
        try:
            return cls(**values)
        except ConfigError as exc:  # a range the class checks: name the file too, as the walk does
            raise ConfigError(f"{path}: {exc}" if path else str(exc)) from None


def read_mapping(path: Path) -> dict[str, Any]:
    """A YAML (or JSON: a subset of YAML) file holding a mapping of settings."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text()) or {}
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: no such file") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, got {type(data).__name__}")
    return data


def judged_with(bank: "BankConfig") -> dict[str, float]:
    """The thresholds a run page draws, as a daemon with these detector settings judges them:
    written into each attempt's audit row when it opens (Ingestor), read back by the run's events."""
    attn = bank.attn
    return {"attn_ceiling": attn.ceiling, "attn_lse_ceiling": attn.ceiling + attn.lse_ceiling_offset}
