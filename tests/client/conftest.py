# The database fixtures (SQLite and PostgreSQL, one per test) are the supervisor tests' own.
from tests.supervisor.conftest import _pg_template, _sqlite_template, _templates, db, pg_admin  # noqa: F401
