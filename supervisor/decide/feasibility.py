"""Up-front checks of a command against the run it is for: what the contract's constructors
cannot know because it needs the database (the run's data size, its checkpoints, its cursor).

A command refused here never reaches the trainer (HTTP 422 / CLI exit 2, naming the value and
the limit), instead of being delivered, half-applied and reported "done" (issue 9: a README
example skipping samples 5.2M-5.4M was accepted on a run that had consumed 800).
Relative LR requests ("halve it") are made absolute here too, against the multiplier in force.
"""

from __future__ import annotations

from typing import Any, Mapping

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from thermowatch.monitors.contract import MAX_LR_MULTIPLIER, CommandBody, Rollback, SampleRange, Skip, merge_ranges
from thermowatch.supervisor.errors import Conflict, UserError
from thermowatch.supervisor.store import checkpoints as ckpt_store
from thermowatch.supervisor.store import lr_changes as lr_store
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import skips as skips_store
from thermowatch.supervisor.store import thermometers as thermo_store
from thermowatch.supervisor.store.orm import Step


def next_step(s: Session, run_id: str) -> int:
    """The step the trainer trains next, as far as the supervisor knows (1-based)."""
    last = thermo_store.latest_step(s, run_id)
    return (last or 0) + 1


def resolve_relative(s: Session, run_id: str, args: Mapping[str, Any]) -> dict[str, Any]:
    """`lr_factor` without `lr_multiplier` ("halve it"): the absolute multiplier is the factor
    times the multiplier in force at the next step; both are kept so people see both."""
    out = dict(args)
    factor = out.get("lr_factor")
    if factor is None or out.get("lr_multiplier") is not None:
        return out
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= MAX_LR_MULTIPLIER:
        raise UserError(f"lr_factor must be a number in (0, {MAX_LR_MULTIPLIER:g}], got {factor!r}")
    base = lr_store.multiplier_in_force(s, run_id, next_step(s, run_id))
    # Rounded: 0.5 * 0.2 is 0.1 in words, and people read this number.
    # 12 significant digits, not decimals: a tiny factor must not round to a multiplier of 0.
    out.update(lr_multiplier=float(f"{base * factor:.12g}"), lr_base=base)
    return out


def check(s: Session, run_id: str, body: CommandBody) -> None:
    """Raise Conflict (409) when `body` cannot do what it says on this run as stored now: the
    request itself is well formed (issue 21: a schema-valid body is not a 422)."""
    ranges = body.ranges if isinstance(body, Skip) else body.skip if isinstance(body, Rollback) else ()
    if ranges:
        _check_data_limit(s, run_id, ranges)
    if isinstance(body, Rollback):
        _check_rollback(s, run_id, body)


def sample_limit(s: Session, run_id: str) -> tuple[int, str] | None:
    """How many sample ids the run can ever consume (steps x largest batch, plus what its ledger
    skips), with the arithmetic in words; None when the run's config does not say."""
    latest = runs_store.latest_attempt(s, run_id)
    cfg = (latest.config if latest else None) or {}
    steps, batch = cfg.get("steps"), (cfg.get("data") or {}).get("global_batch")
    if not isinstance(steps, int) or not isinstance(batch, int):
        return None
    ledger = merge_ranges(skips_store.skip_ranges(s, run_id))
    skipped = sum(len(r) for r in ledger)
    return steps * batch + skipped, f"{steps} steps x batch {batch} + {skipped} skipped"


def _check_data_limit(s: Session, run_id: str, ranges: tuple[SampleRange, ...]) -> None:
    got = sample_limit(s, run_id)
    if got is None:
        return
    limit, how = got
    for r in ranges:
        if r.lo >= limit:  # wholly past the end: it could never skip anything
            raise Conflict(f"skip range {r} is beyond the samples run {run_id!r} can consume: ids stop at "
                            f"{limit} ({how}); ranges are absolute sample ids (see a step's sample_lo/sample_hi)")


def _consumed(s: Session, run_id: str) -> int | None:
    """The highest sample id (exclusive) the run's newest attempt has reported consuming."""
    newest = select(func.max(Step.attempt)).where(Step.run_id == run_id).scalar_subquery()
    return s.execute(select(func.max(Step.sample_hi)).where(Step.run_id == run_id, Step.attempt == newest)).scalar()


def _check_rollback(s: Session, run_id: str, cmd: Rollback) -> None:
    consumed = _consumed(s, run_id)
    if consumed is not None and consumed >= 0:
        for r in cmd.skip:
            if r.lo >= consumed:
                raise Conflict(f"skip range {r} is wholly in the future: run {run_id!r} has consumed samples up to "
                                f"{consumed}, and a rollback skips data already trained on; use `thermowatch skip` "
                                "to pass over samples not yet reached")
    rows = ckpt_store.checkpoints(s, run_id, include_deleted=True)
    usable = [c for c in rows if c.healthy and not c.deleted and c.step <= cmd.to_step]
    at = [c for c in rows if c.step == cmd.to_step]
    if cmd.exact and not any(c.healthy and not c.deleted for c in at):
        raise Conflict(f"--exact: checkpoint {cmd.to_step} of run {run_id!r} {_why_not(at)}; "
                        f"usable checkpoints: {sorted({c.step for c in rows if c.healthy and not c.deleted}) or 'none'}")
    if not usable and rows:
        raise Conflict(f"no healthy checkpoint of run {run_id!r} at or before step {cmd.to_step} "
                        f"(usable: {sorted({c.step for c in rows if c.healthy and not c.deleted}) or 'none'}); "
                        "pick a later step")


def _why_not(rows: list[ckpt_store.CheckpointRow]) -> str:
    if not rows:
        return "was never saved"
    if all(c.deleted for c in rows):
        return "was removed by retention"
    return "is marked unhealthy (saved during a divergence, or on a trajectory a rollback abandoned)"
