"""The peer envelope's rule (monitors/envelope.py) on synthetic loss curves: how soon a run that
falls behind its peers gets a verdict, and that a healthy run, even one a few steps late on the
steep start, gets none (issue 39, item 4). Real recorded runs: tests/supervisor/app/test_peer_envelope.py."""

from __future__ import annotations

import numpy as np
import pytest

from thermowatch.monitors.envelope import Curve, EnvelopeConfig, behind_peers, envelope

STEPS = np.arange(400)
LR = np.full(len(STEPS), 3e-3)
OLD = EnvelopeConfig(start=150, lag=0)  # the rule before issue 39: no verdict before step 150


def _loss(steps: np.ndarray) -> np.ndarray:
    """A small LM's curve: ~5.3 nats at init, steep for ~50 steps, then slowly down to ~2.3."""
    return 2.3 + 2.0 * np.exp(-steps / 20.0) + 1.0 * np.exp(-steps / 150.0)


def _run(name: str, seed: int, loss: np.ndarray, every: int = 1) -> Curve:
    noisy = loss + np.random.default_rng(seed).normal(0.0, 0.1, len(loss))  # one batch: ~0.1 nats
    return Curve(name, STEPS[::every], noisy[::every], LR[::every])


PEERS = [_run(f"peer-{i}", i, _loss(STEPS)) for i in range(3)]


def _fallen(at: int) -> np.ndarray:
    """The peers' curve until `at - 10`, then stalled: 0.25 nats behind them by step `at`, and
    0.4 behind by the end (like qkln-degrade, whose own curve never turns up)."""
    return _loss(STEPS) + 0.4 * (1 - np.exp(-np.maximum(STEPS - (at - 10), 0) / 10.0))


def test_a_run_that_falls_behind_at_step_60_is_paged_by_step_160():
    run = _run("degrade", 7, _fallen(60))
    same_step = envelope(run, PEERS, EnvelopeConfig(lag=0))
    gap = same_step.own - same_step.best
    assert 55 <= int(np.flatnonzero(gap >= 0.25)[0]) <= 70  # it does fall behind at ~60
    f = behind_peers(run, PEERS)
    assert f is not None and f.detect_step <= 160, f
    assert 55 <= f.onset_step < f.detect_step and f.evidence["gap_nats"] >= 0.25
    assert f.evidence["peer_lr_area"] <= f.evidence["lr_area"]
    assert f.evidence["envelope_lag"] <= f.evidence["value"]  # worse than the peers were `lag` steps before
    # The rule before: nothing before step 150 + 30 (the held-out runs paged 124 and 156 steps late).
    assert behind_peers(run, PEERS, OLD).detect_step >= 179


def test_a_healthy_run_is_not_paged_even_a_few_steps_late_on_the_steep_start():
    healthy = _run("healthy", 8, _loss(STEPS))
    assert behind_peers(healthy, PEERS) is None
    # Left the steep start 10 steps after its peers (another seed, a slower warm-up): tenths of a
    # nat behind for ~50 steps, then level with them. It is late, not worse.
    late = _run("late", 9, _loss(np.maximum(STEPS - 10, 0)))
    assert behind_peers(late, PEERS) is None
    # Why the envelope is taken `lag` steps back: against the envelope of the same step it pages.
    assert behind_peers(late, PEERS, EnvelopeConfig(lag=0)) is not None


def test_confirm_counts_steps_not_records():
    """A run recorded every 10th step is confirmed as soon as one recorded every step (before,
    `confirm: 30` meant 30 records: 300 steps)."""
    every = behind_peers(_run("degrade", 7, _fallen(60)), PEERS)
    sparse = behind_peers(_run("degrade", 7, _fallen(60), every=10), PEERS)
    assert sparse is not None and abs(sparse.detect_step - every.detect_step) <= 20
    assert sparse.evidence["steps_behind"] >= EnvelopeConfig().confirm
    # Its trailing mean spans 10 steps too (10 records would reach back into the steep start).
    assert behind_peers(_run("healthy", 8, _loss(STEPS), every=10), PEERS) is None


def test_lag_and_start_are_steps_at_least_zero():
    with pytest.raises(ValueError, match="lag must be >= 0 steps"):
        EnvelopeConfig(lag=-1)
    with pytest.raises(ValueError, match="start must be >= 0 steps"):
        EnvelopeConfig(start=-5)
