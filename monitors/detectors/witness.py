"""Witnesses of harm: evidence, from series other than the attention logits, that training is
being hurt right now. Attention-logit growth alone is `watch`/`alert`; it may `act` only when
one of these agrees (issue 8; DESIGN.md, Trust: "acting on attention growth needs
corroboration").

    loss_behind       the smoothed loss stands above its own recent trend (a line fitted in
                      log-log space over a trailing window that grows with the run)
    grad_growth       the global gradient norm's recent median is a multiple of its baseline
    z_growth          the output logits' log-sum-exp (z/<module>) rose by nats over baseline
    entropy_collapse  a layer's minimum attention entropy (attn_entropy_min/<module>) fell to a
                      fraction of its baseline (ViT-22B: logit growth -> entropy collapse ->
                      divergence)
    update_growth     a layer's update-to-weight ratio (update_ratio/<module>) per unit of LR is a
                      multiple of its baseline: updates large for the LR in force. A raise of
                      the LR (a schedule's warm-up, an operator's x30) makes every update larger
                      and is no harm by itself (issue 24); lr_jump.py judges raises. A record
                      without `lr` leaves its update ratios unjudged

A forecast, not a witness: `lr_peak_ahead` (sent by the trainer with every step: the largest LR
its schedule will still train at) over the step's LR. A logit over the ceiling while the
schedule will still raise the LR `lr_rise`-fold is acted on at once (`forecast()`, read by
attn_logit.py): attention logits grow with the LR (Wortsman et al. 2023, "Small-scale proxies
for large-scale Transformer training instabilities"), and a run already at QK-clip's tau with
twice the LR to come has its divergence ahead of it. Healthy runs that cross the ceiling do so
near or after their peak LR, and stay `alert`. Without the key (a trainer that does not send
it, a recorded run from elsewhere) the forecast is silent.

The attention episode. Witnesses also keep, for the run, the onset of the current attention
episode: set by the first attention finding that alerts (a logit at or above the attention
detectors' act_level, or over the ceiling), and ends after `clear` records in a row with every
layer below that level, or after `stale` records without a new high of the largest logit (a
plateau, however high, is not a rise still going: a divergence that comes out of it later is a
new episode, and its rollback must not reach back across the plateau). An attention
finding that acts carries the episode's onset, so the rollback reaches back before the first
alert, as a fixed ceiling acting at its crossing would have, even when the witness of harm
speaks hundreds of steps later (issue 8: no thermometer tells, at the crossing, a run that will
be damaged from one that will not; bench/lead_analysis.py).

Each witness only speaks when its series is there: a trainer without the entropy or
update-ratio thermometers is judged on the others. A series read every few steps (issue 36: a
thermometer group on its cadence, absent in between; a NaN update ratio or entropy, "not
measured") speaks from its latest reading until the next one is due: a step it was not read on is
not a step on which it stopped speaking (`_standing`). The bank updates one Witnesses per run from
each record before the per-series detectors run, so a detector at step s sees the witnesses of
step s. Pure, bounded, restartable (state_dict / load_state_dict), like every detector.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from thermowatch.monitors.contract import (ATTN_ENTROPY_MIN, ATTN_LOGIT_LSE, ATTN_LOGIT_MAX, GRAD_NORM, LOSS, LR,
                                           LR_PEAK_AHEAD, UPDATE_RATIO, Z, StepRecord)
from thermowatch.monitors.contract import split_key

from .arrays import Rows, as_rows, parts_from_json, parts_to_json
from .base import History, at_least, positive
from .series import logs, median_rows

WITNESSES = ("loss_behind", "grad_growth", "z_growth", "entropy_collapse", "update_growth")


@dataclass
class WitnessConfig:
    # Loss trend: a trailing mean of `loss_smooth` losses (one batch is noisy) ...
    loss_smooth: int = 10
    # ... fitted as log(loss) = a + b log(step) over the points seen so far, at most `trend_max`
    # of them and at least `trend_min`, ending `trend_gap` points before now so a departure does
    # not drag its own baseline. The window is half of what the run has seen: it follows the
    # run's own pace whether it is 300 steps old or 300,000.
    trend_min: int = 32
    trend_max: int = 256
    trend_gap: int = 16
    # The trend starts once the LR has stopped rising for `lr_settle` points (the warm-up's
    # loss curve has another shape, and a power law fitted to it predicts a fall the post-warm-up
    # plateau never makes: healthy runs sat 10-13 % "behind" such a fit right after warm-up).
    # Without an `lr` key in the records, after `lr_settle` points.
    lr_settle: int = 20
    # Behind = smoothed loss >= trend * (1 + margin), margin = max(loss_margin, 3 x the fit's
    # residual spread). Healthy runs of the bench grid stayed within +6.6 % of their own trend
    # (5-point minimum) over 1,500 steps after warm-up; a mid-run LR jump put the loss +24 % to
    # +108 % above it.
    loss_margin: float = 0.08
    # ... for this many points in a row: one noisy batch in the trailing mean is not harm.
    loss_confirm: int = 5
    # Spread of the recent (last `recent` readings) median against a baseline (the readings of
    # the `baseline` steps before them: a stretch of training, so a series read every few steps,
    # issue 36, is compared with its level lately, not since its early steps), for the other
    # witnesses.
    recent: int = 8
    baseline: int = 64
    grad_ratio: float = 2.0  # gradient norm doubled: clipping is now doing the training
    z_rise: float = 2.0  # nats: the output softmax normaliser grew e^2 ~ 7x (PaLM's z-loss target)
    entropy_fraction: float = 0.5  # a layer's min attention entropy halved: attention collapsing
    update_ratio: float = 3.0  # updates 3x their usual size relative to the weights, for the LR in force
    # The witnesses that may turn attention growth into `act`. Entropy collapse is measured and
    # shown with every attention finding, but it does not count by default: the minimum over
    # heads falls to 0.02-0.2 nats in healthy high-LR runs of the bench grid too (specialised
    # heads, e.g. previous-token heads, attend to one key by design), together with the very
    # logit growth it would have to corroborate.
    act_witnesses: tuple[str, ...] = ("loss_behind", "grad_growth", "z_growth", "update_growth")
    # The forecast (module docstring): act on a logit over the ceiling while the schedule will
    # still raise the LR this many times over (0: off). Twice: the LR still to double, a rise as
    # large as the one that took the logits to the ceiling in the first place.
    lr_rise: float = 2.0

    def __post_init__(self) -> None:
        for name in ("loss_margin", "grad_ratio", "z_rise", "update_ratio"):
            positive(name, getattr(self, name))
        if not (self.lr_rise == 0 or self.lr_rise > 1.0):
            raise ValueError(f"lr_rise must be > 1 (a ratio of LRs) or 0 (off), got {self.lr_rise!r}")
        if not 0.0 < self.entropy_fraction < 1.0:
            raise ValueError(f"entropy_fraction must be in (0, 1), got {self.entropy_fraction!r}")
        at_least("loss_smooth", self.loss_smooth, 1)
        at_least("loss_confirm", self.loss_confirm, 1)
        at_least("lr_settle", self.lr_settle, 0)
        self.act_witnesses = tuple(self.act_witnesses)
        unknown = set(self.act_witnesses) - set(WITNESSES)
        if unknown:
            raise ValueError(f"act_witnesses: unknown {sorted(unknown)}; choose from {list(WITNESSES)}")
        at_least("trend_min", self.trend_min, 8)
        at_least("trend_max", self.trend_max, self.trend_min)
        at_least("trend_gap", self.trend_gap, 1)
        at_least("recent", self.recent, 1)
        at_least("baseline", self.baseline, 8)


def line_fit(xs: np.ndarray, ys: np.ndarray) -> tuple[float, float, float, np.ndarray]:
    """Least squares ys = ym + slope (xs - xm): (xm, ym, slope, residuals); slope 0 for one x."""
    xm, ym = xs.mean(), ys.mean()
    sxx = float(((xs - xm) ** 2).sum())
    slope = float(((xs - xm) * (ys - ym)).sum() / sxx) if sxx > 0 else 0.0
    return xm, ym, slope, ys - (ym + slope * (xs - xm))


class LossTrend:
    """The loss against its own trend in log-log space. `update` returns how far above the
    trend the smoothed loss stands (log ratio) and the margin it must clear, or None while
    there is not enough history. Also the core of the degradation detector."""

    def __init__(self, cfg: WitnessConfig) -> None:
        self.cfg = cfg
        # Raw losses as long as the fitted history, so a rollback rewinds both to the same step.
        self.raw = History(cfg.trend_max + cfg.trend_gap + 1)
        self.history = History(cfg.trend_max + cfg.trend_gap + 1)
        self.seen = 0
        self.last: tuple[float, float] | None = None  # (excess, margin) at the newest point
        self.lr_max = -math.inf  # the largest LR seen, and points since it last rose
        self.settled = 0

    def update(self, step: int, loss: float, lr: float | None = None) -> tuple[float, float] | None:
        c = self.cfg
        if not math.isfinite(loss) or loss <= 0.0:
            # A non-finite loss is non_finite.py's; it must not poison the trailing mean.
            return self.last
        if self.settled < c.lr_settle:  # still in the LR warm-up: no trend yet
            rising = lr is not None and math.isfinite(lr) and lr > self.lr_max * (1 + 1e-6)
            if lr is not None and math.isfinite(lr):
                self.lr_max = max(self.lr_max, lr)
            self.settled = 0 if rising else self.settled + 1
            self.raw.append(step, loss)  # feeds the trailing mean, not the fit
            return None
        self.raw.append(step, loss)
        self.seen += 1
        self.history.append(step, math.log(float(self.raw.tail(c.loss_smooth).mean())))
        n_fit = min(c.trend_max, max(c.trend_min, self.seen // 2))
        if len(self.history) < n_fit + c.trend_gap + 1 or self.seen < c.loss_smooth + n_fit + c.trend_gap:
            self.last = None
            return None
        ys = self.history.tail(n_fit, skip_last=c.trend_gap)
        xs = np.log(np.maximum(self.history.tail_steps(n_fit + c.trend_gap)[:n_fit], 1.0))
        xm, ym, slope, resid = line_fit(xs, ys)
        pred = ym + slope * (math.log(max(step, 1)) - xm)
        excess = self.history.values[-1] - pred
        margin = max(math.log1p(c.loss_margin), 3.0 * float(resid.std()))
        self.last = (excess, margin)
        return self.last

    def reset(self, first_step: int | None = None) -> None:
        dropped = self.history.rewind(first_step)
        self.raw.rewind(first_step)
        self.seen = 0 if first_step is None else max(0, self.seen - dropped)
        self.last = None
        if first_step is None:
            self.lr_max, self.settled = -math.inf, 0

    def state_dict(self) -> dict[str, Any]:
        return {"raw": self.raw.state_dict(), "history": self.history.state_dict(), "seen": self.seen,
                "last": list(self.last) if self.last else None,
                "lr_max": self.lr_max if math.isfinite(self.lr_max) else None, "settled": self.settled}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.raw.load_state_dict(d["raw"])
        self.history.load_state_dict(d["history"])
        self.seen = int(d["seen"])
        self.last = tuple(d["last"]) if d["last"] else None  # type: ignore[assignment]
        self.lr_max = -math.inf if d["lr_max"] is None else float(d["lr_max"])
        self.settled = int(d["settled"])


class _Shifts:
    """Recent median against a baseline median, per series (one row each), in each series'
    own transform, for a whole record at once."""

    def __init__(self, cfg: WitnessConfig) -> None:
        self.cfg = cfg
        self.rows = Rows(cfg.recent + cfg.baseline, 1)

    def update(self, keys: list[str], step: int, ys: np.ndarray) -> np.ndarray:
        """recent median - baseline median per key, NaN before the baseline has half its points."""
        return self.now(self.append(keys, step, ys))

    def append(self, keys: list[str], step: int, ys: np.ndarray) -> np.ndarray:
        """The step's points into the rings (the rows, for `now`)."""
        R = self.rows
        rows = as_rows([R.add(k) for k in keys])
        R.append(rows, step, ys)
        return rows

    def now(self, rows: np.ndarray) -> np.ndarray:
        """`update`'s d for `rows`, from their rings as they stand: the median of each series'
        last `recent` readings against the median of its readings in the `baseline` steps before
        them, ready once the ring reaches half of that back. The recent window counts readings
        (a robust "now" needs its points); the baseline is a stretch of training, "its level
        lately". On a series read every step both are what they were (the last `recent` points
        and the `baseline` before them); on one read every k-th step (issue 36) a baseline of
        `baseline` readings would reach k x as far back: 1,000 steps at k = 16, where a healthy
        run's slow rise of z since its early steps read as growth (tests/monitors/test_detector_cadence.py)."""
        c, R = self.cfg, self.rows
        d = np.full(rows.size, np.nan)
        n = R.length[rows]
        rows, at, n = rows[n > c.recent], np.flatnonzero(n > c.recent), n[n > c.recent]
        if not rows.size:
            return d
        st = R.steps[rows[:, None], (R.pos[rows, None] - R.H + np.arange(R.H)[None, :]) % R.H]  # oldest first
        first = st[:, R.H - c.recent:R.H - c.recent + 1]  # the oldest of the recent readings
        older = np.arange(R.H)[None, :] >= (R.H - n)[:, None]
        base = (older & (st < first) & (st >= first - c.baseline)).sum(axis=1)
        oldest = st[np.arange(rows.size), R.H - n]
        ok = (base > 0) & (oldest <= first[:, 0] - c.baseline // 2)
        recent = median_rows(R, rows[ok], c.recent)
        # Grouped by baseline size, the medians are median_rows' (Rows.blocks, np.median): a
        # series read every step gets the same values in the same order as before, and as
        # update_many's batch path.
        for b in np.unique(base[ok]).tolist():
            g = np.flatnonzero(base[ok] == b)
            d[at[np.flatnonzero(ok)[g]]] = recent[g] - median_rows(R, rows[ok][g], b, c.recent)
        return d

    def update_many(self, keys: list[str], steps: np.ndarray, ys: np.ndarray) -> Callable[[int], np.ndarray] | None:
        """`update` for K steps of the same keys at once (ys: [K, len(keys)]): the rings take all
        K points now; returns d_at(t), the d that `update` would have returned at the batch's
        t-th step, computed only when asked (a shift is read only when an attention finding
        asks the witnesses, or at the batch's end). Only for rows whose ring is full, the steady
        state, and whose ring and batch are consecutive steps (then `now`'s baseline of
        `baseline` steps is the `baseline` points before the recent ones); None (nothing changed)
        otherwise, and the caller goes step by step. The medians are of the same values in the
        same order as `update` takes them: bit-identical."""
        c, R = self.cfg, self.rows
        rows = as_rows([R.add(k) for k in keys])
        if rows.size == 0 or (R.length[rows] < R.H).any():
            return None
        newest = R.steps[rows, (R.pos[rows] - 1) % R.H]
        oldest = R.steps[rows, R.pos[rows]]  # a full ring's oldest slot is the next one written
        if ((newest - oldest) != R.H - 1).any() or (newest != steps[0] - 1).any() or steps[-1] - steps[0] != len(steps) - 1:
            return None
        x = np.concatenate([R.ordered(rows), ys.T], axis=1)  # [P, H + K]
        R.append_many(rows, steps, ys.T)

        def d_at(t: int) -> np.ndarray:
            w = x[:, t + 1:t + 1 + R.H]  # the ring after the t-th append
            return np.median(w[:, c.baseline:], axis=-1) - np.median(w[:, :c.baseline], axis=-1)

        return d_at




def _finite_or_none(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _kind(key: str) -> int:
    name = split_key(key)[0]
    if key == GRAD_NORM:
        return 1
    return {Z: 2, ATTN_ENTROPY_MIN: 3, UPDATE_RATIO: 4, ATTN_LOGIT_MAX: 5, ATTN_LOGIT_LSE: 5}.get(name, 0)


class Witnesses:
    """All witnesses of one run. `harm()` names those speaking at the newest step."""

    def __init__(self, cfg: WitnessConfig | None = None, episode_level: float | None = None, clear: int = 5,
                 stale: int = 64) -> None:
        self.cfg = cfg or WitnessConfig()
        # The attention episode (module docstring): None = not tracked (a Witnesses alone).
        self.episode_level = episode_level
        self.episode_clear = clear
        self.episode_stale = stale
        self.episode: int | None = None  # onset step of the current episode's first alert
        self.quiet = 0  # records in a row with every attention logit below episode_level
        self.top = math.nan  # the newest record's largest attention logit
        self.peak = -math.inf  # the episode's largest logit so far, and records since it rose
        self.since_peak = 0
        self.loss = LossTrend(self.cfg)
        self.shifts = _Shifts(self.cfg)
        self._active: dict[str, str] = {}  # witness name -> why, at the newest step (`active`)
        self._pending: tuple | None = None  # the newest step's shifts, judged when first read
        self._shift_kinds: list[int] = []  # per shift row (self.shifts.rows), its kind (_kind)
        self.step = -1
        self.behind = 0  # consecutive points with the loss behind its trend
        self.lr: float | None = None  # the newest record's LR (the degradation detector reads it)
        self.lr_ahead: float | None = None  # and the largest LR its schedule will still reach
        self._kinds: dict[tuple[str, ...], np.ndarray] = {}
        # prepare(): step -> (keys, the shift series judged ahead, their d, the step's largest
        # attention logit or None, their kinds if those are all its shift series, else None)
        self._ahead: dict[int, tuple[tuple[str, ...], np.ndarray, Callable[[], np.ndarray], float | None,
                                     np.ndarray | None]] = {}

    def filling(self, K: int, piece: int) -> bool:
        """A shift ring fills up inside a batch of K steps early enough for pieces of `piece`
        steps to take the rest of it in one pass (update_many needs full rings)."""
        R = self.shifts.rows
        n = R.length[:len(R)]
        return bool(((n < R.H) & (n + K >= R.H + piece)).any())

    def prepare(self, records: Sequence[StepRecord]) -> None:
        """Judge a batch's shifts in one go before its records are observed one by one (issue 10:
        a batch of steps per numpy call): the series judged at every step of the batch (finite,
        and positive where a log is taken) go in one pass; a series that sits out some steps
        goes step by step in observe(), as every series did before. Only for the plain batch:
        steps rising past the newest seen, the same keys in every record, every series known."""
        self._ahead = {}
        if len(records) < 2:
            return
        keys = tuple(records[0].values)
        if any(tuple(r.values) != keys for r in records):
            return
        v = np.array([list(r.values.values()) for r in records], np.float64).reshape(len(records), len(keys))
        self.prepare_arrays(keys, np.fromiter((r.step for r in records), np.int64, len(records)), v)

    def prepare_arrays(self, keys: tuple[str, ...], steps: np.ndarray, v: np.ndarray) -> None:
        """prepare() for a batch given as arrays: every record has `keys`, v [K, len(keys)]."""
        self._ahead = {}
        if len(steps) < 2 or steps[0] <= self.step or (np.diff(steps) <= 0).any():
            return
        if self._pending is not None:
            self.active  # the newest step's shifts read its rings as they stand: judge them first
        kinds = self._kinds_of(keys)
        use = (kinds > 0) & (kinds < 5) & np.isfinite(v) & ((kinds == 2) | (v > 0))  # 5: attention, not a shift
        lr = v[:, keys.index(LR)] if LR in keys else np.full(len(steps), np.nan)
        use &= (kinds != 4) | ((lr > 0) & np.isfinite(lr))[:, None]  # the update ratio is judged per unit of LR
        every = np.flatnonzero(use.all(axis=0))
        if not every.size or any(k not in self.shifts.rows.index for k in (keys[p] for p in np.flatnonzero(use.any(axis=0)))):
            return  # a series seen for the first time: its row is made step by step, in order
        y = v[:, every]
        logged = kinds[every] != 2
        y[:, logged] = logs(y[:, logged])
        upd = kinds[every] == 4
        if upd.any():
            y[:, upd] -= logs(lr)[:, None]
        d_at = self.shifts.update_many([keys[p] for p in every.tolist()], steps, y)
        if d_at is None:
            return
        # A batch whose shift series are the same at every step needs nothing else from its
        # records: observe() takes the step's largest attention logit, and the series' kinds, from here.
        uniform = kinds[every] if bool((use == use[0]).all()) else None
        attn = v[:, kinds == 5]
        seen = np.isfinite(attn)
        top = np.where(seen, attn, -np.inf).max(axis=1, initial=-np.inf)
        has = seen.any(axis=1)
        self._ahead = {st: (keys, every, functools.partial(d_at, i), float(top[i]) if has[i] else None, uniform)
                       for i, st in enumerate(steps.tolist())}

    def _kinds_of(self, keys: tuple[str, ...]) -> np.ndarray:
        kinds = self._kinds.get(keys)
        if kinds is None:
            if len(self._kinds) > 16:
                self._kinds.clear()
            kinds = self._kinds[keys] = np.array([_kind(k) for k in keys], np.int64)
        return kinds

    def observe(self, record: StepRecord) -> None:
        keys = tuple(record.values)
        self.observe_row(record.step, keys, np.fromiter(record.values.values(), np.float64, len(keys)),
                         record.values.get)

    def observe_row(self, step: int, keys: tuple[str, ...], v: np.ndarray, get: Callable[[str], float | None]) -> None:
        """Update from one step: its keys, their values, and `get` (key -> value or None)."""
        c = self.cfg
        if self.step >= 0 and step <= self.step:
            self.reset(step)  # steps went back: an unannounced rollback
        self.step = step
        active: dict[str, str] = {}
        self.lr = get(LR)
        self.lr_ahead = get(LR_PEAK_AHEAD)
        loss = get(LOSS)
        if loss is not None:
            got = self.loss.update(step, loss, self.lr)
            self.behind = self.behind + 1 if got is not None and got[0] > got[1] else 0
            if got is not None and self.behind >= c.loss_confirm:
                active["loss_behind"] = (f"loss {math.expm1(got[0]):+.1%} off its trend for {self.behind} steps "
                                         f"(margin {math.expm1(got[1]):.1%})")
        self._active, self._pending = active, None
        ahead = self._ahead.pop(step, None)
        if ahead is not None and ahead[0] is not keys and ahead[0] != keys:
            ahead = None
        if ahead is not None and ahead[4] is not None:  # prepare() judged every shift series of this step
            if self.episode_level is not None and ahead[3] is not None:
                self._track_episode(ahead[3])
            self._pending = (keys, ahead[1], ahead[4], None, ahead[2], None)
            return
        kinds = self._kinds_of(keys)
        if self.episode_level is not None:
            attn = v[(kinds == 5) & np.isfinite(v)]
            if attn.size:  # a record without a measured logit says nothing about the episode
                self._track_episode(float(attn.max()))
        lr_ok = self.lr is not None and math.isfinite(self.lr) and self.lr > 0
        pos = np.flatnonzero((kinds > 0) & (kinds < 5) & np.isfinite(v) & ((kinds == 2) | (v > 0))
                             & (lr_ok | (kinds != 4)))
        if pos.size:
            # prepare() put the series present at every step of the batch in their rings; the
            # rest go now. Their shifts are judged when `active` is first read.
            held = None if ahead is None else np.isin(pos, ahead[1])  # ahead[1] is a subset of pos
            rest = pos if held is None else pos[~held]
            d_rest = None
            if rest.size:
                y = v[rest]
                logged = kinds[rest] != 2
                y[logged] = logs(y[logged])
                upd = kinds[rest] == 4
                if upd.any():
                    y[upd] -= logs(np.array([self.lr]))[0]
                # Appended now, judged when `active` is first read (before any later append).
                d_rest = functools.partial(self.shifts.now, self.shifts.append([keys[p] for p in rest.tolist()], step, y))
            self._pending = (keys, pos, kinds[pos], held, None if ahead is None else ahead[2], d_rest)
        elif len(self.shifts.rows):  # no shift series read at this step: the standing ones still speak
            self._pending = (keys, pos, kinds[pos], None, None, None)

    def _track_episode(self, top: float) -> None:
        """The step's largest attention logit (a record without one says nothing)."""
        self.top = top
        self.quiet = 0 if top >= self.episode_level else self.quiet + 1
        if top > self.peak:
            self.peak, self.since_peak = top, 0
        else:
            self.since_peak += 1
        if self.quiet >= self.episode_clear or self.since_peak >= self.episode_stale:
            self.episode = None

    @property
    def active(self) -> dict[str, str]:
        """The witnesses speaking at the newest step: name -> why."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._speak(*pending)
        return self._active

    @active.setter
    def active(self, value: dict[str, str]) -> None:
        self._active, self._pending = value, None

    def _speak(self, keys: tuple[str, ...], pos: np.ndarray, k: np.ndarray, held: np.ndarray | None,
               d_ahead: Callable[[], np.ndarray] | None, d_rest: Callable[[], np.ndarray] | None) -> None:
        """Add the shift witnesses speaking at the newest step to `_active` (after loss_behind)."""
        c, active = self.cfg, self._active
        if d_rest is None and d_ahead is None:  # no shift series read at this step
            d = np.empty(0)
        elif d_rest is None:  # every series judged ahead (held is None then, or all True)
            d = d_ahead()
        elif held is None:
            d = d_rest()
        else:
            d = np.empty(pos.size)
            d[held] = d_ahead()
            d[~held] = d_rest()
        names = [keys[p] for p in pos.tolist()]
        rows, k_stand, d_stand = self._standing(names)
        if rows.size:
            names += [self.shifts.rows.keys[r] for r in rows.tolist()]
            k, d = np.concatenate([k, k_stand]), np.concatenate([d, d_stand])
        speaks = {
            "grad_growth": (k == 1) & (d >= math.log(c.grad_ratio)),
            "z_growth": (k == 2) & (d >= c.z_rise),
            "entropy_collapse": (k == 3) & (d <= math.log(c.entropy_fraction)),
            "update_growth": (k == 4) & (d >= math.log(c.update_ratio)),
        }
        # In record order, then the standing series: a witness keeps the place of its first key
        # and the words of its last.
        order = sorted((int(np.flatnonzero(m)[0]), name) for name, m in speaks.items() if m.any())
        for _, name in order:
            j = int(np.flatnonzero(speaks[name])[-1])
            dj, key = float(d[j]), names[j]
            active[name] = {
                "grad_growth": lambda: f"grad norm x{math.exp(dj):.1f} over its baseline",
                "z_growth": lambda: f"{key} +{dj:.1f} nats over its baseline",
                "entropy_collapse": lambda: f"{key} at {math.exp(dj):.0%} of its baseline",
                "update_growth": lambda: f"{key} x{math.exp(dj):.1f} over its baseline per unit of LR",
            }[name]()

    def _standing(self, read: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The shift series not read at the newest step whose latest reading still stands: (their
        rows in self.shifts.rows, kinds, d as of that reading: their rings have not moved since).
        It stands until the next reading is due, judged by the gap between the series' last two
        readings, doubled (a budget may double a group's cadence between two readings); a series
        that stopped being read falls silent then, and one read once has no gap yet."""
        R = self.shifts.rows
        n = len(R)
        none = (np.empty(0, np.int64), np.empty(0, np.int64), np.empty(0))
        if not n:
            return none
        while len(self._shift_kinds) < n:
            self._shift_kinds.append(_kind(R.keys[len(self._shift_kinds)]))
        fresh = np.zeros(n, bool)
        fresh[[R.index[k] for k in read if k in R.index]] = True
        rows = np.flatnonzero(~fresh & (R.length[:n] >= 2))
        if not rows.size:
            return none
        last = R.steps[rows, (R.pos[rows] - 1) % R.H]
        prev = R.steps[rows, (R.pos[rows] - 2) % R.H]
        rows = rows[self.step - last <= 2 * (last - prev)]
        if not rows.size:
            return none
        return rows, np.asarray(self._shift_kinds, np.int64)[rows], self.shifts.now(rows)

    def note_attention(self, onset: int) -> int:
        """An attention finding alerts or acts with `onset`: it opens the episode if none is open.
        Returns the onset an acting finding should carry (the episode's, when earlier)."""
        if self.episode_level is None:
            return onset
        if self.episode is None:
            self.episode, self.peak, self.since_peak = onset, self.top if math.isfinite(self.top) else -math.inf, 0
        elif onset < self.episode:
            self.episode = onset
        return self.episode

    def harm(self) -> dict[str, str]:
        """The witnesses speaking now that count for `act` (WitnessConfig.act_witnesses)."""
        return {k: v for k, v in self.active.items() if k in self.cfg.act_witnesses}

    def forecast(self) -> dict[str, str]:
        """{"lr_forecast": why} when the newest record's schedule will still raise the LR
        `lr_rise`-fold (module docstring), else {}."""
        lr, ahead, rise = self.lr, self.lr_ahead, self.cfg.lr_rise
        if not rise or lr is None or ahead is None or not (math.isfinite(lr) and math.isfinite(ahead) and lr > 0):
            return {}
        if ahead < rise * lr:
            return {}
        return {"lr_forecast": f"the schedule will still raise the LR x{ahead / lr:.1f} (from {lr:.3g} to {ahead:.3g}; "
                               f"lr_rise={rise:g}): logits grow with the LR"}

    def context(self) -> dict[str, str]:
        """Every witness speaking now, counted or not (shown in evidence)."""
        return dict(self.active)

    def reset(self, first_step: int | None = None) -> None:
        self._ahead = {}
        self.loss.reset(first_step)
        self.shifts.rows.rewind(as_rows(range(len(self.shifts.rows))), first_step)
        self.active = {}
        self.behind = 0
        self.step = -1 if first_step is None else first_step - 1
        if first_step is None or (self.episode is not None and self.episode >= first_step):
            self.episode, self.quiet, self.peak, self.since_peak = None, 0, -math.inf, 0  # rolled back before it

    def parts(self, prefix: str, dirty_only: bool = False) -> dict[str, bytes]:
        meta = {"loss": self.loss.state_dict(), "active": dict(self.active), "step": self.step, "behind": self.behind,
                "episode": self.episode, "quiet": self.quiet, "top": _finite_or_none(self.top),
                "peak": _finite_or_none(self.peak), "since_peak": self.since_peak}
        return {**self.shifts.rows.parts(f"{prefix}.shifts", dirty_only), prefix: json.dumps(meta).encode()}

    def load(self, prefix: str, parts: dict[str, bytes]) -> None:
        d = json.loads(parts[prefix])
        self.loss.load_state_dict(d["loss"])
        self.shifts = _Shifts(self.cfg)
        self.shifts.rows.load(f"{prefix}.shifts", parts)
        self._shift_kinds = []
        self.active = {str(k): str(v) for k, v in d["active"].items()}
        self.step = int(d["step"])
        self.behind = int(d["behind"])
        # States saved before the episode existed have none open.
        self.episode = None if d.get("episode") is None else int(d["episode"])
        self.quiet = int(d.get("quiet", 0))
        self.top = math.nan if d.get("top") is None else float(d["top"])
        self.peak = -math.inf if d.get("peak") is None else float(d["peak"])
        self.since_peak = int(d.get("since_peak", 0))

    def mark_saved(self) -> None:
        self.shifts.rows.dirty = set()

    def state_dict(self) -> dict[str, Any]:
        return {"parts": parts_to_json(self.parts("witnesses"))}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.load("witnesses", parts_from_json(d["parts"]))
