"""Attention-logit growth and ceiling detectors on constructed series."""

import json
import math

import numpy as np
import pytest

from thermowatch.monitors.contract import Severity, Signal
from thermowatch.monitors.detectors import AttnLogitCeilingDetector, AttnLogitConfig, AttnLogitGrowthDetector

KEY = "attn_logit_max/blocks.3.attn"


def healthy(seed, n=5000, sigma=0.05):
    """Logits drifting 2 -> 8 over the first 300 steps, then flat, multiplicative noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return (2.0 + 6.0 * np.minimum(t, 300) / 300) * np.exp(rng.normal(0, sigma, n))


def blowup(seed, onset=1000, rate=0.03, n=1200, level=8.0, sigma=0.03):
    """Flat at `level` until `onset`, then growing by `rate` (log) per step."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return level * np.exp(rate * np.maximum(t - (onset - 1), 0) + rng.normal(0, sigma, n))


def run(det, values, start=0):
    return [f for i, v in enumerate(values) if (f := det.update(start + i, float(v))) is not None]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("sigma", [0.03, 0.08])
def test_healthy_drift_raises_nothing(seed, sigma):
    assert run(AttnLogitGrowthDetector(KEY), healthy(seed, sigma=sigma)) == []


@pytest.mark.parametrize("rate", [0.02, 0.03, 0.05])
@pytest.mark.parametrize("seed", range(3))
def test_exponential_growth_caught_within_20_steps_with_onset(rate, seed):
    findings = run(AttnLogitGrowthDetector(KEY), blowup(seed, rate=rate))
    assert findings, "growth not detected"
    first = findings[0]
    assert first.signal is Signal.ATTN_LOGIT_GROWTH
    assert first.module == "blocks.3.attn" and first.metric == KEY
    assert 1000 < first.detect_step <= 1020
    assert abs(first.onset_step - 1000) <= 5
    assert first.evidence["growth_per_step"] > 0.01
    assert first.evidence["ratio"] > first.evidence["threshold_ratio"]


def test_latched_then_escalates_once_to_critical():
    findings = run(AttnLogitGrowthDetector(KEY), blowup(0, rate=0.03))
    assert [f.severity for f in findings] == [Severity.WARN, Severity.CRITICAL]
    assert findings[1].onset_step == findings[0].onset_step  # escalation keeps the onset


def test_single_step_outlier_is_not_growth():
    values = blowup(1, rate=0.0)
    values[700] *= 5.0
    values[701] *= 3.0
    assert run(AttnLogitGrowthDetector(KEY), values) == []


def test_no_finding_during_warmup():
    cfg = AttnLogitConfig(warmup=200)
    values = blowup(2, onset=120, n=200, rate=0.05)
    assert run(AttnLogitGrowthDetector(KEY, cfg), values) == []


def test_lse_bound_growth_detected_like_the_max():
    # The bound = max + an offset in [0, ln(keys)] that wanders slowly with attention entropy.
    rng = np.random.default_rng(7)
    offset = 2.0 + 0.3 * np.sin(np.arange(1200) / 50.0) + rng.normal(0, 0.02, 1200)
    values = blowup(3, rate=0.04) + offset
    findings = run(AttnLogitGrowthDetector("attn_logit_lse/blocks.0.attn"), values)
    assert findings and 1000 < findings[0].detect_step <= 1025
    assert abs(findings[0].onset_step - 1000) <= 8


def test_state_round_trip_mid_stream_gives_identical_findings():
    values = blowup(4, rate=0.03)
    a = AttnLogitGrowthDetector(KEY)
    run(a, values[:995])
    b = AttnLogitGrowthDetector(KEY)
    b.load_state_dict(json.loads(json.dumps(a.state_dict(), allow_nan=False)))
    fa, fb = run(a, values[995:], 995), run(b, values[995:], 995)
    assert fa and [f.to_json() for f in fa] == [f.to_json() for f in fb]


def test_reset_after_rollback_rearms_the_latch_and_keeps_the_baseline():
    values = blowup(5, rate=0.03)
    det = AttnLogitGrowthDetector(KEY)
    first = run(det, values[:1020])  # the supervisor rolls back soon after the finding
    assert first
    det.reset(990)  # rollback: steps >= 990 repeat; history before stays, no new warm-up
    again = run(det, values[990:1030], 990)
    assert again and again[0].detect_step == first[0].detect_step
    assert abs(again[0].onset_step - 1000) <= 5


def test_rollback_deeper_than_the_buffer_waits_for_a_refilled_window():
    values = blowup(5, rate=0.03, n=1100)
    det = AttnLogitGrowthDetector(KEY)
    run(det, values)  # the buffer (128 points) now holds only steps >= 972
    det.reset(900)
    assert len(det.history) == 0
    assert run(det, values[900:940], 900) == []  # needs window/2 + slope_window points first
    refound = run(det, values[940:1100], 940)
    assert refound and abs(refound[0].onset_step - 1000) <= 5


def test_steps_going_back_without_reset_rewind_implicitly():
    values = blowup(5, rate=0.03)
    det = AttnLogitGrowthDetector(KEY)
    first = run(det, values[:1030])
    again = run(det, values[990:1030], 990)
    assert first and again and again[0].detect_step == first[0].detect_step


def test_ceiling_fires_once_critical_and_clears_below_90_percent():
    det = AttnLogitCeilingDetector(KEY, AttnLogitConfig(ceiling=50.0, clear_steps=3))
    values = [30.0] * 20 + [55.0] * 5 + [40.0] * 3 + [60.0] * 2
    findings = run(det, values)
    assert [f.detect_step for f in findings] == [20, 28]
    assert all(f.severity is Severity.CRITICAL and f.signal is Signal.ATTN_LOGIT_CEILING for f in findings)
    assert findings[0].onset_step == 20 and findings[0].evidence["threshold"] == 50.0


def test_ceiling_offset_applies_to_the_lse_bound_only():
    cfg = AttnLogitConfig(ceiling=100.0, lse_ceiling_offset=8.3)
    assert AttnLogitCeilingDetector("attn_logit_lse/b.0", cfg).update(0, 105.0) is None
    assert AttnLogitCeilingDetector("attn_logit_max/b.0", cfg).update(0, 105.0) is not None


def test_non_finite_and_non_positive_values_are_skipped():
    det = AttnLogitGrowthDetector(KEY)
    for v in (math.nan, math.inf, -1.0, 0.0):
        assert det.update(0, v) is None
    assert len(det.history) == 0


@pytest.mark.parametrize("bad", [dict(min_ratio=1.0), dict(window=2), dict(confirm=0), dict(ceiling=-1.0),
                                 dict(level_points=20), dict(history=10)])
def test_config_rejects_bad_values(bad):
    with pytest.raises(ValueError):
        AttnLogitConfig(**bad)
