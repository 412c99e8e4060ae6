"""Small dialect helpers shared by the store modules."""

from __future__ import annotations

from sqlalchemy import Table
from sqlalchemy.orm import Session


def insert_ignore(session: Session, table: Table):
    """INSERT ... ON CONFLICT DO NOTHING for the session's dialect (SQLite or PostgreSQL)."""
    name = session.get_bind().dialect.name
    if name == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif name == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:  # pragma: no cover - only the two dialects are supported
        raise NotImplementedError(f"dialect {name!r} is not supported; use SQLite or PostgreSQL")
    return insert(table).on_conflict_do_nothing()
