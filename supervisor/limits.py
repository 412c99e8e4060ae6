"""What a client may send, in one place (DESIGN.md, Trust: "hostile input is a 4xx, never a 5xx").

Two kinds of limit live here:

- **Column limits**, fixed by the schema (store/orm.py) and the same on both databases: integer
  ranges (Integer is 32 bits on PostgreSQL, BigInteger 64 bits; SQLite's INTEGER is 64), string
  lengths, and the strings no column can hold (NUL on PostgreSQL, lone surrogates on either:
  neither database stores a str that is not valid Unicode). Refusing them here, before SQL, gives
  the same 4xx on both databases instead of a driver error on one.
- **Budgets**, configurable (`limits:` in the supervisor config, fields of `Limits`): how much one
  request or one run may hold, so no single client can make every later read slow (issue 11: a
  run config of 10^6 keys made every GET /api/runs take 6 s; 10^6 metric names in one step spent
  25 s and ended in a 500), and how many runs one token may open per hour (issue 21, item 4;
  supervisor.ingest.quota, answered 429).

Every refusal is a ContractError (422) or LimitExceeded (413) whose message names the field and
the limit; nothing is stored, because the checks run before the transaction opens.
Plain Python: the in-process RecordSink (embedded mode) runs the same checks as the HTTP API.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Mapping

from thermowatch.monitors.commands import INT32_MAX, INT64_MAX, ContractError
from thermowatch.monitors.names import NOT_NAME as _NOT_NAME
from thermowatch.monitors.names import RUN_ID_CHARS, check_chars, check_name, check_run_id
from thermowatch.monitors.names import show as _show

# --- column limits (store/orm.py; not configurable: the schema decides) -------------------------

# RUN_ID_CHARS = 200: runs.run_id String(200), in monitors.names with the run-id rule
WHO_CHARS = 200  # actions.who String(200)
METRIC_CHARS, MODULE_CHARS = 100, 300  # series.metric String(100), series.module String(300)
PATH_CHARS = 4096  # checkpoints.path is Text; PATH_MAX on Linux
DIGEST_CHARS = 64  # StepRecord.ledger_digest


class LimitExceeded(ContractError):
    """A request (or what it would add to a run) bigger than a budget: 413, nothing stored."""


@dataclass(slots=True)
class Limits:
    """Budgets per request and per run. Defaults sit ~10x above what a 48-layer run sends
    (50 steps x 781 values per batch, a config of a few hundred keys, a manifest of a few
    thousand files), so only a broken or hostile client meets them."""

    max_records: int = 10_000  # steps per batch; the controller sends ~50
    max_values: int = 5_000_000  # values per batch (~40 MB of float64 once unpacked)
    max_keys_per_step: int = 20_000  # metric keys in one step record (a 48-layer model: 781)
    # Distinct series a run may hold. Below SQLite's 32,766 bound variables, so the series
    # lookups of one batch stay one statement on both databases.
    max_series_per_run: int = 20_000
    max_json_depth: int = 32  # nesting of any free-form JSON (config, manifest, command args)
    max_config_keys: int = 10_000  # keys of a run config, counted through every level
    max_config_bytes: int = 256 << 10  # a run config as compact JSON
    max_manifest_keys: int = 100_000  # a checkpoint manifest lists every file with its size and crc
    max_manifest_bytes: int = 8 << 20
    # The body of a route that declares no size of its own (commands, acks, approvals, tokens):
    # supervisor.serve.body refuses more with 413 before reading it.
    max_small_body_bytes: int = 1 << 20
    # Request bodies the daemon reads at once, all routes together (supervisor.serve.body): 4
    # batches of the largest size (max_body_bytes, 64 MB), or ~100 of a 48-layer run's 2.4 MB;
    # past it a request gets 503 with Retry-After and the trainer's sink sends it again later.
    max_body_bytes_in_flight: int = 256 << 20
    # New runs (not new attempts of a run) one token may open in any hour (supervisor.ingest.quota).
    # A person or a CI job launches a few to tens an hour, a large sweep a few hundred; a hostile
    # ingest token made 400-600 a second (issue 21, item 4). At 1000 an hour it takes 100 hours
    # to reach 10^5 runs, and every list stays paged and indexed whatever the count.
    max_new_runs_per_token_per_hour: int = 1000
    # New attempts (restarts, rollbacks) of one run, and by one token over all its runs, in any
    # hour (issue 34: 10^4 attempts of one run were accepted). A run restarts a handful of times a
    # day (OPT-175B: 105 restarts in two months); the policy pauses after a few rollbacks of one
    # episode. Past either: 429 with Retry-After, nothing stored.
    max_new_attempts_per_run_per_hour: int = 100
    max_new_attempts_per_token_per_hour: int = 1000
    # Active runs with series of their own in a `/metrics` scrape (supervisor.serve.metrics); the rest
    # are counted. ~6 series a run, so a scrape stays under ~10^4 series however many tokens flood.
    max_runs_in_metrics: int = 1000
    # Reads (GET/HEAD but the trainer's command poll, probes and static files) one client may
    # make a minute, up to a sixth of them at once (supervisor.serve.api.reads): an open run page reads
    # a few a second, a script that pages through 10^5 runs ~10. Past it: 429 with Retry-After.
    max_reads_per_client_per_minute: int = 1200
    # Reads served at once, all clients together; the rest wait their turn (up to 10 s, then 503).
    # Ingest then shares the CPU with at most this many read threads, however many read.
    max_reads_in_flight: int = 2

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"limits.{f.name} must be a positive integer, got {v!r}")

    @classmethod
    def from_dict(cls, values: Mapping[str, Any] | None) -> "Limits":
        """The config's `limits:` mapping (only the fields that differ from the defaults)."""
        values = dict(values or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"unknown limits {unknown}; known: {sorted(known)}")
        return cls(**values)


# --- strings ------------------------------------------------------------------------------------

# json.loads turns a valid surrogate pair into one code point, so any surrogate left in a str is
# a lone one: it cannot be encoded as UTF-8, and no database column can hold it.
_NOT_TEXT = re.compile("[\x00\ud800-\udfff]")
# Names (run ids, metric keys, who) also refuse the other control characters: monitors.names
# (_NOT_NAME), where the client and the trainer check a run id with the daemon's own function.


def check_text(where: str, s: Any, max_chars: int | None = None) -> str:
    """Free text (a reason, an ack's detail, a path): a str without NUL or lone surrogates."""
    if not isinstance(s, str):
        raise ContractError(f"{where} must be a string, got {type(s).__name__}")
    if max_chars is not None and len(s) > max_chars:
        raise ContractError(f"{where} has {len(s)} characters; the limit is {max_chars}")
    return check_chars(where, s, _NOT_TEXT, "strings may not contain NUL or lone surrogates (not valid Unicode text)")


# The whole rule of check_metric_key as one match: the hot path (every distinct key of every batch).
_GOOD_KEY = re.compile(f"[^/\x00-\x1f\x7f\ud800-\udfff]{{1,{METRIC_CHARS}}}"
                       f"(?:/[^\x00-\x1f\x7f\ud800-\udfff]{{1,{MODULE_CHARS}}})?")


def check_metric_key(key: Any) -> None:
    """`metric` or `metric/module` (DESIGN.md, "Metric names"), each part within its column and
    non-empty: `a/` would be stored as the series `a` and could not be told apart from it."""
    if isinstance(key, str) and _GOOD_KEY.fullmatch(key):
        return
    if not isinstance(key, str):
        raise ContractError(f"metric keys must be strings, got {key!r}")
    metric, sep, module = key.partition("/")
    if not metric or len(metric) > METRIC_CHARS or (sep and not module) or len(module) > MODULE_CHARS:
        raise ContractError(f"metric key {_show(key)}: expected 'metric' or 'metric/module', a non-empty metric of at "
                            f"most {METRIC_CHARS} chars and, after '/', a non-empty module of at most {MODULE_CHARS}")
    check_chars("metric key", key, _NOT_NAME, "metric keys may not contain control characters, NUL or lone surrogates")


def check_int(where: str, v: Any, lo: int, hi: int) -> int:
    """An integer for a column: INT32_MAX for Integer columns, INT64_MAX for BigInteger."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        top = {INT64_MAX: "2**63-1", INT32_MAX: "2**31-1"}.get(hi, str(hi))
        raise ContractError(f"{where} must be an integer in [{lo}, {top}], got {_short(v)}")
    return v


def _short(v: Any) -> str:
    text = repr(v) if not isinstance(v, int) or abs(v) < 10**30 else f"an integer of {len(str(abs(v)))} digits"
    return text[:80]


# --- free-form JSON (config, manifest, command args) ----------------------------------------------


def check_json(where: str, obj: Any, *, max_depth: int, max_keys: int | None = None, max_bytes: int | None = None,
               finite: bool = True) -> None:
    """A JSON value a JSON column will hold: nesting within max_depth, at most max_keys keys
    counted through every level, at most max_bytes as compact JSON, strings (keys too) without
    NUL or lone surrogates, and (finite=True) no NaN or +-Infinity: PostgreSQL's json type
    refuses them and SQLite stores them, so refusing keeps one answer on both databases.
    Iterative, so a deep value costs no Python recursion."""
    keys = 0
    stack: list[tuple[Any, str, int]] = [(obj, where, 1)]
    while stack:
        v, path, depth = stack.pop()
        if isinstance(v, dict):
            items: Any = v.items()
        elif isinstance(v, list):
            items = ((f"[{i}]", x) for i, x in enumerate(v))
        elif isinstance(v, str):
            check_text(path, v)
            continue
        elif isinstance(v, float):
            if finite and not math.isfinite(v):
                raise ContractError(f"{path} is {v!r}: numbers in {where} must be finite (store NaN/Infinity as a "
                                    "string if you must)")
            continue
        else:
            continue
        if depth > max_depth:
            raise ContractError(f"{path} is nested {depth} levels deep; the limit is {max_depth}")
        for k, x in items:
            if isinstance(v, dict):
                keys += 1
                check_text(f"a key in {path}", k)
                sub = f"{path}.{k}" if len(path) < 200 else path
            else:
                sub = f"{path}{k}" if len(path) < 200 else path
            if max_keys is not None and keys > max_keys:
                raise LimitExceeded(f"{where} has more than {max_keys} keys (counted through every level); "
                                    "that is the limit")
            if isinstance(x, (dict, list, str, float)):
                stack.append((x, sub, depth + 1))
    if max_bytes is not None:
        size = len(json.dumps(obj, separators=(",", ":"), allow_nan=True).encode("utf-8", "surrogatepass"))
        if size > max_bytes:
            raise LimitExceeded(f"{where} is {size} bytes as JSON; the limit is {max_bytes}")


def check_small_body(obj: Any, where: str = "body") -> None:
    """A command, ack or approval body: bounded nesting (the default budget: these bodies are
    small), and no string a column cannot hold (NUL, lone surrogates) wherever it sits (who,
    reason, args, an ack's detail)."""
    check_json(where, obj, max_depth=_DEFAULTS_DEPTH, finite=False)


_DEFAULTS_DEPTH = Limits().max_json_depth

__all__ = ["Limits", "LimitExceeded", "ContractError", "INT32_MAX", "INT64_MAX", "RUN_ID_CHARS", "WHO_CHARS",
           "METRIC_CHARS", "MODULE_CHARS", "PATH_CHARS", "DIGEST_CHARS", "check_text", "check_name", "check_run_id",
           "check_metric_key", "check_int", "check_json",
           "check_small_body"]
