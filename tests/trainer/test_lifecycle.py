"""The controller's failure policy is a pure table (trainer.lifecycle.make_decision)."""

from __future__ import annotations

import pytest

from thermowatch.trainer.lifecycle import FailureDecision, FailureStatus, make_decision


@pytest.mark.parametrize("failures, max_restarts, want", [
    (1, 3, FailureDecision.RESTART), (3, 3, FailureDecision.RESTART), (4, 3, FailureDecision.RAISE),
    (1, 0, FailureDecision.RAISE),
])
def test_restart_until_max_restarts_is_used_up(failures, max_restarts, want):
    assert make_decision(FailureStatus(failures, max_restarts, RuntimeError("rank 1 died"))) is want
