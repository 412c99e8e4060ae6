"""Detector state as named parts, one row each, saved incrementally (issue 10 item 4).

The one-row-per-run JSON state (0002) is dropped: it was a version-2 state, which the version-3
banks do not read (a bank without readable state starts fresh and says so), so nothing is lost
that would have been used. Downgrade brings back the empty table.

Revision ID: 0008
Revises: 0007
"""

from alembic import op
import sqlalchemy as sa

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "detector_state_parts",
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("part", sa.String(length=200), nullable=False),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], name=op.f("fk_detector_state_parts_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "part", name=op.f("pk_detector_state_parts")),
    )
    op.drop_table("detector_state")


def downgrade() -> None:
    op.create_table(
        "detector_state",
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], name=op.f("fk_detector_state_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", name=op.f("pk_detector_state")),
    )
    op.drop_table("detector_state_parts")
