"""`thermowatch flush DIR`: send what a trainer left in its spool to the daemon now.

A trainer that closed while the daemon was down, slow or silent left the rest in its spool
(thermowatch.spool says what a spool holds; HttpSink.close names it in one log line). Here a
sink opened on that directory replays it, in order, within `timeout_s`, and closes: the same
code that sends it when the next run starts on the directory. Server and token are found as
for every other command (supervisor.operate.client.resolve). The daemon's ingest is idempotent,
so what it already had, sent again, stores nothing new.

Exit codes (thermowatch.cli's): 0 everything was sent, or nothing waited; 1 the daemon failed
(5xx) and it is still spooled; 2 the token was refused (still spooled) or a message was refused
(set aside in rejected.jsonl); 3 no daemon answered (still spooled).
"""

from __future__ import annotations

import os
import sys

from thermowatch.spool import Tail, find_spool
from thermowatch.supervisor.errors import DaemonUnreachable, UserError
from thermowatch.supervisor.operate.client import TOKEN_ENV, resolve
from thermowatch.transport import HttpSink

EXIT_OK, EXIT_FAILED = 0, 1


def flush(path: str | os.PathLike, server: str | None, token: str | None, timeout_s: float = 120.0) -> int:
    ep = resolve(server, token)
    try:
        spool = find_spool(path)
    except FileNotFoundError as exc:
        raise UserError(str(exc)) from None
    before = Tail.of(spool)
    if not before and not before.unreadable:
        print(f"nothing waits in {spool}")
        return EXIT_OK
    # The sink replays the spool it finds on its own; close() gives it the time and reports what
    # stays, without the trainer's close line (the words below say it).
    sink = HttpSink(ep.server, spool, token=ep.token, close_timeout=timeout_s)
    left = sink.close(say=False)
    if not left and not left.unreadable and not sink.rejected:
        print(f"sent {before.words()} to {ep.server}; {spool} is empty")
        return EXIT_OK
    if not left:
        raise UserError(f"{sink.rejected} message(s) of {spool} refused by {ep.server} ({sink.last_error}); they "
                        f"are set aside in {spool / 'rejected.jsonl'} and the rest was sent")
    why = sink.last_error or "no answer"
    waiting = f"{left.words()} still wait in {spool}"
    if why.startswith("HTTP 401"):
        raise UserError(f"{ep.server} refused the token from {ep.token_from} ({why}); {waiting}. Pass --token with "
                        f"the trainer's `ingest` token, or set {TOKEN_ENV}")
    if not why.startswith("HTTP"):
        raise DaemonUnreachable(f"no thermowatch daemon took them at {ep.server} (from {ep.server_from}): {why}; "
                                f"{waiting}. Point it elsewhere with --server URL, or run this again once the daemon "
                                f"is up")
    print(f"thermowatch: {ep.server} did not take them ({why}); {waiting}: run this again later", file=sys.stderr)
    return EXIT_FAILED
