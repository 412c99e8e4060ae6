"""The quarantine's verdicts (supervisor/store/quarantine.py) on real action, incident and step
rows, both databases: when the skip held, when the divergence came back, when it is too early.
The end-to-end run with poisoned data is tests/client/test_quarantine.py."""

from __future__ import annotations

import pytest

from thermowatch.monitors.contract import RunInfo, StepRecord
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store import quarantine as quarantine_store
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import steps as steps_store

RUN = "q"


def _rolled_back(s, signal: str = "loss_spike", manual: bool = False) -> int:
    """A run that diverged at step 150, rolled back to checkpoint 50 skipping [800, 2400)."""
    runs_store.open_attempt(s, RunInfo(RUN, 0, 1))
    steps_store.record_steps(s, RUN, 0, [StepRecord(step=k, values={"loss": 3.0}) for k in range(1, 151)])
    inc = None if manual else incidents_store.open_incident(s, RUN, signal, "", 148, 150, "critical")
    aid = actions_store.enqueue_action(s, RUN, "rollback", {"to_step": 50, "skip_ranges": [[800, 2400]]},
                                       "spike", "manual" if manual else "auto", "ana", incident_id=inc)
    for state in ("sent", "acked"):
        actions_store.set_action_state(s, aid, state)
    actions_store.set_action_state(s, aid, "done", ack_step=51, result={
        "command_id": aid, "ok": True, "first_step": 51, "checkpoint_step": 50, "skip_ranges": [[800, 2400]]})
    if inc is not None:
        incidents_store.resolve_incident(s, inc, "rollback done")
    runs_store.open_attempt(s, RunInfo(RUN, 1, 1, start_step=50))
    return aid


def _reach(s, last: int) -> None:
    steps_store.record_steps(s, RUN, 1, [StepRecord(step=k, values={"loss": 3.0}) for k in range(51, last + 1)])


@pytest.mark.parametrize("case, want", [
    ("clean", "quarantine"),  # ran to 260 > 150 + 100 without it
    ("early", "pending"),  # at 220: not yet 100 past the old detection
    ("same", "recurred"),  # loss_spike again at 160, on the re-trained path
    ("other", "quarantine"),  # a grad_spike is another story: the skip still held
    ("late", "quarantine"),  # loss_spike at 300: past the horizon, a new divergence
    ("attention", "recurred"),  # growth then ceiling: one family
    ("manual", "recurred"),  # a manual rollback: any rollback signal counts
])
def test_verdicts(db, case, want):
    with db.sessions() as s:
        signal = "attn_logit_growth" if case == "attention" else "loss_spike"
        aid = _rolled_back(s, signal, manual=case == "manual")
        _reach(s, 220 if case == "early" else 320)
        again = {"same": ("loss_spike", 160), "other": ("grad_spike", 160), "late": ("loss_spike", 300),
                 "attention": ("attn_logit_ceiling", 170), "manual": ("non_finite", 90)}.get(case)
        if again is not None:
            incidents_store.open_incident(s, RUN, again[0], "", again[1] - 2, again[1], "critical")
        if case == "clean":  # the newest attempt is what counts, at 260
            runs_store.open_attempt(s, RunInfo(RUN, 2, 1, start_step=250))
            steps_store.record_steps(s, RUN, 2, [StepRecord(step=k, values={"loss": 3.0}) for k in range(251, 261)])
        (v,) = quarantine_store.verdicts(s, RUN)
    assert v.action_id == aid and v.status == want, v.why
    assert v.ranges == [(800, 2400)] and v.samples == 1600 and v.first_step == 51 and v.checkpoint_step == 50
    held = quarantine_store.quarantined([v])
    assert held == ([(800, 2400)] if want == "quarantine" else [])
    if want == "recurred":
        assert v.recurrence_incident is not None and "came back" in v.why
    if case == "manual":
        assert v.signal is None and v.detect_step == 51


def test_a_stretch_that_went_on_is_judged_with_the_skip_that_went_on(db):
    """Issue 35: the rest of a bad stretch came back on the re-trained path and the policy rolled
    back to the same checkpoint, skipping on. The first skip is not refuted by that: it takes the
    verdict of the one that skipped on, and both sets of samples are quarantined when it held."""
    with db.sessions() as s:
        first = _rolled_back(s)
        inc = incidents_store.open_incident(s, RUN, "loss_spike", "", 52, 53, "critical")
        aid = actions_store.enqueue_action(s, RUN, "rollback", {"to_step": 50, "skip_ranges": [[2400, 2448]]},
                                           "spike", "auto", "policy", incident_id=inc)
        for state in ("sent", "acked"):
            actions_store.set_action_state(s, aid, state)
        actions_store.set_action_state(s, aid, "done", ack_step=51, result={
            "command_id": aid, "ok": True, "first_step": 51, "checkpoint_step": 50, "skip_ranges": [[2400, 2448]]})
        incidents_store.resolve_incident(s, inc, "rollback done")
        runs_store.open_attempt(s, RunInfo(RUN, 2, 1, start_step=50))
        steps_store.record_steps(s, RUN, 2, [StepRecord(step=k, values={"loss": 3.0}) for k in range(51, 200)])
        v1, v2 = quarantine_store.verdicts(s, RUN)
    assert (v1.action_id, v2.action_id) == (first, aid)
    assert v2.status == "quarantine" and v2.sure == "blunt", v2.why
    assert v1.status == "quarantine" and v1.extended_by == aid and "the bad stretch went on" in v1.why, v1.why
    assert quarantine_store.quarantined([v1, v2]) == [(800, 2448)]


def test_no_rollback_with_a_skip_no_verdict(db):
    with db.sessions() as s:
        runs_store.open_attempt(s, RunInfo(RUN, 0, 1))
        aid = actions_store.enqueue_action(s, RUN, "rollback", {"to_step": 50}, "x", "manual", "ana")
        for state in ("sent", "acked"):
            actions_store.set_action_state(s, aid, state)
        actions_store.set_action_state(s, aid, "done", ack_step=51, result={"command_id": aid, "ok": True, "first_step": 51,
                                                                            "skip_ranges": []})
        assert quarantine_store.verdicts(s, RUN) == []
