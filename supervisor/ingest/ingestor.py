"""Ingest: the supervisor's side of contract.RecordSink, in-process and behind the HTTP router.

One path: a batch of StepRecords (the JSON body, an in-process sink) is checked as records and
converted to columns at the edge (`to_columns`); from there every batch takes `write_columns`.
Each call is one transaction. After a batch commits, `on_records(run_id, attempt, batch)` runs
with the new steps as StepColumns (the judge hangs there); its failure is logged and never undoes
or fails the ingest, because the data is already safely stored and the run controller must not
retry it.
"""

from __future__ import annotations

import logging
import math
from itertools import chain
from typing import Any, Callable, Mapping, Sequence

import numpy as np
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import sessionmaker

from thermowatch.monitors.columns import StepColumns

from thermowatch.monitors.contract import (
    INT32_MAX, INT64_MAX, MAX_WALL_TIME, RECORD_FIELDS, CheckpointInfo, ContractError, RunFinished, RunInfo, StepRecord,
    json_int,
)
from thermowatch.supervisor.ingest.claims import ClaimBounds
from thermowatch.supervisor.ingest import quota
from thermowatch.supervisor.errors import Conflict
from thermowatch.supervisor.limits import (
    PATH_CHARS, LimitExceeded, Limits, check_int, check_json,
    check_run_id, check_text,
)
from thermowatch.supervisor.store import audit as audit_store
from thermowatch.supervisor.store import checkpoints as checkpoints_store
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import steps as steps_store
from thermowatch.supervisor.store import thermometers
from thermowatch.supervisor.ingest.columns import check_columns

log = logging.getLogger(__name__)

_INT64 = 2**63
_RACE_RETRIES = 2  # a batch that lost a race for its steps is compared again (then 409 or nothing new)
OnRecords = Callable[[str, int, StepColumns], Any]  # the judge: a committed batch, as columns
CheckState = Callable[[str, int, Sequence[StepRecord]], Any]  # records of the keys it reads


class IngestError(ValueError):
    """Bad input to ingest; the message names the problem. Nothing was stored."""


class UnknownRun(IngestError, LookupError):
    """The run (or this attempt of it) was never opened."""


class BatchTooLarge(IngestError, LimitExceeded):
    """More records or values in one batch than the supervisor accepts."""


class HistoryConflict(Conflict):
    """A re-sent step whose values differ from the stored ones: stored history is immutable."""


IngestLimits = Limits  # the older name; every limit now lives in supervisor.limits


class Ingestor:
    """Implements contract.RecordSink on top of the store (same semantics as the HTTP API)."""

    def __init__(self, session_factory: sessionmaker, on_records: OnRecords | None = None,
                 limits: IngestLimits | None = None, check_state: CheckState | None = None,
                 check_keys: Sequence[str] | None = None, judged_with: dict[str, float] | None = None) -> None:
        self._sessions = session_factory
        # The thresholds this daemon judges with, written into each new attempt's audit row, so the
        # run page draws the ceiling the run was judged at, whichever daemon later serves it (a
        # `thermowatch demo` judged at 150, served by a `thermowatch serve` whose default is 100).
        self._judged_with = dict(judged_with or {})
        self._on_records = on_records
        # supervisor.judge.consistency: the trainer's reported LR multiplier and ledger digest against
        # the supervisor's record, after the commit (it pages; it never fails the ingest).
        self._check_state = check_state
        # The keys check_state reads (None: every key): each committed batch is handed to it as
        # records of those keys only.
        self.check_keys = None if check_keys is None else tuple(check_keys)
        self.limits = limits or IngestLimits()
        self._cache = thermometers.SeriesCache()
        self._attempts: set[tuple[str, int]] = set()  # opened (run, attempt) pairs seen committed
        self._claims = ClaimBounds()

    # --- RecordSink ----------------------------------------------------------------------------

    def open_run(self, info: RunInfo, actor: str = "run-controller",
                 authorize: Callable[[str, str], None] | None = None) -> None:
        """`actor`: the audit trail's name for the caller (over HTTP, its token's name).
        `authorize(run_id, owner)`: raises (Forbidden) when the caller may not open this run or a
        new attempt of it, `owner` being the run's creator (the actor itself for a new run); it
        runs in the transaction, so of two tokens racing to create one run, the loser is refused
        and stores nothing."""
        validate_run_info(info)
        check_run_info(info, self.limits)
        with self._sessions.begin() as s:
            new = not runs_store.attempt_exists(s, info.run_id, info.attempt)
            created = runs_store.open_attempt(s, info, created_by=actor)
            if authorize is not None:
                authorize(info.run_id, actor if created else runs_store.created_by(s, info.run_id) or "")
            if created:  # a new run, not a new attempt
                quota.check_new_run(s, actor, self.limits)  # past the limit: QuotaExceeded, rolled back
            elif new and info.attempt > 0:  # a restart of an existing run
                quota.check_new_attempt(s, info.run_id, actor, self.limits)
            if new:
                audit_store.audit(s, info.run_id, actor, "attempt_opened",
                                  {"attempt": info.attempt, "world_size": info.world_size, "start_step": info.start_step,
                                   **({"judged_with": self._judged_with} if self._judged_with else {})})
        self._attempts.add((info.run_id, info.attempt))

    def write(self, run_id: str, attempt: int, records: Sequence[StepRecord]) -> int:
        """Store a batch given as StepRecords (the JSON body, an in-process sink); returns the
        number of values it carried. Converted to columns at the edge (to_columns), then the one
        columns path: the same checks, transaction, judge and state checks as write_columns."""
        return self.write_columns(run_id, attempt, self.to_columns(run_id, attempt, records))

    def to_columns(self, run_id: str, attempt: int, records: Sequence[StepRecord]) -> StepColumns:
        """The edge: records checked as records (their Python types, which columns cannot show;
        write_columns then applies the column checks). ContractError/LimitExceeded naming the field
        and the limit."""
        records = list(records)
        self._check_records(records)
        try:
            return StepColumns.from_records(records)
        except OverflowError:  # an int beyond float64
            raise ContractError("a metric value is an integer too large for a float64") from None

    def write_columns(self, run_id: str, attempt: int, cols: StepColumns) -> int:
        """Store a batch given as columns (monitors.columns; what the trainer's sink sends): the
        checks, then one transaction, without a Python object per value on the way in. Stored
        history is immutable, and the database decides it: a step row is inserted plainly, so of
        two overlapping batches sent at once the second meets the first's rows (a unique
        violation), and its retry compares them as any re-send (409 or nothing new)."""
        n_values, _ = check_columns(run_id, attempt, cols, self.limits, BatchTooLarge)
        new = self._store(run_id, attempt, cols)
        if len(new):  # a re-sent batch was checked and judged when it first came: never twice
            # The judge takes the columns as they are (its batch path is arrays); the state checks
            # read records of the few keys they name, so no request builds a dict per step.
            self._committed(run_id, attempt, new)
        return n_values

    def _store(self, run_id: str, attempt: int, cols: StepColumns) -> StepColumns:
        """One transaction; returns the steps it stored (none when all were stored already)."""
        if not len(cols):
            return cols
        keys = set(cols.keys)
        for tries in range(_RACE_RETRIES, -1, -1):
            view = self._cache.view()
            try:
                with self._sessions.begin() as s:
                    self._check_attempt(s, run_id, attempt)
                    new = _new_columns(s, run_id, attempt, cols)
                    if len(new):
                        self._claims.check(s, run_id, attempt, new)  # sample ranges the run can have consumed
                        thermometers.check_series_budget(s, run_id, keys, view, self.limits.max_series_per_run)
                        steps_store.record_step_columns(s, run_id, attempt, new)
                        thermometers.append_columns(s, run_id, attempt, new, view)
            except IntegrityError as exc:
                if not tries or not _is_step_race(exc):
                    raise
                log.info("run %s attempt %s: a concurrent batch stored some of these steps first; comparing", run_id,
                         attempt)
                continue
            break
        self._cache.merge(view)  # only after the commit
        return new

    def _committed(self, run_id: str, attempt: int, batch: StepColumns) -> None:
        if self._check_state is not None:
            try:  # records of the few keys the checks name: no dict per step of every series
                self._check_state(run_id, attempt, (batch if self.check_keys is None else batch.only(self.check_keys))
                                  .to_records())
            except Exception:  # the batch is committed; a failing check must not bounce it
                log.exception("state check failed for run %s attempt %s", run_id, attempt)
        self._notify(run_id, attempt, batch)

    def checkpoint_saved(self, run_id: str, attempt: int, ckpt: CheckpointInfo) -> None:
        validate_checkpoint(ckpt)
        check_checkpoint(ckpt, self.limits)
        with self._sessions.begin() as s:
            self._check_attempt(s, run_id, attempt)
            self._claims.check_cursor(s, run_id, attempt, ckpt.step, ckpt.sample_cursor)
            checkpoints_store.record_checkpoint(s, run_id, attempt, ckpt)

    def checkpoints_deleted(self, run_id: str, attempt: int, steps: Sequence[int], reason: str,
                            actor: str = "run-controller") -> None:
        """The trainer deleted these checkpoints: never offer them again (list, page, policy)."""
        steps = list(steps)
        if len(steps) > MAX_DELETED_STEPS:
            raise LimitExceeded(f"{len(steps)} deleted checkpoint steps in one report; the limit is {MAX_DELETED_STEPS}")
        for i, x in enumerate(steps):
            check_int(f"steps[{i}]", x, 0, INT64_MAX)
        reason = check_text("reason", reason)[:200]  # the audit keeps a short note, as it always did
        with self._sessions.begin() as s:
            self._check_attempt(s, run_id, attempt)
            n = checkpoints_store.mark_deleted(s, run_id, steps)
            if n:
                audit_store.audit(s, run_id, actor, "checkpoints_deleted",
                                  {"steps": steps, "reason": reason, "attempt": attempt})

    def finish_run(self, run_id: str, attempt: int, finished: RunFinished, actor: str = "run-controller") -> None:
        """The attempt ended of its own accord (contract.RunFinished). Idempotent: the same report
        again is nothing new; a different one is a Conflict (an attempt finishes once)."""
        if not isinstance(finished, RunFinished):
            raise ContractError(f"finish_run takes a RunFinished, got {type(finished).__name__}")
        with self._sessions.begin() as s:
            self._check_attempt(s, run_id, attempt)
            stored = runs_store.finish_attempt(s, run_id, attempt, finished)
            if stored is not None and stored.same_as(finished):
                return  # a re-send (a retry, a replayed spool): nothing new
            if stored is not None:
                raise HistoryConflict(f"run {run_id!r} attempt {attempt} already finished at step {stored.step} "
                                      f"({stored.reason.value}, final loss {stored.final_loss}); an attempt finishes "
                                      "once: re-send the same report, or open a new attempt")
            audit_store.audit(s, run_id, actor, "run_finished", {"attempt": attempt, **finished.to_json()})

    def drain(self, timeout: float | None = None) -> bool:
        """Nothing waits here: each call above has committed what it was given before it returns."""
        return True

    def close(self) -> None:
        pass

    # --- helpers -------------------------------------------------------------------------------

    def _check_attempt(self, s, run_id: str, attempt: int) -> None:
        if (run_id, attempt) in self._attempts:
            return
        check_run_id(run_id)
        check_int("attempt", attempt, 0, INT32_MAX)
        if not runs_store.attempt_exists(s, run_id, attempt):
            if not runs_store.run_exists(s, run_id):
                raise UnknownRun(f"unknown run {run_id!r}: open it first (POST /api/runs or Ingestor.open_run)")
            raise UnknownRun(f"run {run_id!r} has no attempt {attempt}: open it first (POST /api/runs)")
        self._attempts.add((run_id, attempt))

    @staticmethod
    def _check_records(records: list) -> None:
        """What columns cannot show: each record's Python types (a StepRecord; integers, not
        bools or floats, that fit an int64; a real wall_time; a dict of numbers; integer ranks).
        Ranges and limits are check_columns's, on the columns the records become. Per record,
        not per value, except where a check fails."""
        for i, r in enumerate(records):
            if not isinstance(r, StepRecord):
                raise ContractError(f"records[{i}] must be a StepRecord, got {type(r).__name__}")
            for name in ("step", "sample_lo", "sample_hi", "tokens"):
                v = getattr(r, name)
                if isinstance(v, bool) or not isinstance(v, int) or not -1 <= v < _INT64:
                    what = "a non-negative integer" if name == "step" else "an integer in [-1, 2**63)"
                    raise ContractError(f"records[{i}]: {name!r} must be {what}, got {v!r}")
            # no float() of a huge int: a real number within range, else check_columns's message
            if (isinstance(r.wall_time, bool) or not isinstance(r.wall_time, (int, float))
                    or not -MAX_WALL_TIME <= r.wall_time <= MAX_WALL_TIME):
                raise ContractError(f"step {r.step}: 'wall_time' must be a finite number of seconds within "
                                    f"+-{MAX_WALL_TIME:g}, got {str(r.wall_time)[:40]}")
            if not isinstance(r.values, dict):
                raise ContractError(f"step {r.step}: 'values' must be a dict of metric -> float")
        _check_numbers(records)
        _check_ranks(records)

    def _notify(self, run_id: str, attempt: int, batch: StepColumns) -> None:
        if self._on_records is None:
            return
        try:
            self._on_records(run_id, attempt, batch)
        except Exception:  # the batch is committed; a detector bug must not bounce it
            log.exception("on_records failed for run %s attempt %s (steps %s..%s)", run_id, attempt,
                          int(batch.steps[0]), int(batch.steps[-1]))


def _is_step_race(exc: IntegrityError) -> bool:
    """A unique violation on the steps table's key: another batch stored the step first."""
    text = str(exc.orig)
    return "steps" in text and ("UNIQUE" in text or "duplicate key" in text)


def _check_numbers(records: Sequence[StepRecord]) -> None:
    """Metric values must be real numbers (NaN/Inf allowed), ranks integers. One C-level pass
    over the value types; the slow scan that names the bad field only runs when it fails."""
    types = set(map(type, chain.from_iterable(r.values.values() for r in records)))
    rank_types = set(map(type, chain.from_iterable(r.ranks.values() for r in records if r.ranks)))
    if types <= {float, int} and rank_types <= {int}:
        return
    for r in records:
        for key, v in r.values.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise ContractError(f"step {r.step}: metric {key!r} must be a number, got {v!r}")
        for key, rank in r.ranks.items():
            if isinstance(rank, bool) or not isinstance(rank, int):
                raise ContractError(f"step {r.step}: ranks[{key!r}] must be an integer rank, got {rank!r}")


def _check_ranks(records: Sequence[StepRecord]) -> None:
    """Ranks fit the int32 column and name a rank (columns read -1 as "none sent")."""
    for r in records:
        for key, rank in r.ranks.items():
            if not 0 <= rank < 2**31:
                raise ContractError(f"step {r.step}: ranks[{key!r}] must be a rank in [0, 2**31), got {rank!r}")


# --- parsing and validating the other two messages (their JSON lives in the contract) -------


def run_info_from_json(obj: Any) -> RunInfo:
    return RunInfo.from_json(obj)


def run_info_to_json(info: RunInfo) -> dict[str, Any]:
    return info.to_json()


def _new_columns(s, run_id: str, attempt: int, cols: StepColumns) -> StepColumns:
    """Stored history is immutable (DESIGN.md, "Trust"): steps of this attempt already stored are
    dropped when the re-send carries exactly what is stored (a sink retry after a time-out), and
    refused with HistoryConflict, naming the step and the field or series, when anything differs.
    Same answer on both databases; nothing of the batch is stored then (one transaction)."""
    old = steps_store.stored(s, run_id, attempt, int(cols.steps.min()), int(cols.steps.max()))
    if not old:
        return cols
    resent = np.isin(cols.steps, np.fromiter(old, np.int64, len(old)))
    if not resent.any():
        return cols
    _check_resent(s, run_id, attempt, cols.select(resent).to_records(), old)  # rare: a retry
    return cols.select(~resent)


def _check_resent(s, run_id: str, attempt: int, resent: list[StepRecord], old: dict[int, steps_store.StoredStep]) -> None:
    """HistoryConflict unless every re-sent step carries exactly what is stored: its samples,
    tokens and wall time as well as every value."""
    points = thermometers.stored_points(s, run_id, attempt, min(r.step for r in resent), max(r.step for r in resent))
    for r in resent:
        was = old[r.step]
        if (r.sample_lo, r.sample_hi) != (was.sample_lo, was.sample_hi):
            raise HistoryConflict(
                f"run {run_id!r} attempt {attempt} step {r.step} is already stored with samples "
                f"[{was.sample_lo}, {was.sample_hi}); this write says [{r.sample_lo}, {r.sample_hi}). Stored "
                "history is immutable: a retrained step belongs to a new attempt (open it with POST /api/runs)")
        for field, then, now in (("tokens", was.tokens, r.tokens), ("wall_time", was.wall_time, float(r.wall_time))):
            if then != now:
                raise HistoryConflict(
                    f"run {run_id!r} attempt {attempt} step {r.step} is already stored with {field} {then!r}; this "
                    f"write says {now!r}. Stored history is immutable: re-send exactly what was sent")
        stored_keys = {k for k, pts in points.items() if r.step in pts}
        for key in sorted(stored_keys | set(r.values)):
            was = points.get(key, {}).get(r.step)
            now = r.values.get(key)
            if was is None or now is None or not (was == now or (math.isnan(was) and math.isnan(now))):
                raise HistoryConflict(
                    f"run {run_id!r} attempt {attempt} step {r.step}, series {key!r}: stored "
                    f"{'nothing' if was is None else repr(was)}, this write says {'nothing' if now is None else repr(now)}. "
                    "Stored history is immutable: re-send exactly what was sent, or report a retrained step "
                    "under a new attempt")


def validate_run_info(info: RunInfo) -> None:
    RunInfo.from_json(info.to_json()) if isinstance(info, RunInfo) else _bad("RunInfo", info)


def check_run_info(info: RunInfo, limits: Limits) -> None:
    """The limits a run report must keep beyond the contract's types (supervisor.limits): a run
    id every column and URL can hold, a config and host map of bounded size with finite
    numbers and clean strings (they are JSON columns, and GET /api/runs reads every config)."""
    check_run_id(info.run_id)
    check_json("config", info.config, max_depth=limits.max_json_depth, max_keys=limits.max_config_keys,
               max_bytes=limits.max_config_bytes)
    check_json("hosts", {str(k): v for k, v in info.hosts.items()}, max_depth=2, max_keys=limits.max_manifest_keys,
               max_bytes=limits.max_manifest_bytes)
    for rank in info.hosts:
        check_int("hosts: a rank", rank, 0, INT32_MAX)


def check_checkpoint(ckpt: CheckpointInfo, limits: Limits) -> None:
    check_text("path", ckpt.path, PATH_CHARS)
    check_json("manifest", ckpt.manifest, max_depth=limits.max_json_depth, max_keys=limits.max_manifest_keys,
               max_bytes=limits.max_manifest_bytes)


def checkpoint_from_json(obj: Any) -> CheckpointInfo:
    return CheckpointInfo.from_json(obj)


def checkpoint_to_json(ckpt: CheckpointInfo) -> dict[str, Any]:
    return ckpt.to_json()


def validate_checkpoint(ckpt: CheckpointInfo) -> None:
    CheckpointInfo.from_json(ckpt.to_json()) if isinstance(ckpt, CheckpointInfo) else _bad("CheckpointInfo", ckpt)


def _bad(want: str, got: Any) -> None:
    raise ContractError(f"expected a {want}, got {type(got).__name__}")


MAX_DELETED_STEPS = 100_000
MAX_DELETED_REASON = 10_000  # characters; the audit trail keeps the first 200


def deleted_from_json(obj: Any) -> tuple[list[int], str]:
    """{"steps": [..], "reason": ".."} of a checkpoints-deleted report."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("steps"), list):
        raise ContractError('body must be {"steps": [checkpoint steps], "reason": "..."}')
    steps = [json_int(x) for x in obj["steps"]]
    if len(steps) > MAX_DELETED_STEPS or any(x is None or not 0 <= x < _INT64 for x in steps):
        raise ContractError(f"'steps' must be a list of at most {MAX_DELETED_STEPS} checkpoint steps in [0, 2**63), "
                            f"got {str(obj['steps'][:10])[:200]}")
    return steps, check_text("reason", obj.get("reason", ""), MAX_DELETED_REASON)[:200]


def finished_from_json(obj: Any) -> RunFinished:
    """{"step", "final_loss", "reason"} of a finished report (ContractError names the bad field)."""
    return RunFinished.from_json(obj)


def records_from_json(obj: Any, limits: Limits | None = None) -> list[StepRecord]:
    """{"records": [flat step records]} -> StepRecords (ContractError names the bad field).
    With `limits`, a batch of too many records, or a record of too many keys, is refused before
    it is parsed (10^6 metric names in one step took 25 s to reach the check after parsing)."""
    if not isinstance(obj, Mapping) or not isinstance(obj.get("records"), list):
        raise ContractError('body must be a JSON object {"records": [...]}')
    if limits is not None and len(obj["records"]) > limits.max_records:
        raise BatchTooLarge(f"batch of {len(obj['records'])} records exceeds the limit of {limits.max_records}; "
                            "send smaller batches")
    max_fields = None if limits is None else limits.max_keys_per_step + len(RECORD_FIELDS)
    out = []
    for i, r in enumerate(obj["records"]):
        if max_fields is not None and isinstance(r, Mapping) and len(r) > max_fields:
            raise LimitExceeded(f"records[{i}] has {len(r)} keys; the limit is {limits.max_keys_per_step} metric keys "
                                "per step")
        try:
            out.append(StepRecord.from_json(r))
        except ContractError as exc:
            raise ContractError(f"records[{i}]: {exc}") from None
        except (ValueError, TypeError, OverflowError) as exc:  # int()/float() of sample_lo, tokens, ranks ...
            raise ContractError(f"records[{i}]: {exc} (sample_lo/sample_hi/tokens must be integers, "
                                "wall_time a number, ranks an object of metric -> integer)") from None
    return out


__all__ = ["Ingestor", "IngestLimits", "Limits", "LimitExceeded", "IngestError", "UnknownRun", "BatchTooLarge", "ContractError",
           "run_info_from_json", "run_info_to_json", "checkpoint_from_json", "checkpoint_to_json", "records_from_json",
           "deleted_from_json"]
