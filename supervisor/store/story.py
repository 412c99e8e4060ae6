"""A run's story in numbers, for the people who were asleep (issue 23): how it ended, what the
supervisor did to it and what that cost. One read for Slack's "run finished" message, the CLI and
the page, so they never tell it differently.

Steps re-trained are counted from the attempts, not from the actions: every attempt that starts
from a checkpoint before the last step its predecessor stored re-trains the difference (a rollback, and a
relaunch from an older checkpoint alike). Samples skipped are the run's merged skip ledger.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from thermowatch.monitors.contract import Rollback, RunFinished
from thermowatch.monitors.commands import ActionOrigin, ActionState, CommandKind
from thermowatch.supervisor.store import actions as actions_store
from thermowatch.supervisor.store import incidents as incidents_store
from thermowatch.supervisor.store import lr_changes as lr_store
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store import skips as skips_store
from thermowatch.supervisor.store.steps import furthest_step, last_step


@dataclass(frozen=True)
class Story:
    run_id: str
    finished: RunFinished | None  # how the newest attempt ended; None while it may train
    last_step: int | None
    attempts: int
    auto_rollbacks: int  # carried out
    manual_actions: int  # carried out
    lr_multiplier: float  # in force at last_step
    steps_retrained: int
    samples_skipped: int
    incidents: int
    open_incidents: int

    def words(self) -> str:
        """"2 automatic rollbacks, LR x0.2, 150 steps re-trained, 1,152 samples skipped; 11
        incidents, 0 open"."""
        did = []
        if self.auto_rollbacks:
            did.append(f"{self.auto_rollbacks} automatic rollback{'s' * (self.auto_rollbacks != 1)}")
        if self.manual_actions:
            did.append(f"{self.manual_actions} manual command{'s' * (self.manual_actions != 1)}")
        if self.lr_multiplier != 1.0:
            did.append(f"LR x{self.lr_multiplier:g}")
        if self.steps_retrained:
            did.append(f"{self.steps_retrained:,} steps re-trained")
        if self.samples_skipped:
            did.append(f"{self.samples_skipped:,} samples skipped")
        head = ", ".join(did) if did else "nothing changed by the supervisor"
        return (f"{head}; {self.incidents} incident{'s' * (self.incidents != 1)}, {self.open_incidents} open; "
                f"{self.attempts} attempt{'s' * (self.attempts != 1)}")

    def ending(self) -> str:
        """"finished (completed at step 200), final loss 2.38 (the last step's)" or "not finished, last
        step 120"."""
        f = self.finished
        if f is None:
            return "not finished" + (f", last step {self.last_step}" if self.last_step is not None else ", no step yet")
        return f"finished ({f.reason.value} at step {f.step}), {loss_words(f.final_loss)}"


def loss_words(final_loss: float | None) -> str:
    """"final loss 2.38 (the last step's)", or "no final loss" when none was measured (NaN is a loss:
    "final loss nan (the last step's)"). Says which: the demo prints a mean of the last 10 steps
    beside it, and two unnamed "final loss" figures in one output disagreed (issue 37)."""
    return "no final loss" if final_loss is None else f"final loss {final_loss:.4g} (the last step's)"


def cost(session: Session, run_id: str, body: Any) -> dict[str, str]:
    """What a rollback throws away, for the person who must approve it (issue 23: "roll back to
    step 10" at step 557 never said it meant 547 steps): {"discards": ..., "skips": ...}, empty
    for any other command. Slack's approval message and the page's approval card both show it."""
    if not isinstance(body, Rollback):
        return {}
    latest = runs_store.latest_attempt(session, run_id)
    last = last_step(session, run_id, latest.attempt) if latest is not None else None
    out = {}
    if last is not None and last > body.to_step:
        out["discards"] = (f"steps {body.to_step + 1}-{last}: {last - body.to_step} steps to train again "
                           f"(from checkpoint {body.to_step} or the newest healthy one before it)")
    if body.skip:
        out["skips"] = f"{sum(r.hi - r.lo for r in body.skip):,} samples: " + ", ".join(str(r) for r in body.skip)
    return out


# (attempts, steps re-trained) of one run in one statement. `stepped`: the attempts that stored
# steps, found by a skip scan of ix_steps_run_id_attempt_step (a seek each), with their last step
# (a seek each). `marks`: every attempt (kind 0) and, after it, its last step if it stored any
# (kind 1); carried forward in attempt order, each attempt meets the last step of the newest
# earlier attempt that stored steps, and re-trained what lies between its start_step and that.
# No row per attempt reaches Python and no query is sent per attempt: a run of 10^4 attempts took
# its page 3.4-9.4 s when this was a query per attempt (issue 34). {pos}: greatest(), which
# SQLite spells max().
_RETRAINED = """
WITH RECURSIVE stepped(attempt) AS (
    SELECT min(attempt) FROM steps WHERE run_id = :run_id
    UNION ALL
    SELECT (SELECT min(s.attempt) FROM steps s WHERE s.run_id = :run_id AND s.attempt > stepped.attempt)
    FROM stepped WHERE stepped.attempt IS NOT NULL
),
marks(attempt, kind, start, last) AS (
    SELECT attempt, 0, start_step, NULL FROM attempts WHERE run_id = :run_id
    UNION ALL
    SELECT attempt, 1, NULL, (SELECT max(s.step) FROM steps s WHERE s.run_id = :run_id AND s.attempt = stepped.attempt)
    FROM stepped WHERE attempt IS NOT NULL
),
carried AS (
    SELECT kind, start, last, count(last) OVER (ORDER BY attempt, kind) AS grp FROM marks
),
filled AS (
    SELECT kind, start, max(last) OVER (PARTITION BY grp) AS reached FROM carried
)
SELECT count(*), coalesce(sum({pos}(reached - start, 0)), 0) FROM filled WHERE kind = 0
"""


def retrained(session: Session, run_id: str) -> tuple[int, int]:
    """(attempts opened, steps re-trained): per attempt, the last step of the newest earlier
    attempt that stored any, less its start_step where that is positive, summed (_RETRAINED)."""
    pos = "greatest" if session.get_bind().dialect.name == "postgresql" else "max"
    n, steps = session.execute(text(_RETRAINED.replace("{pos}", pos)), {"run_id": run_id}).one()
    return int(n), int(steps)


def story(session: Session, run_id: str) -> Story:
    n_attempts, steps_retrained = retrained(session, run_id)
    newest = runs_store.latest_attempt(session, run_id)
    # Where the run is: its newest attempt's last step, else (that attempt has stored none yet)
    # the furthest step any attempt reached.
    now = last_step(session, run_id, newest.attempt) if newest is not None else None
    if now is None:
        now = furthest_step(session, run_id)
    done = [r for r in actions_store.actions(session, run_id, limit=10_000) if r.state is ActionState.DONE]
    incs = incidents_store.incidents(session, run_id)
    return Story(
        run_id=run_id, finished=newest.finished if newest is not None else None, last_step=now,
        attempts=n_attempts,
        auto_rollbacks=sum(r.kind is CommandKind.ROLLBACK and r.origin is ActionOrigin.AUTO for r in done),
        manual_actions=sum(r.origin is ActionOrigin.MANUAL for r in done),
        lr_multiplier=lr_store.multiplier_in_force(session, run_id, now) if now is not None else 1.0,
        steps_retrained=steps_retrained,
        samples_skipped=sum(hi - lo for lo, hi in skips_store.skip_ranges(session, run_id)),
        incidents=len(incs), open_incidents=sum(i.state == "open" for i in incs),
    )
