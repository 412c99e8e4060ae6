"""Non-finite, activation overflow, stall and outlier-rank detectors, and the DetectorBank."""

import json
import math

import numpy as np
import pytest

from thermowatch.monitors.contract import Finding, Severity, Signal, StepRecord
from thermowatch.monitors.detectors import (
    ROUTES,
    ActOverflowConfig,
    ActOverflowDetector,
    BankConfig,
    DetectorBank,
    NonFiniteDetector,
    OutlierRankConfig,
    OutlierRankDetector,
    StallConfig,
    StallDetector,
    Witnesses,
)


def run(det, values, start=0):
    return [f for i, v in enumerate(values) if (f := det.update(start + i, float(v))) is not None]


# --- non-finite ---------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_loss_is_critical_at_once_and_latched(bad):
    det = NonFiniteDetector("loss")
    findings = run(det, [2.5] * 20 + [bad] * 5)
    assert len(findings) == 1
    f = findings[0]
    assert f.signal is Signal.NON_FINITE and f.severity is Severity.CRITICAL
    assert f.detect_step == 20 and f.onset_step == 20 and f.module == ""
    assert isinstance(f.evidence["value"], str)  # strict JSON: "nan"/"inf"
    json.dumps(f.to_json(), allow_nan=False)


def test_non_finite_in_other_metric_is_warn_and_clears_after_finite_run():
    det = NonFiniteDetector("tokens_per_s")
    values = [1e5] * 5 + [math.nan] + [1e5] * 10 + [math.nan]
    findings = run(det, values)
    assert [(f.detect_step, f.severity) for f in findings] == [(5, Severity.WARN), (16, Severity.WARN)]


def test_non_finite_onset_goes_back_to_where_the_climb_began():
    rng = np.random.default_rng(0)
    loss = 2.5 + rng.normal(0, 0.02, 100)
    loss[80:] = 2.5 * np.exp(0.15 * np.arange(1, 21))  # climbs from step 80, NaN at 100
    det = NonFiniteDetector("loss")
    run(det, loss)
    f = det.update(100, math.nan)
    assert f is not None and abs(f.onset_step - 80) <= 2 and f.evidence["onset_method"] == "change_point"


def test_non_finite_grad_norm_of_a_module_is_critical():
    f = NonFiniteDetector("grad_norm/blocks.0.attn").update(3, math.nan)
    assert f is not None and f.severity is Severity.CRITICAL and f.module == "blocks.0.attn"


# --- activation overflow ------------------------------------------------------------------------


def test_act_overflow_fp16_warn_then_critical_with_onset():
    det = ActOverflowDetector("act_max/blocks.2.mlp", ActOverflowConfig(dtype="fp16"))
    values = [100.0] * 50 + [100.0 * 1.3**k for k in range(1, 30)]
    findings = run(det, values)
    assert [f.severity for f in findings] == [Severity.WARN, Severity.CRITICAL]
    first = findings[0]
    assert first.signal is Signal.ACT_OVERFLOW and first.evidence["value"] > 0.5 * 65504
    assert first.evidence["threshold"] == 0.5 * 65504
    assert abs(first.onset_step - 50) <= 2
    assert findings[1].onset_step == first.onset_step


def test_act_min_uses_magnitude():
    det = ActOverflowDetector("act_min/blocks.0", ActOverflowConfig(dtype="fp16", fraction=0.25))
    assert det.update(0, -1000.0) is None
    f = det.update(1, -20000.0)
    assert f is not None and f.evidence["value"] == -20000.0


def test_bf16_activations_of_ordinary_size_never_trigger():
    det = ActOverflowDetector("act_max/blocks.0")
    assert run(det, np.random.default_rng(1).lognormal(5, 2, 5000)) == []


def test_act_config_validation():
    with pytest.raises(ValueError, match="dtype"):
        ActOverflowConfig(dtype="int8")
    with pytest.raises(ValueError):
        ActOverflowConfig(fraction=0.95, critical_fraction=0.9)


# --- stall --------------------------------------------------------------------------------------


def test_stall_after_timeout_escalates_and_clears_on_next_step():
    det = StallDetector(StallConfig(timeout_s=60.0, critical_factor=3.0))
    assert det.check(1000.0) is None  # nothing seen yet: nothing to judge
    det.update(10, wall_time=1000.0)
    assert det.check(1059.0) is None
    f = det.check(1061.0)
    assert f is not None and f.signal is Signal.STALL and f.severity is Severity.WARN
    assert f.onset_step == 10 and f.evidence["silent_s"] == pytest.approx(61.0)
    assert det.check(1100.0) is None  # latched
    g = det.check(1200.0)
    assert g is not None and g.severity is Severity.CRITICAL
    assert det.check(1300.0) is None
    det.update(11, wall_time=1301.0)
    assert det.check(1302.0) is None


def test_stall_state_round_trip():
    det = StallDetector(StallConfig(timeout_s=60.0))
    det.update(5, wall_time=100.0)
    det.check(170.0)
    other = StallDetector(StallConfig(timeout_s=60.0))
    other.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert other.check(175.0) is None  # latch survived
    assert other.check(300.0) is not None  # escalation still possible


# --- outlier rank -------------------------------------------------------------------------------


def _ranks(seed, n, world, bad_rank=None, start_bad=None):
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        r = int(rng.integers(world))
        if bad_rank is not None and i >= start_bad and rng.random() < 0.95:
            r = bad_rank
        out.append(r)
    return out


def test_outlier_rank_named_when_one_rank_keeps_the_max():
    det = OutlierRankDetector(OutlierRankConfig(window=50, min_points=30))
    key = "grad_norm/blocks.4.mlp"
    findings = []
    for step, r in enumerate(_ranks(0, 400, world=8, bad_rank=5, start_bad=200)):
        findings += det.observe(StepRecord(step=step, values={key: 1.0}, ranks={key: r}))
    assert len(findings) == 1
    f = findings[0]
    assert f.signal is Signal.OUTLIER_RANK and f.module == key and f.evidence["rank"] == 5
    assert 200 <= f.onset_step <= f.detect_step <= 260


def test_outlier_rank_silent_for_uniform_holders_and_single_rank():
    det = OutlierRankDetector()
    for step, r in enumerate(_ranks(1, 3000, world=2)):
        assert det.observe(StepRecord(step=step, values={}, ranks={"act_max/b": r})) == []
    single = OutlierRankDetector()
    for step in range(200):
        assert single.observe(StepRecord(step=step, values={}, ranks={"act_max/b": 0})) == []


# --- the bank -----------------------------------------------------------------------------------


def _records(n=600, seed=0, blowup_at=None, nan_at=None):
    rng = np.random.default_rng(seed)
    out = []
    for step in range(n):
        logit = 8.0 * math.exp(rng.normal(0, 0.03))
        if blowup_at is not None and step >= blowup_at:
            logit *= math.exp(0.04 * (step - blowup_at + 1))
        loss = 2.5 * (1 + rng.normal(0, 0.02))
        if nan_at is not None and step >= nan_at:
            loss = math.nan
        values = {"loss": loss, "grad_norm": 0.5 * math.exp(rng.normal(0, 0.2)), "lr": 3e-4,
                  "attn_logit_max/blocks.0.attn": logit, "attn_logit_max/blocks.1.attn": 6.0,
                  "act_max/blocks.0": 30.0, "act_min/blocks.0": -30.0, "tokens_per_s": 1e4}
        out.append(StepRecord(step=step, values=values, wall_time=1000.0 + step,
                              ranks={"grad_norm": int(rng.integers(4))}))
    return out


def test_bank_routes_keys_and_reports_the_growing_layer_only():
    bank = DetectorBank()
    findings = bank.observe_many(_records(blowup_at=400))
    growth = [f for f in findings if f.signal is Signal.ATTN_LOGIT_GROWTH]
    assert growth and {f.module for f in growth} == {"blocks.0.attn"}
    assert abs(growth[0].onset_step - 400) <= 5
    assert set(bank.series["attn_growth"]) == {"attn_logit_max/blocks.0.attn", "attn_logit_max/blocks.1.attn"}
    assert set(bank.series["loss_spike"]) == {"loss"}
    assert set(bank.series["act_overflow"]) == {"act_max/blocks.0", "act_min/blocks.0"}
    assert "lr" in bank.series["non_finite"] and "lr" not in bank.series["grad_spike"]


def test_bank_clean_run_raises_nothing():
    assert DetectorBank().observe_many(_records(n=2000, seed=3)) == []


def test_bank_nan_loss_is_one_critical_finding():
    findings = DetectorBank().observe_many(_records(nan_at=300))
    assert [(f.signal, f.detect_step, f.severity) for f in findings] == [(Signal.NON_FINITE, 300, Severity.CRITICAL)]


def test_bank_sees_a_stall_as_a_gap_in_wall_time_and_on_check():
    recs = _records(n=120)
    for r in recs[100:]:
        r.wall_time += 3600.0  # the run hung for an hour after step 99
    bank = DetectorBank(BankConfig(stall=StallConfig(timeout_s=600.0)))
    stalls = [f for f in bank.observe_many(recs) if f.signal is Signal.STALL]
    assert [(f.onset_step, f.detect_step, f.severity) for f in stalls] == [(99, 99, Severity.CRITICAL)]
    assert bank.check(recs[-1].wall_time + 10) == []
    assert [f.signal for f in bank.check(recs[-1].wall_time + 601)] == [Signal.STALL]


def test_bank_state_round_trip_mid_stream_is_strict_json_and_identical():
    recs = _records(n=700, blowup_at=450, nan_at=650)
    a = DetectorBank()
    a.observe_many(recs[:440])
    state = json.loads(json.dumps(a.state_dict(), allow_nan=False))
    b = DetectorBank()
    b.load_state_dict(state)
    fa, fb = a.observe_many(recs[440:]), b.observe_many(recs[440:])
    assert fa and [f.to_json() for f in fa] == [f.to_json() for f in fb]


def test_bank_reset_after_rollback_repeats_the_finding():
    recs = _records(n=470, blowup_at=400)
    bank = DetectorBank()
    first = [f for f in bank.observe_many(recs) if f.signal is Signal.ATTN_LOGIT_GROWTH]
    bank.reset(390)
    again = [f for f in bank.observe_many(recs[390:]) if f.signal is Signal.ATTN_LOGIT_GROWTH]
    assert first and again and again[0].detect_step == first[0].detect_step


def test_bank_disabled_routes_and_config_from_dict():
    cfg = BankConfig.from_dict({"attn": {"ceiling": 7.0}, "disabled": ["attn_growth", "stall"]})
    assert cfg.attn.ceiling == 7.0 and cfg.loss.window == 128
    findings = DetectorBank(cfg).observe_many(_records(n=50))
    assert {f.signal for f in findings} == {Signal.ATTN_LOGIT_CEILING}
    with pytest.raises(ValueError, match="unknown detector names"):
        BankConfig(disabled=("nope",))
    with pytest.raises(ValueError, match="unknown detector config sections"):
        BankConfig.from_dict({"atn": {}})
    with pytest.raises(TypeError):
        BankConfig.from_dict({"attn": {"no_such_field": 1}})


@pytest.mark.parametrize("route", ROUTES, ids=lambda r: r.name)
def test_every_route_obeys_the_detector_contract(route):
    """Composer-style contract test over every registered detector: strict-JSON state, state
    round trip, findings carry the key, reset() forgets the latch."""
    metric = next(iter(route.metrics)) if route.metrics else "tokens_per_s"
    key = metric if metric in ("loss", "grad_norm", "tokens_per_s") else f"{metric}/blocks.0"
    det = route.build(key, BankConfig(act=ActOverflowConfig(dtype="fp16")), Witnesses())
    sign = -1.0 if metric == "act_min" else 1.0
    rng = np.random.default_rng(0)
    base = [sign * 5.0 * math.exp(rng.normal(0, 0.02)) for _ in range(300)]
    bad = [sign * (math.nan if route.name == "non_finite" else 5.0 * 1.5**k) for k in range(1, 40)]
    out1 = run(det, base + bad)
    assert out1 and all(isinstance(f, Finding) and f.metric == key for f in out1)
    state = json.loads(json.dumps(det.state_dict(), allow_nan=False))
    twin = route.build(key, BankConfig(act=ActOverflowConfig(dtype="fp16")), Witnesses())
    twin.load_state_dict(state)
    assert twin.state_dict() == det.state_dict()
    det.reset(300)
    out2 = run(det, bad, 300)

    def brief(fs):  # evidence may differ: the bounded buffer lost points to the first pass
        return [(f.signal, f.severity, f.onset_step, f.detect_step) for f in fs[:1]]

    assert brief(out2) == brief(out1)


def test_non_finite_findings_name_the_first_broken_output_in_forward_order():
    """The loss and every gradient turn NaN with any layer; the activations before the broken
    module do not. A block's output holds its MLP's, so the MLP (the child) is the origin."""
    mods = ["embed_norm", "blocks.0", "blocks.0.attn", "blocks.0.mlp", "blocks.1", "blocks.1.attn", "blocks.1.mlp"]
    bank = DetectorBank(BankConfig())
    nan = float("nan")

    def rec(step, broken=(), loss=2.0):
        vals = {"loss": loss, "grad_norm": 1.0 if loss == loss else nan}
        for m in mods:
            vals[f"act_max/{m}"] = nan if m in broken else 3.0 + 0.01 * step
            vals[f"act_min/{m}"] = nan if m in broken else -3.0
        return StepRecord(step=step, values=vals)

    for s in range(1, 20):
        assert bank.observe(rec(s)) == []
    found = bank.observe(rec(20, broken=("blocks.1", "blocks.1.mlp"), loss=nan))
    nf = [f for f in found if f.signal is Signal.NON_FINITE]
    assert {f.metric for f in nf} >= {"loss", "grad_norm", "act_max/blocks.1.mlp", "act_max/blocks.1"}
    assert {f.evidence["origin"] for f in nf} == {"act_max/blocks.1.mlp"}
    # Only the loss broke (no activation thermometer saw it): nothing to name.
    bank2 = DetectorBank(BankConfig())
    for s in range(1, 20):
        bank2.observe(rec(s))
    assert all("origin" not in f.evidence for f in bank2.observe(rec(20, loss=nan)))
