"""Change-point onset search (monitors/detectors/onset.py)."""

import numpy as np
import pytest

from thermowatch.monitors.detectors.onset import change_point, estimate_onset


def _steps(n, start=1000):
    return np.arange(start, start + n)


@pytest.mark.parametrize("true_onset", [1100, 1180, 1230])
def test_ramp_in_log_space_onset_found(true_onset):
    rng = np.random.default_rng(true_onset)
    steps = _steps(256)
    y = np.log(8.0) + 0.03 * np.maximum(steps - (true_onset - 1), 0) + rng.normal(0, 0.03, steps.size)
    cp = change_point(steps, y)
    assert cp is not None
    assert abs(cp.onset_step - true_onset) <= 4
    assert cp.shift > 0


def test_step_change_onset_is_exact():
    rng = np.random.default_rng(1)
    steps = _steps(200)
    y = 2.5 + rng.normal(0, 0.02, steps.size)
    y[steps >= 1150] += 1.0
    cp = change_point(steps, y)
    assert cp is not None and cp.onset_step == 1150 and cp.last_baseline_step == 1149


def test_drifting_baseline_without_change_has_no_credible_break():
    rng = np.random.default_rng(2)
    steps = _steps(256)
    y = 3.0 - 0.002 * (steps - 1000) + rng.normal(0, 0.05, steps.size)  # loss falling slowly
    assert change_point(steps, y) is None


def test_downward_break_is_not_an_onset():
    steps = _steps(100)
    y = np.where(steps < 1060, 3.0, 2.0) + np.random.default_rng(3).normal(0, 0.01, 100)
    assert change_point(steps, y) is None


def test_gaps_in_steps_and_nan_values_are_handled():
    steps = np.arange(0, 2000, 10)  # thermometers sampled every 10 steps
    y = np.where(steps >= 1500, 5.0, 1.0) + np.random.default_rng(4).normal(0, 0.05, steps.size)
    y[5] = np.nan
    cp = change_point(steps, y)
    assert cp is not None and cp.onset_step == 1500


def test_estimate_onset_falls_back_to_first_exceed():
    steps = _steps(50)
    y = np.random.default_rng(5).normal(0, 0.1, 50)  # nothing to find
    assert estimate_onset(steps, y, first_exceed_step=1049) == (1049, "first_exceed")
    y2 = np.where(steps >= 1030, 3.0, 0.0)
    assert estimate_onset(steps, y2, first_exceed_step=1040) == (1030, "change_point")
    # a break later than the first crossing cannot be the onset
    assert estimate_onset(steps, y2, first_exceed_step=1020) == (1020, "first_exceed")


def test_too_short_buffer_returns_none():
    assert change_point([1, 2, 3], [0.0, 0.0, 5.0]) is None
