"""Detectors and the default policy on real recorded training traces (tests/fixtures/traces:
tiny GPTs trained by bench/_divergence_runs.py, not hand-made curves)."""

from __future__ import annotations

import pytest

from thermowatch.monitors.contract import LR, LR_PEAK_AHEAD, Outcome, Signal
from thermowatch.monitors.detectors import BankConfig, DetectorBank, Witnesses
from thermowatch.supervisor.decide.replay_policy import replay_decider
from tests.fixtures import traces

ACTS = {"rollback", "set_lr", "pause"}


def _replay(name: str, drop: tuple[str, ...] = ()):
    recs = traces.load(name)
    for r in recs:
        for k in drop:
            r.values.pop(k, None)
    bank, decide = DetectorBank(BankConfig()), replay_decider({})
    out = []
    for r in recs:
        for f in bank.observe(r):
            out.append((f, decide(f)))
    return recs, out


@pytest.mark.parametrize("name", ["healthy", "rise_and_fall", "logit_growth", "qkln_high_lr"])
def test_no_action_without_harm(name):
    """Healthy runs, a rise of the logits to ~320 that falls back while the loss improves, and
    logit growth with the loss on its trend: the default policy never changes the run."""
    _, out = _replay(name)
    assert [(f.signal.value, f.detect_step, d["kind"]) for f, d in out if d["kind"] in ACTS] == []
    assert all(f.outcome is not Outcome.ACT for f, _ in out)


def test_healthy_run_raises_nothing_above_watch():
    _, out = _replay("healthy")
    assert [f for f, _ in out if f.outcome is not Outcome.WATCH] == []


def test_ceiling_crossing_alerts_at_the_first_step_over_100():
    recs, out = _replay("rise_and_fall")
    keys = [k for k in recs[0].values if k.startswith("attn_logit_")]
    first_over = min(r.step for r in recs if any(r.values[k] >= 100 for k in keys))
    ceil = [f for f, _ in out if f.signal is Signal.ATTN_LOGIT_CEILING]
    assert ceil and ceil[0].detect_step == first_over and ceil[0].outcome is Outcome.ALERT
    assert "no witness of harm" in ceil[0].evidence["outcome_why"]


def test_lr_jump_loss_spike_acts_and_rolls_back():
    recs, out = _replay("jump_qkln")
    jump = next(r.step for r, prev in zip(recs[1:], recs) if r.values["lr"] > 10 * prev.values["lr"])
    spikes = [(f, d) for f, d in out if f.signal is Signal.LOSS_SPIKE]
    assert spikes, "the loss spike after the LR jump was not seen"
    f, d = spikes[0]
    assert jump <= f.detect_step <= jump + 5 and f.outcome is Outcome.ACT and d["kind"] == "rollback"
    assert d["to_step"] < f.onset_step


def test_witness_sees_the_loss_leave_its_trend_after_the_jump_and_not_before():
    recs = traces.load("jump_qkln")
    jump = next(r.step for r, prev in zip(recs[1:], recs) if r.values["lr"] > 10 * prev.values["lr"])
    w = Witnesses()
    speaking = []
    for r in recs:
        w.observe(r)
        if "loss_behind" in w.harm():
            speaking.append(r.step)
    assert speaking and jump < speaking[0] <= jump + 10


def test_degradation_alerts_after_the_jump_only():
    _, out = _replay("jump_qkln")
    deg = [f for f, _ in out if f.signal is Signal.LOSS_DEGRADATION]
    assert deg and all(f.detect_step > 300 for f in deg) and deg[0].outcome in (Outcome.ALERT, Outcome.ACT)
    _, healthy = _replay("healthy")
    assert [f for f, _ in healthy if f.signal is Signal.LOSS_DEGRADATION] == []


def test_replay_prints_outcome_and_decision_for_every_finding(tmp_path):
    import io
    import json

    from thermowatch.monitors.replay import replay

    out = io.StringIO()
    replay(traces.HERE / "jump_qkln.jsonl", BankConfig(), out, json_out=True, policy=replay_decider({}))
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert rows and all(r["outcome"] in ("watch", "alert", "act") and r["decision"]["kind"] for r in rows)
    assert any(r["outcome"] == "act" and r["decision"]["kind"] == "rollback" for r in rows)
    text = io.StringIO()
    replay(traces.HERE / "jump_qkln.jsonl", BankConfig(), text, policy=replay_decider({}))
    assert " act " in text.getvalue() and "kind=rollback" in text.getvalue()


def test_a_late_act_rolls_back_before_the_first_alert_of_the_attention_episode():
    """Issue 8's late divergence, judged without the trainer's LR forecast (a trainer that does
    not send `lr_peak_ahead`): the logits pass 100 at step 71 (blocks.2), then at 96 (blocks.1),
    and the act only comes with a witness of harm a hundred steps later. The acting finding
    carries the onset of the run's first attention alert, so its rollback reaches back as far as
    a fixed ceiling acting at the crossing would have, not only to its own layer's rise."""
    recs, out = _replay("late", drop=(LR_PEAK_AHEAD,))
    first_alert = next(f for f, _ in out if f.outcome is not Outcome.WATCH)
    assert first_alert.signal is Signal.ATTN_LOGIT_CEILING and first_alert.detect_step == 71
    act = next(f for f, _ in out if f.outcome is Outcome.ACT)
    assert act.detect_step > 150  # late: no witness spoke at the crossing
    assert act.onset_step == first_alert.onset_step <= 71
    assert act.evidence["own_onset"] > act.onset_step and act.evidence["episode_onset"] == act.onset_step
    assert "attention episode" in act.evidence["outcome_why"]
    # The update ratio is sampled every 10th step (NaN in between, the thermometers' default): not
    # a finding, and the witnesses read the sampled points only.
    assert sum(r.values["update_ratio/blocks.0"] == r.values["update_ratio/blocks.0"] for r in recs) == len(recs) // 10
    assert [f for f, _ in out if f.signal is Signal.NON_FINITE] == []


def test_a_plateau_ends_the_attention_episode():
    """A rise that stops (no new high for the attention detectors' window) closes the episode:
    a later divergence must not roll back across the plateau to the old rise."""
    bank = DetectorBank(BankConfig())
    opened = closed = None
    for r in traces.load("rise_and_fall"):
        bank.observe(r)
        w = bank.witnesses
        if opened is None and w.episode is not None:
            opened = r.step
        if opened is not None and closed is None and w.episode is None:
            closed = r.step
            assert w.since_peak >= BankConfig().attn.window or w.quiet >= BankConfig().attn.clear_steps
    assert opened is not None and closed is not None and closed > opened


def _first_crossing(recs, level: float = 100.0) -> int:
    keys = [k for k in recs[0].values if k.startswith("attn_logit_")]
    return min(r.step for r in recs if any(r.values[k] >= level for k in keys))


def test_the_lr_forecast_acts_at_the_crossing_and_lowers_the_lr_in_place():
    """Issue 8's lead: the late run's logits cross 100 at step 71 while its warm-up will still
    raise the LR from 0.024 to 0.1 (x4.2), and the loss is damaged only from step ~428. With the
    schedule's forecast the ceiling finding acts at the crossing itself (lead 1.0x a fixed ceiling
    of 100), and the policy lowers the LR in place: nothing is damaged yet, so nothing is rolled
    back and no checkpoint is needed."""
    recs, out = _replay("late")
    cross = _first_crossing(recs)
    first_act, decision = next((f, d) for f, d in out if f.outcome is Outcome.ACT)
    assert first_act.signal is Signal.ATTN_LOGIT_CEILING and first_act.detect_step == cross
    at = next(r for r in recs if r.step == cross)
    assert at.values[LR_PEAK_AHEAD] / at.values[LR] >= 2.0
    assert set(first_act.evidence["witnesses"]) == {"lr_forecast"}
    assert "raise the LR" in first_act.evidence["outcome_why"]
    assert decision["kind"] == "set_lr" and decision["lr_multiplier"] == 0.5 and decision["rung"] == 2
    assert decision.get("to_step") is None


def test_a_healthy_crossing_before_the_peak_lr_only_alerts():
    """The control: a healthy run (3e-2, cosine) whose logits cross 100 at step 66, still in its
    warm-up, with 1.5x its LR to come, the nearest the grid's healthy crossings come to the
    forecast's bar of 2x. It alerts and never acts; its logits rise to ~600 and its loss keeps
    improving."""
    recs, out = _replay("crossing_before_peak")
    cross = _first_crossing(recs)
    at = next(r for r in recs if r.step == cross)
    assert cross < 100 and 1.2 < at.values[LR_PEAK_AHEAD] / at.values[LR] < 2.0
    ceil = [f for f, _ in out if f.signal is Signal.ATTN_LOGIT_CEILING]
    assert ceil and ceil[0].detect_step == cross and ceil[0].outcome is Outcome.ALERT
    assert [(f.signal.value, f.detect_step, d["kind"]) for f, d in out if d["kind"] in ACTS] == []
    # The same run with a bar it would pass (1.4x): the forecast is what decides, not the level.
    bank = DetectorBank(BankConfig.from_dict({"witness": {"lr_rise": 1.4}}))
    acted = [f for r in traces.load("crossing_before_peak") for f in bank.observe(r) if f.outcome is Outcome.ACT]
    assert acted and acted[0].detect_step == cross
