"""Thermometer rollups (issue 12): per series and attempt, min/max/last/count buckets at widths
4, 16, ... 262144 steps, packed per aligned span, so a chart reads a few thousand buckets per
series instead of every point (supervisor/store/rollups.py).

The table starts empty: `thermowatch db rollups` backfills existing histories (a chart reads
raw chunks wherever no rollup exists yet, so it is correct before the backfill, only slower).
Downgrade drops the table; the raw chunks are untouched.

Revision ID: 0010
Revises: 0009
"""

from alembic import op
import sqlalchemy as sa

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "thermometer_rollups",
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("series_id", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("width", sa.Integer(), nullable=False),
        sa.Column("first_step", sa.BigInteger(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("buckets", sa.LargeBinary(), nullable=False),
        sa.Column("stats", sa.LargeBinary(), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], name="fk_thermometer_rollups_run_id_runs",
                                ondelete="CASCADE"),
        sa.ForeignKeyConstraint(["series_id"], ["series.id"], name="fk_thermometer_rollups_series_id_series"),
        sa.PrimaryKeyConstraint("run_id", "series_id", "attempt", "width", "first_step",
                                name="pk_thermometer_rollups"),
    )


def downgrade() -> None:
    op.drop_table("thermometer_rollups")
