"""Typed acknowledgements and absolute LR changes.

actions.result         the trainer's acknowledgement as it sent it (what really happened:
                       checkpoint loaded, first step, effective LR multiplier, ledger digest)
lr_changes.rewarmup_steps  the change's re-warm-up, so the supervisor computes the multiplier in
                       force at any step exactly as the trainer does
lr_changes.seq         the change's position in the trainer's list: a newer change replaces the
                       older ones, and acks can arrive out of order (a re-sent one)

Revision ID: 0004
Revises: 0003
"""

from alembic import op
import sqlalchemy as sa

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("actions") as b:
        b.add_column(sa.Column("result", sa.JSON(), nullable=True))
    with op.batch_alter_table("lr_changes") as b:
        b.add_column(sa.Column("rewarmup_steps", sa.BigInteger(), nullable=False, server_default="0"))
        b.add_column(sa.Column("seq", sa.BigInteger(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("lr_changes") as b:
        b.drop_column("seq")
        b.drop_column("rewarmup_steps")
    with op.batch_alter_table("actions") as b:
        b.drop_column("result")
