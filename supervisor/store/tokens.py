"""API tokens: who may call the daemon, and for what (DESIGN.md, "Closed by default").

A token is a high-entropy random secret shown once, at creation; the table keeps only its
SHA-256 digest. A plain hash (no salt, no slow KDF) is enough for 256-bit random secrets: there
is no dictionary to attack, and it lets a request find its token by an indexed lookup of the
digest instead of trying every row. Revoking sets `revoked_at`; rows are never deleted, so
the audit trail's actor names keep their meaning.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import re
import secrets
from dataclasses import dataclass

from sqlalchemy import String, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, Session, mapped_column

from thermowatch.monitors.contract import ContractError
from thermowatch.supervisor.errors import Conflict, NotFound, UserError
from thermowatch.supervisor.limits import check_run_id
from thermowatch.supervisor.store.orm import Base, utcnow

SCOPES = ("ingest", "read", "operate", "admin")
SECRET_PREFIX = "tw_"  # recognisable in a leaked-secret scan; never part of the digest's meaning
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,99}$")


class ApiToken(Base):
    __tablename__ = "api_tokens"
    id: Mapped[int] = mapped_column(primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(100), unique=True)
    digest: Mapped[str] = mapped_column(String(64), unique=True)  # sha256 hex of the secret
    scopes: Mapped[str] = mapped_column(String(100))  # space-separated, sorted: "operate read"
    # The names of the runs an ingest token may create start with this ("" for any name); it
    # writes only the runs it created either way (supervisor.serve.auth; 0013).
    run_prefix: Mapped[str] = mapped_column(String(200), default="", server_default="")
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)
    revoked_at: Mapped[dt.datetime | None] = mapped_column(nullable=True)


@dataclass(frozen=True, slots=True)
class TokenRow:
    id: int
    name: str
    scopes: tuple[str, ...]
    created_at: dt.datetime
    revoked_at: dt.datetime | None
    run_prefix: str = ""


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()


def new_secret() -> str:
    return SECRET_PREFIX + secrets.token_urlsafe(32)  # 256 bits


def check_scopes(scopes) -> tuple[str, ...]:
    scopes = tuple(sorted(set(scopes)))
    if not scopes:
        raise UserError(f"a token needs at least one scope, from {', '.join(SCOPES)}")
    bad = [s for s in scopes if s not in SCOPES]
    if bad:
        raise UserError(f"unknown scope(s) {', '.join(map(repr, bad))}; scopes are {', '.join(SCOPES)}")
    return scopes


def _row(t: ApiToken) -> TokenRow:
    return TokenRow(t.id, t.name, tuple(t.scopes.split()), t.created_at, t.revoked_at, t.run_prefix or "")


def check_run_prefix(prefix: str, scopes) -> str:
    """A token's run-name prefix: a run id's start (the daemon's run-id rules), for a token that
    ingests and is not an admin (an admin's reach is every run, so a prefix on it would promise
    a limit nobody enforces)."""
    if not prefix:
        return ""
    if "admin" in scopes:
        raise UserError("a run prefix cannot bind an admin token (admin writes every run); make an ingest token")
    if "ingest" not in scopes:
        raise UserError(f"a run prefix binds an ingest token; {' '.join(sorted(scopes))} has no ingest scope")
    try:
        return check_run_id(prefix, "run prefix")
    except ContractError as exc:
        raise UserError(str(exc)) from None


def create_token(session: Session, name: str, scopes, secret: str | None = None,
                 run_prefix: str = "") -> tuple[TokenRow, str]:
    """A new token; returns its row and the secret (the only time the secret exists in the clear).
    `run_prefix`: the runs it may create must start with it (ingest tokens only)."""
    if not NAME_RE.match(name or ""):
        raise UserError(f"token name {name!r} must be 1-100 letters, digits or . _ @ - (starting with a letter "
                        f"or digit), e.g. trainer-run42 or alice")
    scopes = check_scopes(scopes)
    run_prefix = check_run_prefix(run_prefix, scopes)
    secret = secret or new_secret()
    row = ApiToken(name=name, digest=digest(secret), scopes=" ".join(scopes), run_prefix=run_prefix)
    try:
        with session.begin_nested():
            session.add(row)
            session.flush()
    except IntegrityError:
        raise Conflict(f"a token named {name!r} exists already (revoked tokens keep their name, so the audit "
                       f"trail stays unambiguous); pick another name") from None
    return _row(row), secret


def find(session: Session, secret: str) -> TokenRow | None:
    """The live token whose secret this is, or None (unknown or revoked)."""
    d = digest(secret)
    t = session.execute(select(ApiToken).where(ApiToken.digest == d)).scalar()
    # The lookup is by digest, so timing reveals nothing about the secret; compare anyway.
    if t is None or not hmac.compare_digest(t.digest, d) or t.revoked_at is not None:
        return None
    return _row(t)


def list_tokens(session: Session) -> list[TokenRow]:
    return [_row(t) for t in session.execute(select(ApiToken).order_by(ApiToken.id)).scalars()]


def any_token(session: Session) -> bool:
    """Whether any token was ever made (revoked ones count)."""
    return session.execute(select(ApiToken.id).limit(1)).first() is not None


def revoke(session: Session, name: str) -> TokenRow:
    res = session.execute(update(ApiToken).where(ApiToken.name == name, ApiToken.revoked_at.is_(None))
                          .values(revoked_at=utcnow()))
    t = session.execute(select(ApiToken).where(ApiToken.name == name)).scalar()
    if t is None:
        known = [r.name for r in list_tokens(session)]
        raise NotFound(f"no token named {name!r}; tokens: {', '.join(known) or 'none'}")
    if res.rowcount == 0:
        raise Conflict(f"token {name!r} was revoked already at {t.revoked_at:%Y-%m-%d %H:%M:%SZ}")
    return _row(t)
