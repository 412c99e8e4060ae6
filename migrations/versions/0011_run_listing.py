"""Runs know who created them, and the runs list is read by index (issue 21, item 4: an ingest
token made 10^5 runs and `GET /api/runs` took 26-67 s).

- `runs.created_by`: the actor that opened the run (its token's name over HTTP,
  "run-controller" in the embedded mode). The run-creation quota counts a token's runs of the
  last hour on `ix_runs_created_by_created_at`. Runs from before this revision read '' and
  count for nobody.
- `ix_runs_created_at_run_id`: the newest-first keyset pages of the list (created_at, then
  run_id to break ties).
- `ix_steps_run_id_attempt_step`: a run's newest attempt with steps and that attempt's last step
  are two index seeks (the primary key is run_id, step, attempt: finding the newest attempt read
  every step of the run, ~100-200 ms at 10^6 steps, for each run on a page).

Plain ALTER TABLE, not a batch copy: on SQLite a batch copy drops and re-creates `runs`, and with
foreign keys on, dropping it would cascade to every table that refers to it.

Revision ID: 0011
Revises: 0010
"""

from alembic import op
import sqlalchemy as sa

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("created_by", sa.String(length=200), server_default="", nullable=False))
    op.create_index("ix_runs_created_at_run_id", "runs", ["created_at", "run_id"])
    op.create_index("ix_runs_created_by_created_at", "runs", ["created_by", "created_at"])
    op.create_index("ix_steps_run_id_attempt_step", "steps", ["run_id", "attempt", "step"])


def downgrade() -> None:
    op.drop_index("ix_steps_run_id_attempt_step", table_name="steps")
    op.drop_index("ix_runs_created_by_created_at", table_name="runs")
    op.drop_index("ix_runs_created_at_run_id", table_name="runs")
    op.drop_column("runs", "created_by")
