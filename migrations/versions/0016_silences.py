"""Silences (issue 37: no acknowledge, silence or snooze): a run's signal silenced until a time,
by whom and why; its alerts stop paging, its findings still act by policy.

Revision ID: 0016
Revises: 0015
"""

from alembic import op
import sqlalchemy as sa

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "silences",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("run_id", sa.String(length=200), sa.ForeignKey("runs.run_id", ondelete="CASCADE"), nullable=False),
        sa.Column("signal", sa.String(length=50), nullable=False),
        sa.Column("until", sa.DateTime(timezone=True), nullable=False),
        sa.Column("who", sa.String(length=200), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("ended_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_silences_run_id_until", "silences", ["run_id", "until"])


def downgrade() -> None:
    op.drop_index("ix_silences_run_id_until", table_name="silences")
    op.drop_table("silences")
