"""Alerts become a durable outbox: state, attempts, next try and the payload to resend.

Rows written before this revision were sent (or recorded as failed) at once: they become `sent`
or `failed` accordingly, never pending, so an upgrade does not replay old alerts.

Revision ID: 0005
Revises: 0004
"""

from alembic import op
import sqlalchemy as sa

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("alerts") as b:
        b.add_column(sa.Column("created_at", sa.DateTime(timezone=True), nullable=True))
        b.add_column(sa.Column("state", sa.String(length=16), server_default="sent", nullable=False))
        b.add_column(sa.Column("attempts", sa.Integer(), server_default="0", nullable=False))
        b.add_column(sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=True))
        b.add_column(sa.Column("payload", sa.JSON(), nullable=True))
        b.alter_column("sent_at", existing_type=sa.DateTime(timezone=True), nullable=True)
        b.create_index("ix_alerts_state_channel_id", ["state", "channel", "id"])
    op.execute("UPDATE alerts SET created_at = sent_at, attempts = 1, "
               "state = CASE WHEN ok THEN 'sent' ELSE 'failed' END")


def downgrade() -> None:
    op.execute("DELETE FROM alerts WHERE sent_at IS NULL")  # pending rows have no place in the old schema
    with op.batch_alter_table("alerts") as b:
        b.drop_index("ix_alerts_state_channel_id")
        b.alter_column("sent_at", existing_type=sa.DateTime(timezone=True), nullable=False)
        b.drop_column("payload")
        b.drop_column("next_attempt_at")
        b.drop_column("attempts")
        b.drop_column("state")
        b.drop_column("created_at")
