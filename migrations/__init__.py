"""Alembic revisions for the supervisor's database. Run them with `thermowatch db upgrade`
or `thermowatch.supervisor.db.upgrade(url)`; the Alembic config is built in code (supervisor/db.py)."""
