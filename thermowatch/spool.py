"""What a trainer's spool holds (`thermowatch flush DIR` sends it: thermowatch.flush).

HttpSink (thermowatch.transport) keeps what the daemon has not taken -- an outage, or a daemon
that was slow or silent when the run closed -- as JSONL files in one directory (`spool/` in a
run's state directory: thermowatch.watch's checkpoint directory, thermowatch.Run's `state_dir`;
`<data dir>/spool/<run id>` for `thermowatch train --supervisor`). Any sink opened on that
directory replays them first, in order; so does `flush` (a sink that only replays and closes). The
daemon's ingest is idempotent (a step sent again with the same values stores nothing new, the
same finish report again is nothing new), so a message sent twice -- the sender gave up waiting
for an answer the daemon did send -- is harmless.
"""

from __future__ import annotations

import base64
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote

from thermowatch.monitors.columns import COLUMNS_CONTENT_TYPE, StepColumns
from thermowatch.monitors.contract import ContractError

SPOOL_GLOBS = ("spool-*.jsonl", "overflow.jsonl")


def find_spool(path: str | os.PathLike) -> Path:
    """The spool `path` names: the directory itself when it holds spool files, else its `spool/`
    (a run's state directory), else the directory itself (an empty spool: nothing to send)."""
    p = Path(path)
    if not p.is_dir():
        raise FileNotFoundError(f"{p} is not a directory: name the spool directory the trainer's close line "
                                f"printed, or the run's state directory that holds spool/")
    if not _files(p) and (p / "spool").is_dir():
        return p / "spool"
    return p


def _files(spool_dir: Path) -> list[Path]:
    return [f for g in SPOOL_GLOBS for f in spool_dir.glob(g)]


@dataclass(frozen=True)
class Tail:
    """What waits in a spool directory: messages, the steps among them, the finish reports and
    the runs they belong to."""

    spool_dir: Path
    messages: int = 0
    steps: int = 0
    finished: int = 0
    runs: tuple[str, ...] = ()
    unreadable: int = 0  # lines that are no message (a torn last line): set aside when replayed

    def __bool__(self) -> bool:
        return self.messages > 0

    @classmethod
    def of(cls, spool_dir: str | os.PathLike) -> "Tail":
        spool_dir = Path(spool_dir)
        messages = steps = finished = unreadable = 0
        runs: dict[str, None] = {}
        for f in _files(spool_dir):
            try:
                lines = [ln for ln in f.read_bytes().splitlines() if ln.strip()]
            except FileNotFoundError:  # replayed and removed while we looked
                continue
            for line in lines:
                try:
                    msg = json.loads(line)
                    path = msg["path"]
                except (ValueError, KeyError, TypeError):
                    unreadable += 1
                    continue
                messages += 1
                parts = path.split("/")  # /api/runs/{run}/attempts/{n}/{what}
                if len(parts) > 3 and parts[:3] == ["", "api", "runs"]:
                    runs[unquote(parts[3])] = None
                if path.endswith("/finished"):
                    finished += 1
                elif path.endswith("/steps"):
                    steps += _steps_in(msg)
        return cls(spool_dir, messages, steps, finished, tuple(runs), unreadable)

    def words(self) -> str:
        """'169 steps and the finish report of run r (5 messages)'."""
        what = [f"{self.steps} step{'s' * (self.steps != 1)}"]
        if self.finished:
            what.append("the finish report" if self.finished == 1 else f"{self.finished} finish reports")
        runs = ", ".join(repr(r) for r in self.runs) or "no run"
        return (f"{' and '.join(what)} of run{'s' * (len(self.runs) > 1)} {runs} "
                f"({self.messages} message{'s' * (self.messages != 1)})")

    def flush_command(self, server: str | None = None) -> str:
        cmd = f"thermowatch flush {shlex.quote(str(self.spool_dir))}"
        return f"{cmd} --server {shlex.quote(server)}" if server else cmd


def _steps_in(msg: dict) -> int:
    try:
        if "body_b64" in msg:
            if msg.get("content_type") != COLUMNS_CONTENT_TYPE:
                return 0
            return len(StepColumns.decode(base64.b64decode(msg["body_b64"])))
        body = msg.get("body")
        return len(body.get("records", [])) if isinstance(body, dict) else 0  # an older spool's JSON steps
    except (ValueError, ContractError, TypeError):
        return 0
