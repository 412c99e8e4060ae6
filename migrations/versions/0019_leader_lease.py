"""The leader's lease (issue 40: one daemon; when its machine died the run trained on
unprotected): one row per database, held by the replica that judges, decides, acts and
notifies; its fencing token grows at each takeover, so a deposed leader's writes are refused.

Revision ID: 0019
Revises: 0018
"""

from alembic import op
import sqlalchemy as sa

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "leader_lease",
        sa.Column("name", sa.String(length=50), primary_key=True),
        sa.Column("holder", sa.String(length=300), nullable=False),
        sa.Column("token", sa.BigInteger(), nullable=False),
        sa.Column("acquired_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("leader_lease")
