"""A checkpoint that proves bad when loaded (issue 39, item 2): non-finite values in the first
steps a rollback re-trained mean the weights it loaded are bad, so the policy distrusts that
checkpoint and falls back one further, by itself, at most MAX_BAD_LOADS times in a row, then
pauses and pages (Megatron-LM #5281: NaN three steps after every load, 44 restarts).

The pure policy here, table-style; the responder and the database with a
real loop in tests/client/test_checkpoint_trust.py."""

from __future__ import annotations

from thermowatch.monitors.commands import CommandKind
from thermowatch.monitors.contract import Signal
from thermowatch.supervisor.decide.policy import (
    BAD_LOAD_STEPS, MAX_BAD_LOADS, Intervention, PolicyInput, make_decision,
)
from tests.supervisor.decide.test_policy import NOW, K, ck, finding, lr_multiplier, to_step

S = Signal
CKPTS = [ck(s) for s in range(10, 110, 10)]


def rollback(loaded: int, *, signal=S.LOSS_SPIKE, onset=None, attempt=1, ago=60.0, automatic=True,
             seq=1) -> Intervention:
    """A rollback that loaded `loaded` and took effect (re-trained from loaded + 1), answering a
    finding of `attempt`; the run's next attempt is attempt + 1."""
    return Intervention(kind=CommandKind.ROLLBACK, signal=signal if automatic else None, module="", step=(onset or loaded + 20),
                        time=NOW - ago, ok=True, automatic=automatic, to_step=loaded, checkpoint_step=loaded,
                        first_step=loaded + 1, attempt=attempt if automatic else None,
                        left_attempt=None if automatic else attempt, onset=onset, seq=seq)


def nan_at(step: int, history, attempt: int):
    return make_decision(PolicyInput(finding=finding(S.NON_FINITE, onset=step, detect=step), now=NOW,
                                     checkpoints=CKPTS, history=history, attempt=attempt))


def test_non_finite_right_after_a_rollback_falls_back_past_the_checkpoint_it_loaded():
    # A spike rolled back to 90; NaN at 91, the first step re-trained: 90's weights are bad.
    d = nan_at(91, [rollback(90)], attempt=2)
    assert d.word == K.ROLLBACK and to_step(d) == 80 and d.distrust_step == 90, d.reasons
    assert d.skip_steps is None and lr_multiplier(d) is None and not d.page  # the file, not the data or the LR
    text = " ".join(d.reasons)
    assert "weights it loaded are bad" in text and "checkpoint 90 is distrusted" in text, text
    # A manual rollback to a bad file is no different; its unhealthy neighbours are passed over.
    d = make_decision(PolicyInput(finding=finding(S.NON_FINITE, onset=92, detect=92), now=NOW, attempt=2,
                                  checkpoints=[ck(70), ck(80, healthy=False), ck(90)],
                                  history=[rollback(90, automatic=False)]))
    assert (d.word, to_step(d), d.distrust_step) == (K.ROLLBACK, 70, 90), d.reasons


def test_not_a_bad_load_when_the_nan_comes_later_or_on_the_old_attempt():
    # Past the first BAD_LOAD_STEPS re-trained steps: the ordinary rules (the same incident, within
    # the rollback's cooldown), the checkpoint not blamed.
    d = nan_at(91 + BAD_LOAD_STEPS, [rollback(90, signal=S.NON_FINITE, onset=110)], attempt=2)
    assert d.word == K.NOOP and d.distrust_step is None and "same incident" in d.reasons[1], d.reasons
    # A late finding of the attempt the rollback left behind: nothing.
    d = nan_at(91, [rollback(90)], attempt=1)
    assert d.word == K.NOOP and d.distrust_step is None, d.reasons


def test_the_fallbacks_are_bounded_then_the_run_pauses_and_pages():
    first = rollback(90, seq=1, ago=300)  # a spike sent it back to 90
    # 90 was bad (NaN at 91): fallback 1, to 80
    fb1 = rollback(80, signal=S.NON_FINITE, onset=91, attempt=2, seq=2, ago=200)
    d = nan_at(81, [first, fb1], attempt=3)  # 80 is bad too: fallback 2, to 70
    assert (d.word, to_step(d), d.distrust_step) == (K.ROLLBACK, 70, 80), d.reasons
    assert f"fallback 2 of at most {MAX_BAD_LOADS}" in " ".join(d.reasons)
    fb2 = rollback(70, signal=S.NON_FINITE, onset=81, attempt=3, seq=3, ago=100)
    d = nan_at(72, [first, fb1, fb2], attempt=4)  # and 70: no third fallback, a human is paged
    assert d.word == K.PAUSE and d.rung == 3 and d.page and d.distrust_step == 70, d.reasons
    assert "checkpoints 70, 80, 90 each went non-finite right after loading" in d.reasons[-1], d.reasons
