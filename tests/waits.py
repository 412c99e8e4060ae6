"""Waiting in tests for an action row to move on (ActionState), as the daemon and the trainer move
it along on their own threads: to a final state (done, failed, expired or cancelled), or out of
pending into the loop's hands."""

from __future__ import annotations

from tests.live_server import wait_until
from thermowatch.monitors.commands import ActionState
from thermowatch.supervisor.store import actions as actions_store


def _action_when(sup, action_id: int, ready, what: str, timeout: float) -> actions_store.ActionRow:
    def row_if_ready():
        with sup.sessions() as s:
            row = actions_store.get_action(s, action_id)
        return row if ready(row.state) else None
    return wait_until(row_if_ready, f"{what} of action {action_id}", timeout)


def action_final(sup, action_id: int, timeout: float = 30.0) -> actions_store.ActionRow:
    """Action `action_id`'s row once it is final."""
    return _action_when(sup, action_id, lambda state: state.is_final, "final state", timeout)


def action_handed(sup, action_id: int, timeout: float = 30.0) -> actions_store.ActionRow:
    """Action `action_id`'s row once the loop's poll has taken it (sent, or on past it). For a test
    that submits a command from inside its loop: called there, it holds the loop between two
    steps until the command is in its hands, so a toy step (a few ms) cannot run the run out first."""
    return _action_when(sup, action_id, lambda state: state != ActionState.PENDING, "hand-over to the loop", timeout)
