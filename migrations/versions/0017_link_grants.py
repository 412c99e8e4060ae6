"""Signed links in alerts (issue 37 item 6: a Slack link opened the sign-in page on a phone): the
key that signs them, shared by every replica and kept across restarts, and the grants already
opened (each opens once).

Revision ID: 0017
Revises: 0016
"""

from alembic import op
import sqlalchemy as sa

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "link_keys",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("secret", sa.String(length=128), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "link_grants",
        sa.Column("grant_id", sa.String(length=32), primary_key=True),
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("incident_id", sa.String(length=50), nullable=True),
        sa.Column("channel", sa.String(length=200), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("spent_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_link_grants_expires_at", "link_grants", ["expires_at"])


def downgrade() -> None:
    op.drop_index("ix_link_grants_expires_at", table_name="link_grants")
    op.drop_table("link_grants")
    op.drop_table("link_keys")
