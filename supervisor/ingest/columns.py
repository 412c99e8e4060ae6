"""Ingest's checks for a batch sent as columns (monitors.columns.StepColumns).

The same rules as the per-step JSON form (supervisor.ingest.ingestor: the contract's from_json plus
supervisor.limits), applied with array operations: a refusal names the field, the step and the
limit, and comes before the transaction opens, so nothing of a refused batch is stored.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from thermowatch.monitors.columns import MAGIC, StepColumns
from thermowatch.monitors.contract import INT32_MAX, MAX_WALL_TIME, RECORD_FIELDS, ContractError
from thermowatch.supervisor.limits import DIGEST_CHARS, LimitExceeded, Limits, check_int, check_metric_key, check_run_id, check_text


def check_header_size(body: bytes, limits: Limits) -> None:
    """Before the columns header is parsed: a header naming more strings than a batch may hold
    (every key and every step's ledger digest is one) is refused (413) by counting its quotes, in
    C, with nothing allocated. Parsed first, ten 12 MB headers of 10^6 keys (each then refused)
    took the daemon from ~470 MB to ~1.4 GB (issue 21)."""
    if len(body) < 8 or body[:4] != MAGIC:
        return  # StepColumns.decode names what is malformed
    (hlen,) = struct.unpack_from("<I", body, 4)
    strings = body.count(b'"', 8, 8 + hlen) // 2
    most = limits.max_series_per_run + limits.max_records + 8  # keys, digests, the header's own fields
    if strings > most:
        raise LimitExceeded(f"columns header holds ~{strings} strings; a batch names at most "
                            f"{limits.max_series_per_run} series (limits.max_series_per_run) and one ledger digest "
                            f"per step (limits.max_records = {limits.max_records})")


def check_columns(run_id: Any, attempt: Any, cols: StepColumns, limits: Limits,
                  too_large: type[LimitExceeded] = LimitExceeded) -> tuple[int, set[str]]:
    """(values in the batch, its metric keys), or ContractError/LimitExceeded naming the problem.
    `too_large`: what a batch of too many records or values raises (ingest's BatchTooLarge)."""
    check_run_id(run_id)
    check_int("attempt", attempt, 0, INT32_MAX)
    n = len(cols)
    if n > limits.max_records:
        raise too_large(f"batch of {n} records exceeds the limit of {limits.max_records}; send smaller batches")
    per_step = cols.present.sum(axis=1) if cols.present is not None else np.full(n, len(cols.keys))
    if n and per_step.max() > limits.max_keys_per_step:
        i = int(per_step.argmax())
        raise LimitExceeded(f"step {int(cols.steps[i])} has {int(per_step[i])} metric keys; the limit is "
                            f"{limits.max_keys_per_step} per step")
    n_values = int(per_step.sum())
    if n_values > limits.max_values:
        raise too_large(f"batch of {n_values} values exceeds the limit of {limits.max_values}; "
                            "send fewer steps per batch")
    if n > 1:
        uniq, counts = np.unique(cols.steps, return_counts=True)
        if counts.max() > 1:
            j = int(counts.argmax())
            raise ContractError(f"step {int(uniq[j])} appears {int(counts[j])} times in the batch; a batch holds each "
                                "step once (a retrained step belongs to a new attempt)")
    bad = np.flatnonzero(cols.steps < 0)
    if bad.size:
        raise ContractError(f"records[{int(bad[0])}]: 'step' must be a non-negative integer, got {int(cols.steps[bad[0]])}")
    for name in ("sample_lo", "sample_hi", "tokens"):
        col = getattr(cols, name)
        bad = np.flatnonzero(col < -1)
        if bad.size:
            raise ContractError(f"records[{int(bad[0])}]: {name!r} must be an integer in [-1, 2**63), "
                                f"got {int(col[bad[0]])}")
    # A column holds it: SQLite stores a NaN REAL as NULL (a NOT NULL failure, i.e. a 500).
    bad = np.flatnonzero(~(np.abs(cols.wall_time) <= MAX_WALL_TIME))
    if bad.size:
        raise ContractError(f"step {int(cols.steps[bad[0]])}: 'wall_time' must be a finite number of seconds "
                            f"within +-{MAX_WALL_TIME:g}, got {cols.wall_time[bad[0]]!r}")
    if cols.ledger_digest is not None:
        for step, d in zip(cols.steps.tolist(), cols.ledger_digest):
            if d:
                check_text(f"step {step}: 'ledger_digest'", d, DIGEST_CHARS)
    keys = set(cols.keys)
    if len(keys) > limits.max_series_per_run:  # before a check per key
        raise LimitExceeded(f"batch names {len(keys)} distinct series; a run may hold at most "
                            f"{limits.max_series_per_run} (limits.max_series_per_run)")
    for key in cols.keys:
        if key in RECORD_FIELDS:
            raise ContractError(f"metric key {key!r} is a field of the step record, not a metric")
        check_metric_key(key)
    if cols.ranks is not None:
        rk = cols.ranks if cols.present is None else np.where(cols.present, cols.ranks, -1)
        bad = np.argwhere(rk < -1)
        if bad.size:
            i, j = bad[0]
            raise ContractError(f"step {int(cols.steps[i])}: ranks[{cols.keys[j]!r}] must be a rank in [0, 2**31), "
                                f"got {int(rk[i, j])}")
        if cols.present is not None:
            cols.ranks = rk  # a rank for a value the step did not send is dropped, as in the JSON form
    return n_values, keys
