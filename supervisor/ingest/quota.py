"""Budgets over time: how many new runs one token may open in an hour (issue 21, item 4), and how
many new attempts one run, and one token over all its runs, may open in an hour (issue 34: 10^4
attempts of one run were accepted, and its page took seconds to draw).

An ingest token made 400-600 runs a second, and every read that listed them slowed down with
them. `limits.max_new_runs_per_token_per_hour` (supervisor.limits) bounds that per token: the
(limit+1)-th new run within an hour is refused with QuotaExceeded (HTTP 429 and Retry-After);
a new attempt of an existing run is never counted, nor is another token's run.

The database decides, in the transaction that creates the run, after the run's insert, so that
concurrent creations by one token cannot all read the same count and all pass:
- SQLite: the insert took the database's one write lock, held until commit; the count that
  follows sees every run committed before, and no other can commit meanwhile.
- PostgreSQL: a transaction-scoped advisory lock per creator, taken after the insert, queues
  that creator's creations; each count (READ COMMITTED: a fresh snapshot per statement) then
  sees every creation committed before it.
Over the limit the caller's transaction rolls back: the run and its attempt are not stored.
"""

from __future__ import annotations

import datetime as dt
import math

from sqlalchemy import text
from sqlalchemy.orm import Session

from thermowatch.supervisor.errors import QuotaExceeded
from thermowatch.supervisor.limits import Limits
from thermowatch.supervisor.store import runs as runs_store
from thermowatch.supervisor.store.orm import utcnow

WINDOW = dt.timedelta(hours=1)
# pg_advisory_xact_lock(class, key): this module's class, so its keys (a hash of the creator's
# name) cannot meet another use of advisory locks. A hash collision only queues two tokens together.
_LOCK_CLASS = 0x7477_0001


def check_new_run(session: Session, created_by: str, limits: Limits, now: dt.datetime | None = None) -> None:
    """In the transaction that has just created a run for `created_by` (store.runs.open_attempt
    returned True): raise QuotaExceeded if that makes more than the limit within the window."""
    limit = limits.max_new_runs_per_token_per_hour
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:cls, hashtext(:who))"),
                        {"cls": _LOCK_CLASS, "who": created_by})
    now = now or utcnow()
    # The run just inserted is the newest of the window; over the limit when there is a
    # (limit+1)-th. The slot comes back when that one (the oldest that counts against this
    # request) leaves the window.
    oldest = runs_store.nth_newest_created_by(session, created_by, now - WINDOW, limit + 1)
    if oldest is None:
        return
    retry_after = max(1, math.ceil((oldest + WINDOW - now).total_seconds()))
    raise QuotaExceeded(
        f"{created_by!r} opened {limit} new runs in the last hour, the limit "
        f"(limits.max_new_runs_per_token_per_hour in the supervisor config): retry in {retry_after} s. "
        "A new attempt of an existing run is not limited; reuse the run id to report a restart",
        retry_after)


def check_new_attempt(session: Session, run_id: str, opened_by: str, limits: Limits,
                      now: dt.datetime | None = None) -> None:
    """In the transaction that has just opened a new attempt (a restart) of an existing run: raise
    QuotaExceeded when that makes more than the run's hourly budget, or more than the token's over
    all its runs. Under the same per-creator lock as check_new_run on PostgreSQL (a token's
    attempts queue); two tokens restarting one run at once may overrun the run's budget by one."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:cls, hashtext(:who))"),
                        {"cls": _LOCK_CLASS, "who": opened_by})
    now = now or utcnow()
    for limit, key, what, setting in (
            (limits.max_new_attempts_per_run_per_hour, {"run_id": run_id}, f"run {run_id!r}",
             "max_new_attempts_per_run_per_hour"),
            (limits.max_new_attempts_per_token_per_hour, {"opened_by": opened_by}, f"{opened_by!r}",
             "max_new_attempts_per_token_per_hour")):
        oldest = runs_store.nth_newest_attempt(session, now - WINDOW, limit + 1, **key)
        if oldest is not None:
            retry_after = max(1, math.ceil((oldest + WINDOW - now).total_seconds()))
            raise QuotaExceeded(
                f"{what} opened {limit} new attempts in the last hour, the limit (limits.{setting} in the "
                f"supervisor config): retry in {retry_after} s. A run restarting this often is crash-looping; "
                "look at its trainer's log", retry_after)
