"""The skip ledger: absolute sample-index ranges that training must never see.

PaLM restarted ~100 steps before a loss spike and skipped 200-500 batches; YaLM-100B did the
same by hand ("roll back to 13k and skip the bad batches"). The ledger holds those ranges as
*absolute* sample ids, so it means the same thing for every world size, every restart, and
whatever the curriculum's batch size was at the time (DESIGN.md, "Rollback semantics").

Ranges are half-open [lo, hi), kept sorted and merged (touching ranges fuse), in two int64
arrays so that membership and "next k unskipped ids" are binary searches, not Python loops.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import numpy as np


class SkipLedger:
    """Sorted, merged, disjoint half-open ranges [lo, hi) of absolute sample ids."""

    __slots__ = ("_lo", "_hi")

    def __init__(self, ranges: Iterable[Sequence[int]] = ()) -> None:
        self._lo = np.zeros(0, dtype=np.int64)
        self._hi = np.zeros(0, dtype=np.int64)
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
        self._lo = lo[starts]
        self._hi = np.maximum.reduceat(hi, np.flatnonzero(starts))

    # --- queries ----------------------------------------------------------------------------

    def contains(self, ids: np.ndarray | int) -> np.ndarray | bool:
        """Whether each id is skipped (vectorised; a scalar in gives a bool out)."""
        arr = np.asarray(ids, dtype=np.int64)
        if not len(self._lo):
            inside = np.zeros(arr.shape, dtype=bool)
        else:
            k = np.searchsorted(self._lo, arr, side="right") - 1
            inside = (k >= 0) & (arr < self._hi[np.maximum(k, 0)])
        return bool(inside) if arr.ndim == 0 else inside

    def next_unskipped(self, i: int) -> int:
        """The smallest id >= i that is not skipped (merged ranges: one jump is enough)."""
        k = int(np.searchsorted(self._lo, i, side="right")) - 1
        if k >= 0 and i < self._hi[k]:
            return int(self._hi[k])
        return int(i)

    def take(self, cursor: int, n: int) -> np.ndarray:
        """The next n unskipped ids >= cursor, ascending (int64). Loops over gaps, not ids."""
        if n < 0:
            raise ValueError(f"cannot take a negative number of samples ({n})")
        out: list[np.ndarray] = []
        cur, need = int(cursor), int(n)
        while need:
            cur = self.next_unskipped(cur)
            k = int(np.searchsorted(self._lo, cur, side="right"))
            gap_end = int(self._lo[k]) if k < len(self._lo) else cur + need
            m = min(need, gap_end - cur)
            out.append(np.arange(cur, cur + m, dtype=np.int64))
            cur += m
            need -= m
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    def skipped_between(self, lo: int, hi: int) -> int:
        """How many ids in [lo, hi) are skipped."""
        a = np.clip(self._lo, lo, hi)
        b = np.clip(self._hi, lo, hi)
        return int((b - a).sum())

    @property
    def ranges(self) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in zip(self._lo, self._hi)]

    def __len__(self) -> int:
        """Number of merged ranges."""
        return len(self._lo)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SkipLedger) and self.ranges == other.ranges

    def __repr__(self) -> str:
        return f"SkipLedger({self.ranges})"

    def copy(self) -> "SkipLedger":
        new = SkipLedger()
        new._lo, new._hi = self._lo.copy(), self._hi.copy()
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
