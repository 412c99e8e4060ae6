"""Divergence episodes (issue 37: one divergence tripped nine (signal, module) incidents, and Slack
got nine threads): `incidents.episode_id`, the first incident of the episode an incident belongs
to (store.incidents.episode_of); NULL for the first, and for every incident from before this
revision (each its own thread, as they were).

Revision ID: 0015
Revises: 0014
"""

from alembic import op
import sqlalchemy as sa

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("incidents", sa.Column("episode_id", sa.Integer(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("incidents") as batch:
        batch.drop_column("episode_id")
