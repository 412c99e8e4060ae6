"""What a name may hold (a run id above all), checked by one function wherever a name enters:
the daemon's API and ingest (supervisor.limits re-exports these), the client (`thermowatch.Run`,
`thermowatch.watch`: monitors.contract.RunInfo) and the bundled trainer's config.

A run id is a path segment everywhere it goes: a URL (`/api/runs/<id>`), the client's state
directory (`.thermowatch/runs/<id>`), a checkpoint directory (`checkpoints/<id>`). Before issue
34 the client checked less than the daemon: a run id of `..` in `thermowatch.watch` wrote its
checkpoints into the working directory and trained with every request refused. Names also end
up in log lines and Slack messages, so they hold no control characters.
"""

from __future__ import annotations

import re
from typing import Any

from thermowatch.monitors.commands import ContractError

RUN_ID_CHARS = 200  # runs.run_id String(200) (supervisor/store/orm.py)

# json.loads turns a valid surrogate pair into one code point, so any surrogate left in a str is
# a lone one: it cannot be encoded as UTF-8, and no database column can hold it. Names also
# refuse the other control characters: they end up in URLs, file names, log lines and Slack.
NOT_NAME = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")


def show(s: str) -> str:
    """A name for an error message: ascii() (control characters visible), cut at 60 characters."""
    return ascii(s[:60]) + ("..." if len(s) > 60 else "")


def check_name(where: str, s: Any, max_chars: int, *, min_chars: int = 1) -> str:
    """A name (run id, metric key, who): text of min_chars..max_chars without control characters."""
    if not isinstance(s, str):
        raise ContractError(f"{where} must be a string, got {type(s).__name__}")
    if not min_chars <= len(s) <= max_chars:
        raise ContractError(f"{where} must have {min_chars} to {max_chars} characters, got {len(s)}")
    return check_chars(where, s, NOT_NAME, "names may not contain control characters, NUL or lone surrogates")


def check_chars(where: str, s: str, bad: re.Pattern[str], rule: str) -> str:
    """`s`, or a ContractError naming the first character `bad` finds in it, its position and `rule`."""
    m = bad.search(s)
    if m:
        raise ContractError(f"{where} {show(s)} holds {ascii(m.group())} at position {m.start()}: {rule}")
    return s


def check_run_id(s: Any, where: str = "run_id") -> str:
    """A run id the daemon stores and every side may use as one path segment: a name of at most
    RUN_ID_CHARS characters, without '/', and not '.' or '..' (the API's schema spells the same
    rule as RUN_ID_PATTERN, supervisor/serve/api/schemas.py)."""
    check_name(where, s, RUN_ID_CHARS)
    if "/" in s:
        raise ContractError(f"{where} {show(s)} may not contain '/': it is one path segment (a URL's, a "
                            "checkpoint directory's); use '-' or '_' instead")
    if s in (".", ".."):  # a URL client resolves them away: /api/runs/../x is /api/x, never the run
        raise ContractError(f"{where} {s!r} cannot be a run id: it is a relative path segment (checkpoints/{s} "
                            "is not a folder of its own); name the run")
    return s


# What a terminal or a log line would act on: C0 controls (newline and escape included), DEL and
# C1 controls; plus lone surrogates, which cannot be printed at all.
_UNPRINTABLE = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")


def printable(text: Any) -> str:
    """`text` safe for one line of a terminal or a log: every control character shown as its
    escape (`\\n`, `\\x1b`), so a reason or an ack's detail, which the daemon stores as free text,
    can neither start a line that looks like the daemon's own nor move a terminal's cursor."""
    s = text if isinstance(text, str) else str(text)
    return _UNPRINTABLE.sub(lambda m: ascii(m.group())[1:-1], s)


def printable_tree(obj: Any) -> Any:
    """Every string in a JSON answer (keys too) made printable, for a renderer that prints them."""
    if isinstance(obj, str):
        return printable(obj)
    if isinstance(obj, dict):
        return {printable_tree(k): printable_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [printable_tree(v) for v in obj]
    return obj


__all__ = ["RUN_ID_CHARS", "NOT_NAME", "show", "check_name", "check_run_id", "printable", "printable_tree"]
