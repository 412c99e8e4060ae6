"""An action's kind, state and origin are closed vocabularies (issue 38: "state as strings",
compared by literal in 13 files): the database checks each column holds one of its words, as the
ORM's WordColumn does before a write. The words are written out here, as they were when this
migration was made; a later vocabulary change is a migration of its own.

Revision ID: 0018
Revises: 0017
"""

from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

WORDS = {
    "kind": ("pause", "resume", "rollback", "skip", "set_lr", "stop", "profile"),
    "state": ("pending", "sent", "acked", "done", "failed", "cancelled", "expired"),
    "origin": ("auto", "manual"),
}


def upgrade() -> None:
    with op.batch_alter_table("actions") as batch:
        for column, words in WORDS.items():
            batch.create_check_constraint(column, f"{column} IN ({', '.join(repr(w) for w in words)})")


def downgrade() -> None:
    with op.batch_alter_table("actions") as batch:
        for column in WORDS:
            batch.drop_constraint(op.f(f"ck_actions_{column}"), type_="check")
