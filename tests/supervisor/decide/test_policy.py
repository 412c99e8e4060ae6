"""Table tests for the pure policy: each row is (finding + state + config) -> expected decision."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from thermowatch.monitors.commands import CommandKind, Rollback
from thermowatch.monitors.contract import CheckpointInfo, Finding, Outcome, Severity, Signal
from thermowatch.supervisor.decide.policy import (
    DEFAULT_ROLLBACK_SIGNALS,
    Decision,
    Intervention,
    PolicyConfig,
    PolicyConfigError,
    PolicyInput,
    make_decision,
)

NOW = 1_800_000_000.0
H = 3600.0
S = Signal


class K:
    """A decision's word (Decision.word): its command's kind, else alert or noop."""
    ROLLBACK, SET_LR, PAUSE, ALERT, NOOP = "rollback", "set_lr", "pause", "alert", "noop"


# What a decision's command says, read off the typed command (None where it has no such field).
def to_step(d: Decision) -> int | None:
    return d.command.to_step if isinstance(d.command, Rollback) else None


def checkpoint(d: Decision) -> str | None:
    return d.command.checkpoint if isinstance(d.command, Rollback) else None


def lr_multiplier(d: Decision) -> float | None:
    return d.lr.multiplier if d.lr is not None else None


def lr_steps(d: Decision) -> int | None:
    return d.lr.steps if d.lr is not None else None


def rewarmup_steps(d: Decision) -> int | None:
    return d.lr.rewarmup_steps if d.lr is not None else None


def exclude_rank(d: Decision) -> int | None:
    return d.command.exclude_rank if isinstance(d.command, Rollback) else None


def exclude_node(d: Decision) -> str | None:
    return d.command.exclude_node if isinstance(d.command, Rollback) else None


VIEW = {f.__name__: f for f in (to_step, checkpoint, lr_multiplier, lr_steps, rewarmup_steps, exclude_rank, exclude_node)}


def ck(step: int, healthy: bool = True) -> CheckpointInfo:
    return CheckpointInfo(step=step, path=f"/ckpt/step{step}", sample_cursor=step * 64, healthy=healthy)


def finding(signal=S.LOSS_SPIKE, onset=990, detect=1000, sev=Severity.CRITICAL, module="", outcome=Outcome.ACT,
            **evidence) -> Finding:
    return Finding(signal=signal, module=module, severity=sev, onset_step=onset, detect_step=detect,
                   metric="loss" if signal is S.LOSS_SPIKE else "", evidence=evidence, outcome=outcome)


def iv(kind=K.ROLLBACK, signal=S.LOSS_SPIKE, step=1000, ago=H, ok=True, automatic=True, first_step=None,
       attempt=None, to_step=None, lowered_lr=False) -> Intervention:
    return Intervention(kind=CommandKind(kind), signal=signal, module="", step=step, time=NOW - ago, ok=ok, automatic=automatic,
                        first_step=first_step, attempt=attempt, to_step=to_step, lowered_lr=lowered_lr)


# A rung-1 rollback decided at step 1000 that went back to 850 and was acknowledged: the run
# re-trains from step 851, so a finding at step 1000 is 149 steps into the re-trained attempt.
RB = dict(step=1000, first_step=851, to_step=850)


CKPTS = [ck(800), ck(850), ck(900), ck(950)]

# (id, PolicyInput kwargs, PolicyConfig kwargs, expected Decision attributes; "says": substrings of reasons)
CASES = [
    ("rung1-loss-spike-margin-100",
     dict(finding=finding(), checkpoints=CKPTS), {},
     dict(word=K.ROLLBACK, rung=1, to_step=850, checkpoint="/ckpt/step850", skip_steps=(890, 1000),
          lr_multiplier=None, page=False, requires_approval=False, says=["rung 1", "step 850", "890-1000"])),
    ("rung1-small-run-margin-20",
     dict(finding=finding(), checkpoints=[ck(900), ck(950), ck(980)]), dict(rollback_margin_steps=20),
     dict(word=K.ROLLBACK, to_step=950, skip_steps=(970, 1000))),
    ("rung1-attention-logit-growth",
     dict(finding=finding(S.ATTN_LOGIT_GROWTH, module="blocks.3.attn"), checkpoints=CKPTS), {},
     dict(word=K.ROLLBACK, rung=1, to_step=850, says=["blocks.3.attn"])),
    ("rung1-unhealthy-checkpoint-passed-over",
     dict(finding=finding(), checkpoints=[ck(800), ck(850, healthy=False), ck(950)]), {},
     dict(word=K.ROLLBACK, to_step=800, skip_steps=(890, 1000), says=["850", "unhealthy"])),
    ("rung1-target-at-limit-skips-from-next-step",
     dict(finding=finding(), checkpoints=[ck(890)]), {},
     dict(word=K.ROLLBACK, to_step=890, skip_steps=(891, 1000))),
    ("rung2-recurrence-rollback-and-lower-lr",
     dict(finding=finding(onset=940, detect=950), checkpoints=CKPTS, history=[iv(step=1000)]), {},
     dict(word=K.ROLLBACK, rung=2, to_step=800, skip_steps=None, lr_multiplier=0.5, lr_steps=None,
          page=False, says=["rung 2", "50 steps short of step", "1 -> 0.5", "no samples skipped"])),
    ("rung2-at-once-on-the-lr-forecast",  # issue 8: a rollback alone would replay the same rising LR
     dict(finding=finding(S.ATTN_LOGIT_CEILING, module="blocks.1.attn", onset=940, detect=1000,
                          witnesses={"lr_forecast": "the schedule will still raise the LR x3.1"}),
          checkpoints=CKPTS), {},
     dict(word=K.SET_LR, rung=2, to_step=None, skip_steps=None, lr_multiplier=0.5,
          says=["rung 2 at once", "x3.1", "1 -> 0.5", "nothing to roll back"])),
    ("rung2-forecast-at-the-lr-floor-pauses",
     dict(finding=finding(S.ATTN_LOGIT_CEILING, witnesses={"lr_forecast": "x3"}), checkpoints=CKPTS,
          current_lr_multiplier=0.01), {},
     dict(word=K.PAUSE, rung=3, page=True, says=["min_lr_multiplier"])),
    ("rung1-another-witness-keeps-the-lr",
     dict(finding=finding(S.ATTN_LOGIT_CEILING, module="blocks.1.attn", witnesses={"grad_growth": "grad norm x2.3"}),
          checkpoints=CKPTS), {},
     dict(word=K.ROLLBACK, rung=1, lr_multiplier=None)),
    ("rung2-multiplier-compounds",
     dict(finding=finding(), checkpoints=CKPTS, history=[iv(step=1100)], current_lr_multiplier=0.5), {},
     dict(word=K.ROLLBACK, rung=2, lr_multiplier=0.25)),
    ("rung2-attention-growth-then-ceiling-is-same-signal",
     dict(finding=finding(S.ATTN_LOGIT_CEILING, module="blocks.5.attn"), checkpoints=CKPTS,
          history=[iv(signal=S.ATTN_LOGIT_GROWTH, step=1020)]), {},
     dict(word=K.ROLLBACK, rung=2, lr_multiplier=0.5)),
    ("rung2-temporary-lr-with-rewarmup",
     dict(finding=finding(), checkpoints=CKPTS, history=[iv(**RB)]), dict(lr_steps=2000, rewarmup_steps=100),
     dict(word=K.ROLLBACK, rung=2, lr_steps=2000, rewarmup_steps=100, says=["2000 steps", "re-warm-up"])),
    ("rung2-lower-lr-in-place",
     dict(finding=finding(), checkpoints=CKPTS, history=[iv(**RB)]), dict(recurrence_rollback=False),
     dict(word=K.SET_LR, rung=2, to_step=None, skip_steps=None, lr_multiplier=0.5)),
    ("rung1-previous-rollback-outside-step-window",
     dict(finding=finding(onset=1990, detect=2000), checkpoints=CKPTS + [ck(1800)], history=[iv(step=1000)]), {},
     dict(word=K.ROLLBACK, rung=1, to_step=1800, lr_multiplier=None)),
    ("rung1-previous-rollback-on-another-signal",
     dict(finding=finding(S.ATTN_LOGIT_GROWTH), checkpoints=CKPTS, history=[iv(**RB)]), {},
     dict(word=K.ROLLBACK, rung=1, lr_multiplier=None)),
    ("rung1-previous-rollback-failed-is-no-recurrence",
     dict(finding=finding(), checkpoints=CKPTS, history=[iv(step=1000, ok=False)]), {},
     dict(word=K.ROLLBACK, rung=1, lr_multiplier=None)),
    ("rung3-lr-floor",
     dict(finding=finding(), checkpoints=CKPTS, history=[iv(**RB)], current_lr_multiplier=0.125), {},
     dict(word=K.PAUSE, rung=3, page=True, to_step=None, says=["min_lr_multiplier"])),
    ("rung3-too-many-interventions",
     dict(finding=finding(), checkpoints=CKPTS,
          history=[iv(signal=S.ATTN_LOGIT_GROWTH, step=s, ago=a) for s, a in
                   [(3000, 5 * H), (5000, 4 * H), (7000, 3 * H), (9000, 2 * H)]]), {},
     dict(word=K.PAUSE, rung=3, page=True, says=["4 automatic interventions", "max_interventions=4"])),
    ("interventions-outside-window-do-not-count",
     dict(finding=finding(), checkpoints=CKPTS,
          history=[iv(signal=S.ATTN_LOGIT_GROWTH, step=s, ago=7 * H) for s in (3000, 5000, 7000, 9000)]), {},
     dict(word=K.ROLLBACK, rung=1)),
    ("manual-interventions-do-not-count",
     dict(finding=finding(), checkpoints=CKPTS,
          history=[iv(signal=None, step=s, ago=2 * H, automatic=False) for s in (3000, 5000, 7000, 9000)]), {},
     dict(word=K.ROLLBACK, rung=1)),
    ("rung3-no-healthy-checkpoint-before-onset",  # one at the onset is not before it
     dict(finding=finding(), checkpoints=[ck(990), ck(1000)]), {},
     dict(word=K.PAUSE, rung=3, page=True, says=["no healthy checkpoint before the onset at step 990",
                                                 "thermowatch rollback RUN --to-step N"])),
    ("rung3-only-unhealthy-checkpoints-before-onset",
     dict(finding=finding(), checkpoints=[ck(800, healthy=False), ck(850, healthy=False), ck(1000)]), {},
     dict(word=K.PAUSE, rung=3, page=True, says=["unhealthy at [800, 850]"])),
    ("rung1-inside-the-margin-when-none-is-that-old",  # issue 35: was a pause
     dict(finding=finding(), checkpoints=[ck(950), ck(1000)]), {},
     dict(word=K.ROLLBACK, rung=1, to_step=950, skip_steps=(951, 1000),
          says=["no healthy checkpoint at or before step 890", "inside the margin to step 950", "oldest"])),
    ("rung3-failed-action",
     dict(finding=finding(), checkpoints=CKPTS, failed_action_pending=True), {},
     dict(word=K.PAUSE, rung=3, page=True, says=["previous action failed"])),
    ("non-finite-rolls-back-with-margin",
     dict(finding=finding(S.NON_FINITE, onset=1000, detect=1000, sev=Severity.CRITICAL), checkpoints=CKPTS), {},
     dict(word=K.ROLLBACK, rung=1, to_step=900, skip_steps=(901, 1000))),
    ("non-finite-inside-margin-when-needed",
     dict(finding=finding(S.NON_FINITE, onset=1000, detect=1001, sev=Severity.CRITICAL),
          checkpoints=[ck(950), ck(980, healthy=False), ck(1000)]), {},
     dict(word=K.ROLLBACK, rung=1, to_step=950, skip_steps=(951, 1001), says=["inside the margin", "980"])),
    ("non-finite-no-healthy-checkpoint-before-onset",
     dict(finding=finding(S.NON_FINITE, onset=1000, detect=1000, sev=Severity.CRITICAL),
          checkpoints=[ck(950, healthy=False), ck(1000)]), {},
     dict(word=K.PAUSE, rung=3, page=True)),
    ("non-finite-ignores-cooldown",
     dict(finding=finding(S.NON_FINITE, onset=1000, detect=1000, sev=Severity.CRITICAL), checkpoints=CKPTS,
          history=[iv(signal=S.ATTN_LOGIT_GROWTH, step=3000, ago=60)]), {},
     dict(word=K.ROLLBACK, rung=1)),
    # The wall-clock cooldown is off by default (issue 22); set, it still holds any action back.
    ("cooldown-s-off-by-default",
     dict(finding=finding(), checkpoints=CKPTS, history=[iv(signal=S.ATTN_LOGIT_GROWTH, step=3000, ago=1)]), {},
     dict(word=K.ROLLBACK, rung=1)),
    ("cooldown-s-too-soon-alerts",
     dict(finding=finding(sev=Severity.WARN), checkpoints=CKPTS,
          history=[iv(signal=S.ATTN_LOGIT_GROWTH, step=3000, ago=60)]), dict(act_min_severity="warn", cooldown_s=600),
     dict(word=K.ALERT, rung=0, page=False, to_step=None, says=["cooldown", "60s ago", "cooldown_s=600"])),
    ("cooldown-s-critical-finding-pages",
     dict(finding=finding(sev=Severity.CRITICAL), checkpoints=CKPTS,
          history=[iv(signal=S.ATTN_LOGIT_GROWTH, step=3000, ago=60)]), dict(cooldown_s=600),
     dict(word=K.ALERT, page=True)),
    ("cooldown-s-holds-back-a-recurrence-too",
     dict(finding=finding(), checkpoints=CKPTS, history=[iv(**RB, ago=60)]), dict(cooldown_s=600),
     dict(word=K.ALERT, page=True, says=["60s ago"])),
    ("cooldown-s-expired-acts",
     dict(finding=finding(), checkpoints=CKPTS, history=[iv(signal=S.ATTN_LOGIT_GROWTH, step=3000, ago=700)]),
     dict(cooldown_s=600),
     dict(word=K.ROLLBACK, rung=1)),
    ("cooldown-s-manual-action-does-not-block",
     dict(finding=finding(), checkpoints=CKPTS,
          history=[iv(signal=None, step=3000, ago=60, automatic=False)]), dict(cooldown_s=600),
     dict(word=K.ROLLBACK, rung=1)),
    # Steps: another signal within cooldown_steps of where the last action took effect alerts.
    ("cooldown-steps-another-signal-alerts",
     dict(finding=finding(onset=880, detect=890), checkpoints=CKPTS,
          history=[iv(signal=S.ATTN_LOGIT_GROWTH, **RB, ago=1)]), {},
     dict(word=K.ALERT, page=True, says=["cooldown", "39 steps into the re-trained attempt", "cooldown_steps=50"])),
    ("cooldown-steps-over-acts",
     dict(finding=finding(onset=900, detect=901), checkpoints=CKPTS,
          history=[iv(signal=S.ATTN_LOGIT_GROWTH, **RB, ago=1)]), {},
     dict(word=K.ROLLBACK, rung=1)),
    ("cooldown-steps-zero-is-off",
     dict(finding=finding(onset=850, detect=851), checkpoints=CKPTS,
          history=[iv(signal=S.ATTN_LOGIT_GROWTH, **RB, ago=1)]), dict(cooldown_steps=0, rollback_margin_steps=0),
     dict(word=K.ROLLBACK, rung=1)),
    ("same-incident-is-noop",
     dict(finding=finding(onset=990, detect=1010), checkpoints=CKPTS, history=[iv(step=1000, ago=30)]), {},
     dict(word=K.NOOP, says=["same incident", "step 1000"])),
    ("same-incident-on-the-re-trained-attempt-is-noop",
     dict(finding=finding(onset=880, detect=890), checkpoints=CKPTS, history=[iv(**RB, ago=1, attempt=0)],
          attempt=1), {},
     dict(word=K.NOOP, says=["same incident", "39 steps into the re-trained attempt (first step 851)"])),
    ("recurrence-past-cooldown-on-the-re-trained-attempt-climbs",  # issue 22: rollback to 850, again at 910
     dict(finding=finding(onset=900, detect=910), checkpoints=CKPTS, history=[iv(**RB, ago=1, attempt=0)],
          attempt=1), {},
     dict(word=K.ROLLBACK, rung=2, to_step=800, lr_multiplier=0.5, says=["rung 2", "90 steps short of step"])),
    ("late-finding-of-the-abandoned-attempt-is-noop",
     dict(finding=finding(onset=1100, detect=1200), checkpoints=CKPTS, history=[iv(**RB, ago=1, attempt=0)],
          attempt=0), {},
     dict(word=K.NOOP, says=["late finding of attempt 0", "left behind"])),
    ("late-finding-of-the-abandoned-attempt-any-signal-is-noop",
     dict(finding=finding(S.NON_FINITE, onset=1200, detect=1200), checkpoints=CKPTS,
          history=[iv(**RB, ago=1, attempt=2)], attempt=1), {},
     dict(word=K.NOOP, says=["late finding of attempt 1"])),
    ("lower-lr-in-place-same-incident-until-cooldown-steps-after-its-ack",
     dict(finding=finding(onset=1000, detect=1040), checkpoints=CKPTS,
          history=[iv(kind=K.SET_LR, step=1000, first_step=1002, lowered_lr=True, ago=1, attempt=0)],
          attempt=0), {},
     dict(word=K.NOOP, says=["38 steps into its effect"])),
    ("failed-action-starts-no-cooldown",
     dict(finding=finding(), checkpoints=CKPTS, history=[iv(step=1000, ago=1, ok=False)]), {},
     dict(word=K.ROLLBACK, rung=1)),
    ("same-incident-non-finite-is-noop",
     dict(finding=finding(S.NON_FINITE, onset=1000, detect=1003, sev=Severity.CRITICAL), checkpoints=CKPTS,
          history=[iv(signal=S.NON_FINITE, step=1000, ago=30)]), {},
     dict(word=K.NOOP)),
    ("per-day-cap",
     dict(finding=finding(), checkpoints=CKPTS,
          history=[iv(signal=S.ATTN_LOGIT_GROWTH, step=s, ago=a) for s, a in [(3000, 20 * H), (5000, 10 * H)]]),
     dict(max_rollbacks_per_day=2),
     dict(word=K.PAUSE, rung=3, page=True, says=["2 automatic rollbacks in the last 24 h"])),
    ("per-day-cap-forgets-yesterday",
     dict(finding=finding(), checkpoints=CKPTS,
          history=[iv(signal=S.ATTN_LOGIT_GROWTH, step=s, ago=a) for s, a in [(3000, 30 * H), (5000, 10 * H)]]),
     dict(max_rollbacks_per_day=2),
     dict(word=K.ROLLBACK, rung=1)),
    ("advise-only-rollback-needs-approval",
     dict(finding=finding(), checkpoints=CKPTS), dict(advise_only=True),
     dict(word=K.ROLLBACK, to_step=850, skip_steps=(890, 1000), requires_approval=True, page=True,
          says=["advise-only"])),
    ("advise-only-pause-needs-approval",
     dict(finding=finding(), checkpoints=[]), dict(advise_only=True),
     dict(word=K.PAUSE, requires_approval=True)),
    ("advise-only-alert-needs-no-approval",
     dict(finding=finding(S.GRAD_SPIKE), checkpoints=CKPTS), dict(advise_only=True),
     dict(word=K.ALERT, requires_approval=False)),
    ("grad-spike-alerts-only",
     dict(finding=finding(S.GRAD_SPIKE, sev=Severity.CRITICAL), checkpoints=CKPTS), {},
     dict(word=K.ALERT, page=False, to_step=None, says=["clipping"])),
    ("grad-spike-rolls-back-when-configured",
     dict(finding=finding(S.GRAD_SPIKE), checkpoints=CKPTS),
     dict(rollback_signals=["grad_spike", "loss_spike"]),
     dict(word=K.ROLLBACK, to_step=850)),
    ("stall-alerts-and-pages",
     dict(finding=finding(S.STALL), checkpoints=CKPTS), {},
     dict(word=K.ALERT, page=True, says=["stall"])),
    ("info-severity-alerts-only",
     dict(finding=finding(sev=Severity.INFO), checkpoints=CKPTS), {},
     dict(word=K.ALERT, says=["below act_min_severity"])),
    ("warn-severity-never-acts-by-default",
     dict(finding=finding(S.ATTN_LOGIT_GROWTH, sev=Severity.WARN), checkpoints=CKPTS), {},
     dict(word=K.ALERT, says=["below act_min_severity=critical"])),
    ("warn-severity-acts-when-configured",
     dict(finding=finding(S.ATTN_LOGIT_GROWTH, sev=Severity.WARN), checkpoints=CKPTS), dict(act_min_severity="warn"),
     dict(word=K.ROLLBACK, rung=1)),
    ("watch-outcome-is-noop",
     dict(finding=finding(S.ATTN_LOGIT_GROWTH, outcome=Outcome.WATCH), checkpoints=CKPTS), {},
     dict(word=K.NOOP, page=False, says=["outcome watch"])),
    ("alert-outcome-critical-alerts-only",
     dict(finding=finding(S.ATTN_LOGIT_CEILING, outcome=Outcome.ALERT), checkpoints=CKPTS), {},
     dict(word=K.ALERT, to_step=None, says=["outcome alert"])),
    ("alert-outcome-with-failed-action-does-not-pause",
     dict(finding=finding(outcome=Outcome.ALERT), checkpoints=CKPTS, failed_action_pending=True), {},
     dict(word=K.ALERT, rung=0, says=["earlier action failed"])),
    ("loss-degradation-alerts-by-default",
     dict(finding=finding(S.LOSS_DEGRADATION), checkpoints=CKPTS), {},
     dict(word=K.ALERT, to_step=None, says=["behind its own trend"])),
    ("loss-degradation-acts-when-configured",
     dict(finding=finding(S.LOSS_DEGRADATION), checkpoints=CKPTS),
     dict(rollback_signals=["loss_degradation", "loss_spike"]),
     dict(word=K.ROLLBACK, rung=1)),
    ("alert-outcome-stall-pages",
     dict(finding=finding(S.STALL, outcome=Outcome.ALERT), checkpoints=CKPTS), {},
     dict(word=K.ALERT, page=True)),
    ("paused-run-is-noop",
     dict(finding=finding(S.NON_FINITE, sev=Severity.CRITICAL), checkpoints=CKPTS, paused=True), {},
     dict(word=K.NOOP, says=["paused"])),
    ("action-in-flight-is-noop",
     dict(finding=finding(), checkpoints=CKPTS, action_in_flight=True), {},
     dict(word=K.NOOP, says=["in flight"])),
    ("outlier-rank-alert-names-rank-and-node",
     dict(finding=finding(S.OUTLIER_RANK, rank=5, node="gpu-node-07"), checkpoints=CKPTS), {},
     dict(word=K.ALERT, to_step=None, exclude_rank=None, says=["rank 5 on node gpu-node-07"])),
    ("outlier-rank-alerts-off",
     dict(finding=finding(S.OUTLIER_RANK, rank=5), checkpoints=CKPTS), dict(outlier_rank_alerts=False),
     dict(word=K.NOOP)),
    ("outlier-rank-restart-without-it",
     dict(finding=finding(S.OUTLIER_RANK, rank=5, host="gpu-node-07"), checkpoints=CKPTS),
     dict(restart_without_outlier=True),
     dict(word=K.ROLLBACK, to_step=950, skip_steps=None, exclude_rank=5, exclude_node="gpu-node-07",
          says=["without rank 5"])),
    ("outlier-rank-restart-needs-a-rank",
     dict(finding=finding(S.OUTLIER_RANK), checkpoints=CKPTS), dict(restart_without_outlier=True),
     dict(word=K.ALERT, exclude_rank=None, says=["names no rank"])),
]


@pytest.mark.parametrize("inp_kw, cfg_kw, expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_decision_table(inp_kw, cfg_kw, expected):
    decision = make_decision(PolicyInput(now=NOW, **inp_kw), PolicyConfig(**cfg_kw))
    expected = dict(expected)
    says = expected.pop("says", [])
    got = {k: VIEW[k](decision) if k in VIEW else getattr(decision, k) for k in expected}
    assert got == expected, decision.reasons
    text = "\n".join(decision.reasons)
    for phrase in says:
        assert phrase in text, f"{phrase!r} not in reasons:\n{text}"
    # Every decision explains itself: the finding first, then at least one why.
    assert len(decision.reasons) >= 2 and inp_kw["finding"].signal.value in decision.reasons[0]


def test_never_targets_an_unhealthy_checkpoint_or_one_past_the_onset():
    rng = random.Random(0)
    for _ in range(500):
        ckpts = [ck(s, healthy=rng.random() < 0.6) for s in sorted(rng.sample(range(0, 2000, 10), 8))]
        onset = rng.randrange(50, 2000)
        sig = rng.choice([S.LOSS_SPIKE, S.NON_FINITE, S.ATTN_LOGIT_CEILING])
        inp = PolicyInput(finding=finding(sig, onset=onset, detect=onset + rng.randrange(0, 30)),
                          now=NOW, checkpoints=ckpts)
        cfg = PolicyConfig(rollback_margin_steps=rng.choice([0, 20, 100]))
        d = make_decision(inp, cfg)
        assert d == make_decision(inp, cfg)  # pure
        assert d.word in (K.ROLLBACK, K.PAUSE)
        if d.word == K.ROLLBACK:
            chosen = next(c for c in ckpts if c.step == to_step(d))
            assert chosen.healthy
            limit = onset - cfg.rollback_margin_steps
            if chosen.step <= limit:  # the newest healthy one that old
                assert not any(c.healthy and chosen.step < c.step <= limit for c in ckpts)
            else:  # inside the margin only when none is that old, then the oldest before the onset
                assert not any(c.healthy and c.step <= limit for c in ckpts)
                assert chosen.step < onset and not any(c.healthy and c.step < chosen.step for c in ckpts)
            if d.skip_steps:
                assert to_step(d) < d.skip_steps[0] <= d.skip_steps[1] == inp.finding.detect_step
        else:  # a pause: no healthy checkpoint before the onset at all
            assert not any(c.healthy and c.step < onset for c in ckpts)


def test_decision_to_json_is_plain():
    d = make_decision(PolicyInput(finding=finding(), now=NOW, checkpoints=CKPTS))
    j = d.to_json()
    assert j["kind"] == "rollback" and j["skip_steps"] == [890, 1000] and j["to_step"] == 850
    assert isinstance(d, Decision) and d.acts


@pytest.mark.parametrize("kwargs, match", [
    (dict(lr_factor=1.5), "lr_factor=1.5 must be in \\(0, 1\\)"),
    (dict(lr_factor=0.0), "lr_factor=0.0"),
    (dict(rollback_margin_steps=-1), "rollback_margin_steps=-1"),
    (dict(max_interventions=0), "max_interventions=0 must be >= 1"),
    (dict(lr_steps=0), "lr_steps=0 must be >= 1, or None"),
    (dict(cooldown_s=-5), "cooldown_s must be a finite number >= 0, got -5"),
    (dict(cooldown_s=math.inf), "cooldown_s must be a finite number >= 0, got inf"),
    (dict(intervention_window_s=math.nan), "intervention_window_s must be a finite number > 0, got nan"),
    (dict(rollback_signals=["stall"]), "rollback cannot fix"),
    (dict(rollback_signals=["loss_spik"]), "known signals"),
    (dict(act_min_severity="fatal"), "info, warn, critical"),
], ids=["lr-above-1", "lr-zero", "negative-margin", "no-interventions", "lr-steps-zero", "negative-cooldown",
        "infinite-cooldown", "nan-window", "stall-cannot-roll-back", "typo-signal", "bad-severity"])
def test_config_rejects_bad_values(kwargs, match):
    with pytest.raises(PolicyConfigError, match=match):
        PolicyConfig(**kwargs)


def test_config_accepts_strings_from_yaml():
    cfg = PolicyConfig(rollback_signals=["loss_spike"], page_signals=["stall", "grad_spike"], act_min_severity="critical")
    assert cfg.rollback_signals == frozenset({S.LOSS_SPIKE})
    assert cfg.page_signals == frozenset({S.STALL, S.GRAD_SPIKE})
    assert cfg.act_min_severity is Severity.CRITICAL


# --- only `act` changes a run (DESIGN.md, Trust) -------------------------------------------------

_findings = st.builds(
    Finding,
    signal=st.sampled_from(list(Signal)),
    module=st.sampled_from(["", "blocks.0.attn", "blocks.3.attn"]),
    severity=st.sampled_from(list(Severity)),
    onset_step=st.integers(0, 3000),
    detect_step=st.integers(0, 3000),
    metric=st.sampled_from(["", "loss", "grad_norm", "attn_logit_max/blocks.0.attn"]),
    evidence=st.fixed_dictionaries({}, optional={"rank": st.integers(0, 7), "node": st.just("gpu-node-07"),
                                                 "witnesses": st.just({"lr_forecast": "the LR x3 to come"})}),
    outcome=st.sampled_from([Outcome.WATCH, Outcome.ALERT]),
)
_history = st.lists(st.builds(
    Intervention, kind=st.sampled_from(list(CommandKind)), signal=st.none() | st.sampled_from(list(Signal)),
    module=st.just(""), step=st.integers(0, 3000), time=st.floats(NOW - 2 * 86_400, NOW), ok=st.booleans(),
    automatic=st.booleans(), to_step=st.none() | st.integers(0, 3000), lowered_lr=st.booleans(),
    first_step=st.none() | st.integers(0, 3000), attempt=st.none() | st.integers(0, 3)), max_size=6)
_inputs = st.builds(
    PolicyInput, finding=_findings, now=st.just(NOW),
    checkpoints=st.lists(st.builds(ck, st.integers(0, 3000), st.booleans()), max_size=6), history=_history,
    current_lr_multiplier=st.floats(0.01, 1.0), failed_action_pending=st.booleans(),
    action_in_flight=st.booleans(), paused=st.booleans(), attempt=st.none() | st.integers(0, 4))
_configs = st.builds(
    PolicyConfig, rollback_signals=st.sets(st.sampled_from(sorted(set(Signal) - {S.STALL, S.OUTLIER_RANK}))),
    act_min_severity=st.sampled_from(list(Severity)), advise_only=st.booleans(),
    restart_without_outlier=st.booleans(), recurrence_rollback=st.booleans(), cooldown_s=st.sampled_from([0.0, 600.0]),
    max_interventions=st.integers(1, 4), max_rollbacks_per_day=st.integers(1, 4))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inp=_inputs, cfg=_configs)
def test_watch_and_alert_findings_never_change_the_run(inp, cfg):
    """Whatever the signal, severity, run state and settings: a watch or alert finding never
    rolls back, lowers the LR or pauses (issue 8)."""
    d = make_decision(inp, cfg)
    assert d.word in (K.NOOP, K.ALERT), d.reasons
    assert not d.acts and to_step(d) is None and lr_multiplier(d) is None and d.rung == 0
    assert d.word == (K.NOOP if inp.finding.outcome is Outcome.WATCH else K.ALERT)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inp=_inputs, cfg=_configs, signal=st.sampled_from([S.ATTN_LOGIT_CEILING, S.ATTN_LOGIT_GROWTH]))
def test_an_act_on_the_lr_forecast_alone_never_rolls_back(inp, cfg, signal):
    """Issue 8's forecast: nothing is damaged yet, so with no recurrence to answer the policy
    lowers the LR in place (or pauses, alerts, waits for approval), never rolls back, and a
    lowered LR is lower than the one in force."""
    f = Finding(signal=signal, module="blocks.1.attn", severity=Severity.CRITICAL, onset_step=90, detect_step=100,
                metric=f"{signal.value}/blocks.1.attn", outcome=Outcome.ACT,
                evidence={"witnesses": {"lr_forecast": "the schedule will still raise the LR x3.1"}})
    # A run that takes attention signals and is free to act (the guards have their own tests).
    cfg = dataclasses.replace(cfg, rollback_signals=cfg.rollback_signals | {signal})
    inp = dataclasses.replace(inp, finding=f, history=[], paused=False, action_in_flight=False,
                              failed_action_pending=False)
    d = make_decision(inp, cfg)
    assert d.word != K.ROLLBACK, d.reasons
    if d.word == K.SET_LR:
        assert lr_multiplier(d) < inp.current_lr_multiplier and to_step(d) is None and d.rung == 2


# --- the ladder at any speed (issue 22) ----------------------------------------------------------
# A fast loop re-diverged after its first rollback and nothing acted for the rest of the run: a
# 600 s wall-clock cooldown silenced every action. Cooldowns now count steps from where an action
# took effect, so a recurrence climbs the ladder however little wall-clock time has passed.


class Run:
    """A run as the policy sees it: a checkpoint every 10 steps, each healthy until the current
    divergence's onset; each rollback is acknowledged at once (its first step is target + 1)
    and starts a new attempt."""

    def __init__(self, cfg: PolicyConfig, t0: float = NOW):
        self.cfg, self.now, self.attempt, self.lr = cfg, t0, 0, 1.0
        self.history: list[Intervention] = []

    def inp(self, f: Finding, attempt: int | None = None) -> PolicyInput:
        cks = [ck(s, healthy=s < f.onset_step) for s in range(0, 3000, 10)]
        return PolicyInput(finding=f, now=self.now, checkpoints=cks, history=list(self.history),
                           current_lr_multiplier=self.lr, attempt=self.attempt if attempt is None else attempt)

    def decide(self, f: Finding, gap_s: float = 1.0) -> Decision:
        self.now += gap_s
        d = make_decision(self.inp(f), self.cfg)
        if d.acts:
            first = to_step(d) + 1 if d.word == K.ROLLBACK else f.detect_step + 1
            self.history.append(Intervention(kind=d.kind, signal=f.signal, module=f.module, step=f.detect_step,
                                             time=self.now, ok=True, first_step=first, attempt=self.attempt,
                                             to_step=to_step(d), lowered_lr=lr_multiplier(d) is not None,
                                             skipped_samples=d.skip_steps is not None, seq=len(self.history)))
            self.lr = lr_multiplier(d) or self.lr
            if d.word == K.ROLLBACK:
                self.attempt += 1
        return d

    @property
    def start(self) -> int:
        """The first step of the trajectory the run is on now."""
        return self.history[-1].first_step if self.history else 0


def attn(onset: int, detect: int) -> Finding:
    return finding(S.ATTN_LOGIT_CEILING, onset=onset, detect=detect, module="blocks.1.attn")


def test_issue_22_recurrence_after_a_rollback_climbs_instead_of_being_silenced():
    """Rollback to checkpoint 100, the run diverges again at step 160 of the new attempt one
    second later: rung 2 (roll back again, lower the LR), then a pause at the LR floor."""
    run = Run(PolicyConfig(rollback_margin_steps=20, min_lr_multiplier=0.5))
    d1 = run.decide(attn(onset=125, detect=130))
    assert (d1.word, d1.rung, to_step(d1)) == (K.ROLLBACK, 1, 100), d1.reasons
    d2 = run.decide(attn(onset=150, detect=160))
    assert (d2.word, d2.rung, lr_multiplier(d2)) == (K.ROLLBACK, 2, 0.5), d2.reasons
    assert to_step(d2) <= 100  # no later than rung 1 went: the checkpoints since had the same LR
    d3 = run.decide(attn(onset=to_step(d2) + 55, detect=to_step(d2) + 60))
    assert (d3.word, d3.rung, d3.page) == (K.PAUSE, 3, True), d3.reasons
    assert "min_lr_multiplier" in "\n".join(d3.reasons)


def loss(onset: int, detect: int) -> Finding:
    return finding(S.LOSS_SPIKE, onset=onset, detect=detect)


def test_issue_35_the_rest_of_a_bad_stretch_is_skipped_at_once_not_trained_in_the_cooldown():
    """A poisoned stretch detected one step into it: the first data rollback skips the samples up to
    the detection, and the re-trained path meets the rest of the stretch at once, inside the
    50-step cooldown. Before, that was a NOOP ("same incident") and the stretch was trained; now
    it rolls back to the same checkpoint at the same LR and the skip grows through the new
    detection, until the caps stop the loop."""
    run = Run(PolicyConfig(rollback_margin_steps=100, cooldown_steps=50, max_interventions=4))
    d1 = run.decide(loss(onset=171, detect=172))
    assert (d1.word, d1.rung, to_step(d1), d1.skip_steps) == (K.ROLLBACK, 1, 70, (71, 172)), d1.reasons
    d2 = run.decide(loss(onset=73, detect=74))  # 3 steps into the re-trained path: the stretch goes on
    assert (d2.word, d2.rung, to_step(d2), d2.skip_steps, lr_multiplier(d2)) == (K.ROLLBACK, 1, 70, (71, 74), None)
    assert "the bad stretch goes on past the samples it skipped" in "\n".join(d2.reasons)
    # the first skips skip_ahead_steps past its detection (16 by default); a return skips past the new
    # detection too, doubling with each: 2x, then 4x the onset-to-detection steps
    assert d1.skip_ahead_steps == 16 and d2.skip_ahead_steps == 2 * 2
    assert "16 steps' worth past them" in "\n".join(d1.reasons)
    d3 = run.decide(loss(onset=72, detect=73))
    assert (d3.word, to_step(d3), d3.skip_ahead_steps) == (K.ROLLBACK, 70, 2 * 4), d3.reasons
    d4 = run.decide(loss(onset=72, detect=73))
    assert d4.word == K.ROLLBACK
    d5 = run.decide(loss(onset=72, detect=73))  # the fifth in the window: the caps hold
    assert (d5.word, d5.rung) == (K.PAUSE, 3) and "max_interventions=4" in "\n".join(d5.reasons)


@pytest.mark.parametrize("first, again, skipped", [
    (attn(onset=171, detect=172), attn(onset=73, detect=74), True),  # the logits: the optimizer's, the ladder's
    (loss(onset=171, detect=172), loss(onset=73, detect=74), False),  # a rollback that skipped nothing
])
def test_issue_35_only_a_spike_after_a_data_rollback_skips_the_cooldown(first, again, skipped):
    run = Run(PolicyConfig(rollback_margin_steps=100, cooldown_steps=50))
    d1 = run.decide(first)
    assert d1.word == K.ROLLBACK
    if not skipped:
        run.history[-1] = dataclasses.replace(run.history[-1], skipped_samples=False)
    d2 = run.decide(again)
    assert d2.word in (K.NOOP, K.ALERT) and "cooldown" in "\n".join(d2.reasons), d2.reasons


def test_issue_35_a_spike_back_at_the_same_step_on_other_samples_is_the_lr_not_the_data():
    """The study's LR blow-up: the loss spikes at 153, the rollback to 50 skips the samples of
    51-153, and the re-trained path spikes again at 153 on other samples: the schedule did it.
    Not another data rollback (the ladder's cooldown, then its LR cut), where the rest of a
    poisoned stretch comes back right after the skip (the test above)."""
    run = Run(PolicyConfig(rollback_margin_steps=100, cooldown_steps=50))
    d1 = run.decide(loss(onset=152, detect=153))
    assert (d1.word, to_step(d1)) == (K.ROLLBACK, 50) and d1.skip_steps[1] == 153
    d2 = run.decide(loss(onset=152, detect=153))
    assert "the bad stretch goes on" not in "\n".join(d2.reasons), d2.reasons
    assert d2.word != K.ROLLBACK or lr_multiplier(d2) is not None, d2.reasons


def test_issue_35_a_late_finding_of_the_abandoned_attempt_still_never_acts():
    run = Run(PolicyConfig(rollback_margin_steps=100, cooldown_steps=50))
    run.decide(loss(onset=171, detect=172))
    d = make_decision(run.inp(loss(onset=173, detect=175), attempt=0), run.cfg)  # the old attempt, arriving late
    assert d.word == K.NOOP and "left behind" in "\n".join(d.reasons)


def test_issue_22_a_wall_clock_cooldown_still_holds_when_set():
    run = Run(PolicyConfig(rollback_margin_steps=20, cooldown_s=600))
    assert run.decide(attn(onset=125, detect=130)).word == K.ROLLBACK
    d = run.decide(attn(onset=150, detect=160))
    assert (d.word, d.page) == (K.ALERT, True) and "cooldown_s=600" in "\n".join(d.reasons)
    d = run.decide(attn(onset=170, detect=180), gap_s=601)
    assert (d.word, d.rung) == (K.ROLLBACK, 2), d.reasons


@settings(max_examples=50, deadline=None)
@given(margin=st.sampled_from([10, 20, 100]), cooldown_steps=st.sampled_from([0, 5, 50]),
       lag=st.integers(0, 30), lr=st.sampled_from([0.5, 0.3]), floor=st.sampled_from([0.01, 0.1, 0.5]),
       max_interventions=st.integers(3, 6), gaps=st.lists(st.floats(0.0, 2.0), min_size=8, max_size=8),
       extra=st.lists(st.integers(0, 300), min_size=8, max_size=8))
def test_recurrences_climb_the_ladder_to_a_pause_however_fast_the_loop(margin, cooldown_steps, lag, lr, floor,
                                                                         max_interventions, gaps, extra):
    """Each divergence comes back `cooldown_steps + extra` steps into the re-trained attempt,
    0-2 s after the last action: rung 1, then rung 2 with a lower LR each time, then a pause
    (the LR floor or max_interventions), never an alert or a noop on the way. Meanwhile late
    findings of the abandoned attempt, and findings still inside the cooldown, do nothing."""
    cfg = PolicyConfig(rollback_margin_steps=margin, cooldown_steps=cooldown_steps, lr_factor=lr,
                       min_lr_multiplier=floor, max_interventions=max_interventions)
    run = Run(cfg)
    detect = 2000
    rungs = []
    for i in range(8):
        d = run.decide(attn(onset=detect - lag, detect=detect), gaps[i])
        rungs.append(d.rung)
        assert d.word in (K.ROLLBACK, K.PAUSE), d.reasons
        if d.word == K.PAUSE:
            assert d.rung == 3 and d.page
            why = "\n".join(d.reasons)
            assert "min_lr_multiplier" in why or "max_interventions" in why, why
            break
        assert d.rung == (1 if i == 0 else 2) and (lr_multiplier(d) is None) == (i == 0)
        # The abandoned attempt's findings arrive late: nothing happens.
        late = make_decision(run.inp(attn(onset=detect, detect=detect + 5), attempt=run.attempt - 1), cfg)
        assert late.word == K.NOOP and "left behind" in late.reasons[1]
        if cooldown_steps:  # the re-trained attempt, still inside the cooldown: the same incident
            soon = make_decision(run.inp(attn(onset=run.start, detect=run.start + cooldown_steps - 1)), cfg)
            assert soon.word == K.NOOP and "same incident" in soon.reasons[1], soon.reasons
        detect = run.start + cooldown_steps + extra[i]
    else:
        raise AssertionError(f"no pause after 8 recurrences: rungs {rungs}")
    assert rungs == sorted(rungs) and rungs[0] == 1 and rungs[-1] == 3
    assert len(rungs) <= max_interventions + 1  # the caps end the ladder, they never cut it short
    # rung 2 comes unless its first LR cut is already below the floor
    assert (rungs[1] == 2) == (lr >= floor), rungs


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inp=_inputs, cfg=_configs, signal=st.sampled_from(sorted(DEFAULT_ROLLBACK_SIGNALS)),
       step=st.integers(0, 3000), left=st.integers(0, 3), rolled_back=st.integers(0, 3000))
def test_a_late_finding_of_an_abandoned_attempt_never_acts(inp, cfg, signal, step, left, rolled_back):
    """Whatever came before: after the newest rollback took effect (attempt `left` -> later),
    a finding judged on attempt `left` or older changes nothing."""
    f = Finding(signal=signal, module="blocks.1.attn", severity=Severity.CRITICAL, onset_step=step,
                detect_step=step, outcome=Outcome.ACT)
    rb = Intervention(kind=CommandKind.ROLLBACK, signal=S.LOSS_SPIKE, module="", step=rolled_back + 10, time=NOW - 1,
                      ok=True, to_step=rolled_back, first_step=rolled_back + 1, attempt=left, seq=99)
    inp = dataclasses.replace(inp, finding=f, history=[h for h in inp.history if h.time < NOW - 1] + [rb],
                              attempt=left - (step % 2 if left else 0), failed_action_pending=False, paused=False)
    cfg = dataclasses.replace(cfg, rollback_signals=cfg.rollback_signals | {signal})  # free to act on it
    d = make_decision(inp, cfg)
    assert not d.acts, d.reasons
    if not inp.action_in_flight:
        assert d.word == K.NOOP and "left behind" in d.reasons[1], d.reasons


# Issue 35, item 3: the default margin adapts to the checkpoints that exist. With none at or
# before onset - margin, the oldest healthy checkpoint before the onset (the nearest to what the
# margin asked for), the skip from the step after it; a pause only with none before the onset.
EVERY_10 = [ck(s) for s in range(10, 80, 10)]
MARGIN_CASES = [
    ("a-run-younger-than-the-margin",  # the issue's "no healthy checkpoint at or before step -29"
     dict(finding=finding(onset=71, detect=72), checkpoints=EVERY_10), {},
     dict(word=K.ROLLBACK, rung=1, to_step=10, skip_steps=(11, 72), page=False,
          says=["no healthy checkpoint at or before step -29", "inside the margin to step 10",
                "61 steps before it", "from the checkpoint"])),
    ("the-oldest-healthy-one-unhealthy-ones-passed-over",
     dict(finding=finding(onset=71, detect=72), checkpoints=[ck(10, False), ck(20, False), *EVERY_10[2:]]), {},
     dict(word=K.ROLLBACK, to_step=30, skip_steps=(31, 72), says=["step 30"])),
    ("the-margin-met-is-still-preferred",
     dict(finding=finding(onset=171, detect=172), checkpoints=[ck(s) for s in range(10, 180, 10)]), {},
     dict(word=K.ROLLBACK, to_step=70, skip_steps=(71, 172), says=["margin 100 = step 71"])),
    ("a-quarter-margin-is-not-the-rule-the-oldest-is",  # 46 would be onset - margin/4: 10 is nearer to -29
     dict(finding=finding(onset=71, detect=72), checkpoints=[ck(10), ck(40), ck(60)]), {},
     dict(word=K.ROLLBACK, to_step=10)),
    ("no-checkpoint-before-the-onset-pauses",
     dict(finding=finding(onset=30, detect=32), checkpoints=[ck(50)]), {},
     dict(word=K.PAUSE, rung=3, page=True, says=["no healthy checkpoint before the onset at step 30",
                                                 "healthy checkpoints at [50]"])),
    ("no-checkpoint-at-all-pauses",
     dict(finding=finding(onset=30, detect=32), checkpoints=[]), {},
     dict(word=K.PAUSE, rung=3, says=["healthy checkpoints at none"])),
    ("non-finite-the-same-rule",
     dict(finding=finding(S.NON_FINITE, onset=71, detect=71), checkpoints=EVERY_10), {},
     dict(word=K.ROLLBACK, to_step=10, skip_steps=(11, 71))),
    ("recurrence-past-the-cap-when-none-is-left-before-it",  # rung 2: the cap is 850, gone
     dict(finding=finding(onset=1000, detect=1010), checkpoints=[ck(900), ck(950)], history=[iv(**RB)]), {},
     dict(word=K.ROLLBACK, rung=2, to_step=900, skip_steps=None, lr_multiplier=0.5,
          says=["oldest healthy one before the onset", "none is left at or before step 850"])),
]


@pytest.mark.parametrize("inp_kw, cfg_kw, expected", [c[1:] for c in MARGIN_CASES], ids=[c[0] for c in MARGIN_CASES])
def test_issue_35_the_margin_adapts_to_the_checkpoints_that_exist(inp_kw, cfg_kw, expected):
    test_decision_table(inp_kw, cfg_kw, expected)


def test_only_a_data_rollback_skips_ahead_and_zero_turns_it_off():
    """skip_ahead_steps applies to a rung-1 rollback for a loss or gradient spike (the data is the
    likely cause): an attention-logit blow-up is the optimizer's, and skipping data past it would
    only lose clean samples; 0 turns it off."""
    d = Run(PolicyConfig(rollback_margin_steps=100)).decide(finding(S.ATTN_LOGIT_CEILING, onset=171, detect=172))
    assert d.word == K.ROLLBACK and d.skip_steps is not None and d.skip_ahead_steps == 0, d.reasons
    d = Run(PolicyConfig(rollback_margin_steps=100, skip_ahead_steps=0)).decide(loss(onset=171, detect=172))
    assert d.word == K.ROLLBACK and d.skip_ahead_steps == 0
    d = Run(PolicyConfig(rollback_margin_steps=100, skip_ahead_steps=5)).decide(loss(onset=171, detect=172))
    assert d.word == K.ROLLBACK and d.skip_ahead_steps == 5, d.reasons
    with pytest.raises(PolicyConfigError, match="skip_ahead_steps"):
        PolicyConfig(skip_ahead_steps=-1)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "20"])
def test_a_bad_approval_pause_is_refused_with_its_name(bad):
    with pytest.raises(PolicyConfigError, match="approval_pause_after_steps"):
        PolicyConfig(approval_pause_after_steps=bad)


# --- after replay triage (issue 39) --------------------------------------------------------------

def test_after_triage_cuts_the_lr_only_when_the_optimizer_is_named():
    from thermowatch.supervisor.decide.policy import after_triage

    f = finding()
    assert after_triage(f, "data", 1.0) is None and after_triage(f, "hardware", 1.0) is None
    d = after_triage(f, "optimizer", 0.5)
    assert d.word == K.SET_LR and d.rung == 2 and lr_multiplier(d) == 0.25
    assert any("replay triage" in r for r in d.reasons)
    floor = after_triage(f, "optimizer", 0.1)  # 0.05 would be below min_lr_multiplier 0.1
    assert floor.word == K.PAUSE and floor.page and floor.rung == 3
    advised = after_triage(f, "optimizer", 1.0, PolicyConfig(advise_only=True))
    assert advised.requires_approval


def test_after_triage_pages_about_the_one_rank_a_hardware_fault_broke():
    """Under torchrun the abandoned path's non-finite figures named one rank: a person is paged
    to look at its device; the run changes no further (an alert, nothing to approve)."""
    from thermowatch.supervisor.decide.policy import after_triage
    from thermowatch.supervisor.notify.base import Alert

    f = finding()
    d = after_triage(f, "hardware", 1.0, rank=1)
    assert d.word == K.ALERT and d.page and not d.acts and not d.requires_approval
    assert any("suspect rank 1's device" in r for r in d.reasons) and any("exclude_rank=1" in r for r in d.reasons)
    assert Alert.from_decision("r", f, d).severity is Severity.CRITICAL
    assert after_triage(f, "data", 1.0, rank=1) is None  # the data explains it: the rank only held the sample
    assert after_triage(f, "optimizer", 0.5, rank=1).word == K.SET_LR


def test_after_triage_restarts_without_the_broken_ranks_node_when_the_team_allows_it():
    """restart_without_outlier on: the hardware verdict's rank is restarted without, from the
    checkpoint the rollback loaded, nothing skipped, and a person is still paged; off, or with no
    rank or no checkpoint known, the page alone (a human decides)."""
    from thermowatch.supervisor.decide.policy import after_triage

    f = finding()
    on = PolicyConfig(restart_without_outlier=True)
    d = after_triage(f, "hardware", 1.0, on, rank=1, checkpoint=(40, "/ckpt/step_40"))
    assert d.word == K.ROLLBACK and d.acts and d.page and exclude_rank(d) == 1
    assert (to_step(d), checkpoint(d), d.skip_steps, lr_multiplier(d)) == (40, "/ckpt/step_40", None, None)
    assert any("without rank 1's node; no data skipped" in r for r in d.reasons)
    assert after_triage(f, "hardware", 1.0, on, rank=None, checkpoint=(40, "p")) is None
    assert after_triage(f, "hardware", 1.0, on, rank=1).word == K.ALERT  # no checkpoint known
    assert after_triage(f, "hardware", 1.0, rank=1, checkpoint=(40, "p")).word == K.ALERT  # off
    advised = after_triage(f, "hardware", 1.0, PolicyConfig(restart_without_outlier=True, advise_only=True),
                           rank=1, checkpoint=(40, "p"))
    assert advised.word == K.ROLLBACK and advised.requires_approval
