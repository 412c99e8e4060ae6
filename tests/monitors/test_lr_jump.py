"""The LR-jump detector (issue 24, item 2) and what the policy does with its finding.

The curves here are power laws with seeded noise, the shape the detector models; the real runs
(LR raised x30 and x4 mid-run on a real GPT) are bench/divergence.py's grid, scored in
BENCHMARKS.md and, through the trainer, in tests/client/test_lr_jump_seam.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from thermowatch.monitors.contract import LOSS, LR, LR_PEAK_AHEAD, CheckpointInfo, Outcome, Severity, Signal
from thermowatch.monitors.contract import StepRecord
from thermowatch.monitors.detectors import BankConfig, DetectorBank, LrJumpConfig, LrJumpDetector
from tests.supervisor.decide.test_policy import lr_multiplier, lr_steps, to_step
from thermowatch.supervisor.decide.policy import PolicyConfig, PolicyInput, make_decision

JUMP = 200


def curve(steps: int = 500, jump: float = 30.0, harm: float = 0.0, recover: int | None = None, seed: int = 0,
          forecast: bool = True, warmup: int = 100) -> list[dict[str, float]]:
    """A loss falling as a power law with 2 % noise, the LR warming up to 1e-3 over `warmup`
    steps, then flat, raised `jump`-fold at JUMP. From JUMP the loss sits `harm` (a fraction)
    above the law; with `recover`, the harm fades linearly to 0 by JUMP + recover."""
    rng = np.random.default_rng(seed)
    out = []
    for s in range(steps):
        lr = 1e-3 * min(1.0, (s + 1) / warmup) * (jump if s >= JUMP else 1.0)
        loss = 4.0 * (s + 10) ** -0.12 * (1 + 0.02 * rng.standard_normal())
        if s >= JUMP and harm:
            fade = 1.0 if recover is None else max(0.0, 1 - (s - JUMP) / recover)
            loss *= 1 + harm * fade
        rec = {LOSS: loss, LR: lr}
        if forecast:  # the schedule's largest LR ahead: the raise is never in it
            rec[LR_PEAK_AHEAD] = max(lr, 1e-3 * (jump if s >= JUMP else 1.0))
        out.append(rec)
    return out


def judge(values: list[dict[str, float]], det: LrJumpDetector | None = None, start: int = 0):
    det = det or LrJumpDetector()
    return [f for i, v in enumerate(values[start:], start) if (f := det.observe(i, v.get)) is not None]


def test_sustained_harm_after_an_unplanned_raise_acts_once_after_the_window():
    found = judge(curve(harm=0.15))
    assert len(found) == 1
    f = found[0]
    assert f.signal is Signal.LR_JUMP and f.outcome is Outcome.ACT and f.severity is Severity.CRITICAL
    assert f.onset_step == JUMP and JUMP + 100 <= f.detect_step <= JUMP + 130, f.detect_step
    ev = f.evidence
    assert ev["lr_before"] == pytest.approx(1e-3) and ev["lr_after"] == pytest.approx(3e-2)
    assert ev["planned_peak"] == pytest.approx(1e-3) and ev["points_behind"] >= 20
    assert 0.08 < ev["above_trend"] < 0.3


@pytest.mark.parametrize("case", ["transient", "none", "planned", "small"])
def test_a_raise_that_costs_nothing_lasting_is_left_alone(case):
    if case == "transient":  # 20 % worse at once, back on the trend 60 steps later
        values = curve(jump=4.0, harm=0.2, recover=60)
    elif case == "none":
        values = curve(jump=4.0)
    elif case == "planned":  # the schedule forecast the raise: its own plan, not an edit
        values = curve(harm=0.15)
        for v in values[:JUMP]:
            v[LR_PEAK_AHEAD] = 3e-2
    else:  # x1.3 is under jump_ratio
        values = curve(jump=1.3, harm=0.15)
    assert judge(values) == []


def test_without_a_forecast_warm_up_is_no_jump_and_a_raise_after_a_flat_lr_is():
    assert judge(curve(jump=1.0, harm=0.0, forecast=False)) == []
    found = judge(curve(harm=0.15, forecast=False))
    assert len(found) == 1 and found[0].onset_step == JUMP and found[0].evidence["planned_peak"] is None


def test_a_rollback_to_before_the_raise_forgets_it_and_the_replayed_raise_is_judged_again():
    values = curve(harm=0.15)
    det = LrJumpDetector()
    assert judge(values[:250], det) == []  # armed, no verdict yet
    det.reset(150)
    assert det.jump is None
    found = judge(values, det, start=150)
    assert len(found) == 1 and found[0].onset_step == JUMP


@settings(max_examples=15, deadline=None)
@given(cut=st.integers(1, 480), seed=st.integers(0, 3), harm=st.sampled_from([0.0, 0.15]))
def test_state_round_trip_at_any_step_gives_the_same_findings(cut, seed, harm):
    values = curve(harm=harm, seed=seed)
    whole = judge(values)
    det = LrJumpDetector()
    first = judge(values[:cut], det)
    again = LrJumpDetector()
    again.load_state_dict(det.state_dict())
    rest = judge(values, again, start=cut)
    assert [f.to_json() for f in first + rest] == [f.to_json() for f in whole]


def test_the_bank_routes_records_to_it_saves_it_and_can_switch_it_off():
    values = curve(harm=0.15)
    recs = [StepRecord(step=i, values=v) for i, v in enumerate(values)]
    bank = DetectorBank()
    found = [f for r in recs[:260] for f in bank.observe(r)]
    restored = DetectorBank()
    restored.load_state_parts(bank.state_parts())
    found += [f for r in recs[260:] for f in restored.observe(r)]
    jumps = [f for f in found if f.signal is Signal.LR_JUMP]
    assert len(jumps) == 1 and jumps[0].onset_step == JUMP
    off = DetectorBank(BankConfig.from_dict({"disabled": ["lr_jump"]}))
    assert not [f for r in recs for f in off.observe(r) if f.signal is Signal.LR_JUMP]


def test_config_is_checked():
    with pytest.raises(ValueError, match="jump_ratio"):
        LrJumpConfig(jump_ratio=1.0)
    with pytest.raises(ValueError, match="confirm"):
        LrJumpConfig(window=10, confirm=20)


# --- the policy ----------------------------------------------------------------------------------


def _finding():
    (f,) = judge(curve(harm=0.15))
    return f


def test_policy_sets_the_lr_back_to_before_the_raise_with_its_reasons():
    f = _finding()
    ck = [CheckpointInfo(step=s, path=f"c{s}", sample_cursor=0, healthy=True) for s in (100, 200, 300)]
    d = make_decision(PolicyInput(finding=f, now=1e9, checkpoints=ck, current_lr_multiplier=0.5))
    assert d.word == "set_lr" and d.rung == 2 and lr_steps(d) is None
    assert lr_multiplier(d) == pytest.approx(0.5 / 30, rel=1e-5)  # below min_lr_multiplier: an LR the run trained at
    text = " ".join(d.reasons)
    assert "rose x30 at step 200" in text and "past the schedule's own forecast" in text
    assert "setting the LR back to 0.001" in text and "0.5 -> 0.0166667" in text
    assert to_step(d) is None and d.skip_steps is None  # in place: nothing rolled back


def test_policy_alerts_when_reverting_is_off_and_waits_while_an_action_is_in_flight():
    f = _finding()
    d = make_decision(PolicyInput(finding=f, now=1e9), PolicyConfig(revert_lr_jumps=False))
    assert d.word == "alert" and "revert_lr_jumps is off" in d.reasons[-1]
    d = make_decision(PolicyInput(finding=f, now=1e9, action_in_flight=True))
    assert d.word == "noop"
    d = make_decision(PolicyInput(finding=f, now=1e9), PolicyConfig(advise_only=True))
    assert d.word == "set_lr" and d.requires_approval


def test_a_finding_from_json_round_trips_through_the_policy():
    f = _finding()
    from thermowatch.monitors.contract import Finding

    g = Finding.from_json(f.to_json())
    assert lr_multiplier(make_decision(PolicyInput(finding=g, now=0.0))) == pytest.approx(1 / 30, rel=1e-5)
    assert math.isfinite(g.evidence["above_trend"])
