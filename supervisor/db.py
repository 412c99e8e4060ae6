"""The supervisor's database: engine construction and Alembic migrations, run programmatically.

SQLite (a file in the data dir, embedded default) or PostgreSQL (`postgresql+psycopg://...`).
Migrations ship inside the installed `migrations` package, so `upgrade()` works from a wheel
without an alembic.ini on disk.
"""

from __future__ import annotations

import functools
from pathlib import Path

from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

import thermowatch.migrations as _migrations_pkg

# __path__, not __file__: also right when an older editable install maps it as a namespace package
MIGRATIONS_DIR = Path(next(iter(_migrations_pkg.__path__))).resolve()


class DatabaseError(RuntimeError):
    """Base class for database setup problems; messages say how to fix them."""


class DatabaseBehind(DatabaseError):
    """The schema is older than this code (or not created yet)."""


SchemaOutOfDate = DatabaseBehind  # the name the CLI uses


def redact(url: str) -> str:
    """The URL with its password masked, for logs and messages."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # not a URL we can parse: show only what follows the credentials
        return url.split("@")[-1]


def _sqlite_pragmas(dbapi_conn, _record, *, busy_timeout: bool = True) -> None:
    # WAL lets the web page read while ingest writes; synchronous=NORMAL is durable across a
    # process crash in WAL mode (only an OS crash can lose the last commits), and ~10x
    # faster than FULL for many small commits. busy_timeout instead of "database is locked":
    # 10 s, unless the URL sets its own (`sqlite:///path.db?timeout=30`, seconds, the driver's
    # sqlite3.connect(timeout=...)).
    cur = dbapi_conn.cursor()
    cur.execute("PRAGMA journal_mode=WAL")
    cur.execute("PRAGMA synchronous=NORMAL")
    if busy_timeout:
        cur.execute("PRAGMA busy_timeout=10000")
    cur.execute("PRAGMA foreign_keys=ON")
    cur.close()


def _postgres_settings(dbapi_conn, _record) -> None:
    # The supervisor's queries are short: small index range reads (a chart's chunks and rollups,
    # a step's rows) and writes. On those, a planner misestimate (a rolled-back attempt's step
    # range looks large to the statistics) made PostgreSQL start two parallel workers and JIT-
    # compile the query: 30 ms for a read that executes in 3 (EXPLAIN ANALYZE; a 100-layer chart
    # of 10^6 steps read in 240 ms instead of 128, bench/plot.py). Committed at once: SQLAlchemy's
    # pool rolls back on check-in, which would undo a SET left in an open transaction.
    cur = dbapi_conn.cursor()
    cur.execute("SET jit = off")
    cur.execute("SET max_parallel_workers_per_gather = 0")
    cur.close()
    dbapi_conn.commit()


def make_engine(url: str, **kwargs) -> Engine:
    """Engine for a SQLite file (`sqlite:///path.db`) or PostgreSQL (`postgresql+psycopg://...`).

    A bare `postgresql://` URL is switched to the psycopg 3 driver.
    """
    u = make_url(url)
    if u.drivername in ("postgresql", "postgres"):
        u = u.set(drivername="postgresql+psycopg")
    if u.get_backend_name() == "sqlite":
        if u.database and u.database != ":memory:":
            Path(u.database).parent.mkdir(parents=True, exist_ok=True)
        engine = create_engine(u, **kwargs)
        event.listen(engine, "connect", functools.partial(_sqlite_pragmas, busy_timeout="timeout" not in u.query))
        return engine
    kwargs.setdefault("pool_pre_ping", True)
    engine = create_engine(u, **kwargs)
    event.listen(engine, "connect", _postgres_settings)
    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker:
    # expire_on_commit=False: store functions return plain values, but callers that hold a row
    # past commit should not trigger a reload.
    return sessionmaker(engine, expire_on_commit=False)


def _alembic_config(engine: Engine):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", engine.url.render_as_string(hide_password=False).replace("%", "%%"))
    return cfg


def _as_engine(url_or_engine: str | Engine) -> tuple[Engine, bool]:
    if isinstance(url_or_engine, Engine):
        return url_or_engine, False
    return make_engine(url_or_engine), True


def upgrade(url_or_engine: str | Engine, revision: str = "head") -> None:
    """Apply migrations up to `revision` (default: the newest)."""
    _run(url_or_engine, "upgrade", revision)


def downgrade(url_or_engine: str | Engine, revision: str = "base") -> None:
    _run(url_or_engine, "downgrade", revision)


def _run(url_or_engine: str | Engine, op: str, revision: str) -> None:
    from alembic import command

    engine, owned = _as_engine(url_or_engine)
    try:
        cfg = _alembic_config(engine)
        with engine.begin() as conn:
            cfg.attributes["connection"] = conn  # env.py runs on this connection
            getattr(command, op)(cfg, revision)
    finally:
        if owned:
            engine.dispose()


def head_revision() -> str:
    from alembic.script import ScriptDirectory

    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS_DIR))
    heads = ScriptDirectory.from_config(cfg).get_heads()
    if len(heads) != 1:
        raise DatabaseError(f"migrations have {len(heads)} heads {heads}; merge them (alembic merge)")
    return heads[0]


def current_revision(engine: Engine) -> str | None:
    from alembic.runtime.migration import MigrationContext

    with engine.connect() as conn:
        return MigrationContext.configure(conn).get_current_revision()


def check_current(engine: Engine) -> None:
    """Raise DatabaseBehind unless the DB is at the newest migration."""
    head = head_revision()
    cur = current_revision(engine)
    if cur != head:
        url = engine.url.render_as_string(hide_password=True)
        state = "has no thermowatch schema" if cur is None else f"is at revision {cur}"
        raise DatabaseBehind(
            f"database {url} {state}, this code needs {head}; "
            f"run `thermowatch db upgrade` (or supervisor.db.upgrade(url)) to migrate it"
        )
