"""Behind comparable runs (issue 24, item 1): a run whose loss falls behind the runs of the same
model config already in the database pages, even when nothing in its own history looks wrong.

qk-LayerNorm bounds the attention logits, so a qk-LN model at too high an LR shows no logit
growth and no spike; it simply learns worse (bench/divergence.py's `qkln-degrade` ends 0.4-0.6
nats behind `healthy-qkln`), and its own trend is a fine straight line. Only other runs of the
same model say it is behind. Not every run ahead counts, though: a run at a higher LR is ahead of
a low-LR run that is merely slow. So at each step the envelope is the lowest smoothed loss among
the comparable runs that trained with *no more* LR so far (cumulative LR, the sum of the recorded
`lr` up to that step): being behind those means this run's extra LR hurt it.

    behind = smoothed loss - envelope >= gap_nats, for `confirm` steps in a row, from step `start`

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
    confirm: int = 30
    start: int = 150  # steps before any verdict: runs at different LRs part ways in their warm-ups
    smooth: int = 10  # trailing mean: one batch is ~0.1 nats of noise here
    min_peers: int = 1  # fewer comparable runs than this: no verdict

    def __post_init__(self) -> None:
        if not (self.gap_nats > 0 and math.isfinite(self.gap_nats)):
            raise ValueError(f"gap_nats must be > 0 and finite, got {self.gap_nats!r}")
        for name in ("confirm", "smooth", "min_peers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not self.start >= 0:  # steps; a negative start was accepted and meant 0 (issue 34)
            raise ValueError(f"start must be >= 0 steps, got {self.start!r}")


@dataclass(frozen=True)
class Curve:
    """One run's loss and LR by step (ascending, unique steps)."""

    run_id: str
    steps: np.ndarray
    loss: np.ndarray
    lr: np.ndarray


def _smoothed(c: Curve, smooth: int) -> np.ndarray:
    x = np.where(np.isfinite(c.loss), c.loss, np.nan)
    ok = np.isfinite(x).astype(float)
    csum, cnt = np.cumsum(np.nan_to_num(x)), np.cumsum(ok)
    lo = np.maximum(np.arange(len(x)) - smooth, -1)
    tot = csum - np.where(lo >= 0, csum[np.maximum(lo, 0)], 0.0)
    n = cnt - np.where(lo >= 0, cnt[np.maximum(lo, 0)], 0.0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(n > 0, tot / n, np.nan)


def _area(c: Curve) -> np.ndarray:
    return np.cumsum(np.where(np.isfinite(c.lr) & (c.lr > 0), c.lr, 0.0))


@dataclass(frozen=True)
class Envelope:
    """Per step of the run: its smoothed loss, the envelope (inf where no peer is eligible), the
    index of the peer that sets it (-1: none), the run's cumulative LR, and each peer's."""

    own: np.ndarray
    best: np.ndarray
    who: np.ndarray
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
    return Envelope(own, best, who, area, areas)


def behind_peers(run: Curve, peers: Sequence[Curve], cfg: EnvelopeConfig | None = None) -> Finding | None:
    """The first confirmed stretch of `run` behind its envelope, as a finding (None: not behind)."""
    cfg = cfg or EnvelopeConfig()
    if len(run.steps) < cfg.confirm or len(peers) < cfg.min_peers:
        return None
    env = envelope(run, peers, cfg)
    own, best, who, area, areas = env.own, env.best, env.who, env.area, env.peer_areas
    gap = own - best
    hit = (run.steps >= cfg.start) & np.isfinite(gap) & (gap >= cfg.gap_nats)
    # The first index closing a run of `confirm` hits in a row.
    runs = np.convolve(hit.astype(int), np.ones(cfg.confirm, int), mode="full")[: len(hit)]
    done = np.flatnonzero(runs >= cfg.confirm)
    if not done.size:
        return None
    k = int(done[0])
    first = k - cfg.confirm + 1
    peer = peers[int(who[k])]
    return Finding(
        signal=Signal.LOSS_BEHIND_PEERS, module="", severity=Severity.WARN, onset_step=int(run.steps[first]),
        detect_step=int(run.steps[k]), metric=LOSS, outcome=Outcome.ALERT,
        evidence={"value": float(own[k]), "envelope": float(best[k]), "gap_nats": float(gap[k]),
                  "threshold_nats": cfg.gap_nats, "peer_run": peer.run_id, "peers": len(peers),
                  "lr_area": float(area[k]), "peer_lr_area": float(areas[int(who[k])][np.searchsorted(peer.steps, run.steps[k])]),
                  "steps_behind": cfg.confirm, "onset_method": "envelope"})
