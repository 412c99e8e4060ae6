"""Who may call the daemon (DESIGN.md, "Closed by default"): scopes, the configured token, the
first-start admin token, and the rule against an open daemon on a network.

Plain Python (no FastAPI): supervisor.serve.guard turns a request into a secret and asks this
module who holds it.

Scopes:
    ingest   the trainer: open runs, and write only the runs it opened (steps, checkpoints, deletions,
             the finished report, command polls, acks); a run prefix given at creation bounds the
             names of the runs it may open
    read     runs, history, incidents, actions, audit, the web page and its plots
    operate  manual commands, approve, cancel; implies `read` (an operator acts on what they see)
    admin    create, list and revoke tokens; implies every scope
`ingest` implies nothing else: a trainer's token, copied onto every GPU node, cannot read other
runs' history or issue commands, nor write into them (issue 33: else a token made for team B
could post a NaN step into team A's run and make the supervisor roll it back). A run's owner is
the token that opened it (`runs.created_by`, by token name: names are never reused); `admin` keeps
its reach over every run, and `operate` acts on any run through its own routes.

A link from an alert (supervisor.notify.link_grants) signs its opener in as a principal bound to
that run (`Principal.run_id`): `read` only, and only the routes of that run (Guard.check).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy.orm import sessionmaker

from thermowatch.supervisor.app.config import ConfigError, SupervisorConfig
from thermowatch.supervisor.errors import Forbidden
from thermowatch.supervisor.notify.link_grants import SCOPE as LINK_SCOPE
from thermowatch.supervisor.notify.link_grants import SESSION_PREFIX, LinkGrants
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import tokens as tokens_store

log = logging.getLogger(__name__)

IMPLIES = {
    "ingest": frozenset({"ingest"}),
    "read": frozenset({"read"}),
    "operate": frozenset({"operate", "read"}),
    "admin": frozenset(tokens_store.SCOPES),
}
CONFIG_TOKEN_NAME = "config-admin"  # the actor name of THERMOWATCH_API_TOKEN / api_token_file
BOOTSTRAP_TOKEN_NAME = "bootstrap-admin"
BOOTSTRAP_FILE = "admin-token"  # in the data dir, mode 0600
_OWNERS_KEPT = 100_000  # run owners kept in memory (~10 MB at most), then read again


@dataclass(frozen=True, slots=True)
class Principal:
    """The authenticated caller: its token's name is the actor in action and audit rows."""

    name: str
    scopes: frozenset[str]
    run_prefix: str = ""  # the runs it may open start with this ("" for any name)
    # Reads this run only (a link from an alert, supervisor.notify.link_grants); None: any run.
    run_id: str | None = None

    def allows(self, scope: str) -> bool:
        return scope in self.scopes

    def reaches(self, run_id: str | None) -> bool:
        """Whether a request about `run_id` (None: about no one run, or every run) is within this
        principal's runs: a link's session reaches only its own run's routes."""
        return self.run_id is None or run_id == self.run_id

    @property
    def bound(self) -> bool:
        """Writes only the runs it opened (every token without `admin`; supervisor.serve.auth)."""
        return "admin" not in self.scopes

    def check_opens(self, run_id: str) -> None:
        """A new run's name within this token's prefix; Forbidden naming the rule otherwise."""
        if self.bound and self.run_prefix and not run_id.startswith(self.run_prefix):
            raise Forbidden(f"token {self.name!r} may open only runs whose id starts with {self.run_prefix!r} "
                            f"(its run prefix); {run_id!r} does not. Name the run within the prefix, or use a "
                            f"token made for it: thermowatch token create NAME --scope ingest --run-prefix PREFIX")

    def check_open(self, run_id: str, owner: str) -> None:
        """A run (or a new attempt of it) this token may open: within its prefix, and its own."""
        self.check_opens(run_id)
        self.check_owns(run_id, owner)

    def check_owns(self, run_id: str, owner: str) -> None:
        """Forbidden unless this token may write the run `owner` opened (see the module docstring)."""
        if self.bound and owner != self.name:
            by = f"token {owner!r}" if owner else "an unknown token (before thermowatch recorded run owners)"
            raise Forbidden(f"token {self.name!r} may write only the runs it opened; run {run_id!r} was opened by "
                            f"{by}. Use that run's own ingest token (or an admin token)")


def effective(scopes) -> frozenset[str]:
    out: set[str] = set()
    for s in scopes:
        out |= IMPLIES[s]
    return frozenset(out)


ANONYMOUS_LOCAL = Principal("local-no-auth", effective(["admin"]))  # `auth: false` on loopback only


class Authenticator:
    """secret -> Principal (or None). The configured admin token is kept only as a digest and
    compared in constant time; database tokens are found by their digest."""

    def __init__(self, sessions: sessionmaker, *, config_token: str = "", links: LinkGrants | None = None) -> None:
        self.sessions = sessions
        self._config_digest = tokens_store.digest(config_token) if config_token else None
        self.links = links  # a link session's cookie (supervisor.notify.link_grants): reads one run
        self._owners: dict[str, str] = {}  # run_id -> the token that opened it; it never changes

    def check_writes(self, principal: Principal, run_id: str) -> None:
        """Forbidden unless `principal` may write this existing run; an unknown run passes (its
        route answers 404, as to anyone). The owner is read once per run, then kept: a run's
        creator never changes, and every step batch asks."""
        if not principal.bound:
            return
        owner = self._owners.get(run_id)
        if owner is None:
            with self.sessions() as s:
                owner = runs_store.created_by(s, run_id)
            if owner is None:
                return
            if len(self._owners) >= _OWNERS_KEPT:
                self._owners.clear()
            self._owners[run_id] = owner
        principal.check_owns(run_id, owner)

    def authenticate(self, secret: str) -> Principal | None:
        if not secret:
            return None
        if secret.startswith(SESSION_PREFIX):
            session = self.links.session(secret) if self.links is not None else None
            return None if session is None else Principal(session.actor, frozenset({LINK_SCOPE}),
                                                          run_id=session.run_id)
        if self._config_digest is not None and hmac.compare_digest(tokens_store.digest(secret), self._config_digest):
            return Principal(CONFIG_TOKEN_NAME, effective(["admin"]))
        with self.sessions() as s:
            row = tokens_store.find(s, secret)
        return None if row is None else Principal(row.name, effective(row.scopes), row.run_prefix)


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a hostname: it may resolve to anything, so it counts as a network address


def check_bind(cfg: SupervisorConfig) -> None:
    """Refuse an unauthenticated daemon on anything but loopback: its API can roll back, re-tune
    and stop a run that costs a cluster-month (issue 11)."""
    if not cfg.auth and not is_loopback(cfg.host):
        raise ConfigError(
            f"refusing to listen on {cfg.host}:{cfg.port} with `auth: false`: anyone on that network could stop or "
            f"roll back runs. Remove `auth: false` (auth is on by default), or bind host 127.0.0.1 and put an "
            f"authenticating ingress in front")
    if cfg.public_read and not is_loopback(cfg.host):
        log.warning("public_read: true on %s: run histories, configs and the audit trail are readable by anyone "
                    "who can reach this address", cfg.host)


def bootstrap_admin(cfg: SupervisorConfig, sessions: sessionmaker) -> Path | None:
    """First start: no tokens at all and no configured admin token -> create an admin token and
    write its secret once to <data_dir>/admin-token, mode 0600 (only the daemon's user can read
    it). Logs the path, never the secret. Returns the path, or None when nothing was needed.

    "No tokens at all" counts revoked ones: revoking every token must not mint a new admin one
    on the next restart."""
    if not cfg.auth or cfg.api_token:
        return None
    path = cfg.data_dir / BOOTSTRAP_FILE
    with sessions.begin() as s:
        if tokens_store.any_token(s):
            return None
        _, secret = tokens_store.create_token(s, BOOTSTRAP_TOKEN_NAME, ["admin"])
        audit_store.audit(s, None, "supervisor", "token_created", {"name": BOOTSTRAP_TOKEN_NAME, "scopes": ["admin"],
                                                                    "file": str(path)})
        write_secret_file(path, secret)  # inside the transaction: no row without its file
    log.warning("first start: created admin token %r; its secret is in %s (mode 0600, shown nowhere else). "
                "Create scoped tokens with `thermowatch token create NAME --scope ...`, then delete that file",
                BOOTSTRAP_TOKEN_NAME, path.resolve())
    return path


def write_secret_file(path: Path, secret: str) -> None:
    """Create `path` readable by its owner only. The mode is set at creation (O_CREAT 0600 under
    any umask), so the secret is never on disk with wider permissions, not even briefly."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.unlink()
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (secret + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
