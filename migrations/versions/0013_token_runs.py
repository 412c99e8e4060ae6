"""Ingest tokens are bound to the runs they create (issue 33: any ingest token wrote any run).

- `api_tokens.run_prefix`: the start every run id a token creates must have ("" for any name).
- `runs.created_by` is the rule's owner. Runs from before 0011 have '' there: each is given the
  actor of its first `attempt_opened` audit row (the token that opened it over HTTP), so the tokens
  that already wrote a run keep working for it. A run with no such row stays '' and only an admin
  token writes it.

The downgrade drops the column; the owners filled in stay (0011 already had the column).

Revision ID: 0013
Revises: 0012
"""

from alembic import op
import sqlalchemy as sa

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("api_tokens", sa.Column("run_prefix", sa.String(length=200), nullable=False, server_default=""))
    op.execute(sa.text(
        "UPDATE runs SET created_by = (SELECT a.actor FROM audit a WHERE a.run_id = runs.run_id "
        "AND a.event = 'attempt_opened' ORDER BY a.id LIMIT 1) "
        "WHERE created_by = '' AND EXISTS (SELECT 1 FROM audit a WHERE a.run_id = runs.run_id "
        "AND a.event = 'attempt_opened')"))


def downgrade() -> None:
    with op.batch_alter_table("api_tokens") as batch:  # SQLite drops a column with a server default by a copy
        batch.drop_column("run_prefix")
