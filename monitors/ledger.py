"""The skip ledger: absolute sample-index ranges that training must never see.

PaLM restarted ~100 steps before a loss spike and skipped 200-500 batches; YaLM-100B did the
same by hand ("roll back to 13k and skip the bad batches"). The ledger holds those ranges as
*absolute* sample ids, so it means the same thing for every world size, every restart, and
whatever the curriculum's batch size was at the time (DESIGN.md, "Rollback semantics").

Ranges are half-open [lo, hi), kept sorted and merged (touching ranges fuse), in two int64
arrays so that membership and "next k unskipped ids" are binary searches, not Python loops.

A loop that makes more than one pass over its data (`data[ids % len(data)]`) gives the ledger
that length as its `period` (issue 35: under DDP a second pass brought the same poisoned windows
back): a skipped id then stands for its data index `id % period`, skipped in every pass. The
ranges it was given (what the supervisor ordered, what the ledger digest covers) stay as they
are; `data_ranges` folds them into [0, period), and membership and `take` read those. A loop
that shuffles each pass gives its map from ids to data indices as `index` (vectorised: an int64
array of ids in, their data indices out): the data indices the ranges held are skipped wherever
a later pass puts them.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

import numpy as np


class SkipLedger:
    """Sorted, merged, disjoint half-open ranges [lo, hi) of absolute sample ids."""

    __slots__ = ("_lo", "_hi", "period", "index", "_flo", "_fhi")

    def __init__(self, ranges: Iterable[Sequence[int]] = (), period: int | None = None,
                 index: Callable[[np.ndarray], np.ndarray] | None = None) -> None:
        if period is not None and (isinstance(period, bool) or not isinstance(period, (int, np.integer)) or period < 1):
            raise ValueError(f"a skip ledger's period is the dataset's length, an integer >= 1, got {period!r}")
        if index is not None and period is None:
            raise ValueError("a skip ledger's index maps ids to data indices in [0, period): give the period too")
        self.period = None if period is None else int(period)
        self.index = index
        self._lo = np.zeros(0, dtype=np.int64)
        self._hi = np.zeros(0, dtype=np.int64)
        self._flo, self._fhi = self._lo, self._hi  # the ranges folded into [0, period) (or the ranges)
        pairs = [tuple(r) for r in ranges]
        if pairs:
            self.add_many(pairs)

    # --- building ---------------------------------------------------------------------------

    def add(self, lo: int, hi: int) -> None:
        """Skip [lo, hi). Empty ranges are ignored; overlapping or touching ones merge."""
        self.add_many([(lo, hi)])

    def add_many(self, ranges: Iterable[Sequence[int]]) -> None:
        pairs = np.asarray([_check_pair(r) for r in ranges], dtype=np.int64).reshape(-1, 2)
        pairs = pairs[pairs[:, 1] > pairs[:, 0]]
        if not len(pairs):
            return
        lo = np.concatenate([self._lo, pairs[:, 0]])
        hi = np.concatenate([self._hi, pairs[:, 1]])
        order = np.argsort(lo, kind="stable")
        lo, hi = lo[order], hi[order]
        # A range starts a new merged group when it begins after every earlier range ended.
        run_hi = np.maximum.accumulate(hi)
        starts = np.ones(len(lo), dtype=bool)
        starts[1:] = lo[1:] > run_hi[:-1]
        lo, hi = lo[starts], np.maximum.reduceat(hi, np.flatnonzero(starts))
        # folded first: ranges that would leave nothing to train on change nothing
        (self._flo, self._fhi), self._lo, self._hi = self._fold(lo, hi), lo, hi

    def _fold(self, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The data indices ranges stand for, [0, period): a range is cut where a pass ends."""
        if self.period is None:
            return lo, hi
        n = self.period
        whole = (hi - lo) >= n
        if whole.any():
            i = int(np.flatnonzero(whole)[0])
            raise ValueError(f"skip range [{int(lo[i])}, {int(hi[i])}) spans the whole dataset "
                             f"({n} samples): nothing would be left to train on")
        if self.index is not None:  # the data indices the ids were, as ranges of data indices
            ids = np.repeat(lo - np.cumsum(np.concatenate([[0], (hi - lo)[:-1]])), hi - lo) + np.arange(int((hi - lo).sum()))
            d = np.unique(np.asarray(self.index(ids), dtype=np.int64))
            cut = np.flatnonzero(np.diff(d) != 1) + 1
            lo, hi = d[np.concatenate([[0], cut])], d[np.concatenate([cut - 1, [len(d) - 1]])] + 1
            if len(d) >= n:
                raise ValueError(f"the skip ranges cover every one of the dataset's {n} samples: nothing would be "
                                 "left to train on")
            return lo.astype(np.int64), hi.astype(np.int64)
        a, b = lo % n, hi % n
        wraps = b <= a  # [a, n) and [0, b) in index space (empty ranges were dropped)
        lo = np.concatenate([a[~wraps], a[wraps], np.zeros(int(wraps.sum()), np.int64)])
        hi = np.concatenate([b[~wraps], np.full(int(wraps.sum()), n, np.int64), b[wraps]])
        keep = hi > lo
        folded = SkipLedger(np.stack([lo[keep], hi[keep]], axis=1).tolist())
        if folded.skipped_between(0, n) >= n:
            raise ValueError(f"the skip ranges cover every one of the dataset's {n} samples: nothing would be left "
                             "to train on")
        return folded._lo, folded._hi

    # --- queries ----------------------------------------------------------------------------

    def contains(self, ids: np.ndarray | int) -> np.ndarray | bool:
        """Whether each id is skipped (vectorised; a scalar in gives a bool out). With a period:
        whether its data index is."""
        arr = np.asarray(ids, dtype=np.int64)
        if not len(self._flo):
            inside = np.zeros(arr.shape, dtype=bool)
        else:
            idx = self._data_of(arr)
            k = np.searchsorted(self._flo, idx, side="right") - 1
            inside = (k >= 0) & (idx < self._fhi[np.maximum(k, 0)])
        return bool(inside) if arr.ndim == 0 else inside

    def _data_of(self, ids: np.ndarray) -> np.ndarray:
        if self.period is None:
            return ids
        if self.index is None:
            return ids % self.period
        return np.asarray(self.index(ids.reshape(-1)), dtype=np.int64).reshape(ids.shape)

    def next_unskipped(self, i: int) -> int:
        """The smallest id >= i that is not skipped (merged ranges: one jump is enough; with a
        period, a jump to a pass's end may land on the next pass's first range: two at most)."""
        i = int(i)
        if self.index is not None and len(self._flo):
            return int(self.take(i, 1)[0])
        for _ in range(2):
            base, idx = (0, i) if self.period is None else (i - i % self.period, i % self.period)
            k = int(np.searchsorted(self._flo, idx, side="right")) - 1
            if not (k >= 0 and idx < self._fhi[k]):
                return i
            i = base + int(self._fhi[k])
        return i

    def _gap_end(self, cur: int) -> int | None:
        """Where the unskipped run starting at `cur` ends (the next skipped id); None: never."""
        if not len(self._flo):
            return None
        if self.period is None:
            k = int(np.searchsorted(self._lo, cur, side="right"))
            return int(self._lo[k]) if k < len(self._lo) else None
        base, idx = cur - cur % self.period, cur % self.period
        k = int(np.searchsorted(self._flo, idx, side="right"))
        return base + (int(self._flo[k]) if k < len(self._flo) else self.period + int(self._flo[0]))

    def take(self, cursor: int, n: int) -> np.ndarray:
        """The next n unskipped ids >= cursor, ascending (int64). Loops over gaps, not ids."""
        if n < 0:
            raise ValueError(f"cannot take a negative number of samples ({n})")
        out: list[np.ndarray] = []
        cur, need = int(cursor), int(n)
        if self.index is not None and len(self._flo):  # shuffled passes: ids in chunks, the skipped left out
            while need:
                chunk = np.arange(cur, cur + max(2 * need, 1024), dtype=np.int64)
                free = chunk[~self.contains(chunk)][:need]
                out.append(free)
                need -= len(free)
                cur = int(chunk[-1]) + 1  # a chunk that fell short was used up
            return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
        while need:
            cur = self.next_unskipped(cur)
            end = self._gap_end(cur)
            m = need if end is None else min(need, end - cur)
            out.append(np.arange(cur, cur + m, dtype=np.int64))
            cur += m
            need -= m
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def skipped_between(self, lo: int, hi: int) -> int:
        """How many ids in [lo, hi) are skipped (with a period: whose data index is)."""
        if self.period is None:
            a = np.clip(self._lo, lo, hi)
            b = np.clip(self._hi, lo, hi)
            return int((b - a).sum())
        return self._skipped_below(hi) - self._skipped_below(lo)

    def _skipped_below(self, x: int) -> int:
        """Skipped ids below x: every pass skips each skipped data index once (a bijection)."""
        n = self.period
        per_pass = int((self._fhi - self._flo).sum())
        r = x % n
        if self.index is not None:
            return (x // n) * per_pass + int(self.contains(np.arange(x - r, x, dtype=np.int64)).sum())
        return (x // n) * per_pass + int((np.clip(self._fhi, 0, r) - np.clip(self._flo, 0, r)).sum())

    @property
    def data_ranges(self) -> list[tuple[int, int]]:
        """The data indices skipped, [lo, hi) within [0, period); without a period, the ranges."""
        return [(int(a), int(b)) for a, b in zip(self._flo, self._fhi)]

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in zip(self._lo, self._hi)]

    def __len__(self) -> int:
        """Number of merged ranges."""
        return len(self._lo)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SkipLedger) and self.ranges == other.ranges and self.period == other.period

    def __repr__(self) -> str:
        return f"SkipLedger({self.ranges}{'' if self.period is None else f', period={self.period}'})"

    def copy(self) -> "SkipLedger":
        new = SkipLedger(period=self.period, index=self.index)
        new._lo, new._hi = self._lo.copy(), self._hi.copy()
        new._flo, new._fhi = self._flo.copy(), self._fhi.copy()
        return new

    # --- JSON -------------------------------------------------------------------------------

    def to_json(self) -> list[list[int]]:
        return [[a, b] for a, b in self.ranges]

    @classmethod
    def from_json(cls, obj: Any) -> "SkipLedger":
        if obj is None:
            return cls()
        if not isinstance(obj, (list, tuple)):
            raise ValueError(
                f"a skip ledger is a JSON list of [lo, hi] pairs, got {type(obj).__name__}: {obj!r}"
            )
        return cls(obj)


def _check_pair(r: Sequence[int]) -> tuple[int, int]:
    try:
        lo, hi = r
    except (TypeError, ValueError):
        raise ValueError(f"a skip range is a pair [lo, hi), got {r!r}") from None
    for v in (lo, hi):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ValueError(f"skip range {r!r}: bounds must be integers sample ids, got {v!r}")
    if lo < 0 or hi < lo:
        raise ValueError(f"skip range [{lo}, {hi}) must satisfy 0 <= lo <= hi (half-open [lo, hi))")
    return int(lo), int(hi)
