"""Detector state per run, so a restarted supervisor keeps its baselines.

Revision ID: 0002
Revises: 0001
"""

from alembic import op
import sqlalchemy as sa

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "detector_state",
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], name=op.f("fk_detector_state_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_detector_state")),
    )


def downgrade() -> None:
    op.drop_table("detector_state")
