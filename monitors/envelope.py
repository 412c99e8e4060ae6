"""Behind comparable runs (issue 24, item 1): a run whose loss falls behind the runs of the same
model config already in the database pages, even when nothing in its own history looks wrong.

qk-LayerNorm bounds the attention logits, so a qk-LN model at too high an LR shows no logit
growth and no spike; it simply learns worse (bench/divergence.py's `qkln-degrade` ends 0.4-0.6
nats behind `healthy-qkln`), and its own trend is a fine straight line. Only other runs of the
same model say it is behind. Not every run ahead counts, though: a run at a higher LR is ahead of
a low-LR run that is merely slow. So at each step the envelope is the lowest smoothed loss among
the comparable runs that trained with *no more* LR so far (cumulative LR, the recorded `lr` summed
over the steps up to that one): being behind those means this run's extra LR hurt it.

    behind = smoothed loss - envelope >= gap_nats, and smoothed loss >= the envelope `lag` steps
             before, for `confirm` steps in a row (steps, not records), from step `start`

Why the second condition (issue 39, item 4): early on every curve falls steeply and seeds leave
the first plateau a few steps apart, so a run a few steps late stands tenths of a nat behind
without being worse. Worse than where the peers were `lag` steps before is more than late. Once
the peers' curve flattens the condition is the first one's, so their own curve decides when a
verdict can come, not a fixed step.

Pure, like the detectors: `behind_peers(run, peers)` over arrays; supervisor.app.jobs reads the
runs from the store (supervisor/store/peers.py) and hands the finding to the responder (an alert
that pages by default); the run page draws `envelope(run, peers)` on its loss chart.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from thermowatch.monitors.contract import LOSS, Finding, Outcome, Severity, Signal


@dataclass(frozen=True)
class EnvelopeConfig:
    # 0.25 nats for 30 steps: on the grid (68 runs) this alerts on every qkln-degrade run (final
    # gap 0.43-0.63) and on no healthy run that ends less than 0.3 nats behind.
    gap_nats: float = 0.25
    confirm: int = 30  # steps (not records): a run recorded every 10th step confirms as fast
    start: int = 0  # steps before any verdict (was 150); `lag` keeps the steep start out instead
    # 20 steps: on the grid (issue 39) the degraded runs page 29-103 steps after falling behind
    # (median 42; start 150: 68-156), the same healthy run pages as before and no other, and no
    # other healthy run stays behind for more than 12 steps in a row (start 150: 29).
    lag: int = 20  # steps a run may trail its peers' curve and not be behind (see the docstring)
    smooth: int = 10  # steps of trailing mean: one batch is ~0.1 nats of noise here
    min_peers: int = 1  # fewer comparable runs than this: no verdict

    def __post_init__(self) -> None:
        if not (self.gap_nats > 0 and math.isfinite(self.gap_nats)):
            raise ValueError(f"gap_nats must be > 0 and finite, got {self.gap_nats!r}")
        for name in ("confirm", "smooth", "min_peers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        for name in ("start", "lag"):  # steps; a negative start was accepted and meant 0 (issue 34)
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0 steps, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Curve:
    """One run's loss and LR by step (ascending, unique steps)."""

    run_id: str
    steps: np.ndarray
    loss: np.ndarray
    lr: np.ndarray


def _smoothed(c: Curve, smooth: int) -> np.ndarray:
    """The mean finite loss over the last `smooth` steps (the records within them): in steps, as
    a window of records would reach 100 steps back on a run recorded every 10th step, into
    its steep start, and put a healthy run behind."""
    x = np.where(np.isfinite(c.loss), c.loss, np.nan)
    ok = np.isfinite(x).astype(float)
    csum, cnt = np.cumsum(np.nan_to_num(x)), np.cumsum(ok)
    lo = np.searchsorted(c.steps, c.steps - smooth, side="right") - 1  # the last record left out
    tot = csum - np.where(lo >= 0, csum[np.maximum(lo, 0)], 0.0)
    n = cnt - np.where(lo >= 0, cnt[np.maximum(lo, 0)], 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, tot / n, np.nan)


def _area(c: Curve) -> np.ndarray:
    """Cumulative LR: each recorded LR times the steps since the record before (one step for
    the first), so a run recorded every 10th step is weighed like one recorded every step."""
    lr = np.where(np.isfinite(c.lr) & (c.lr > 0), c.lr, 0.0)
    return np.cumsum(lr * np.diff(c.steps, prepend=c.steps[:1] - 1)) if len(c.steps) else lr


@dataclass(frozen=True)
class Envelope:
    """Per step of the run: its smoothed loss; the envelope (inf where no peer is eligible); the
    index of the peer that sets it (-1: none); the envelope `lag` steps before (inf: none yet); the
    run's cumulative LR, and each peer's."""

    own: np.ndarray
    best: np.ndarray
    who: np.ndarray
    before: np.ndarray
    area: np.ndarray
    peer_areas: list[np.ndarray]


def envelope(run: Curve, peers: Sequence[Curve], cfg: EnvelopeConfig | None = None) -> Envelope:
    """The lowest smoothed loss, at each of the run's steps, among the peers that had trained
    with no more cumulative LR by then (the rule behind_peers judges, and the run page draws)."""
    cfg = cfg or EnvelopeConfig()
    own, area = _smoothed(run, cfg.smooth), _area(run)
    best = np.full(len(run.steps), np.inf)
    who = np.full(len(run.steps), -1)
    areas: list[np.ndarray] = []  # each peer's cumulative LR, for the evidence too
    for i, p in enumerate(peers):
        areas.append(_area(p))
        if len(p.steps) == 0:
            continue
        at = np.searchsorted(p.steps, run.steps)
        have = (at < len(p.steps)) & (p.steps[np.minimum(at, len(p.steps) - 1)] == run.steps)
        j = np.minimum(at, len(p.steps) - 1)
        ps, pa = _smoothed(p, cfg.smooth)[j], areas[i][j]
        eligible = have & (pa <= area * (1 + 1e-9)) & np.isfinite(ps)
        better = eligible & (ps < best)
        best, who = np.where(better, ps, best), np.where(better, i, who)
    # At the run's last recorded step at or before step - lag (none yet: inf, no verdict).
    back = np.searchsorted(run.steps, run.steps - cfg.lag, side="right") - 1
    before = np.where(back >= 0, best[np.maximum(back, 0)], np.inf)
    return Envelope(own, best, who, before, area, areas)


def _confirmed(hit: np.ndarray, steps: np.ndarray, confirm: int) -> tuple[int, int] | None:
    """The first stretch of hits (consecutive records) to span `confirm` steps, as the indices of
    its first hit and of the hit that completes the span; counted in steps, so a run recorded
    every 10th step confirms as soon as one recorded every step."""
    idx = np.arange(len(hit))
    # Index of the first hit of the stretch each index is in: one past the last miss before it.
    since = np.maximum.accumulate(np.where(hit, -1, idx)) + 1
    span = steps - steps[np.minimum(since, len(steps) - 1)] + 1
    done = np.flatnonzero(hit & (span >= confirm))
    return (int(since[done[0]]), int(done[0])) if done.size else None


def behind_peers(run: Curve, peers: Sequence[Curve], cfg: EnvelopeConfig | None = None) -> Finding | None:
    """The first confirmed stretch of `run` behind its envelope, as a finding (None: not behind)."""
    cfg = cfg or EnvelopeConfig()
    if len(run.steps) == 0 or len(peers) < cfg.min_peers:
        return None
    env = envelope(run, peers, cfg)
    own, best, who, area, areas = env.own, env.best, env.who, env.area, env.peer_areas
    gap = own - best
    with np.errstate(invalid="ignore"):
        hit = (run.steps >= cfg.start) & np.isfinite(gap) & (gap >= cfg.gap_nats) & (own >= env.before)
    stretch = _confirmed(hit, run.steps, cfg.confirm)
    if stretch is None:
        return None
    first, k = stretch
    peer = peers[int(who[k])]
    return Finding(
        signal=Signal.LOSS_BEHIND_PEERS, module="", severity=Severity.WARN, onset_step=int(run.steps[first]),
        detect_step=int(run.steps[k]), metric=LOSS, outcome=Outcome.ALERT,
        evidence={"value": float(own[k]), "envelope": float(best[k]), "gap_nats": float(gap[k]),
                  "threshold_nats": cfg.gap_nats, "peer_run": peer.run_id, "peers": len(peers),
                  "lr_area": float(area[k]), "peer_lr_area": float(areas[int(who[k])][np.searchsorted(peer.steps, run.steps[k])]),
                  "envelope_lag": float(env.before[k]), "lag": cfg.lag, "steps_behind": int(run.steps[k] - run.steps[first] + 1),
                  "onset_method": "envelope"})
