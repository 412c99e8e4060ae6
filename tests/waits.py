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


def action_handed(sup, action_id: int, timeout: float = 30.0) -> actions_store.ActionRow:
    """Action `action_id`'s row once the loop's poll has taken it (sent, or on past it). For a test
    that submits a command from inside its loop: called there, it holds the loop between two
    steps until the command is in its hands, so a toy step (a few ms) cannot run the run out first."""
    def handed():
        with sup.sessions() as s:
            row = actions_store.get_action(s, action_id)
        return row if row.state != "pending" else None
    return wait_until(handed, f"action {action_id} handed to the loop", timeout)
