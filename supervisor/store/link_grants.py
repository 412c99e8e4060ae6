"""Signed links in alerts (issue 37 item 6; supervisor.notify.link_grants): the key that signs
them and the grants already spent.

The key is a row, not a file or a process secret: a restarted daemon keeps honouring the links it
sent, and every replica on one PostgreSQL signs and checks with the same key. Whoever reads the
database is an admin already (docs/auth.md), so the key is no weaker there than the tokens' table.

A grant is single-use: its id is written here when it is opened, and the primary key makes a
second open (on any replica, even at the same instant) fail to insert. A row is kept until its
grant has expired, then pruned: an expired grant is refused before this table is asked.
"""

from __future__ import annotations

import datetime as dt
import secrets

from sqlalchemy import Integer, String, delete
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, Session, mapped_column

from thermowatch.supervisor.store.orm import Base, utcnow

KEY_ID = 1  # one key for every replica; deleting its row (then restarting) voids every link and link session
KEY_BYTES = 32  # HMAC-SHA256's block-size-worth of key: more adds nothing


class LinkKey(Base):
    __tablename__ = "link_keys"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=False)
    secret: Mapped[str] = mapped_column(String(128))  # hex of KEY_BYTES random bytes
    created_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


class LinkGrant(Base):
    """A grant that was opened: its id, what it was for, and when."""

    __tablename__ = "link_grants"
    grant_id: Mapped[str] = mapped_column(String(32), primary_key=True)
    run_id: Mapped[str] = mapped_column(String(200))  # no FK, like the audit trail: kept if the run goes
    incident_id: Mapped[str | None] = mapped_column(String(50), nullable=True)
    channel: Mapped[str] = mapped_column(String(200), default="")  # where the link was sent (slack:#x, pagerduty)
    expires_at: Mapped[dt.datetime] = mapped_column(index=True)
    spent_at: Mapped[dt.datetime] = mapped_column(default=utcnow)


def signing_key(session: Session) -> bytes:
    """The key, made on first use. Two replicas making it at once: one insert wins, the other
    reads the winner's (its own insert fails on the primary key inside a savepoint)."""
    row = session.get(LinkKey, KEY_ID)
    if row is None:
        try:
            with session.begin_nested():
                session.add(LinkKey(id=KEY_ID, secret=secrets.token_hex(KEY_BYTES)))
                session.flush()
        except IntegrityError:
            pass
        row = session.get(LinkKey, KEY_ID, populate_existing=True)
    assert row is not None
    return bytes.fromhex(row.secret)


def spend(session: Session, grant_id: str, run_id: str, incident_id: str | None, channel: str,
          expires_at: dt.datetime) -> bool:
    """Record the grant as opened; False when it was opened before (the row exists)."""
    try:
        with session.begin_nested():
            session.add(LinkGrant(grant_id=grant_id, run_id=run_id, incident_id=incident_id, channel=channel[:200],
                                  expires_at=expires_at))
            session.flush()
    except IntegrityError:
        return False
    return True


def spent(session: Session, grant_id: str) -> LinkGrant | None:
    return session.get(LinkGrant, grant_id)


def prune(session: Session, before: dt.datetime) -> int:
    """Forget grants that expired before `before` (they are refused as expired anyway)."""
    return session.execute(delete(LinkGrant).where(LinkGrant.expires_at < before)).rowcount or 0
