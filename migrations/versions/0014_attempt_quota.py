"""New attempts are a budget too (issue 34: 10,000 new attempts of one run by one token were all
accepted, and that run's page took 3.4-9.4 s).

- `attempts.opened_by`: the actor (a token's name) that opened the attempt; '' for attempts from
  before this revision, which no quota counts.
- Indexes for the two counts of supervisor.ingest.quota: a run's attempts of the last hour
  (run_id, started_at) and a token's (opened_by, started_at), each read for at most limit+1 rows.

Revision ID: 0014
Revises: 0013
"""

from alembic import op
import sqlalchemy as sa

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("attempts", sa.Column("opened_by", sa.String(length=200), nullable=False, server_default=""))
    op.create_index("ix_attempts_run_id_started_at", "attempts", ["run_id", "started_at"])
    op.create_index("ix_attempts_opened_by_started_at", "attempts", ["opened_by", "started_at"])


def downgrade() -> None:
    op.drop_index("ix_attempts_opened_by_started_at", table_name="attempts")
    op.drop_index("ix_attempts_run_id_started_at", table_name="attempts")
    with op.batch_alter_table("attempts") as batch:  # SQLite drops a column with a server default by a copy
        batch.drop_column("opened_by")
