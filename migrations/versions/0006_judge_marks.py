"""The judge's durable marker: commit, answer, then judge (supervisor.judge.judge).

Existing attempts are marked judged through their newest stored step: before this revision
every batch was judged inside its ingest request, so nothing is waiting.

Revision ID: 0006
Revises: 0005
"""

from alembic import op
import sqlalchemy as sa

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "judge_marks",
        sa.Column("run_id", sa.String(length=200), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("through_step", sa.BigInteger(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["run_id"], ["runs.run_id"], name=op.f("fk_judge_marks_run_id_runs"),
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("run_id", "attempt", name=op.f("pk_judge_marks")),
    )
    op.execute("INSERT INTO judge_marks (run_id, attempt, through_step, updated_at) "
               "SELECT run_id, attempt, MAX(step), CURRENT_TIMESTAMP FROM steps GROUP BY run_id, attempt")


def downgrade() -> None:
    op.drop_table("judge_marks")
