"""What a trainer claims about its data, bounded by what its run can have consumed (issue 34).

A step's `sample_lo`/`sample_hi` are where the policy's skip ranges come from
(store.steps.sample_range): a trainer that claimed `[0, 10^15)` for a few steps made the policy
order `skip [[0, 1000000000000301]]`, the whole dataset. Claims are cheap to check and the
checks need only what the run said at its start:

- a range is `lo <= hi` (`-1` for an end the trainer does not know, as before);
- by step `s` a run has consumed at most `(s + 1) x global_batch` sample ids plus those its skip
  ledger passed over, so `hi` stays within that;
- one step consumes one global batch, plus the skipped ids its range may straddle.

`global_batch` is the run's config (`data.global_batch`, what `thermowatch.watch`, `Run` and the
bundled trainer send); a run that does not say has only the first check. A run that passes over
its data more than once says `data.dataset_size` N: a skipped id then stands for its data, skipped
again in every pass (monitors.ledger), so each pass of N ids may pass over as many ids as the
ledger holds, and the ledger's share of the bound grows with the passes a claim reaches. The ledger's size is
read once per run and again only when a claim would fail with it (the ledger only grows, so a
kept size can only be too small, never let a bad claim through).
"""

from __future__ import annotations

import numpy as np
from sqlalchemy.orm import Session

from thermowatch.monitors.columns import StepColumns
from thermowatch.monitors.contract import ContractError, merge_ranges
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import skips as skips_store

_KEPT = 100_000  # (run, attempt) batches and run ledger sizes kept in memory, then read again


class ClaimBounds:
    """Ingestor's check of a batch's sample ranges; keeps each attempt's global batch and each
    run's skipped total between batches (see the module docstring)."""

    def __init__(self) -> None:
        self._batch: dict[tuple[str, int], tuple[int | None, int | None]] = {}
        self._skipped: dict[str, int] = {}

    def check(self, s: Session, run_id: str, attempt: int, cols: StepColumns) -> None:
        lo, hi = cols.sample_lo, cols.sample_hi
        if not len(cols) or hi.max() < 0:
            return
        both = (lo >= 0) & (hi >= 0)
        bad = np.flatnonzero(both & (lo > hi))
        if bad.size:
            i = int(bad[0])
            raise ContractError(f"step {int(cols.steps[i])}: sample range [{int(lo[i])}, {int(hi[i])}) ends before it "
                                "starts; sample_lo <= sample_hi (-1 for an end you do not know)")
        batch, n = self._data_of(s, run_id, attempt)
        if batch is None:
            return
        if self._first_over(cols, batch, self._skipped_of(s, run_id, fresh=False), n) is None:
            return
        ledger = self._skipped_of(s, run_id, fresh=True)  # a skip since it was read?
        over = self._first_over(cols, batch, ledger, n)
        if over is None:
            return
        i, past_end = over
        step, a, b = int(cols.steps[i]), int(lo[i]), int(hi[i])
        skipped = int(_passed_over(np.array([float(b)]), ledger, n)[0])
        why = (f"by step {step} it has consumed at most {(step + 1) * batch + skipped} sample ids ((step + 1) x "
               f"data.global_batch {batch} + {skipped} its skip ledger passed over)" if past_end else
               f"one step consumes at most {batch + skipped} ids (data.global_batch {batch} + {skipped} its skip "
               f"ledger passed over), this range spans {b - a}")
        raise ContractError(
            f"step {step}: claims samples [{a}, {b}), more than run {run_id!r} can have consumed: {why}. Send the "
            "absolute ids the step trained on (thermowatch.watch's batch_ids), or -1 when unknown")

    def check_cursor(self, s: Session, run_id: str, attempt: int, step: int, cursor: int) -> None:
        """A checkpoint's sample cursor (the next id its run reads after it) within the same
        bound as the step's claims: a rollback to it resumes there."""
        batch, n = self._data_of(s, run_id, attempt)
        if batch is None or cursor < 0:
            return
        for fresh in (False, True):
            skipped = int(_passed_over(np.array([float(cursor)]), self._skipped_of(s, run_id, fresh=fresh), n)[0])
            if cursor <= (step + 1) * batch + skipped:
                return
        raise ContractError(
            f"checkpoint {step}: sample_cursor {cursor} is past what run {run_id!r} can have consumed by step {step}: "
            f"at most {(step + 1) * batch + skipped} ((step + 1) x data.global_batch {batch} + {skipped} its skip "
            "ledger passed over)")

    @staticmethod
    def _first_over(cols: StepColumns, batch: int, ledger: int, n: int | None) -> tuple[int, bool] | None:
        """The first step whose claim is over a bound, and whether it is the run's end (else one
        step's width); None when every claim is within."""
        lo, hi = cols.sample_lo, cols.sample_hi
        # float64: (step + 1) x batch may pass 2**63; ids this large are exact to 2**53, far past any dataset
        skipped = _passed_over(hi.astype(np.float64), ledger, n)
        bound = (cols.steps.astype(np.float64) + 1.0) * batch + skipped
        past_end = (hi >= 0) & (hi.astype(np.float64) > bound)
        too_wide = (lo >= 0) & (hi >= 0) & ((hi - lo) > batch + skipped)
        idx = np.flatnonzero(past_end | too_wide)
        return (int(idx[0]), bool(past_end[idx[0]])) if idx.size else None

    def _data_of(self, s: Session, run_id: str, attempt: int) -> tuple[int | None, int | None]:
        """The attempt's `data.global_batch` and `data.dataset_size` (None where not a positive int)."""
        key = (run_id, attempt)
        if key not in self._batch:
            cfg = runs_store.attempt_config(s, run_id, attempt) or {}
            data = cfg.get("data") if isinstance(cfg, dict) else None
            data = data if isinstance(data, dict) else {}
            if len(self._batch) >= _KEPT:
                self._batch.clear()
            self._batch[key] = (_positive(data.get("global_batch")), _positive(data.get("dataset_size")))
        return self._batch[key]

    def _skipped_of(self, s: Session, run_id: str, *, fresh: bool) -> int:
        if fresh or run_id not in self._skipped:
            if len(self._skipped) >= _KEPT:
                self._skipped.clear()
            self._skipped[run_id] = sum(len(r) for r in merge_ranges(skips_store.skip_ranges(s, run_id)))
        return self._skipped[run_id]


def _positive(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def _passed_over(hi: np.ndarray, ledger: int, n: int | None) -> np.ndarray:
    """At most how many ids below each `hi` a ledger of `ledger` ids passes over: the ids once, or,
    with a dataset of n samples, the data they stand for once in every pass `hi` reaches."""
    if n is None:
        return np.full(hi.shape, float(ledger))
    return float(min(ledger, n)) * np.maximum(np.ceil(np.maximum(hi, 0.0) / n), 1.0)
