"""Alembic revisions for the supervisor's database. Run them with `thermowatch db upgrade`
or `supervisor.db.upgrade(url)`; the Alembic config is built in code (supervisor/db.py)."""
