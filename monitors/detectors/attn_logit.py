"""Attention-logit growth and ceiling (keys `attn_logit_max/<module>`, `attn_logit_lse/<module>`):
the detectors for the attention blow-up that YaLM-100B names as the reason for its divergence.

YaLM-100B: "starting at about 14,000 iterations, the maxima of matmul in attention began to grow
sharply. This growth is the reason for the divergence." A blowing-up attention logit grows
*multiplicatively* (a few % per step), while a healthy run drifts slowly up (e.g. 2 -> 8 over a
few hundred early steps, well under 1 %/step). So we judge log(value):

  growth  = all of, for `confirm` consecutive points:
            (a) level - baseline > max(z * sigma, ln(min_ratio)): the median of the last
                `level_points` log values stands well above the median of a trailing baseline
                window that ends before the slope window (so the ramp does not pull it up);
            (b) Theil-Sen slope of the last `slope_window` log values >= ln(1 + min_growth)
                per step: it is *growing*, not a one-step outlier or a plateau.
  ceiling = value >= `ceiling` (absolute), whatever the history.

Outcomes (issue 8): growth of the max logit alone never acts. Growth below `act_level` is
`watch` (early training moves logits fast and for real); above it, `alert`. Either detector says
`act` only when the growth is still going at decision time (the growth test holds at this very
point; for the ceiling, a Theil-Sen slope of at least `min_growth` per step) AND a witness of harm speaks (witness.py: the
loss behind its own trend, gradient-norm growth, output-logit z growth, attention-entropy
collapse, update-ratio growth), or when the logit reaches `extreme`, where waiting is unsafe, or
when it is over the ceiling while the LR schedule will still raise the LR `lr_rise`-fold (the
forecast: witness.py; the policy then lowers the LR in place, without a rollback, see policy.py).
A rise that turns back while the loss improves therefore stays `alert` at most.

LSE bound caveat: `attn_logit_lse` = max + ln(sum_j exp(x_j - max)), an offset in [0, ln(keys)]
(~8.3 for 4096 keys). Growth in log space still works because a blowup of the max soon
dominates a bounded additive offset, but: (1) the offset dilutes the relative growth while the
max is small (log(max + 8) rises slower than log(max)), so detection comes a few steps later;
(2) the offset moves with attention entropy alone (diffuse attention raises it, collapse onto one
key lowers it toward 0), which can mimic or mask a few log units of change; (3) the ceiling
fires earlier on the bound than on the exact max: set `lse_ceiling_offset` to compensate.

Ranks: the value is already the max over ranks (contract.reduction), so growth on one rank
shows here; outlier_rank.py says which rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from thermowatch.monitors.contract import ATTN_LOGIT_LSE, Outcome, Severity, Signal

from .base import at_least_each, positive
from .arrays import block_max, window_medians
from .series import Found, SeriesBank, Single, logs, median_rows, quiet_excursions, robust_rows
from .witness import Witnesses


@dataclass
class AttnLogitConfig:
    # QK-clip (Kimi K2's MuonClip) caps the max logit at tau = 100; beyond it softmax is
    # effectively one-hot and bf16 logits lose integer precision (arXiv:2507.20534).
    ceiling: float = 100.0
    # ln(4096 keys) ~ 8.3: the LSE bound can sit this far above the exact max.
    lse_ceiling_offset: float = 0.0
    # Baseline window (points): long enough for a robust median, short enough to follow
    # healthy early-training drift.
    window: int = 64
    # Points in the slope fit; also the gap between the baseline window and "now".
    slope_window: int = 16
    # Median of the last 3 log values: one noisy point neither triggers nor clears.
    level_points: int = 3
    # 1 %/step: healthy drift (2 -> 8 in 300 steps) is ~0.5 %/step, YaLM-style blowups are
    # several %/step.
    min_growth: float = 0.01
    # The level must be 25 % above baseline before growth counts (noise floor for quiet series).
    min_ratio: float = 1.25
    # Robust z on the baseline's log spread; 4 keeps healthy noisy drift out.
    z: float = 4.0
    # Consecutive points before firing: 3 points rejects a 1-2 point blip, adds <= 3 steps.
    confirm: int = 3
    # Level twice the baseline: escalate to CRITICAL (the run is diverging, roll back).
    critical_ratio: float = 2.0
    # Growth below this level is not reported at all (0: off).
    min_level: float = 0.0
    # Growth below this level is `watch` only: early training moves logits fast and for real (a
    # healthy 4-layer byte-level GPT at lr 5e-3 took its LSE logit from 5 to 30 in 200 steps,
    # docs/demo.md; issue 8 saw healthy runs rolled back at 20-25). Half the QK-clip tau: below
    # it softmax still spreads over several keys. A level, not a step count, so it holds for
    # runs of any length.
    act_level: float = 50.0
    # At or above this the logit is acted on without a witness: ten times QK-clip's tau. Healthy
    # runs do get far past 100: a rise-and-fall reported in issue 8 peaked at ~345, and the bench
    # grid's healthy RMSNorm + ReLU^2 runs at LR 3e-2 peaked at ~700 while their loss improved;
    # its damaged runs went on to 2,600-10,000.
    extreme: float = 1000.0
    # Points seen before any growth finding (0: only the baseline window must be half full).
    # Not a run length: the watch band above does the early-training work a long warm-up did.
    warmup: int = 0
    # Points kept for the onset search (bounded buffer).
    history: int = 128
    # Points searched back for the onset: enough baseline before a change caught within
    # ~20-40 points, short enough that slow healthy curvature is not read as the break.
    onset_lookback: int = 96
    # Consecutive in-band points before a finding may be raised again.
    clear_steps: int = 5

    def __post_init__(self) -> None:
        for name in ("ceiling", "min_growth", "z", "critical_ratio", "act_level", "extreme"):
            positive(name, getattr(self, name))
        if not self.lse_ceiling_offset >= 0:
            raise ValueError(f"lse_ceiling_offset must be >= 0, got {self.lse_ceiling_offset!r}")
        if not self.min_level >= 0:
            raise ValueError(f"min_level must be >= 0 (0 turns it off), got {self.min_level!r}")
        if not self.min_ratio > 1.0:
            raise ValueError(f"min_ratio must be > 1 (a ratio over baseline), got {self.min_ratio!r}")
        at_least_each(self, window=4, slope_window=3, level_points=1, confirm=1, warmup=0, clear_steps=1)
        # after window and slope_window: history's floor is their sum
        at_least_each(self, history=self.window + self.slope_window, onset_lookback=8)
        if self.onset_lookback > self.history:
            raise ValueError(f"onset_lookback ({self.onset_lookback}) must not exceed history ({self.history})")
        if self.level_points > self.slope_window:
            raise ValueError("level_points must not exceed slope_window")


def theil_sen_slope(steps: np.ndarray, values: np.ndarray) -> float:
    """Median of pairwise slopes: one outlier among 16 points cannot fake a trend."""
    i, j = np.triu_indices(values.size, k=1)
    dt = steps[j] - steps[i]
    good = dt > 0
    if not good.any():
        return 0.0
    return float(np.median((values[j] - values[i])[good] / dt[good]))


class AttnLogitGrowthBank(SeriesBank):
    """Sustained multiplicative growth of attention-logit series."""

    signal = Signal.ATTN_LOGIT_GROWTH

    def __init__(self, config: AttnLogitConfig | None = None, witnesses: Witnesses | None = None) -> None:
        self.config = config or AttnLogitConfig()
        self.witnesses = witnesses  # shared with the bank: the same run's other series
        super().__init__(self.config.history, self.config.clear_steps)

    def bulk_points_of(self) -> int:
        return self.config.window + self.config.slope_window - 1  # _bulk: the baseline and the slope window

    def batch_values(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        every = (np.isfinite(values) & (values > 0.0)).all(axis=0)
        v = values[:, every]
        return every, logs(v.ravel()).reshape(v.shape)

    def _bulk(self, steps: np.ndarray, rows: np.ndarray, values: np.ndarray):
        c, R = self.config, self.rows
        every, ys = self.batch_values(values)
        at = self._quiet_candidates(rows, every, points=c.window + c.slope_window - 1, warmup=c.warmup)
        if not at.size:
            return None
        y = ys[:, np.searchsorted(np.flatnonzero(every), at)]  # ys holds the columns of `every`
        K, H = len(steps), R.H
        x = np.concatenate([R.ordered(rows[at]), y.T], axis=1)
        # _update after appending y_t (the newest point is x[:, H + t]): the level is the median
        # of the last level_points, the baseline the window that ends slope_window before them.
        a_level, a_base = H + 1 - c.level_points, H + 1 - c.slope_window - c.window
        floor = math.log(c.min_ratio)
        quiet = quiet_excursions(x, a_base, c.window, K, c.z,
                                 lambda i: window_medians(x[i], a_level, c.level_points, K, robust=False)[0],
                                 block_max(x, a_level, c.level_points, K),
                                 lambda med: np.full(med.shape, floor), lambda lo, hi: np.full(lo.shape, floor))
        return at[quiet], y[:, quiet]

    def _update(self, rows: np.ndarray, step: int, values: np.ndarray) -> Found:
        c, R = self.config, self.rows
        idx = np.flatnonzero(np.isfinite(values) & (values > 0.0))  # non_finite.py reports NaN/Inf;
        rows, vals = rows[idx], values[idx]  # log space needs a positive value
        R.append(rows, step, logs(vals))
        R.seen[rows] += 1
        live = np.flatnonzero((R.seen[rows] > c.warmup) & (R.sizes(rows, c.window, c.slope_window) >= c.window // 2))
        lrows = rows[live]
        med, sigma = robust_rows(R, lrows, c.window, c.slope_window)
        level = median_rows(R, lrows, c.level_points)
        rise = level - med
        thr = np.maximum(c.z * sigma, math.log(c.min_ratio))
        R.observe(lrows, rise <= thr / 2)
        exceeded = rise > thr
        if c.min_level > 0:
            exceeded &= level >= math.log(c.min_level)
        slope = np.full(lrows.size, math.nan)
        for j in np.flatnonzero(exceeded):  # the slope costs O(slope_window^2); only where the level is up
            row = int(lrows[j])
            slope[j] = theil_sen_slope(R.tail_steps(row, c.slope_window), R.tail(row, c.slope_window))
            exceeded[j] = slope[j] >= math.log1p(c.min_growth)
        R.count_exceed(lrows, step, exceeded)
        out: Found = []
        for j in np.flatnonzero(R.run[lrows] >= c.confirm):
            row, rj = int(lrows[j]), float(rise[j])
            severity = Severity.CRITICAL if rj >= math.log(c.critical_ratio) else Severity.WARN
            outcome, why, harm = _judge(math.exp(float(level[j])), c, self.witnesses, "growing")
            if outcome is Outcome.ACT:
                severity = Severity.CRITICAL
            fired = self._fire(row, severity, c.onset_lookback, outcome)
            if fired is None:
                continue
            ev = self._evidence(row, float(vals[live[j]]), float(med[j]), rj, float(thr[j]), float(slope[j]), fired[1])
            ev.update(outcome_why=why, witnesses=harm)
            onset = _episode(self.witnesses, outcome, fired[0], ev)
            out.append((int(idx[live[j]]), self._finding(row, severity, onset, step, ev, outcome)))
        return out

    def _evidence(self, row: int, value: float, med: float, rise: float, thr: float, slope: float,
                  method: str) -> dict[str, Any]:
        return {
            "value": value,
            "baseline": math.exp(med),
            "ratio": math.exp(rise),
            "threshold": math.exp(med + thr),  # the level (not one point) had to pass this
            "threshold_ratio": math.exp(thr),
            "growth_per_step": math.expm1(slope),
            "min_growth_per_step": self.config.min_growth,
            "recent": [math.exp(v) for v in self.recent(row)],
            "onset_method": method,
        }


class AttnLogitCeilingBank(SeriesBank):
    """Absolute ceiling on attention-logit series (latched; clears below 90 % of it)."""

    signal = Signal.ATTN_LOGIT_CEILING

    def __init__(self, config: AttnLogitConfig | None = None, witnesses: Witnesses | None = None) -> None:
        self.config = config or AttnLogitConfig()
        self.witnesses = witnesses
        self.ceilings: list[float] = []
        super().__init__(self.config.history, self.config.clear_steps)

    def _describe(self, row: int, key: str) -> None:
        super()._describe(row, key)
        offset = self.config.lse_ceiling_offset if self.metric[row] == ATTN_LOGIT_LSE else 0.0
        self.ceilings.append(self.config.ceiling + offset)

    def load(self, prefix: str, parts: dict[str, bytes]) -> None:
        self.ceilings = []
        super().load(prefix, parts)

    def _bulk(self, steps: np.ndarray, rows: np.ndarray, values: np.ndarray):
        ceiling = np.asarray(self.ceilings)[rows]
        ok = (np.isfinite(values) & (values > 0.0)).all(axis=0) & (values < ceiling).all(axis=0)
        at = self._quiet_candidates(rows, ok)
        v = values[:, at]
        return at, logs(v.ravel()).reshape(v.shape)

    def _update(self, rows: np.ndarray, step: int, values: np.ndarray) -> Found:
        c, R = self.config, self.rows
        idx = np.flatnonzero(np.isfinite(values) & (values > 0.0))
        rows, vals = rows[idx], values[idx]
        R.append(rows, step, logs(vals))
        R.seen[rows] += 1
        ceiling = np.asarray(self.ceilings)[rows]
        over = vals >= ceiling
        R.observe(rows, vals < 0.9 * ceiling)
        R.count_exceed(rows, step, over)
        out: Found = []
        for j in np.flatnonzero(over):
            row, value = int(rows[j]), float(vals[j])
            # Still going: the log values of the last slope_window points trend up. Only an
            # escalation to act needs it; the first crossing alerts whatever the trend.
            slope = theil_sen_slope(R.tail_steps(row, c.slope_window), R.tail(row, c.slope_window))
            going = slope >= math.log1p(c.min_growth)  # the growth detector's own bar: real growth
            outcome, why, harm = _judge(value, c, self.witnesses if going else None,
                                        "above the ceiling and rising" if going else "above the ceiling, not rising")
            fired = self._fire(row, Severity.CRITICAL, c.onset_lookback, outcome)
            if fired is None:
                continue
            evidence = {"value": value, "threshold": self.ceilings[row], "onset_method": fired[1],
                        "recent": [math.exp(v) for v in self.recent(row)], "outcome_why": why, "witnesses": harm}
            onset = _episode(self.witnesses, outcome, fired[0], evidence)
            out.append((int(idx[j]), self._finding(row, Severity.CRITICAL, onset, step, evidence, outcome)))
        return out


class AttnLogitGrowthDetector(Single):
    def __init__(self, key: str, config: AttnLogitConfig | None = None, witnesses: Witnesses | None = None) -> None:
        super().__init__(AttnLogitGrowthBank(config, witnesses), key)


class AttnLogitCeilingDetector(Single):
    def __init__(self, key: str, config: AttnLogitConfig | None = None, witnesses: Witnesses | None = None) -> None:
        super().__init__(AttnLogitCeilingBank(config, witnesses), key)
        self.ceiling = self.bank.ceilings[0]


def _episode(witnesses: Witnesses | None, outcome: Outcome, onset: int, evidence: dict[str, Any]) -> int:
    """The onset a finding carries. An alert opens the run's attention episode; an act reaches
    back to the episode's first alert (witness.py), so its rollback lands before the logits
    first crossed act_level, not before the latest layer's own rise. Watch findings neither."""
    if outcome is Outcome.WATCH or witnesses is None:
        return onset
    episode = witnesses.note_attention(onset)
    if outcome is Outcome.ACT and episode < onset:
        evidence.update(own_onset=onset, episode_onset=episode)
        evidence["outcome_why"] += f"; onset moved back to the attention episode's first alert (step {episode})"
        return episode
    return onset


def _judge(value: float, c: AttnLogitConfig, witnesses: Witnesses | None, what: str) -> tuple[Outcome, str, dict]:
    """(outcome, why, witnesses) for an attention finding at `value` (module docstring)."""
    if value >= c.extreme:
        return Outcome.ACT, f"logit {value:.0f} >= extreme={c.extreme:g}: too large to wait for a witness", {}
    if value < c.act_level:
        return Outcome.WATCH, f"logit {value:.1f} below act_level={c.act_level:g}: early-training growth", {}
    harm = witnesses.harm() if witnesses is not None else {}
    if harm:
        return Outcome.ACT, f"{what}, and " + "; ".join(harm.values()), harm
    ahead = witnesses.forecast() if witnesses is not None and value >= c.ceiling else {}
    if ahead:
        return Outcome.ACT, f"{what}, and " + ahead["lr_forecast"], ahead
    seen = witnesses.context() if witnesses is not None else {}
    also = f" (seen, not counted: {'; '.join(seen.values())})" if seen else ""
    return Outcome.ALERT, f"{what}, but no witness of harm (loss on trend, no grad/z/update growth){also}", {}
