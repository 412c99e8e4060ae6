"""Database fixtures shared by the supervisor's tests: real SQLite files and real PostgreSQL.

`db`        a freshly migrated, empty database (TestDB: url, engine, sessions, dialect),
            parametrised over "sqlite" and "postgres".
`empty_url` a URL of a database with no tables at all (for migration tests), same params.

PostgreSQL: THERMOWATCH_TEST_PG_URL (default postgresql+psycopg://postgres@127.0.0.1:5432/test).
Each pytest session works in its own schema (tw_test_<random>), dropped at the end, so parallel
sessions do not see each other. If PostgreSQL is unreachable its tests are skipped with the
reason, unless THERMOWATCH_REQUIRE_PG=1 (CI), where they fail.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import Engine
from sqlalchemy.orm import sessionmaker

from thermowatch.supervisor.db import make_engine, make_sessionmaker, upgrade

PG_URL = os.environ.get("THERMOWATCH_TEST_PG_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test")
DIALECTS = ["sqlite", "postgres"]


@dataclass
class TestDB:
    __test__ = False  # not a test class
    url: str  # self-contained: make_engine(url) reaches the same database (and schema)
    engine: Engine
    sessions: sessionmaker
    dialect: str  # "sqlite" | "postgresql"


def pg_schema_url(schema: str) -> str:
    return f"{PG_URL}?options=-csearch_path%3D{schema}"


def _pg_admin() -> Engine:
    eng = make_engine(PG_URL, isolation_level="AUTOCOMMIT")
    try:
        with eng.connect():
            pass
        return eng
    except sa.exc.OperationalError as exc:
        eng.dispose()
        if os.environ.get("THERMOWATCH_REQUIRE_PG") == "1":
            raise
        pytest.skip(f"PostgreSQL not reachable at {PG_URL} ({exc.orig}); set THERMOWATCH_TEST_PG_URL")


@pytest.fixture(scope="session")
def pg_admin():
    eng = _pg_admin()
    schemas: list[str] = []
    yield eng, schemas
    with eng.connect() as c:
        for s in schemas:
            c.execute(sa.text(f'DROP SCHEMA IF EXISTS "{s}" CASCADE'))
    eng.dispose()


def new_pg_schema(pg_admin) -> str:
    eng, schemas = pg_admin
    name = f"tw_test_{uuid.uuid4().hex[:12]}"
    with eng.connect() as c:
        c.execute(sa.text(f'CREATE SCHEMA "{name}"'))
    schemas.append(name)
    return name


@pytest.fixture(scope="session")
def _templates():
    """One migrated database per dialect per session, made on first use: each test gets a copy
    of the SQLite file, or the PostgreSQL schema with every table truncated."""
    return {}


def _sqlite_template(templates, tmp_path_factory) -> str:
    if "sqlite" not in templates:
        path = tmp_path_factory.mktemp("tw-template") / "template.db"
        upgrade(f"sqlite:///{path}")
        templates["sqlite"] = str(path)
    return templates["sqlite"]


def _pg_template(templates, pg_admin) -> str:
    if "postgres" not in templates:
        url = pg_schema_url(new_pg_schema(pg_admin))
        upgrade(url)
        templates["postgres"] = url
    return templates["postgres"]


def _truncate_all(engine: Engine) -> None:
    """Every table empty and every sequence back at its start, as `TRUNCATE <all> RESTART IDENTITY`
    leaves them, touching only what the previous test used: a TRUNCATE of all 22 tables and its
    commit cost ~0.2 s a test (~550 PostgreSQL tests), one query finds the few tables with rows
    and the sequences ever read, and those are emptied (DELETE, the foreign keys' triggers off for
    this transaction: every table it leaves holds no rows; TRUNCATE past 1 MiB) and restarted."""
    with engine.begin() as c:
        tables = [t for t in sa.inspect(c).get_table_names() if t != "alembic_version"]
        if not tables:
            return
        probe = " UNION ALL ".join(f"SELECT '{t}' WHERE EXISTS (SELECT 1 FROM \"{t}\")" for t in tables)
        full = c.execute(sa.text(probe)).scalars().all()
        used = c.execute(sa.text("SELECT sequencename FROM pg_sequences "
                                 "WHERE schemaname = current_schema() AND last_value IS NOT NULL")).scalars().all()
        # A table of many rows (a rollup test's points) is cheaper truncated than deleted.
        big = [t for t in full if c.execute(sa.text(f"SELECT pg_relation_size('\"{t}\"')")).scalar() > (1 << 20)]
        if big:
            c.execute(sa.text("TRUNCATE " + ", ".join(f'"{t}"' for t in big) + " CASCADE"))
        if full:
            c.execute(sa.text("SET LOCAL session_replication_role = replica"))
            for t in full:
                if t not in big:
                    c.execute(sa.text(f'DELETE FROM "{t}"'))
        for seq in used:
            c.execute(sa.text(f'ALTER SEQUENCE "{seq}" RESTART'))


@pytest.fixture(params=DIALECTS)
def db(request, tmp_path, tmp_path_factory, _templates):
    if request.param == "sqlite":
        path = tmp_path / "thermowatch.db"
        shutil.copyfile(_sqlite_template(_templates, tmp_path_factory), path)
        url = f"sqlite:///{path}"
    else:
        url = _pg_template(_templates, request.getfixturevalue("pg_admin"))
    engine = make_engine(url)
    if request.param == "postgres":
        _truncate_all(engine)
    yield TestDB(url, engine, make_sessionmaker(engine), engine.dialect.name)
    engine.dispose()


@pytest.fixture(params=DIALECTS)
def empty_url(request, tmp_path):
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'empty.db'}"
    else:
        yield pg_schema_url(new_pg_schema(request.getfixturevalue("pg_admin")))
