"""An attempt can say it finished, with its final loss (issue 22, item 9: a loop that ended early
or normally had no way to say "finished"; the run read finished only after a stop or the planned
step count).

- `attempts.finished_at`, `final_step`, `final_loss`, `finish_reason`: set once by
  POST /api/runs/{run_id}/attempts/{attempt}/finished (contract.RunFinished). NULL on every
  attempt from before this revision: those runs keep the older rules.
  `final_loss` is a float that may be NaN or Inf (the loss a diverged run ended on); on SQLite
  a NaN is kept as the text 'nan' (store.orm.ExactFloat).

Plain ADD/DROP COLUMN, as in 0011 (a batch copy of `attempts` on SQLite is not needed for
nullable columns).

Revision ID: 0012
Revises: 0011
"""

from alembic import op
import sqlalchemy as sa

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("attempts", sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True))
    op.add_column("attempts", sa.Column("final_step", sa.BigInteger(), nullable=True))
    op.add_column("attempts", sa.Column("final_loss", sa.Float(), nullable=True))
    op.add_column("attempts", sa.Column("finish_reason", sa.String(length=20), nullable=True))


def downgrade() -> None:
    op.drop_column("attempts", "finish_reason")
    op.drop_column("attempts", "final_loss")
    op.drop_column("attempts", "final_step")
    op.drop_column("attempts", "finished_at")
