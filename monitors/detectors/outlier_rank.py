"""Outlier rank: the same rank holds the extreme of a metric step after step.

The run controller reduces each max/min metric across ranks and records which rank held the
extreme (`StepRecord.ranks`). With data parallelism each rank sees different samples, so the
holder of the max wanders over the ranks; one rank holding it in `min_share` of the last
`window` steps points at that rank's hardware (OPT-175B's bad-node hunts), not at the data.
A step names a rank only where the ranks' values differ (monitors/reduce.py, monitors/collective.py):
not a value every rank shares (a global norm, a replicated batch), nor a figure no rank measured
that step (NaN on every rank: a sampled group's off-steps, which named rank 0 and paged a
healthy FSDP2 run, issue 35).

Limits, said plainly: the record carries only the reduced value, so "far above the others" is
judged by persistence, not by the gap (add a per-rank spread key if that is wanted). Under
tensor/pipeline parallelism different ranks own different layers/heads, so a per-module key can
legitimately live on one rank: restrict `metrics` to data-parallel-replicated keys then.
Finding: module = the metric key (per the contract's "module field can hold the key"), the
rank is in evidence["rank"].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from thermowatch.monitors.contract import Finding, Outcome, Severity, Signal, StepRecord, split_key

from .arrays import BOUND_BLOCK, NO_STEP, Rows, as_rows, block_starts
from thermowatch.monitors.commands import json_safe

from .base import at_least


@dataclass
class OutlierRankConfig:
    window: int = 50  # steps judged; with 2 ranks P(>= 40 of 50 by chance) ~ 1e-5
    min_share: float = 0.8  # share of the window one rank must hold
    clear_share: float = 0.5  # below this share the latch clears (hysteresis)
    min_points: int = 30  # no verdict on fewer steps than this
    world_size: int | None = None  # None: inferred as max rank seen + 1
    # Metric names (before "/") judged; empty = every key the controller reports a rank for.
    metrics: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        at_least("window", self.window, 2)
        at_least("min_points", self.min_points, 1)
        if self.min_points > self.window:
            raise ValueError(f"min_points ({self.min_points}) must not exceed window ({self.window})")
        if not 0.0 < self.clear_share < self.min_share <= 1.0:
            raise ValueError(f"need 0 < clear_share < min_share <= 1, got {self.clear_share}, {self.min_share}")
        if self.world_size is not None:
            at_least("world_size", self.world_size, 1)
        self.metrics = tuple(self.metrics)


class OutlierRankDetector:
    """Record-level: `observe(record)` looks at every key in `record.ranks`. The keys' windows
    are rows of arrays (arrays.Rows: a ring of (step, rank) per key), so a step is judged with a
    few numpy operations across its keys, and a batch's quiet keys in one pass (`observe_many`)."""

    signal = Signal.OUTLIER_RANK

    def __init__(self, config: OutlierRankConfig | None = None) -> None:
        self.config = config or OutlierRankConfig()
        self._rows = Rows(self.config.window, 1)  # key -> ring of (step, rank); its length is len(buf)
        self._latched = np.full(8, -1, np.int64)  # row -> rank already reported, -1 none
        self._max_rank = -1

    def _row_of(self, keys: Sequence[str]) -> np.ndarray:
        R = self._rows
        rows = as_rows([R.add(k) for k in keys])
        if len(R) > self._latched.size:
            self._latched = np.concatenate([self._latched, np.full(max(len(R), 2 * self._latched.size) - self._latched.size, -1, np.int64)])
        return rows

    def _keys(self, ranks: dict[str, int]) -> list[str]:
        """The keys judged: in `metrics` (if set), with a rank (a negative one is none)."""
        m = self.config.metrics
        return [k for k, r in ranks.items() if r >= 0 and (not m or split_key(k)[0] in m)]

    def observe(self, record: StepRecord) -> list[Finding]:
        return self.observe_ranks(record.step, record.ranks)

    def observe_ranks(self, step: int, ranks: dict[str, int]) -> list[Finding]:
        """Judge one step's ranks (metric key -> the rank that held its extreme)."""
        keys = self._keys(ranks)
        if not keys:
            return []
        return self._step(keys, step, np.fromiter((int(ranks[k]) for k in keys), np.int64, len(keys)))

    def update(self, key: str, step: int, rank: int) -> Finding | None:
        found = self._step([key], step, np.array([int(rank)], np.int64))
        return found[0] if found else None

    def step_back(self, step: int, rows: np.ndarray | None = None) -> None:
        """Steps went back to `step` without reset(): `rows` (default: every key) forget their
        ranks from `step` on, and their latch."""
        R = self._rows
        if rows is None:
            rows = as_rows(range(len(R)))
        back = rows[(R.length[rows] > 0) & (R.last_step[rows] >= step)]
        if back.size:
            R.rewind(back, step)
            self._latched[back] = -1

    def _step(self, keys: list[str], step: int, ranks: np.ndarray) -> list[Finding]:
        c, R = self.config, self._rows
        rows = self._row_of(keys)
        self.step_back(step, rows)
        R.append(rows, step, ranks.astype(np.float64))
        R.last_step[rows] = step
        # Each key is judged with the ranks seen up to it (this step's keys in record order).
        seen = np.maximum(self._max_rank, np.maximum.accumulate(ranks))
        self._max_rank = int(seen[-1])
        world = np.full(rows.size, c.world_size) if c.world_size is not None else seen + 1
        judged = np.flatnonzero((R.length[rows] >= c.min_points) & (world >= 2))
        if not judged.size:
            return []
        rows, keys_at, world = rows[judged], judged, world[judged]
        n = R.length[rows]
        window = self._window(rows)
        top, count = _mode(window)
        share = count / n
        held = self._latched[rows]
        latched = held >= 0
        if latched.any():
            held_share = (window[latched] == held[latched, None]).sum(axis=1) / n[latched]
            self._latched[rows[latched][held_share < c.clear_share]] = -1
        out = []
        for j in np.flatnonzero(~latched & (share >= c.min_share)).tolist():
            row, rank = int(rows[j]), int(top[j])
            self._latched[row] = rank
            buf_steps, buf_ranks = self._ordered(row)
            onset = int(buf_steps[np.flatnonzero(buf_ranks == rank)[0]])
            key = keys[int(keys_at[j])]
            w = int(world[j])
            evidence = {"rank": rank, "share": float(share[j]), "window": int(n[j]), "world_size": w,
                        "expected_share": 1.0 / w}
            # Outcome act: persistence over a whole window is the evidence a restart without the
            # rank needs; the policy only does that with restart_without_outlier (off by default).
            out.append(Finding(signal=self.signal, module=key, severity=Severity.WARN, onset_step=onset,
                               detect_step=step, metric=key, evidence=json_safe(evidence), outcome=Outcome.ACT))
        return out

    @property
    def empty(self) -> bool:
        """No key seen yet: the first steps go one by one (observe_many takes known keys only)."""
        return len(self._rows) == 0

    def observe_many(self, steps: np.ndarray, keys: list[str], ranks: np.ndarray) -> np.ndarray:
        """A plain batch ahead of its records (steps rising; ranks [K, len(keys)], -1 where a step
        sent none for a key): the keys that hold a rank at every step, are not latched and can
        reach neither min_share nor a verdict in the batch take all K points now, as K observe()
        calls would leave them (they raise nothing); returns their mask over `keys`, which
        observe() must then skip for these steps. The bound: a rank's count in any window of the
        batch is at most its count in the ring now plus its count in the batch, and, for the
        windows of a block of steps, its count in the span they cover; below
        min_share x min_points - 1, no window can give it min_share of the points."""
        c, R = self.config, self._rows
        take = np.zeros(len(keys), bool)
        m = self.config.metrics
        if not keys or len(steps) == 0:
            return take
        want = np.array([not m or split_key(k)[0] in m for k in keys], bool)
        known = np.array([k in R.index for k in keys], bool)
        ok = want & known & (ranks >= 0).all(axis=0)
        if not ok.any():
            return take
        at = np.flatnonzero(ok)
        rows = as_rows([R.index[keys[i]] for i in at.tolist()])
        r = ranks[:, at]
        if int(r.max()) > self._max_rank:
            return take  # a new rank (early in a run): the world each step sees changes, go step by step
        ok = (self._latched[rows] < 0) & ((R.length[rows] == 0) | (R.last_step[rows] < steps[0]))
        x = np.concatenate([self._window(rows, ordered=True), r.T], axis=1)  # [P, H + K]; empty slots < 0
        bar = c.min_share * c.min_points - 1
        # First over the whole of ring + batch (one count per rank: it clears most keys of a
        # wide world), then by blocks for the keys it cannot clear.
        if self._max_rank < 64:
            clear = _bincount_rows(x, self._max_rank + 1).max(axis=1) < bar
        else:  # no table sized by the ranks: blocks (sorted spans) for all
            clear = np.zeros(rows.size, bool)
        tight = np.flatnonzero(ok & ~clear)
        ok &= clear
        if tight.size:
            ok[tight] = self._block_bound(x[tight], len(steps)) < bar
        at, rows, r = at[ok], rows[ok], r[:, ok]
        if at.size:
            R.append_many(rows, steps, r.T.astype(np.float64))
            R.last_step[rows] = steps[-1]
            take[at] = True
        return take

    def _block_bound(self, x: np.ndarray, K: int) -> np.ndarray:
        """Per row of x (window oldest first, then the batch's K ranks): the largest count of one
        rank in the span covered by the windows of a block of steps, over the blocks."""
        H = self._rows.H
        starts, b = block_starts(K, BOUND_BLOCK)
        if self._max_rank < 64:  # counts per rank from running totals: [P, H + K + 1, ranks]
            run = np.zeros((x.shape[0], x.shape[1] + 1, self._max_rank + 1), np.int32)
            np.cumsum(x[..., None] == np.arange(self._max_rank + 1), axis=1, out=run[:, 1:])
            return (run[:, starts + H + b] - run[:, starts + 1]).max(axis=(1, 2))
        # a table per rank would be large: sort each span instead
        span = np.lib.stride_tricks.sliding_window_view(x, H + b - 1, axis=1)[:, starts + 1]  # [P, B, H + b - 1]
        return _mode(span.reshape(-1, span.shape[-1]))[1].reshape(span.shape[:2]).max(axis=1)

    def _window(self, rows: np.ndarray, ordered: bool = False) -> np.ndarray:
        """[len(rows), window] ranks in each row's window, in slot order (`ordered`: oldest
        first); the empty slots hold distinct negative numbers (no rank is negative), so they
        never form a run in _mode."""
        R = self._rows
        if ordered:
            vals = R.ordered(rows)
            valid = np.arange(R.H)[None, :] >= (R.H - R.length[rows])[:, None]
        else:
            vals = R.vals[rows]
            valid = ((R.pos[rows, None] - 1 - np.arange(R.H)[None, :]) % R.H) < R.length[rows, None]
        return np.where(valid, vals.astype(np.int64), -1 - np.arange(R.H)[None, :])

    def _ordered(self, row: int) -> tuple[np.ndarray, np.ndarray]:
        R = self._rows
        k = int(R.length[row])
        slots = (R.pos[row] - k + np.arange(k)) % R.H
        return R.steps[row, slots], R.vals[row, slots].astype(np.int64)

    def release_latches(self) -> None:
        """Forget the ranks already reported: one still out of line is reported again."""
        self._latched[:] = -1

    def reset(self, first_step: int | None = None) -> None:
        R = self._rows
        R.rewind(as_rows(range(len(R))), first_step)
        self._latched[:] = -1
        if first_step is None:
            self._max_rank = -1
        last = R.steps[np.arange(len(R)), (R.pos[:len(R)] - 1) % R.H]
        R.last_step[:len(R)] = np.where(R.length[:len(R)] > 0, last, NO_STEP)

    # --- state: the windows as Rows parts (saved incrementally), latches and max rank as JSON ---

    def parts(self, prefix: str, dirty_only: bool = False) -> dict[str, bytes]:
        R = self._rows
        latched = {R.keys[row]: int(self._latched[row]) for row in np.flatnonzero(self._latched[:len(R)] >= 0).tolist()}
        meta = {"latched": latched, "max_rank": self._max_rank}
        return {**R.parts(f"{prefix}.rows", dirty_only), prefix: json.dumps(meta).encode()}

    def load(self, prefix: str, parts: dict[str, bytes]) -> None:
        self._rows = R = Rows(self.config.window, 1)
        self._latched = np.full(8, -1, np.int64)
        if f"{prefix}.rows.rows" in parts:
            R.load(f"{prefix}.rows", parts)
            self._row_of([])  # size the latches to the rows
        meta = json.loads(parts[prefix])
        for key, rank in meta["latched"].items():
            self._latched[self._row_of([key])] = int(rank)
        self._max_rank = int(meta["max_rank"])

    def mark_saved(self) -> None:
        self._rows.dirty = set()

    def state_dict(self) -> dict[str, Any]:
        R = self._rows
        seen = {}
        for row, key in enumerate(R.keys):
            s, r = self._ordered(row)
            seen[key] = [[int(a), int(b)] for a, b in zip(s.tolist(), r.tolist())]
        latched = {R.keys[row]: int(self._latched[row]) for row in np.flatnonzero(self._latched[:len(R)] >= 0).tolist()}
        return {"seen": seen, "latched": latched, "max_rank": self._max_rank}

    def load_state_dict(self, d: dict[str, Any]) -> None:
        self._rows = R = Rows(self.config.window, 1)
        self._latched = np.full(8, -1, np.int64)
        for key, pairs in d["seen"].items():
            row = self._row_of([key])
            pairs = pairs[-R.H:]
            if pairs:
                a = np.asarray(pairs, np.int64).reshape(-1, 2)
                R.append_many(row, a[:, 0], a[None, :, 1].astype(np.float64))
                R.last_step[row] = a[-1, 0]
        for key, rank in d["latched"].items():
            self._latched[self._row_of([key])] = int(rank)
        self._max_rank = int(d["max_rank"])


def _mode(vals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of `vals` ([P, n] ints): (a most frequent value, its count), by sorting each row
    and measuring its runs (no table sized by the largest rank). Ties go to the smallest value;
    a tie never decides a verdict (min_share > 1/2)."""
    P, n = vals.shape
    if n == 0:
        return np.zeros(P, np.int64), np.zeros(P, np.int64)
    srt = np.sort(vals, axis=1)
    start = np.ones((P, n), bool)
    start[:, 1:] = srt[:, 1:] != srt[:, :-1]
    run = np.cumsum(start, axis=1) - 1  # run index within its row
    flat = (np.arange(P)[:, None] * n + run).ravel()
    counts = np.bincount(flat, minlength=P * n).reshape(P, n)
    best = counts.argmax(axis=1)
    first = np.argmax(run == best[:, None], axis=1)  # a position of the best run in the sorted row
    return srt[np.arange(P), first], counts[np.arange(P), best]


def _bincount_rows(vals: np.ndarray, W: int) -> np.ndarray:
    """Per row of `vals` ([P, n] ints; negative = none), the count of each value in 0..W-1: [P, W]."""
    P = vals.shape[0]
    ok = (vals >= 0) & (vals < W)
    return np.bincount((np.arange(P)[:, None] * W + vals)[ok], minlength=P * W).reshape(P, W)
