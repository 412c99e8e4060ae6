"""The supervisor's exception hierarchy.

`UserError` and its subclasses are mistakes a person can fix (a bad flag, an unknown run, an
action in the wrong state): the CLI prints them without a traceback and exits 2, the HTTP API
answers 4xx. Everything else is a bug or an outage and is logged with its traceback.
"""


class UserError(ValueError):
    """Bad input from a person or a client. The message names the value and the fix."""


class NotFound(UserError):
    """An id (run, action, checkpoint) that does not exist."""


class Conflict(UserError):
    """A request that is valid but not now (e.g. approving an action that already ran)."""


class Forbidden(UserError):
    """An authenticated caller asking for what its token may not touch (issue 33: an ingest token
    writes only the runs it created): HTTP 403 naming the rule. Nothing was stored."""


class QuotaExceeded(UserError):
    """A caller used up a budget over time (supervisor.ingest.quota): HTTP 429 with Retry-After.
    Nothing was stored."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class NotLeader(RuntimeError):
    """This replica is a standby (or was deposed): what was asked is the leader's to do (issue 40:
    commands, approvals, acknowledgements). HTTP 503 with Retry-After, naming the leader, so a
    client with several daemon addresses tries the next one."""

    retry_after_s = 2


class DaemonUnreachable(RuntimeError):
    """The CLI found no thermowatch daemon at the address; the message names it and how to point
    elsewhere (exit 3)."""
