"""Detectors that know the cadence (issue 36, part 4). A thermometer group read every k-th step
(step % k == 0) is ABSENT from the records in between: never a zero, never the last value. A
missing point must not read as a zero, a reset, a stall or a finding, and a window must mean the
same stretch of training whether its series is read every step or every 16th.

Each test names the case it was written for: what the detectors did before.
"""

from __future__ import annotations

import functools
import json
import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thermowatch.monitors.contract import (ACT_MAX, ACT_MIN, ATTN_ENTROPY_MIN, ATTN_LOGIT_LSE, ATTN_LOGIT_MAX,
                                           GRAD_NORM, UPDATE_RATIO, Z, Signal, StepRecord, split_key)
from thermowatch.monitors.detectors import BankConfig, DetectorBank, Witnesses
from thermowatch.monitors.detectors.arrays import pack, unpack
from thermowatch.supervisor.decide.replay_policy import replay_decider
from tests.fixtures import traces

pytestmark = pytest.mark.timeout(300)

ACTS = {"rollback", "set_lr", "pause"}
# The groups a budget thins, by metric name (as bench/_divergence_thin.py): the global grad_norm stays.
GROUPS = {"attn": {ATTN_LOGIT_MAX, ATTN_LOGIT_LSE, ATTN_ENTROPY_MIN}, "act": {ACT_MAX, ACT_MIN, Z},
          "grad": {GRAD_NORM}, "update": {UPDATE_RATIO}}


def _thin(records: list[StepRecord], every: dict[str, int]) -> list[StepRecord]:
    """The records as a client reading group g every every[g]-th step sends them."""
    out = []
    for r in records:
        values = {}
        for k, v in r.values.items():
            metric, module = split_key(k)
            g = next((g for g, names in GROUPS.items() if metric in names and (module or metric != GRAD_NORM)), None)
            if g is None or r.step % every.get(g, 1) == 0:
                values[k] = v
        out.append(StepRecord(step=r.step, values=values, wall_time=r.wall_time))
    return out


def _judge(records, cfg=None):
    """(finding, decision) of the default policy for each finding of a replay."""
    bank, decide = DetectorBank(BankConfig.from_dict(cfg)), replay_decider({})
    return [(f, decide(f), r) for r in records for f in bank.observe(r)]


# --- witnesses --------------------------------------------------------------------------------


def _witness_run(every: int, n: int, z, stop: int | None = None):
    """Witnesses over loss and the global grad norm every step and z/head read every `every`-th
    step (until `stop`): the witnesses speaking after each step."""
    rng = np.random.default_rng(every)
    w, out = Witnesses(), []
    for step in range(1, n + 1):
        v = {"loss": 2.5 + 0.01 * float(rng.standard_normal()), "grad_norm": 0.5, "lr": 1e-3}
        if step % every == 0 and (stop is None or step <= stop):
            v["z/head"] = z(step)
        w.observe(StepRecord(step=step, values=v))
        out.append(set(w.harm()))
    return out


@settings(max_examples=20, deadline=None)
@given(every=st.sampled_from([2, 4, 8, 16]), rise_at=st.integers(300, 500), rise=st.floats(2.5, 6.0))
def test_a_witness_speaks_from_its_latest_reading_until_the_next(every, rise_at, rise):
    """Before: a witness spoke only on the steps its series was read. With z read every 16th
    step, an attention finding on any of the 15 steps between heard no z_growth at all: a
    missing point read as "no harm". Now each step says what the latest reading said, and a series
    that stops being read falls silent once its next two readings are overdue."""
    n, stop = rise_at + 30 * every, rise_at + 20 * every
    z = lambda s: 5.0 + 0.05 * math.sin(s) + (rise if s >= rise_at else 0.0)  # noqa: E731
    said = _witness_run(every, n, z, stop)
    spoke = [s for s in range(1, n + 1) if "z_growth" in said[s - 1]]
    assert spoke, "the rise was never witnessed"
    for s in range(spoke[0], stop + 1):
        last_read = s - s % every
        assert ("z_growth" in said[s - 1]) == ("z_growth" in said[last_read - 1]), s
    assert any(s % every for s in spoke), "it spoke only on the steps z was read"
    last = stop - stop % every
    assert all(s <= last + 2 * every for s in spoke), "a series no longer read went on speaking"


def _drift(s: int) -> float:
    """z of a healthy run, rising slowly as its output sharpens: 6 nats over 1,000 steps."""
    return 5.0 + 0.006 * s + 0.05 * math.sin(1.7 * s)


@pytest.mark.parametrize("every", [1, 4, 16])
def test_a_baseline_is_the_series_level_lately_not_since_its_early_steps(every):
    """Before: the baseline was the 64 readings before the recent 8, 1,000 steps back for z read
    every 16th step: a healthy run's early rise of z read as "+2 nats over its baseline", which
    read every step it never was. Now the baseline is the readings of the 64 steps before them."""
    said = _witness_run(every, 1200, _drift)
    assert not any("z_growth" in s for s in said)


def test_a_healthy_run_read_at_the_budgets_cadence_is_not_acted_on_through_z():
    """The real trace of that: a healthy rise-and-fall of the attention logits (tests/fixtures/
    traces) with z read every 16th step. With the first fix alone (witnesses standing between
    readings, the baseline still in readings), the ceiling acted at step 693 with "z/head +2.2
    nats over its baseline"."""
    found = _judge(_thin(traces.load("rise_and_fall"), {"act": 16}))
    assert [(f.detect_step, f.signal.value, d["kind"]) for f, d, _ in found if d["kind"] in ACTS] == []


def _update_run(lr, ratio, n=400, every=10):
    w, out = Witnesses(), []
    for step in range(1, n + 1):
        v = {"loss": 2.5, "grad_norm": 0.5, "lr": lr(step)}
        v[f"{UPDATE_RATIO}/blocks.0"] = ratio(step) if step % every == 0 else math.nan  # NaN: not measured
        w.observe(StepRecord(step=step, values=v))
        out.append(set(w.harm()))
    return out


def test_the_update_ratio_is_judged_per_unit_of_lr_and_from_its_first_hundred_steps():
    """Before: the update ratio, read every 10th step, needed 32 readings of baseline, 400 steps,
    before it could speak at all. Counted in steps it speaks from step ~110; and then an LR raise
    (the grid's x30 operator raise, healthy by its loss) must not read as harm by itself: the
    ratio is judged per unit of LR. Updates that grow at the same LR still speak."""
    raised = _update_run(lambda s: 1e-3 * (30.0 if s >= 200 else 1.0),
                         lambda s: 0.004 * (4.0 if s >= 200 else 1.0))
    assert not any("update_growth" in s for s in raised)
    grown = _update_run(lambda s: 1e-3, lambda s: 0.004 * (4.0 if s >= 200 else 1.0))
    spoke = [s for s in range(1, 401) if "update_growth" in grown[s - 1]]
    assert spoke and 200 <= spoke[0] <= 250, spoke[:3]


# --- onsets, warm-up ---------------------------------------------------------------------------


@settings(max_examples=15, deadline=None)
@given(every=st.sampled_from([1, 2, 4, 8, 16]), reads_before=st.integers(12, 30))
def test_an_onset_is_the_step_after_the_last_reading_before_the_change(every, reads_before):
    """Before: a series read every 16th step that overflowed (or turned NaN) at a reading got
    that reading's step as its onset, though the change may have begun on any of the 15 steps
    since the last reading; a rollback "before the onset" could keep some of them."""
    cross = every * (reads_before + 1)
    records, nan_at = [], cross + 10 * every
    for step in range(1, nan_at + 1):
        v = {"loss": 2.5, "grad_norm": 0.5}
        if step % every == 0:  # one layer overflows at `cross`; another turns NaN at `nan_at`
            v["act_max/blocks.0"] = 100.0 if step < cross else 40000.0
            v["act_max/blocks.1"] = math.nan if step == nan_at else 100.0 * (1.0 + 0.01 * math.sin(step))
        records.append(StepRecord(step=step, values=v))
    found = [f for f, _, _ in _judge(records, {"act": {"dtype": "fp16"}})]
    over = [f for f in found if f.signal is Signal.ACT_OVERFLOW]
    assert [(f.metric, f.detect_step, f.onset_step) for f in over] == [("act_max/blocks.0", cross, cross - every + 1)]
    nan = [f for f in found if f.signal is Signal.NON_FINITE]
    assert [(f.metric, f.detect_step, f.onset_step) for f in nan] == [("act_max/blocks.1", nan_at, nan_at - every + 1)]


def _layer_norms(seed: int, n: int, every: int, spike_reads: tuple[int, ...] = ()):
    """A per-layer gradient norm read every `every`-th step, log-normal around a slow decay as a
    real run's (0.2 sd in log), x20 at the given readings; loss and the global norm every step."""
    rng = np.random.default_rng(seed)
    out, read = [], 0
    for step in range(1, n + 1):
        v = {"loss": 2.5 + 0.02 * float(rng.standard_normal()), "grad_norm": 0.5 * math.exp(0.1 * rng.standard_normal())}
        if step % every == 0:
            read += 1
            g = 0.3 * math.exp(-step / 3000) * math.exp(0.2 * float(rng.standard_normal()))
            v["grad_norm/blocks.0"] = g * (20.0 if read in spike_reads else 1.0)
        out.append(StepRecord(step=step, values=v))
    return out


def test_a_layer_read_every_16th_step_leaves_warm_up_by_its_age():
    """Before: the spike detectors' warm-up of 100 counted points, so a per-layer norm read every
    16th step was in warm-up until step 1,600 and a x20 spike at step ~350 went unseen. Warm-up is
    "early training falls and jumps fast": steps of age, then the window's 16 points."""
    found = _judge(_layer_norms(0, 400, 16, spike_reads=(21, 22)))
    spikes = [f for f, _, _ in found if f.signal is Signal.GRAD_SPIKE and f.metric == "grad_norm/blocks.0"]
    assert spikes and spikes[0].detect_step == 22 * 16 and spikes[0].onset_step == 20 * 16 + 1


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31 - 1), every=st.sampled_from([4, 8, 16]))
def test_a_quiet_layer_read_sparsely_raises_nothing(seed, every):
    assert [f for f, _, _ in _judge(_layer_norms(seed, 1200, every))] == []


# --- steps that go back --------------------------------------------------------------------------


def test_a_step_going_back_forgets_the_abandoned_path_of_series_the_record_does_not_carry():
    """Before: an unannounced rollback (a replay of a log with a restart) rewound only the series
    the repeated record carried. Attention read every 4th step, then from step 98 again: the
    record at 98 carries none, and its points at 100-120, of the path left behind, stayed in the
    windows until the next reading (at 104, or never, had the new path read every 8th step)."""
    bank = DetectorBank()
    recs = [StepRecord(step=s, values={"loss": 2.5, **({"attn_logit_max/b0": 8.0} if s % 4 == 0 else {})})
            for s in range(1, 121)]
    for r in recs:
        bank.observe(r)
    bank.observe(StepRecord(step=98, values={"loss": 2.5}))
    for name in ("attn_growth", "attn_ceiling", "non_finite"):
        R = bank.series[name].rows
        assert R.tail_steps(R.index["attn_logit_max/b0"], 128).max() < 98, name


# --- real traces at any cadence ----------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _every_step(name: str) -> tuple[tuple[int, str], ...]:
    return tuple((f.detect_step, f.signal.value) for f, d, _ in _judge(traces.load(name)) if d["kind"] in ACTS)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(traces.TRACES)), attn=st.sampled_from([1, 2, 4, 8]),
       act=st.sampled_from([1, 2, 4, 8, 16]), update=st.sampled_from([1, 10, 20]))
def test_real_traces_read_at_any_cadence(name, attn, act, update):
    """The recorded traces (tests/fixtures/traces: healthy, rise-and-fall, late divergence, LR
    jumps, a qk-LN blow-up ...) with the attention figure read every `attn`-th step, z every
    `act`-th, the update ratio every `update`-th: no finding on a key its record lacks (a missing
    point is never a finding), no non-finite finding, no act where every-step reading has none,
    and every trace acted on still acted on, by the same signal, at most attn - 1 steps later."""
    found = _judge(_thin(traces.load(name), {"attn": attn, "act": act, "update": update}))
    for f, _, rec in found:
        assert f.metric in rec.values, (f.detect_step, f.signal.value, f.metric)
    assert [f for f, _, _ in found if f.signal is Signal.NON_FINITE] == []
    acts = [(f.detect_step, f.signal.value) for f, d, _ in found if d["kind"] in ACTS]
    base = _every_step(name)
    assert bool(acts) == bool(base), (acts[:1], base[:1])
    if base:
        assert acts[0][1] == base[0][1] and base[0][0] <= acts[0][0] <= base[0][0] + attn - 1, (acts[0], base[0])


# --- state -------------------------------------------------------------------------------------


def test_a_state_saved_before_rows_knew_their_first_step_loads():
    """The rows' first step (for a series' age) is new in the saved state; a state saved without
    it loads, taking the oldest point its ring holds, and judges on as a bank that never stopped."""
    recs = traces.load("late")
    whole = [f.to_json() for f, _, _ in _judge(recs)]
    a = DetectorBank()
    head = [f.to_json() for r in recs[:120] for f in a.observe(r)]
    parts = {}
    for k, v in a.state_parts().items():
        if k.endswith(".rows"):
            arrays, extra = unpack(v)
            assert "born" in arrays
            v = pack({n: x for n, x in arrays.items() if n != "born"}, extra)
        parts[k] = v
    b = DetectorBank()
    b.load_state_parts(parts)
    tail = [f.to_json() for r in recs[120:] for f in b.observe(r)]
    assert head + tail == whole
    json.dumps(b.state_dict(), allow_nan=False)
