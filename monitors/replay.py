"""Replay a thermometer log through the detector bank (the core of `thermowatch replay FILE`).

Input: JSONL (one flat record per line, DESIGN.md "Metric names"; Python json's NaN, Infinity
and -Infinity literals are values) or CSV (header row of keys; an empty cell is a missing
value). Unknown metric keys are kept. A record's `attempt` (what `thermowatch export` writes for
every attempt of a run) is no metric: where it changes, the detectors forget what they saw from
the new attempt's first step on, as the daemon's do when a rollback takes effect, so a replay of a
rolled-back run finds each divergence an abandoned attempt had. A malformed line is reported on stderr with its line
number and skipped: one torn line at the end of a log must not hide the divergence before it.

A JSONL line with an `event` (what `thermowatch export` writes for each rollback the daemon's
run went through, before the attempt it opened: the checkpoint loaded, the first re-trained
step, what was skipped, and replay triage's cause, issue 39) is no record: the replay prints it
where that attempt starts, so a reader sees what the run did and why beside what the detectors
find again.

Exit codes: 0 no finding, 1 at least one finding, 2 the file could not be read (or held no
record at all).
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

from thermowatch.monitors.contract import RECORD_FIELDS, ContractError, Finding, StepRecord

ATTEMPT = "attempt"  # a record's attempt: read beside the record, never a metric
EVENT = "event"  # a line that is what the run did (a rollback), not a step record

from .detectors import BankConfig, DetectorBank

EXIT_CLEAN, EXIT_FINDINGS, EXIT_ERROR = 0, 1, 2


def _coerce(obj: dict[str, Any], warned: set[str], where: str, err: TextIO) -> dict[str, Any]:
    """Keep numeric metrics (also numeric strings like "NaN" from CSV-ish writers); drop other
    non-numeric fields such as {"phase": "train"} with one warning per key."""
    out: dict[str, Any] = {}
    for key, val in obj.items():
        if key in RECORD_FIELDS or key == ATTEMPT or val is None or (isinstance(val, (int, float))
                                                                    and not isinstance(val, bool)):
            out[key] = val
            continue
        if isinstance(val, str):
            try:
                out[key] = float(val)
                continue
            except ValueError:
                pass
        if key not in warned:
            warned.add(key)
            print(f"{where}: ignoring non-numeric field {key!r} (and in later records)", file=err)
    return out


def _split(obj: dict[str, Any]) -> tuple[int | None, StepRecord]:
    attempt = obj.pop(ATTEMPT, None)
    if attempt is not None:
        if isinstance(attempt, float) and attempt.is_integer():
            attempt = int(attempt)
        if isinstance(attempt, bool) or not isinstance(attempt, int) or attempt < 0:
            raise ContractError(f"'attempt' must be an integer >= 0, got {attempt!r}")
    return attempt, StepRecord.from_json(obj)


def _jsonl(path: Path, err: TextIO, events: dict[int | None, list[dict[str, Any]]] | None = None,
           ) -> Iterator[tuple[int, int | None, StepRecord]]:
    warned: set[str] = set()
    with path.open("r", encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
                if not isinstance(obj, dict):
                    raise ContractError(f"expected a JSON object, got {type(obj).__name__}")
                if EVENT in obj:  # what the run did, not a step record: kept by the attempt it opened
                    if events is not None:
                        at = obj.get(ATTEMPT)
                        events.setdefault(at if isinstance(at, int) and not isinstance(at, bool) else None, []).append(obj)
                    continue
                yield lineno, *_split(_coerce(obj, warned, where, err))
            except (json.JSONDecodeError, ContractError, TypeError, ValueError) as exc:
                print(f"{where}: skipped malformed record: {exc}", file=err)


def _csv_value(key: str, cell: str) -> Any:
    if key == "ranks":
        return json.loads(cell)
    if key in RECORD_FIELDS and key != "wall_time":
        return int(float(cell))  # "1200" or "1200.0"
    return float(cell)  # float() reads nan, inf, -inf, Infinity


def _csv(path: Path, err: TextIO) -> Iterator[tuple[int, int | None, StepRecord]]:
    warned: set[str] = set()
    with path.open("r", encoding="utf-8", errors="replace", newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if header is None:
            return
        header = [h.strip() for h in header]
        for row in reader:
            lineno = reader.line_num
            where = f"{path}:{lineno}"
            if not any(cell.strip() for cell in row):
                continue
            try:
                if len(row) != len(header):
                    raise ContractError(f"{len(row)} cells for {len(header)} columns")
                obj: dict[str, Any] = {}
                for key, cell in zip(header, row):
                    cell = cell.strip()
                    if cell == "":
                        continue  # empty cell = this metric was not measured at this step
                    try:
                        obj[key] = _csv_value(key, cell)
                    except ValueError:
                        obj[key] = cell  # let _coerce warn about a non-numeric column
                yield lineno, *_split(_coerce(obj, warned, where, err))
            except (ContractError, TypeError, ValueError) as exc:
                print(f"{where}: skipped malformed record: {exc}", file=err)


def read_attempts(path: str | Path, err: TextIO | None = None,
                  events: dict[int | None, list[dict[str, Any]]] | None = None,
                  ) -> Iterator[tuple[int, int | None, StepRecord]]:
    """(line number, attempt or None, record) for each good line; `.csv` files are CSV, anything
    else JSONL. Raises OSError if the file cannot be opened (replay turns that into exit code 2).
    `events`: a JSONL export's event lines go there as they are read, by the attempt they opened
    (None: no attempt followed them); an event comes before its attempt's first record, so it is
    there when that record is yielded. CSV carries none."""
    p = Path(path)
    err = err if err is not None else sys.stderr
    return _csv(p, err) if p.suffix.lower() == ".csv" else _jsonl(p, err, events)


def format_event(e: dict[str, Any]) -> str:
    """A rollback the run went through, in one line: what it loaded, skipped, and why."""
    cause = e.get("cause") if isinstance(e.get("cause"), dict) else None
    skipped = e.get("skip_ranges", e.get("skipped")) or []  # "skipped": exported before issue 38's rename
    line = (f"attempt {e.get(ATTEMPT, '?')}: {e.get(EVENT)} (action {e.get('action')}, {e.get('origin') or '?'}) "
            f"to checkpoint {e.get('checkpoint_step')}, re-training from step {e.get('first_step')}; skipped "
            + (", ".join(f"[{r[0]}, {r[1]})" for r in skipped if isinstance(r, list) and len(r) == 2) or "nothing"))
    if e.get("search"):
        line += f"; precise skip: {e['search']}"
    if cause is not None:
        line += (f"; cause: {cause.get('label')} (the run had spiked at step {cause.get('recorded_step')}"
                 + (f", only rank {cause['rank']}'s figures non-finite" if cause.get("rank") is not None else "")
                 + f"; replays {len(cause.get('replays') or [])}, {cause.get('steps')} steps, {cause.get('seconds')} s)")
    return line


def read_records(path: str | Path, err: TextIO | None = None) -> Iterator[tuple[int, StepRecord]]:
    """(line number, record) for each good line (read_attempts without the attempt)."""
    return ((lineno, rec) for lineno, _, rec in read_attempts(path, err))


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def format_finding(f: Finding, decision: dict[str, Any] | None = None) -> str:
    """One readable line: detect step, severity, outcome, signal, where, onset, key evidence, and
    the policy's decision when there is one."""
    where = f.module or f.metric or "-"
    ev = f.evidence
    keys = ("value", "baseline", "ratio", "threshold", "threshold_ratio", "growth_per_step", "rank", "share", "silent_s")
    details = " ".join(f"{k}={_fmt(ev[k])}" for k in keys if k in ev)
    line = (f"step {f.detect_step:>8}  {f.severity.value.upper():8} {f.outcome.value:5}  {f.signal.value:20} {where}"
            f"  onset={f.onset_step} ({f.detect_step - f.onset_step} steps before)  {details}")
    if decision is not None:
        line += "  -> " + " ".join(f"{k}={_fmt(v)}" for k, v in decision.items())
    return line


def replay(
    path: str | Path,
    config: BankConfig | None,
    out: TextIO,
    json_out: bool = False,
    policy: Callable[[Finding], dict[str, Any]] | None = None,
    err: TextIO | None = None,
) -> int:
    """Run every record of `path` through a fresh DetectorBank and print the findings (one JSON
    object per line with `json_out`). `policy` maps a finding to a printable decision dict,
    printed as "decision". Returns the exit code (module docstring)."""
    err = err if err is not None else sys.stderr
    p = Path(path)
    if not p.is_file():
        why = "no such file" if not p.exists() else "not a regular file"
        print(f"thermowatch replay: cannot read {p}: {why}; pass a JSONL or CSV thermometer log", file=err)
        return EXIT_ERROR
    bank = DetectorBank(config)
    n_records = n_findings = 0

    def said(events: list[dict[str, Any]]) -> None:
        for e in events:
            out.write((json.dumps(e, default=str) if json_out else format_event(e)) + "\n")

    try:
        events: dict[int | None, list[dict[str, Any]]] = {}
        current: int | None = None
        for _, attempt, record in read_attempts(p, err, events):
            n_records += 1
            if attempt is not None and current is not None and attempt != current:
                said(events.pop(attempt, []))  # what the run did there, and why
                bank.reset(record.step)  # the new attempt re-trains from here (Banks.rewind)
            current = attempt if attempt is not None else current
            for finding in bank.observe(record, attempt):
                n_findings += 1
                decision = policy(finding) if policy is not None else None
                if json_out:
                    obj = finding.to_json()
                    if decision is not None:
                        obj["decision"] = decision
                    out.write(json.dumps(obj, default=str) + "\n")
                else:
                    out.write(format_finding(finding, decision) + "\n")
        said([e for es in events.values() for e in es])  # nothing trained after them
    except OSError as exc:
        print(f"thermowatch replay: cannot read {p}: {exc}", file=err)
        return EXIT_ERROR
    if n_records == 0:
        print(f"thermowatch replay: {p} holds no readable step record", file=err)
        return EXIT_ERROR
    if not json_out:
        out.write(f"{n_records} records, {n_findings} findings\n")
    return EXIT_FINDINGS if n_findings else EXIT_CLEAN
