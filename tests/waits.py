"""Waiting in tests for an action row to reach a final state (ActionState.is_final: done, failed,
expired or cancelled), as the daemon and the trainer move it along on their own threads."""

from __future__ import annotations

from tests.live_server import wait_until
from thermowatch.supervisor.store import actions as actions_store


def action_final(sup, action_id: int, timeout: float = 30.0) -> actions_store.ActionRow:
    """Action `action_id`'s row once it is final."""
    def final():
        with sup.sessions() as s:
            row = actions_store.get_action(s, action_id)
        return row if row.state.is_final else None
    return wait_until(final, f"final state of action {action_id}", timeout)
