"""Peer baselines (OLMo-core, LLM Foundry, Megatron-LM) behave as their upstream rules say."""

import json
import math

import numpy as np
import pytest

from thermowatch.monitors.contract import Signal, StepRecord
from thermowatch.monitors.detectors.baselines import FoundryKillLossSpike, MegatronSpikyLoss, OlmoCoreSpike, PeerBank


def run(det, values, start=0):
    return [f for i, v in enumerate(values) if (f := det.update(start + i, float(v))) is not None]


def noisy(n, level=2.5, sigma=0.01, seed=0):
    return level * (1 + np.random.default_rng(seed).normal(0, sigma, n))


def test_olmo_core_fires_past_mean_plus_six_sigma_after_a_full_window():
    values = list(noisy(300))
    values[100] = 10.0  # inside the first 128 steps: no full window yet, ignored
    values[250] = 10.0
    findings = run(OlmoCoreSpike("loss"), values)
    assert [f.detect_step for f in findings] == [250]
    assert findings[0].evidence["rule"] == "olmo_core"


def test_olmo_core_threshold_is_inflated_by_a_recent_spike():
    # A spike inside the window raises mean + 6 std: a second spike 10 steps later is missed.
    # This is the weakness the robust median/MAD detectors avoid.
    values = list(noisy(400))
    values[300] = 6.0
    values[310] = 4.0  # 60 noise sigmas above the mean, yet under the inflated bar (~4.4)
    assert [f.detect_step for f in run(OlmoCoreSpike("loss"), values)] == [300]
    values[300] = 2.5
    assert [f.detect_step for f in run(OlmoCoreSpike("loss"), values)] == [310]


def test_foundry_needs_more_than_patience_outliers_and_reports_first_outlier():
    values = list(noisy(200))
    for i in range(150, 156):
        values[i] = 6.0  # >= 2x mean for 6 steps: the 5th consecutive (> patience 4) fires
    findings = run(FoundryKillLossSpike(), values)
    assert [(f.onset_step, f.detect_step) for f in findings] == [(150, 154)]
    short = list(noisy(200))
    for i in range(150, 154):
        short[i] = 6.0  # 4 outliers only
    assert run(FoundryKillLossSpike(), short) == []


def test_foundry_persistently_high_loss():
    values = [12.0] * 250  # above loss_cap=10 from the start, never 2x its own mean
    findings = run(FoundryKillLossSpike(), values)
    assert findings and findings[0].detect_step == 200  # from step 2 * window on


def test_megatron_ten_x_the_max_of_the_first_hundred():
    values = list(noisy(300))
    values[10] = 4.0  # part of the sampled max
    values[200] = 39.0  # < 10 x 4.0
    values[250] = 41.0
    values[260] = math.nan  # ignored
    findings = run(MegatronSpikyLoss(), values)
    assert [f.detect_step for f in findings] == [250]


def test_peer_bank_routes_scalar_keys_only_and_round_trips_state():
    bank = PeerBank("olmo_core")
    recs = [StepRecord(step=i, values={"loss": float(v), "grad_norm": 1.0 + 0.01 * (i % 7), "grad_norm/b.0": 99.0})
            for i, v in enumerate(noisy(200))]
    recs[180].values["grad_norm"] = 50.0
    bank.observe_many(recs[:150])
    twin = PeerBank("olmo_core")
    twin.load_state_dict(json.loads(json.dumps(bank.state_dict())))
    fa, fb = bank.observe_many(recs[150:]), twin.observe_many(recs[150:])
    assert [f.to_json() for f in fa] == [f.to_json() for f in fb]
    assert [(f.signal, f.metric, f.detect_step) for f in fa] == [(Signal.GRAD_SPIKE, "grad_norm", 180)]
    assert set(bank.series) == {"loss", "grad_norm"}


def test_peer_bank_rejects_unknown_names():
    with pytest.raises(ValueError, match="olmo_core"):
        PeerBank("nope")
