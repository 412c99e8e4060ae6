"""Loss-spike and grad-norm-spike detectors (robust rolling median/MAD) on constructed series."""

import json
import math

import numpy as np
import pytest

from thermowatch.monitors.contract import Severity, Signal
from thermowatch.monitors.detectors import GradSpikeConfig, GradSpikeDetector, LossSpikeConfig, LossSpikeDetector


def loss_curve(seed, n=5000, sigma=0.03):
    """A falling pretraining loss with batch noise: 8 -> ~2.5, noise proportional to level."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    level = 2.4 + 5.6 * np.exp(-t / 400.0)
    return level * (1 + rng.normal(0, sigma, n))


def grad_curve(seed, n=5000, sigma=0.25):
    """Grad norm: large early, settling to ~0.3, log-normal noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(n)
    return (0.3 + 3.0 * np.exp(-t / 200.0)) * np.exp(rng.normal(0, sigma, n))


def run(det, values, start=0):
    return [f for i, v in enumerate(values) if (f := det.update(start + i, float(v))) is not None]


@pytest.mark.parametrize("seed", range(4))
def test_clean_loss_raises_nothing(seed):
    assert run(LossSpikeDetector(), loss_curve(seed)) == []


@pytest.mark.parametrize("seed", range(4))
def test_clean_grad_norm_raises_nothing(seed):
    assert run(GradSpikeDetector(), grad_curve(seed)) == []


@pytest.mark.parametrize("seed", range(3))
def test_loss_step_up_detected_with_exact_onset(seed):
    values = loss_curve(seed)
    values[3000:] *= 1.3  # a sustained jump (a PaLM-style spike that does not recover by itself)
    findings = run(LossSpikeDetector(), values)
    assert findings
    f = findings[0]
    assert f.signal is Signal.LOSS_SPIKE and f.module == "" and f.metric == "loss"
    assert f.detect_step == 3001  # confirm = 2 points
    assert f.onset_step == 3000
    assert f.severity is Severity.WARN
    assert f.evidence["value"] > f.evidence["threshold"] > f.evidence["baseline"]


def test_loss_exponential_rise_detected_with_onset_before_detection():
    values = loss_curve(0)
    t = np.arange(values.size)
    values = values * np.exp(0.02 * np.maximum(t - 2999, 0))
    findings = run(LossSpikeDetector(), values[:3100])
    assert findings and findings[0].detect_step <= 3015
    assert abs(findings[0].onset_step - 3000) <= 4
    assert findings[-1].severity is Severity.CRITICAL  # escalates once the loss is 1.5x baseline


def test_single_bad_batch_is_not_a_spike():
    values = loss_curve(1)
    values[3000] *= 2.0
    assert run(LossSpikeDetector(), values) == []


def test_falling_loss_is_not_a_spike():
    values = loss_curve(2)
    values[3000:] *= 0.7
    assert run(LossSpikeDetector(), values) == []


def test_warmup_suppresses_early_findings():
    values = loss_curve(3, n=300)
    values[50:] *= 2.0
    assert run(LossSpikeDetector(), values[:100]) == []


@pytest.mark.parametrize("seed", range(3))
def test_grad_norm_spike_in_log_space(seed):
    values = grad_curve(seed)
    values[4000:4010] *= 20.0
    findings = run(GradSpikeDetector("grad_norm/blocks.1.mlp"), values)
    assert len(findings) == 1  # latched over the burst, not one per step
    f = findings[0]
    assert f.signal is Signal.GRAD_SPIKE and f.module == "blocks.1.mlp"
    assert f.detect_step == 4001 and f.onset_step == 4000
    assert f.severity is Severity.CRITICAL  # 20x > critical_ratio 10x
    assert f.evidence["threshold"] / f.evidence["baseline"] >= 2.0  # min_ratio floor


def test_latch_clears_and_a_second_spike_is_reported():
    values = grad_curve(4)
    values[3000:3005] *= 20.0
    values[3500:3505] *= 20.0
    findings = run(GradSpikeDetector(), values)
    assert [f.onset_step for f in findings] == [3000, 3500]


def test_zero_and_non_finite_grad_norms_are_skipped():
    det = GradSpikeDetector()
    for i, v in enumerate([0.0, math.nan, math.inf, -1.0]):
        assert det.update(i, v) is None
    assert len(det.history) == 0


@pytest.mark.parametrize("make", [LossSpikeDetector, GradSpikeDetector])
def test_state_round_trip_mid_stream_gives_identical_findings(make):
    values = loss_curve(5) if make is LossSpikeDetector else grad_curve(5)
    values[3000:3010] *= 10.0
    a = make()
    run(a, values[:2990])
    b = make()
    b.load_state_dict(json.loads(json.dumps(a.state_dict(), allow_nan=False)))
    fa, fb = run(a, values[2990:], 2990), run(b, values[2990:], 2990)
    assert fa and [f.to_json() for f in fa] == [f.to_json() for f in fb]


def test_reset_rearms_the_latch():
    values = loss_curve(6)
    values[3000:] *= 1.3
    det = LossSpikeDetector()
    first = run(det, values[:3010])
    det.reset(2995)
    again = run(det, values[2995:3010], 2995)
    assert first and again and again[0].detect_step == first[0].detect_step == 3001


@pytest.mark.parametrize("bad", [dict(z=0), dict(window=4), dict(confirm=0), dict(history=10)])
def test_spike_configs_reject_bad_values(bad):
    with pytest.raises(ValueError):
        LossSpikeConfig(**bad)
    with pytest.raises(ValueError):
        GradSpikeConfig(**bad)


def test_grad_config_needs_ratio_over_one():
    with pytest.raises(ValueError, match="min_ratio"):
        GradSpikeConfig(min_ratio=0.5)


def test_a_re_sent_record_does_not_raise_the_same_finding_twice():
    values = loss_curve(7)
    values[3000:] *= 1.3
    det = LossSpikeDetector()
    first = run(det, values[:3010])
    assert [f.detect_step for f in first] == [3001]
    assert det.update(3009, float(values[3009])) is None  # the spool sent step 3009 again
    assert run(det, values[3010:3020], 3010) == []
