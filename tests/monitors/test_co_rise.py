"""A blow-up that builds (issue 24, item 3: detectors/co_rise.py): the loss and the gradient norm
rising together, acted on well before the loss-spike detector would, and never on the healthy
runs, on real recorded traces (tests/fixtures/traces: tiny GPTs trained by bench/_divergence_runs.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from thermowatch.monitors.contract import GRAD_NORM, LOSS, Outcome, Severity, Signal, signal_family
from thermowatch.monitors.columns import StepColumns
from thermowatch.monitors.detectors import BankConfig, CoRiseConfig, CoRiseDetector, DetectorBank
from thermowatch.monitors.contract import DEFAULT_ROLLBACK_SIGNALS
from thermowatch.supervisor.decide.replay_policy import replay_decider
from tests.fixtures import traces

ACTS = {"rollback", "set_lr", "pause"}


def _acts(name: str, disabled: tuple[str, ...] = ()) -> list[tuple[str, int, int, str]]:
    bank, decide = DetectorBank(BankConfig.from_dict({"disabled": list(disabled)})), replay_decider({})
    out = []
    for rec in traces.load(name):
        for f in bank.observe(rec):
            d = decide(f)
            if d["kind"] in ACTS:
                out.append((f.signal.value, f.onset_step, f.detect_step, d["kind"]))
    return out


def test_a_building_blowup_is_rolled_back_64_steps_before_the_loss_spike_would():
    """qk-LN at a long warm-up to LR 1.0: the loss climbs from ~3.0 at step ~155 (5+ by 200) with
    the gradient norm, logits under 100 until step 248. The co-rise acts at 169 with an onset of 160;
    without it the first act is the loss spike's, at 233."""
    first = _acts("qkln_blowup")[0]
    assert first[0] == "loss_grad_rise" and first[3] == "rollback"
    assert 155 <= first[1] <= first[2] <= 175, first
    before = _acts("qkln_blowup", disabled=("co_rise",))
    assert before and before[0][2] >= first[2] + 50, before
    loss = np.array([r.values[LOSS] for r in traces.load("qkln_blowup")])
    # The act comes with the trailing loss ~10 % up; the spike's, with it ~60 % up (the held-out
    # run of issue 24 was acted on after a ~50 % rise).
    base = float(np.median(loss[100:150]))
    assert loss[first[2] - 9: first[2] + 1].mean() < 1.2 * base
    assert loss[before[0][2] - 9: before[0][2] + 1].mean() > 1.5 * base


def test_an_operators_x30_raise_the_policy_missed_is_now_rolled_back():
    acts = _acts("jump_x30")
    assert acts and acts[0][0] == "loss_grad_rise" and acts[0][3] == "rollback"
    assert 200 <= acts[0][2] <= 212, acts
    assert _acts("jump_x30", disabled=("co_rise",)) == []  # the miss it closes


@pytest.mark.parametrize("name", ["healthy", "rise_and_fall", "logit_growth", "qkln_high_lr", "crossing_before_peak",
                                  "jump_x4"])
def test_no_healthy_trace_and_no_transient_raise_meets_it(name):
    bank = DetectorBank(BankConfig())
    found = [f for rec in traces.load(name) for f in bank.observe(rec) if f.signal is Signal.LOSS_GRAD_RISE]
    assert found == []


def _series(n: int, rise_at: int | None, loss_rise: float, grad_rise: float, seed: int = 0):
    """A flat noisy loss and gradient norm; from `rise_at`, both ramp up for 40 steps, then stay."""
    rng = np.random.default_rng(seed)
    loss = 3.0 + 0.1 * rng.standard_normal(n)
    grad = np.exp(0.2 * rng.standard_normal(n))
    if rise_at is not None:
        ramp = np.clip(np.arange(n) - rise_at, 0, 40)
        loss = loss + loss_rise * ramp
        grad = grad * (1 + grad_rise * ramp)
    return loss, grad


def _judge(det: CoRiseDetector, loss, grad, start: int = 0):
    return [f for i in range(len(loss)) if (f := det.observe(start + i, {LOSS: loss[i], GRAD_NORM: grad[i]}.get))]


def test_the_finding_acts_with_its_evidence_and_is_a_loss_divergence_to_the_policy():
    loss, grad = _series(400, 250, 0.03, 0.15)
    (f,) = _judge(CoRiseDetector(), loss, grad)
    assert f.signal is Signal.LOSS_GRAD_RISE and f.outcome is Outcome.ACT and f.severity is Severity.CRITICAL
    assert 245 <= f.onset_step <= f.detect_step <= 265, (f.onset_step, f.detect_step)
    ev = f.evidence
    assert ev["value"] >= ev["threshold"] > ev["baseline"] and ev["grad_ratio"] >= 1.5
    assert Signal.LOSS_GRAD_RISE in DEFAULT_ROLLBACK_SIGNALS
    assert signal_family(Signal.LOSS_GRAD_RISE) == signal_family(Signal.LOSS_SPIKE)


@pytest.mark.parametrize("loss_rise,grad_rise", [(0.03, 0.0), (0.0, 0.15)])
def test_one_rising_alone_is_not_a_blowup(loss_rise, grad_rise):
    """A loss up with a quiet gradient norm (a hard stretch of data) or the gradient norm up with
    a quiet loss (clipping absorbs it) is the spike detectors' business, not this one's."""
    loss, grad = _series(400, 250, loss_rise, grad_rise)
    assert _judge(CoRiseDetector(), loss, grad) == []


def test_no_gradient_norm_means_nothing_and_nan_points_are_passed_over():
    loss, _ = _series(400, 250, 0.03, 0.15)
    det = CoRiseDetector()
    assert [det.observe(i, {LOSS: v}.get) for i, v in enumerate(loss)] == [None] * 400
    loss, grad = _series(400, 250, 0.03, 0.15)
    loss[100:110] = math.nan
    assert len(_judge(CoRiseDetector(), loss, grad)) == 1


def test_a_rollback_forgets_the_rise_and_judges_the_retrained_steps_again():
    loss, grad = _series(400, 250, 0.03, 0.15)
    det = CoRiseDetector()
    (f,) = _judge(det, loss[:300], grad[:300])
    det.reset(200)  # rolled back to 200: the re-trained path rises again at the same place
    (g,) = _judge(det, loss[200:300], grad[200:300], start=200)
    assert g.onset_step == f.onset_step and g.detect_step == f.detect_step
    # The state survives a save and load mid-way.
    det2 = CoRiseDetector()
    _judge(det2, loss[:240], grad[:240])
    det3 = CoRiseDetector()
    det3.load_state_dict(det2.state_dict())
    assert [(x.onset_step, x.detect_step) for x in _judge(det3, loss[240:300], grad[240:300], start=240)] == [
        (f.onset_step, f.detect_step)]


def test_config_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="grad_ratio"):
        CoRiseConfig(grad_ratio=1.0)
    with pytest.raises(ValueError, match="warmup"):
        CoRiseConfig(warmup=10)
    with pytest.raises(ValueError, match="unknown detector"):
        BankConfig(disabled=("co-rise",))


@settings(max_examples=8, deadline=None)
# CI's CPU: np.log's SIMD loop and math.log differed in the last bit of one window's median
@example(seed=4048, rise_at=120, cuts=[1, 6])
@given(seed=st.integers(0, 10_000), rise_at=st.sampled_from([None, 120, 200, 260]),
       cuts=st.lists(st.integers(1, 120), min_size=1, max_size=6))
def test_batches_judge_as_one_step_at_a_time(seed, rise_at, cuts):
    """The columns path (one sliding-window pass per batch) gives the findings and state of
    judging one record at a time, wherever the batches are cut."""
    loss, grad = _series(320, rise_at, 0.03, 0.15, seed)
    one = DetectorBank(BankConfig())
    want = [f for i in range(320) for f in one.observe_many([_record(i, loss[i], grad[i])])]
    bank, got, lo, i = DetectorBank(BankConfig()), [], 0, 0
    while lo < 320:
        hi, i = min(320, lo + cuts[i % len(cuts)]), i + 1
        got += bank.observe_many(StepColumns.from_records([_record(i, loss[i], grad[i]) for i in range(lo, hi)]))
        lo = hi
    assert [(f.signal, f.onset_step, f.detect_step, f.evidence) for f in got] == [
        (f.signal, f.onset_step, f.detect_step, f.evidence) for f in want]
    assert bank.co_rise.state_dict() == one.co_rise.state_dict()


def _record(step: int, loss: float, grad: float):
    from thermowatch.monitors.contract import StepRecord

    return StepRecord(step=step, values={LOSS: float(loss), GRAD_NORM: float(grad)})
