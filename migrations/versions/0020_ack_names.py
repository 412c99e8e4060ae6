"""A stored ack says `first_step` and `skip_ranges` (issue 38: one name per concept), not `step`
and `skipped`: the action rows' result JSON is rewritten, so every reader of a stored ack reads
one name. Ack.from_json still reads the old names for one release (an older client's acks).

Revision ID: 0020
Revises: 0019
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

NAMES = {"step": "first_step", "skipped": "skip_ranges"}  # old -> new, as when this was made

_actions = sa.table("actions", sa.column("id", sa.Integer), sa.column("result", sa.JSON))


def _rename(names: dict[str, str]) -> None:
    conn = op.get_bind()
    rows = conn.execute(sa.select(_actions.c.id, _actions.c.result).where(_actions.c.result.isnot(None))).all()
    for row_id, result in rows:
        if not isinstance(result, dict) or not any(old in result for old in names):
            continue
        new = {names.get(k, k): v for k, v in result.items() if not (k in names and names[k] in result)}
        conn.execute(_actions.update().where(_actions.c.id == row_id).values(result=new))


def upgrade() -> None:
    _rename(NAMES)


def downgrade() -> None:
    _rename({new: old for old, new in NAMES.items()})
