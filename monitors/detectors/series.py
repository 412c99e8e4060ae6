"""A detector type over many series at once (`SeriesBank`), and the one-series view of it
(`Single`) that keeps the per-series interface (SeriesDetector) for tests, tools and routes.

A bank's `observe(step, rows, values)` judges one step of every series it is given with numpy
operations across them (arrays.Rows holds their state); only rows that may raise a finding are
decided one by one in Python (latch, onset search, evidence), which is rare by construction.
A `Single` is a bank of one row, so there is one implementation of each detector's rule.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import numpy as np

from thermowatch.monitors.commands import json_safe
from thermowatch.monitors.contract import Finding, Outcome, Severity, Signal, split_key

from .arrays import NO_STEP, Rows, as_rows, parts_from_json, parts_to_json, window_bounds, window_medians
from .base import MAD_TO_SIGMA
from .onset import estimate_onset

Found = list[tuple[int, Finding]]  # (index into the rows given to observe, finding)


def logs(v: np.ndarray) -> np.ndarray:
    """The natural log, as the log-scale detectors store their points: numpy's, one call per
    array (the step-by-step and the batch paths share it, so they agree to the bit)."""
    return np.log(v)


def slogs(v: np.ndarray) -> np.ndarray:
    """Signed log1p, a log scale for values that may be negative or zero (act_min)."""
    return np.copysign(np.log1p(np.abs(v)), v)


def robust_rows(rows: Rows, idx: np.ndarray, n: int, skip_last: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(median, sigma) per row over the window tail(n, skip_last), sigma = 1.4826 * MAD: half the
    window may be outliers and the baseline still holds, unlike mean/std where one spike inflates
    the threshold. Rows of a batch begun ahead (Rows.begin_batch) are looked up, not recomputed."""
    med, sigma = np.full(idx.size, np.nan), np.full(idx.size, np.nan)
    rest = np.arange(idx.size)
    got = rows.window_stats(idx, n, skip_last, True)
    if got is not None:
        covered, m, s = got
        med[covered], sigma[covered] = m, s
        rest = np.flatnonzero(~covered)
    for at, block in rows.blocks(idx[rest], n, skip_last):
        if block.shape[1]:
            m = np.median(block, axis=1)
            med[rest[at]] = m
            sigma[rest[at]] = MAD_TO_SIGMA * np.median(np.abs(block - m[:, None]), axis=1)
    return med, sigma


def median_rows(rows: Rows, idx: np.ndarray, n: int, skip_last: int = 0) -> np.ndarray:
    out = np.full(idx.size, np.nan)
    rest = np.arange(idx.size)
    got = rows.window_stats(idx, n, skip_last, False)
    if got is not None:
        covered, m, _ = got
        out[covered] = m
        rest = np.flatnonzero(~covered)
    for at, block in rows.blocks(idx[rest], n, skip_last):
        if block.shape[1]:
            out[rest[at]] = np.median(block, axis=1)
    return out


def quiet_excursions(x: np.ndarray, a0: int, n: int, K: int, z: float, value: np.ndarray, value_hi: np.ndarray,
                     floor: Callable[[np.ndarray], np.ndarray],
                     floor_lo: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> np.ndarray:
    """The rows (of x: each ring oldest first, then the batch, [P, H + K]) where no step t of the
    batch has value[:, t] - median_t > max(z * sigma_t, floor(median_t)), the median and sigma
    (1.4826 MAD) taken over the window x[:, a0 + t : a0 + t + n]: the excursion test the spike
    and growth banks make step by step. First by bounds per block of steps (window_bounds, with
    value_hi [P, blocks] above every value of a block and floor_lo(median_lo, median_hi) below
    every floor): no partition per window. The rows the bounds cannot clear are tested exactly,
    with the same arithmetic as the step-by-step test. `value` may be a callable giving the
    values of some rows (computed only for those)."""
    lo, hi, mad_lo = window_bounds(x, a0, n, K)
    thr_lo = np.maximum(z * (MAD_TO_SIGMA * mad_lo), floor_lo(lo, hi))
    quiet = ((value_hi - lo) <= thr_lo).all(axis=1)
    rest = np.flatnonzero(~quiet)
    if rest.size:
        med, sigma = window_medians(x[rest], a0, n, K, robust=True)
        v = value(rest) if callable(value) else value[rest]
        quiet[rest] = ~((v - med) > np.maximum(z * sigma, floor(med))).any(axis=1)
    return quiet


class SeriesBank:
    """Common bookkeeping: rows by key, implicit rewind when steps go back, reset, findings,
    onset, state. Subclasses set `signal` and define `_update(rows, step, values) -> Found`."""

    signal: Signal

    def __init__(self, history: int, clear_steps: int) -> None:
        self.rows = Rows(history, clear_steps)
        self.metric: list[str] = []
        self.module: list[str] = []

    def __iter__(self) -> Iterator[str]:
        return iter(self.rows.keys)

    def __contains__(self, key: object) -> bool:
        return key in self.rows.index

    def __len__(self) -> int:
        return len(self.rows)

    def row(self, key: str) -> int:
        r = self.rows.index.get(key)
        if r is None:
            r = self.rows.add(key)
            self._describe(r, key)
        return r

    def _describe(self, row: int, key: str) -> None:
        """Per-row constants from the key (subclasses add theirs)."""
        m, mod = split_key(key)
        self.metric.append(m)
        self.module.append(mod)

    def observe(self, step: int, rows: np.ndarray, values: np.ndarray) -> Found:
        self.step_back(step, rows)
        self.rows.last_step[rows] = step
        return self._update(rows, step, values)

    def step_back(self, step: int, rows: np.ndarray | None = None) -> None:
        """Steps went back to `step` without reset() (an unannounced rollback, or a re-sent
        record): `rows` (default: all) forget their points from `step` on. Keep a latch whose
        excursion began before `step`, so a duplicate does not raise the same finding twice."""
        R = self.rows
        if rows is None:
            rows = as_rows(range(len(R)))
        back = rows[R.last_step[rows] >= step]
        if back.size:
            keep = back[(R.lsev[back] >= 0) & (R.lonset[back] < step)]
            saved = [R.lsev[keep], R.lout[keep], R.lonset[keep], R.lclear[keep]]
            self.reset_rows(back, step)
            R.lsev[keep], R.lout[keep], R.lonset[keep], R.lclear[keep] = saved

    def _update(self, rows: np.ndarray, step: int, values: np.ndarray) -> Found:  # pragma: no cover
        raise NotImplementedError

    def batch_values(self, values: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """For a batch ([K, rows] values): (mask of the rows appended at every step, the values
        they append [K, that many]), for banks whose windows can be taken ahead; None if not."""
        return None

    def begin_batch(self, steps: np.ndarray, rows: np.ndarray, values: np.ndarray) -> None:
        """Before observing a batch of steps one by one: hand the rows that append at every step
        to Rows.begin_batch, so each window statistic is one numpy call for the whole batch.
        Only when the batch goes forward for every row (no implicit rewind inside it)."""
        R = self.rows
        R.end_batch()
        if rows.size == 0 or (R.last_step[rows] >= steps[0]).any():
            return
        got = self.batch_values(values)
        if got is not None and got[0].any():
            R.begin_batch(rows[got[0]], steps, got[1])

    def end_batch(self) -> None:
        self.rows.end_batch()

    # --- a whole batch at once (issue 10: K steps per call for the rows that stay quiet) ------

    def judge_bulk(self, steps: np.ndarray, rows: np.ndarray, values: np.ndarray) -> np.ndarray:
        """For a plain batch (values [K, len(rows)]; the caller checked that the steps rise past
        every row's last step): advance, through all K steps in one pass, the rows that provably
        raise nothing and touch no latch in it, leaving exactly the state K observe() calls
        would; returns their mask over `rows`. The others are left as they were, for observe().
        Subclasses pick their quiet rows (`_bulk`); the default (and rows going back) takes none."""
        take = np.zeros(rows.size, bool)
        R = self.rows
        if rows.size == 0 or len(steps) == 0 or (R.last_step[rows] >= steps[0]).any():
            return take
        got = self._bulk(steps, rows, values)
        if got is not None:
            at, ys, *warm = got
            if at.size:
                self._advance(rows[at], steps, ys, warm[0] if warm else None)
                take[at] = True
        return take

    def _bulk(self, steps: np.ndarray, rows: np.ndarray, values: np.ndarray
              ) -> tuple[np.ndarray, np.ndarray] | None:
        """(indices into `rows` that stay quiet through the batch, the values their rings take,
        [K, that many]), or None for none. Only rows whose latch is inactive qualify: an active
        latch counts in-band points step by step (Rows.observe). An optional third element marks
        the rows still in warm-up at every step of the batch: K steps only fill their rings (no
        test is made, so their exceedance counters stay as they are)."""
        return None

    def _advance(self, rows: np.ndarray, steps: np.ndarray, ys: np.ndarray, warm: np.ndarray | None = None) -> None:
        """K quiet steps of `rows` at once (ys: [K, len(rows)], as the ring stores them): what K
        observe() calls leave when nothing exceeds and no latch is active (`warm`: the rows whose
        steps all fall in warm-up, where observe() only appends)."""
        R = self.rows
        R.append_many(rows, steps, ys.T)
        R.seen[rows] += len(steps)
        tested = rows if warm is None else rows[~warm]
        R.run[tested], R.first_exceed[tested] = 0, -1
        R.last_step[rows] = steps[-1]

    def bulk_points_of(self) -> int:
        """Ring points a row needs before judge_bulk can take it (0: none)."""
        return 0

    def filling(self, rows: np.ndarray, K: int, piece: int) -> bool:
        """Some row's window fills up inside a batch of K steps early enough that pieces of
        `piece` steps would judge the rest of the batch in bulk (DetectorBank takes it so)."""
        need = self.bulk_points_of()
        if need <= 0 or rows.size == 0:
            return False
        n = self.rows.length[rows]
        return bool(((n < need) & (n + K >= need + piece)).any())

    def _quiet_candidates(self, rows: np.ndarray, every: np.ndarray, points: int = 0, warmup: int = 0,
                          first_step: int | None = None) -> np.ndarray:
        """Indices into `rows` with a value at every step (`every`), no active latch, past
        `warmup` points at the batch's first step (or `warmup` steps of age there, with
        `first_step`: SpikeBank's rule), and at least `points` points in the ring (the newest
        `points` of the ring, then the batch, hold every window of the batch at its full size:
        the one `blocks` would give)."""
        R = self.rows
        age = R.seen[rows] + 1
        if first_step is not None:
            age = np.maximum(age, R.age(rows, first_step, first_step))
        return np.flatnonzero(every & (R.lsev[rows] < 0) & (age > warmup) & (R.length[rows] >= points))

    def reset(self, first_step: int | None = None) -> None:
        """After a rollback to `first_step`: forget points at or after it, drop the latches. With
        None, forget everything (warm-up starts again)."""
        self.reset_rows(as_rows(range(len(self.rows))), first_step)

    def release_latches(self) -> None:
        """Drop every latch and keep everything else (the points, the excursion counters): a
        condition that persists fires again on its next point. After a cooldown that held a
        finding back (supervisor.act.respond)."""
        self.rows.reset_latch(as_rows(range(len(self.rows))))

    def reset_rows(self, rows: np.ndarray, first_step: int | None) -> None:
        R = self.rows
        dropped = R.rewind(rows, first_step)
        R.reset_latch(rows)
        R.run[rows], R.first_exceed[rows] = 0, -1
        if first_step is None:
            R.seen[rows], R.last_step[rows] = 0, NO_STEP
        else:
            # Warm-up is about the run's age, and a rollback does not make a detector that was
            # armed young again: the re-trained path is where the rest of a bad stretch comes
            # (issue 35: a poisoned stretch's last 13 steps trained right after the rollback to
            # step 50, the loss spike detector silent in a warm-up it had left 50 steps before).
            # A rollback deeper than the buffer still waits for a refilled window (the judging
            # paths ask for points in the ring, not only `seen`).
            del dropped
            last = R.steps[rows, (R.pos[rows] - 1) % R.H]
            R.last_step[rows] = np.where(R.length[rows] > 0, last, NO_STEP)

    def _onset(self, row: int, lookback: int) -> tuple[int, str]:
        """Onset from the buffered history (which already holds the detection point)."""
        R = self.rows
        return estimate_onset(R.tail_steps(row, lookback), R.tail(row, lookback), int(R.first_exceed[row]))

    def _fire(self, row: int, severity: Severity, lookback: int | None, outcome: Outcome | None = None
              ) -> tuple[int, str] | None:
        """The latch's decision for one row: None if it holds, else (onset, method), latched."""
        lt = self.rows.latch(row)
        if not lt.should_fire(severity, outcome):
            return None
        if lt.active:
            onset, method = lt.onset_step, "latched"
        elif lookback is None:
            onset, method = int(self.rows.first_exceed[row]), "first_exceed"
        else:
            onset, method = self._onset(row, lookback)
        lt.fire(severity, onset, outcome)
        self.rows.store_latch(row, lt)
        return onset, method

    def outcome_for(self, severity: Severity) -> Outcome:
        """What a finding of this severity may lead to. A critical excursion is strong enough
        evidence to act on by itself (the policy's rollback_signals still decide whether it
        does); a warning tells a human. Detectors whose evidence needs corroboration override."""
        return Outcome.ACT if severity is Severity.CRITICAL else Outcome.ALERT

    def _finding(self, row: int, severity: Severity, onset: int, step: int, evidence: dict[str, Any],
                 outcome: Outcome | None = None) -> Finding:
        return Finding(
            signal=self.signal,
            module=self.module[row],
            severity=severity,
            onset_step=onset,
            detect_step=step,
            metric=self.rows.keys[row],
            evidence=json_safe(evidence),
            outcome=outcome if outcome is not None else self.outcome_for(severity),
        )

    def recent(self, row: int, n: int = 8) -> np.ndarray:
        return self.rows.tail(row, n)

    # --- state ----------------------------------------------------------------------------

    def parts(self, prefix: str, dirty_only: bool = False) -> dict[str, bytes]:
        return self.rows.parts(prefix, dirty_only)

    def load(self, prefix: str, parts: dict[str, bytes]) -> None:
        self.rows.load(prefix, parts)
        self.metric, self.module = [], []
        for r, key in enumerate(self.rows.keys):
            self._describe(r, key)

    def mark_saved(self) -> None:
        self.rows.dirty = set()

    def state_dict(self) -> dict[str, Any]:
        return {"parts": parts_to_json(self.parts("bank"))}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self.load("bank", parts_from_json(d["parts"]))


class HistoryView:
    """`len(det.history)` and History's read API for a Single."""

    def __init__(self, rows: Rows, row: int) -> None:
        self._rows, self._row = rows, row

    def __len__(self) -> int:
        return int(self._rows.length[self._row])

    def tail(self, n: int, skip_last: int = 0) -> np.ndarray:
        return self._rows.tail(self._row, n, skip_last)

    def tail_steps(self, n: int) -> np.ndarray:
        return self._rows.tail_steps(self._row, n)


class Single:
    """One series through a bank of one row: the SeriesDetector interface."""

    def __init__(self, bank: SeriesBank, key: str) -> None:
        self.bank = bank
        self.key = key
        self.metric, self.module = split_key(key)
        self._rows = as_rows([bank.row(key)])
        self.config = getattr(bank, "config", None)

    @property
    def history(self) -> HistoryView:
        return HistoryView(self.bank.rows, int(self._rows[0]))

    def update(self, step: int, value: float, wall_time: float | None = None) -> Finding | None:
        found = self.bank.observe(int(step), self._rows, np.array([float(value)]))
        return found[0][1] if found else None

    def reset(self, first_step: int | None = None) -> None:
        self.bank.reset(first_step)

    def release_latches(self) -> None:
        self.bank.release_latches()

    def state_dict(self) -> dict[str, Any]:
        return {"key": self.key, **self.bank.state_dict()}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if d["key"] != self.key:
            raise ValueError(f"state is for series {d['key']!r}, not {self.key!r}")
        self.bank.load_state_dict(d)
        self._rows = as_rows([self.bank.row(self.key)])
