"""Slack threads per incident (issue 12): each alert row knows its thread and keeps the id the
channel gave it.

`thread_key` names the story a row belongs to ("incident:42", or "action:7" for a manual
command); `ts` is the channel's message id once sent (Slack's ts). The outbox delivers a
channel's rows in id order, so a reply's parent has its ts (or has failed for good) before the
reply is sent; keeping the ts in the database makes threads survive a daemon restart.
Downgrade drops both columns (replies sent afterwards go top-level, as before 0009).

Revision ID: 0009
Revises: 0008
"""

from alembic import op
import sqlalchemy as sa

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("alerts") as batch:
        batch.add_column(sa.Column("thread_key", sa.String(length=100), nullable=True))
        batch.add_column(sa.Column("ts", sa.String(length=64), nullable=True))
    op.create_index("ix_alerts_channel_thread_key_id", "alerts", ["channel", "thread_key", "id"])


def downgrade() -> None:
    op.drop_index("ix_alerts_channel_thread_key_id", table_name="alerts")
    with op.batch_alter_table("alerts") as batch:
        batch.drop_column("ts")
        batch.drop_column("thread_key")
