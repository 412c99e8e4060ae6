"""The re-trained path is judged at once (issue 35): a rollback 100 steps back (the policy's
margin) leaves 26 of the 128 points a spike detector keeps, and the rest of a poisoned stretch
comes right after the samples the rollback skipped. The loss spike detector stayed silent there
(out of points and back in warm-up) while 13 poisoned steps trained; now it fires on the second."""

from __future__ import annotations

import numpy as np

from thermowatch.monitors.contract import StepRecord
from thermowatch.monitors.detectors import BankConfig, DetectorBank


def _loss(rng, n):
    return 3.0 + 0.15 * rng.standard_normal(n)


def test_a_spike_right_after_a_rollback_100_steps_back_is_found_on_its_second_step():
    rng = np.random.default_rng(0)
    bank = DetectorBank(BankConfig())
    healthy = _loss(rng, 150)
    for step, v in enumerate(healthy, start=1):
        assert not bank.observe(StepRecord(step=step, values={"loss": float(v)}), 1)
    found = bank.observe(StepRecord(step=151, values={"loss": 7.8}), 1) + \
        bank.observe(StepRecord(step=152, values={"loss": 7.6}), 1)
    assert [(f.signal.value, f.detect_step) for f in found] == [("loss_spike", 152)]
    # The rollback to checkpoint 50: the supervisor resets to the first step trained after it, as
    # the executor books it (ack.first_step); step 50's point is the checkpoint's and stays. (A reset to
    # 50 would say step 50 is re-trained too, and the onset would be 50, the step after the last
    # point kept: issue 36's onset on a series with a gap.)
    bank.reset(51)
    again = bank.observe(StepRecord(step=51, values={"loss": 7.0}), 2) + \
        bank.observe(StepRecord(step=52, values={"loss": 6.9}), 2)
    assert [(f.signal.value, f.onset_step, f.detect_step) for f in again] == [("loss_spike", 51, 52)]


def test_a_healthy_re_trained_path_after_a_rollback_raises_nothing():
    rng = np.random.default_rng(1)
    bank = DetectorBank(BankConfig())
    for step, v in enumerate(_loss(rng, 152), start=1):
        bank.observe(StepRecord(step=step, values={"loss": float(v)}), 1)
    bank.reset(50)
    for step, v in enumerate(_loss(rng, 100), start=51):
        assert not bank.observe(StepRecord(step=step, values={"loss": float(v)}), 2), step
