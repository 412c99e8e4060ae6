"""Series state as arrays (issue 10 item 4): one `Rows` holds every series of one detector type,
one row per series, so a step's values are judged with a few numpy operations across all of
them instead of one Python object per series.

Per row: a ring buffer of the last `history` (step, value) points (the bounded History of the
per-series design), the count of points seen, the last step, the run of points past the
threshold and its first step, and the severity latch (Latch, base.py, materialised for the
few rows that may fire). Steps in a row only ever increase (a step going back rewinds first),
so a rewind is a count of trailing points, not a search.

Saved incrementally: the ring is stored in column chunks of `CHUNK` slots; a save writes the
per-row scalars (small) and only the chunks written since the last save (`dirty`), so a save
after k steps costs O(k x series), not the whole history. `parts()` is the one serialisation:
the database stores the parts as rows, `state_dict()` wraps the same bytes as strict JSON.
"""

from __future__ import annotations

import base64
import json
import zlib
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np

from thermowatch.monitors.contract import Outcome, Severity

from .base import MAD_TO_SIGMA, Latch

CHUNK = 8  # ring slots per saved chunk: one step dirties 1/16 of a 128-slot ring, a 50-step batch 7
NO_STEP = np.iinfo(np.int64).min  # "no last step" (None in the per-series design)
SEVERITIES = (Severity.INFO, Severity.WARN, Severity.CRITICAL)
OUTCOMES = tuple(Outcome)
# born: the step of the row's first point (NO_STEP: none yet, or all forgotten), for its age in steps
_SCALARS = ("pos", "length", "seen", "last_step", "run", "first_exceed", "lsev", "lout", "lonset", "lclear", "born")


@dataclass(slots=True)
class _Batch:
    rows: np.ndarray  # sorted
    pos0: np.ndarray  # their ring positions when the batch began
    x: np.ndarray  # [rows, H + K]: each ring oldest first, then the batch's values
    steps: np.ndarray  # [K]
    cache: dict


def pack(arrays: dict[str, np.ndarray], extra: dict[str, Any] | None = None) -> bytes:
    """A JSON header line (names, dtypes, shapes, extra) and the raw bytes, zlib level 1 (steps,
    counters and positions are nearly the same in every row): exact and deterministic."""
    items = [(k, np.ascontiguousarray(a)) for k, a in arrays.items()]
    head = {"arrays": [[k, a.dtype.str, list(a.shape)] for k, a in items], "extra": extra or {}}
    raw = json.dumps(head, separators=(",", ":")).encode() + b"\n" + b"".join(a.tobytes() for _, a in items)
    return zlib.compress(raw, 1)


def unpack(data: bytes) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    data = zlib.decompress(data)
    nl = data.index(b"\n")
    head = json.loads(data[:nl])
    out, at = {}, nl + 1
    for name, dtype, shape in head["arrays"]:
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) * dt.itemsize
        out[name] = np.frombuffer(data[at:at + n], dtype=dt).reshape(shape).copy()
        at += n
    return out, head["extra"]


def parts_to_json(parts: dict[str, bytes]) -> dict[str, str]:
    return {k: base64.b64encode(v).decode() for k, v in parts.items()}


def parts_from_json(d: dict[str, str]) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in d.items()}


class Rows:
    def __init__(self, history: int, clear_steps: int) -> None:
        self.H = history
        self.clear_steps = clear_steps
        self.keys: list[str] = []
        self.index: dict[str, int] = {}
        self._alloc(8)
        self.dirty: set[int] = set()  # ring chunks written since the last save
        self._batch: _Batch | None = None  # begin_batch(): the rows' values of a whole batch, ahead

    def _alloc(self, cap: int) -> None:
        old = getattr(self, "steps", None)
        steps = np.zeros((cap, self.H), np.int64)
        vals = np.zeros((cap, self.H), np.float64)
        fill = {"last_step": NO_STEP, "first_exceed": -1, "lsev": -1, "lout": -1, "lonset": -1, "born": NO_STEP}
        scal = {k: np.full(cap, fill.get(k, 0), np.int64) for k in _SCALARS}
        if old is not None:
            n = old.shape[0]
            steps[:n], vals[:n] = self.steps, self.vals
            for k in _SCALARS:
                scal[k][:n] = getattr(self, k)
        self.steps, self.vals = steps, vals
        for k, a in scal.items():
            setattr(self, k, a)

    def __len__(self) -> int:
        return len(self.keys)

    def add(self, key: str) -> int:
        row = self.index.get(key)
        if row is None:
            row = self.index[key] = len(self.keys)
            self.keys.append(key)
            if row >= self.steps.shape[0]:
                self._alloc(2 * self.steps.shape[0])
        return row

    # --- the ring -------------------------------------------------------------------------

    def append(self, rows: np.ndarray, step: int, ys: np.ndarray) -> None:
        """Append (step, ys[i]) to each row; a full ring drops its oldest point."""
        if rows.size == 0:
            return
        p = self.pos[rows]
        self.steps[rows, p] = step
        self.vals[rows, p] = ys
        self.born[rows] = np.where(self.born[rows] == NO_STEP, step, self.born[rows])
        self.pos[rows] = (p + 1) % self.H
        self.length[rows] = np.minimum(self.length[rows] + 1, self.H)
        lo, hi = int(p.min()), int(p.max())
        if lo == hi:  # the usual case: every row of the type appended at every step
            self.dirty.add(lo // CHUNK)
        else:
            self.dirty.update((np.unique(p) // CHUNK).tolist())

    def append_many(self, rows: np.ndarray, steps: np.ndarray, ys: np.ndarray) -> None:
        """`append` of K steps at once (ys: [len(rows), K]); the same ring, counters and dirty
        chunks as K calls, in one fancy assignment (only the last H of them can survive)."""
        K = len(steps)
        if rows.size == 0 or K == 0:
            return
        first = max(0, K - self.H)
        p = self.pos[rows]
        self.born[rows] = np.where(self.born[rows] == NO_STEP, steps[0], self.born[rows])
        if (p == p[0]).all():  # the usual case: one position for all, so at most two column slices
            a = (int(p[0]) + first) % self.H
            for lo, hi, src in ((a, min(self.H, a + K - first), 0), (0, max(0, a + K - first - self.H), self.H - a)):
                if hi > lo:
                    n = hi - lo
                    self.steps[rows, lo:hi] = steps[first + src:first + src + n][None, :]
                    self.vals[rows, lo:hi] = ys[:, first + src:first + src + n]
        else:
            slots = (p[:, None] + np.arange(first, K)[None, :]) % self.H
            self.steps[rows[:, None], slots] = steps[first:][None, :]
            self.vals[rows[:, None], slots] = ys[:, first:]
        self.pos[rows] = (p + K) % self.H
        self.length[rows] = np.minimum(self.length[rows] + K, self.H)
        p = np.unique(p)  # usually one position: every row of the type appended at every step
        self.dirty.update(np.unique((p[:, None] + np.arange(K)[None, :]) % self.H // CHUNK).tolist())

    # --- a batch of steps ahead (issue 10: one numpy call per window for the whole batch) -------

    def begin_batch(self, rows: np.ndarray, steps: np.ndarray, ys: np.ndarray) -> None:
        """The caller will append ys[t] (ys: [K, len(rows)]) to `rows` at steps[t], one step at a
        time, each row at every step. Until end_batch(), window statistics of those rows come
        from one sliding-window pass over ring + batch (`window_stats`), the same values in the
        same order as `blocks` gives step by step. Only full rings and K < H (a row's position
        then tells how many of the batch it holds); otherwise nothing is kept."""
        self._batch = None
        K = len(steps)
        if rows.size == 0 or K == 0 or K >= self.H or (self.length[rows] < self.H).any():
            return
        order = np.argsort(rows, kind="stable")
        rows = rows[order]
        x = np.concatenate([self.ordered(rows), ys[:, order].T], axis=1)  # [P, H + K]
        self._batch = _Batch(rows, self.pos[rows].copy(), x, np.asarray(steps, np.int64), {})

    def end_batch(self) -> None:
        self._batch = None

    def window_stats(self, idx: np.ndarray, n: int, skip_last: int, robust: bool):
        """(covered mask over idx, median, sigma or None) of the window `blocks(idx, n,
        skip_last)` would give, for the rows begin_batch() holds; None when it holds none."""
        b = self._batch
        if b is None or idx.size == 0:
            return None
        j = np.minimum(np.searchsorted(b.rows, idx), b.rows.size - 1)
        covered = b.rows[j] == idx
        if not covered.any():
            return None
        j = j[covered]
        held = (self.pos[idx[covered]] - b.pos0[j]) % self.H  # batch points each row holds now
        # A row that missed an append would hold a different batch step last: leave it to blocks.
        last = self.steps[idx[covered], (self.pos[idx[covered]] - 1) % self.H]
        ok = (held == 0) | (last == b.steps[np.maximum(held - 1, 0)])
        covered[np.flatnonzero(covered)[~ok]] = False
        j, held = j[ok], held[ok]
        k = min(n, self.H - skip_last)
        if k <= 0 or not covered.any():
            return None
        key = (k, skip_last, robust)
        got = b.cache.get(key)
        if got is None:
            # windows ending `skip_last` before the newest point, after a = 0..K batch points
            w = np.lib.stride_tricks.sliding_window_view(b.x, k, axis=1)
            start = self.H - skip_last - k
            w = w[:, start:start + len(b.steps) + 1]  # [P, K + 1, k]
            med = np.median(w, axis=-1)
            sig = MAD_TO_SIGMA * np.median(np.abs(w - med[..., None]), axis=-1) if robust else None
            got = b.cache[key] = (med, sig)
        med, sig = got
        return covered, med[j, held], (sig[j, held] if robust else None)

    def ordered(self, rows: np.ndarray) -> np.ndarray:
        """Each row's ring, oldest first ([len(rows), H]); meaningful for full rows."""
        p = self.pos[rows]
        if rows.size and (p == p[0]).all():  # one position for all: two column slices
            v = self.vals[rows]
            return np.concatenate([v[:, int(p[0]):], v[:, :int(p[0])]], axis=1)
        return self.vals[rows[:, None], self._slots(rows, self.H, 0)]

    def _slots(self, rows: np.ndarray, k: int, skip_last: int) -> np.ndarray:
        return (self.pos[rows, None] - skip_last - k + np.arange(k)[None, :]) % self.H

    def tail(self, row: int, n: int, skip_last: int = 0) -> np.ndarray:
        """History.tail for one row: the `n` values before the last `skip_last`, oldest first."""
        k = max(0, min(n, int(self.length[row]) - skip_last))
        return self.vals[row, self._slots(np.array([row]), k, skip_last)[0]]

    def tail_steps(self, row: int, n: int) -> np.ndarray:
        k = max(0, min(n, int(self.length[row])))
        return self.steps[row, self._slots(np.array([row]), k, 0)[0]].astype(np.float64)

    def last(self, row: int) -> tuple[int, float] | None:
        if self.length[row] == 0:
            return None
        p = (self.pos[row] - 1) % self.H
        return int(self.steps[row, p]), float(self.vals[row, p])

    def blocks(self, rows: np.ndarray, n: int, skip_last: int = 0) -> Iterable[tuple[np.ndarray, np.ndarray]]:
        """(indices into `rows`, values block) grouped by the window size each row has, so a
        median over axis 1 sees exactly the values History.tail gave the per-series design."""
        k = np.clip(np.minimum(n, self.length[rows] - skip_last), 0, None)
        for size in np.unique(k):
            at = np.flatnonzero(k == size)
            if size == 0:
                yield at, np.empty((at.size, 0))
            else:
                r = rows[at]
                yield at, self.vals[r[:, None], self._slots(r, int(size), skip_last)]

    def age(self, rows: np.ndarray, step: int, first: int) -> np.ndarray:
        """Steps from each row's first point to `step`, both counted; `first` stands for the
        first point of a row without one (the step of the first point to come)."""
        born = self.born[rows]
        return step - np.where(born == NO_STEP, first, born) + 1

    def sizes(self, rows: np.ndarray, n: int, skip_last: int = 0) -> np.ndarray:
        return np.clip(np.minimum(n, self.length[rows] - skip_last), 0, None)

    def rewind(self, rows: np.ndarray, first_step: int | None) -> np.ndarray:
        """History.rewind per row; returns how many points each row dropped."""
        self._batch = None  # a batch taken ahead assumed no rewind inside it
        if rows.size == 0:
            return np.zeros(0, np.int64)
        if first_step is None:
            dropped = self.length[rows].copy()
            self.length[rows] = 0
            self.born[rows] = NO_STEP
            return dropped
        order = self._slots(rows, self.H, 0)
        valid = np.arange(self.H)[None, :] >= (self.H - self.length[rows])[:, None]
        dropped = ((self.steps[rows[:, None], order] >= first_step) & valid).sum(axis=1)
        self.length[rows] -= dropped
        self.pos[rows] = (self.pos[rows] - dropped) % self.H
        self.born[rows] = np.where(self.born[rows] >= first_step, NO_STEP, self.born[rows])
        return dropped

    # --- counters and the latch -----------------------------------------------------------

    def count_exceed(self, rows: np.ndarray, step: int, exceeded: np.ndarray) -> None:
        run = self.run[rows]
        self.first_exceed[rows] = np.where(exceeded, np.where(run == 0, step, self.first_exceed[rows]), -1)
        self.run[rows] = np.where(exceeded, run + 1, 0)

    def observe(self, rows: np.ndarray, inside_band: np.ndarray) -> None:
        """The latch's clear rule: `clear_steps` consecutive in-band points drop an active latch."""
        active = self.lsev[rows] >= 0
        if not active.any():
            return  # an inactive latch's clear count is 0 already (reset_latch, Latch.fire)
        clear = np.where(active & inside_band, self.lclear[rows] + 1, 0)
        self.lclear[rows] = clear
        done = rows[active & (clear >= self.clear_steps)]
        self.reset_latch(done)

    def reset_latch(self, rows: np.ndarray) -> None:
        self.lsev[rows], self.lout[rows], self.lonset[rows], self.lclear[rows] = -1, -1, -1, 0

    def latch(self, row: int) -> Latch:
        lt = Latch(self.clear_steps)
        if self.lsev[row] >= 0:
            lt.severity = SEVERITIES[self.lsev[row]]
        if self.lout[row] >= 0:
            lt.outcome = OUTCOMES[self.lout[row]]
        lt.onset_step, lt._clear_run = int(self.lonset[row]), int(self.lclear[row])
        return lt

    def store_latch(self, row: int, lt: Latch) -> None:
        self.lsev[row] = -1 if lt.severity is None else SEVERITIES.index(lt.severity)
        self.lout[row] = -1 if lt.outcome is None else OUTCOMES.index(lt.outcome)
        self.lonset[row], self.lclear[row] = lt.onset_step, lt._clear_run

    # --- saving ---------------------------------------------------------------------------

    def parts(self, prefix: str, dirty_only: bool) -> dict[str, bytes]:
        n = len(self.keys)
        out = {f"{prefix}.rows": pack({k: getattr(self, k)[:n] for k in _SCALARS}, {"keys": self.keys, "H": self.H})}
        chunks = sorted(self.dirty) if dirty_only else range((self.H + CHUNK - 1) // CHUNK)
        for c in chunks:
            sl = slice(c * CHUNK, (c + 1) * CHUNK)
            out[f"{prefix}.ring.{c}"] = pack({"steps": self.steps[:n, sl], "vals": self.vals[:n, sl]})
        return out

    def load(self, prefix: str, parts: dict[str, bytes]) -> None:
        arrays, extra = unpack(parts[f"{prefix}.rows"])
        if extra["H"] != self.H:
            raise ValueError(f"{prefix}: saved history {extra['H']} != configured {self.H}")
        self.keys, self.index = [], {}
        self._alloc(max(8, len(extra["keys"])))
        for key in extra["keys"]:
            self.add(key)
        n = len(self.keys)
        for k in _SCALARS:
            if k in arrays:
                getattr(self, k)[:n] = arrays[k]
        for c in range((self.H + CHUNK - 1) // CHUNK):
            data = parts.get(f"{prefix}.ring.{c}")
            if data is None:
                continue  # never written: nothing in those slots is inside any row's length
            a, _ = unpack(data)
            m, sl = min(a["steps"].shape[0], n), slice(c * CHUNK, c * CHUNK + a["steps"].shape[1])
            self.steps[:m, sl], self.vals[:m, sl] = a["steps"][:m], a["vals"][:m]
        if "born" not in arrays:  # saved before rows had it: the oldest point the ring still holds
            rows = np.arange(n)
            oldest = self.steps[rows, (self.pos[rows] - self.length[rows]) % self.H]
            self.born[:n] = np.where(self.length[:n] > 0, oldest, NO_STEP)
        self.dirty = set()


def as_rows(idx: Sequence[int]) -> np.ndarray:
    return np.asarray(idx, dtype=np.int64)


BOUND_BLOCK = 8  # windows per bound: the span's extra points loosen the bounds by as many ranks


def block_starts(K: int, block: int) -> tuple[np.ndarray, int]:
    """Starts of blocks of `b` = min(block, K) consecutive steps covering 0..K-1; the last block
    is moved back to end at K - 1 (blocks may overlap: a bound over more windows still holds)."""
    b = min(block, K)
    return np.minimum(np.arange(0, K, b), K - b), b


def window_bounds(x: np.ndarray, a0: int, n: int, K: int, block: int = BOUND_BLOCK
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bounds on np.median and the median absolute deviation of the K windows
    x[:, a0 + t : a0 + t + n], t = 0..K-1, per block of consecutive windows (block_starts):
    (median_lo, median_hi, mad_lo), each [rows, blocks], from one partition of each block's span
    instead of one per window. Every window of a block lies inside its span S (n + b - 1 points),
    and the i-th smallest of a subset is at least the i-th smallest of S and at most its
    (i + |S| - n)-th, so the median lies in [S_(n-1)//2, S_(n//2 + b - 1)]; each |w - median| is
    at least w's distance to that interval, so the MAD is at least the ((n-1)//2)-th smallest of
    those distances. Rounding is monotone, so the bounds hold for the float results too."""
    starts, b = block_starts(K, block)
    span = np.lib.stride_tricks.sliding_window_view(x, n + b - 1, axis=1)[:, a0 + starts]  # [P, B, n + b - 1]
    lo_k, hi_k = (n - 1) // 2, n // 2 + b - 1
    part = np.partition(span, (lo_k, hi_k), axis=-1)
    lo, hi = part[..., lo_k], part[..., hi_k]
    dist = np.maximum(np.maximum(lo[..., None] - span, span - hi[..., None]), 0.0)
    return lo, hi, np.partition(dist, lo_k, axis=-1)[..., lo_k]


def block_max(y: np.ndarray, a0: int, n: int, K: int, block: int = BOUND_BLOCK) -> np.ndarray:
    """Per block (block_starts), the largest of y[:, a0 + t : a0 + t + n] over its windows t:
    an upper bound of any median, or value, taken from them. [rows, blocks]."""
    starts, b = block_starts(K, block)
    return np.lib.stride_tricks.sliding_window_view(y, n + b - 1, axis=1)[:, a0 + starts].max(axis=-1)


def window_medians(x: np.ndarray, a0: int, n: int, K: int, robust: bool
                   ) -> tuple[np.ndarray, np.ndarray | None]:
    """Exact (median, 1.4826 * MAD or None) of the K windows x[:, a0 + t : a0 + t + n], [rows, K]:
    the same values in the same order as Rows.blocks gives step by step, so bit-identical."""
    w = np.lib.stride_tricks.sliding_window_view(x, n, axis=1)[:, a0:a0 + K]
    med = np.median(w, axis=-1)
    return med, (MAD_TO_SIGMA * np.median(np.abs(w - med[..., None]), axis=-1) if robust else None)
