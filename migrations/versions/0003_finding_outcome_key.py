"""Findings get their outcome (watch | alert | act) and a key that stores each finding once.

Revision ID: 0003
Revises: 0002
"""

from alembic import op
import sqlalchemy as sa

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    # batch mode: SQLite cannot add a constraint to an existing table in place.
    with op.batch_alter_table("findings") as batch:
        batch.add_column(sa.Column("outcome", sa.String(length=10), server_default="alert", nullable=False))
        batch.add_column(sa.Column("key", sa.String(length=600), nullable=True))
        batch.create_unique_constraint(op.f("uq_findings_run_id_key"), ["run_id", "key"])


def downgrade() -> None:
    with op.batch_alter_table("findings") as batch:
        batch.drop_constraint(op.f("uq_findings_run_id_key"), type_="unique")
        batch.drop_column("key")
        batch.drop_column("outcome")
